"""`ee-transformers bench-serve` end to end on tiny folders: servers start, every request is answered, rows add up
(a smoke run: its numbers mean nothing)."""

import json

import pytest
from helpers import served_folders

from ee_transformers.tools.bench.serve import LOSSLESS, ServeBenchConfig, Workload, format_serve, main, text_mismatches

pytest.importorskip("openai")


def test_bench_serve_runs_plain_and_stored_servers_on_every_workload(tmp_path):
    base, folder = served_folders(tmp_path)
    argv = ["--model", str(folder), "--base", str(base), "--out", str(tmp_path / "out"), "--servers", "plain,stored"]
    argv += ["--workloads", "prompts,chat,edits", "--clients", "1,2", "--requests", "2", "--new-tokens", "4"]
    argv += ["--turns", "2", "--threads", "1", "--cb-block-size", "16", "--num-prompts", "4"]
    assert main(argv) == 0  # the tiny folder stores exits at layer 0: its stored server is lossy, plain is checked
    rows = json.loads((tmp_path / "out" / "serve.json").read_text())["rows"]
    levels = [(w, c) for w in ("prompts", "chat", "edits") for c in (1, 2)]
    assert [(r["server"], r["workload"], r["clients"]) for r in rows] == [
        (s, w, c) for s in ("plain", "stored") for w, c in levels
    ]
    requests = {("prompts", 1): 2, ("prompts", 2): 2, ("chat", 1): 2, ("chat", 2): 4, ("edits", 1): 2, ("edits", 2): 4}
    for r in rows:
        assert r["requests"] == requests[(r["workload"], r["clients"])] and r["tokens"] == 4 * r["requests"]
        assert r["tokens_per_s"] > 0 and r["rss_mb"] > 0
        if r["server"] == "plain":
            assert r["same_text"] == r["requests"]
    assert (tmp_path / "out" / "serve.md").read_text().startswith("| server |")
    log = (tmp_path / "out" / "server-stored-continuous-batching.log").read_text()
    assert "paged cache" in log and "Traceback" not in log


def test_conversations_repeat_what_came_before():
    config = ServeBenchConfig(turns=3, workloads=["chat", "edits"])
    for name in ("chat", "edits"):
        sessions = Workload(name, ["alpha beta gamma delta", "epsilon zeta theta iota"], config, chat=True).sessions(2)
        assert [len(s) for s in sessions] == [3, 3]
        key, build = sessions[1][2]
        messages = build(["first answer", "second answer"])["messages"]
        assert key == f"{name} 1 turn 2" and [m["role"] for m in messages] == ["user", "assistant"] * 2 + ["user"]
        assert [messages[1]["content"], messages[3]["content"]] == ["first answer", "second answer"]
        plain = Workload(name, ["alpha beta gamma delta"], config, chat=False).sessions(1)[0][1][1](["an answer"])
        assert plain["prompt"].startswith("User: ") and "Assistant: an answer\n" in plain["prompt"]


def test_text_check_fails_lossless_rows_only():
    row = dict(mode="continuous-batching", workload="chat", clients=4, requests=8)
    rows = [{**row, "server": "plain", "same_text": 8}, {**row, "server": "stored", "same_text": 7}]
    rows += [{**row, "server": "exits", "same_text": 0}, {"server": "stored", "mode": "sequential", "error": "boom"}]
    assert text_mismatches(rows, LOSSLESS) == [
        "stored continuous-batching chat 4 clients: 7/8",
        "stored sequential: boom",
    ]
    assert text_mismatches(rows, ("plain",)) == []


def test_rows_compare_with_plain_at_the_same_level():
    row = dict(mode="continuous-batching", workload="chat", clients=4, requests=8, p50_s=1, p95_s=2, same_text=8)
    rows = [{**row, "server": "plain", "tokens_per_s": 10.0, "rss_mb": 1000}]
    rows += [{**row, "server": "stored", "tokens_per_s": 15.0, "rss_mb": 1050}]
    rows += [{**row, "server": "stored", "clients": 16, "tokens_per_s": 15.0, "rss_mb": 1050}]  # no plain row
    lines = format_serve(rows).splitlines()
    assert "| 15.0 | 1.50x |" in lines[3] and "| 1050 | 1.05x | 8/8 |" in lines[3]
    assert "| 15.0 | - |" in lines[4] and "| 1050 | - | 8/8 |" in lines[4]


def test_bench_serve_config_names_bad_fields():
    with pytest.raises(ValueError, match="servers"):
        ServeBenchConfig(servers=["fast"])
    with pytest.raises(ValueError, match="workloads"):
        ServeBenchConfig(workloads=["poems"])
    with pytest.raises(ValueError, match="prompt_domain"):
        ServeBenchConfig(prompt_domain="news")
    with pytest.raises(ValueError, match="exit_settings"):
        ServeBenchConfig(exit_settings="{")


def test_table_from_serves_a_copy_with_the_table_of_that_text(tmp_path):
    """`--table-from FILE`: the served copy's draft table is counted on that text (so the drafts of a run meet text
    the table was not built from); the folder itself is left as it was."""
    import ee_transformers as eet
    from ee_transformers.tools.bench.serve import folder_with_table

    _, folder = served_folders(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{2 + i % 7}" for i in range(400)))  # words of the numbered tokenizer
    copy = folder_with_table(str(folder), str(text), tmp_path / "out")
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
    original = eet.from_base(folder)
    served = eet.from_base(copy)
    assert not original.config.draft_table_size and served.config.draft_table_size > 0
    assert served.generation_config.exit_check_layers == original.generation_config.exit_check_layers


def test_no_level_sends_a_passage_an_earlier_level_sent():
    """A server keeping a history of its answers would draft a repeated prompt's answer: every level of a run gets
    passages of its own."""
    from ee_transformers.tools.bench.serve import level_workloads

    config = ServeBenchConfig(clients=[1, 4], workloads=["prompts", "chat", "edits"], requests=3, turns=2)
    sizes = {("prompts", 1): 3, ("prompts", 4): 4, ("chat", 1): 2, ("chat", 4): 8, ("edits", 1): 1, ("edits", 4): 4}
    passages = [f"passage {i}" for i in range(sum(sizes.values()))]
    levels = level_workloads(config, passages, chat=True)
    assert {k: len(w.passages) for k, w in levels.items()} == sizes
    sent = [p for w in levels.values() for p in w.passages]
    assert sorted(sent) == sorted(passages)  # each passage once in the whole run


def test_results_name_no_path_of_this_machine():
    import os
    from pathlib import Path

    from ee_transformers.tools.bench.serve import portable

    text = f"Loading {Path.home()}/.cache/m and {os.getcwd()}{os.sep}runs/ee"
    assert portable(text) == "Loading ~/.cache/m and runs/ee"


def test_vllm_servers_keep_a_stored_lossless_mode_off_where_they_measure_exits(tmp_path):
    """A folder's stored lossless mode turns our proposer on in vLLM (and its exits off), so the exits-off and forced
    rows must switch it off; the drafts row names the proposer with the stored number of drafts."""
    from ee_transformers.tools.bench.serve import _vllm_argv

    (tmp_path / "generation_config.json").write_text(json.dumps({"prompt_lookup_num_tokens": 3}))
    config = ServeBenchConfig()

    def flag(kind, name):
        argv = _vllm_argv(kind, str(tmp_path), "base", config, "eager")
        return json.loads(argv[argv.index(name) + 1]) if name in argv else None

    assert flag("vllm-off", "--override-generation-config") == {"early_exit": False, "prompt_lookup_num_tokens": 0}
    assert flag("vllm-forced-50", "--override-generation-config")["prompt_lookup_num_tokens"] == 0
    assert flag("vllm-drafts", "--speculative-config")["num_speculative_tokens"] == 3
    assert flag("vllm-plain", "--speculative-config") is None
