"""`ee-transformers serve --continuous-batching` sized from the model and surviving what clients do under load: bad
requests answer 400 naming the field, disconnected clients give their paged-cache blocks back, and the server keeps
serving with no traceback in its log (one server on 127.0.0.1 for the module, killed by its PID)."""

import json
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from helpers import served_folders

from ee_transformers.tools.bench.serve import ServerProcess, openai_client
from ee_transformers.tools.serve import (
    DEFAULT_CB_MEMORY,
    CachePlan,
    length_error,
    main,
    parse_bytes,
    plan_paged_cache,
    request_error,
    server_seams_missing,
)

openai = pytest.importorskip("openai")

LONG = " ".join(f"w{3 + i % 90}" for i in range(300))  # 300 tokens: longer than the tiny model's 256 positions


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    _, folder = served_folders(root)
    argv = [sys.executable, "-m", "ee_transformers.tools.cli", "serve", str(folder), "--continuous-batching"]
    process = ServerProcess(argv, threads=1, log_path=root / "server.log")
    process.client, process.model = openai_client(process), str(folder)
    try:
        yield process
    finally:
        process.stop()


def cache_state(server) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/ee/cache", timeout=10).read())


def wait_idle(server, limit=60.0) -> tuple[dict, float]:
    """The cache state once no request is in flight (bounded), and how long that took."""
    start = time.perf_counter()
    while True:
        state = cache_state(server)
        elapsed = time.perf_counter() - start
        if (state["active_requests"] == 0 and state["waiting_requests"] == 0) or elapsed > limit:
            return state, elapsed
        time.sleep(0.02)


def complete(server, **kwargs):
    args = dict(model=server.model, prompt="w5 w6 w7", max_tokens=6, temperature=0)
    return server.client.completions.create(**{**args, **kwargs})


def vm_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def test_default_paged_cache_follows_the_model_and_serves_under_2_gib(server):
    text = complete(server).choices[0].text
    assert text.strip()
    log = server.log_path.read_text()
    # 32 requests (--cb-max-requests) of the model's 256 positions, 1 block of 256 tokens each; 4 layers x 2 x 2 KV
    # heads x 8 dims x 4 bytes = 512 bytes per token; steps of 1024 tokens: a mask of 1024 x (8192 + 1024) x 4 bytes
    assert "paged cache 32 blocks x 256 tokens (8192 tokens), K/V 4.0 MiB (512 bytes/token)" in log, log[-2000:]
    assert "steps of at most 1024 tokens (--cb-max-batch-tokens), attention mask up to 36.0 MiB" in log
    state = cache_state(server)
    assert state["started"] and state["num_blocks"] == 32 and state["kv_bytes"] == 32 * 256 * 512
    assert vm_rss(server.proc.pid) < 2 * 2**30  # (about 470 MB here; 960 MB with transformers' 8192-token steps)


BAD = [
    ("completions", {"max_tokens": -5}, "max_tokens"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": "5"}, "max_tokens"),
    ("completions", {"max_tokens": 2.5}, "max_tokens"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"temperature": -0.5}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"max_tokens": 300}, "max_tokens"),  # 3 + 300 > the model's 256 positions
    ("completions", {"prompt": LONG}, "prompt"),
    ("completions", {"generation_config": json.dumps({"exit_policy": "sideways"})}, "generation_config.exit_policy"),
    ("completions", {"generation_config": json.dumps({"prompt_lookup_num_tokens": 3})}, "generation_config."),
    ("completions", {"generation_config": "{"}, "generation_config"),
    ("completions", {"generation_config": json.dumps({"max_new_tokens": -1})}, "generation_config.max_new_tokens"),
    # continuous batching samples every request as the first one (greedy here) and carries no stop strings
    (
        "completions",
        {"temperature": None, "generation_config": json.dumps({"do_sample": True, "temperature": 0.7})},
        "temperature",
    ),
    ("completions", {"stop": ["w9"]}, "stop"),
    ("chat", {"max_tokens": -1}, "max_tokens"),
    ("chat", {"max_completion_tokens": "many"}, "max_completion_tokens"),
    ("chat", {"temperature": "hot"}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
]


def test_bad_requests_answer_400_naming_the_field_and_the_server_keeps_serving(server):
    reference = complete(server).choices[0].text
    for endpoint, change, param in BAD:
        if endpoint == "chat":
            args = dict(model=server.model, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=4)
        else:
            args = dict(model=server.model, prompt="w5 w6 w7", max_tokens=6, temperature=0)
        extra = {k: change.pop(k) for k in list(change) if k == "generation_config"}
        args.update(change)
        create = server.client.chat.completions.create if endpoint == "chat" else server.client.completions.create
        with pytest.raises(openai.BadRequestError) as caught:
            create(**args, extra_body=extra or None)
        error = caught.value.body
        assert error["type"] == "invalid_request_error", (change, error)
        assert error["param"].startswith(param), (change, error)
        named = error["param"].split(".")[-1]
        assert named in error["message"] or "prompt" in error["message"], (change, error)
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/v1/responses",
        data=json.dumps({"model": server.model, "input": "w5", "max_output_tokens": -1}).encode(),
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400 and json.loads(caught.value.read())["error"]["param"] == "max_output_tokens"
    assert complete(server).choices[0].text == reference  # still serving, the same text
    # a request that leaves its length unset gets what fits (transformers' default 1024 would not)
    fits = complete(server, prompt=" ".join(LONG.split()[:250]), max_tokens=None)
    assert fits.usage.completion_tokens == 256 - 250
    assert "Traceback" not in server.log_path.read_text()


def test_disconnected_clients_give_their_blocks_back(server):
    complete(server)
    start, _ = wait_idle(server)
    begin = time.perf_counter()
    complete(server, max_tokens=250)  # what a request left to run would cost
    full = time.perf_counter() - begin
    waits = []
    for i in range(12):
        if i % 3 == 2:  # non-streaming: the client times out and closes the connection
            # a quarter of what 250 tokens take here: a fixed 0.3 s was longer than the whole answer on a fast host
            with pytest.raises(openai.APITimeoutError):
                server.client.with_options(timeout=full / 4, max_retries=0).completions.create(
                    model=server.model, prompt="w5 w6", max_tokens=250, temperature=0
                )
        else:  # streaming, completions and chat: read one chunk and close
            if i % 3 == 0:
                stream = server.client.completions.create(
                    model=server.model, prompt="w5 w6", max_tokens=250, temperature=0, stream=True
                )
            else:
                stream = server.client.chat.completions.create(
                    model=server.model, messages=[{"role": "user", "content": "w5"}], max_tokens=250, stream=True
                )
            next(iter(stream))
            stream.close()
        state, waited = wait_idle(server)
        waits.append(waited)
        assert state["free_blocks"] == start["free_blocks"] and state["free_kv_bytes"] == start["free_kv_bytes"]
    # cancelled, not run to the end: run to the end, each would stay busy for most of `full` (the timed-out ones for
    # three quarters of it), twelve of them for about 11 x full; a stall of this loaded host may hold up one (0.64 s
    # of 1.13 in a CI run), so the typical request and the total are what is asserted, not the slowest
    assert sorted(waits)[len(waits) // 2] < full / 4 and sum(waits) < 3 * full, (waits, full)
    assert complete(server).choices[0].text.strip()
    assert "Traceback" not in server.log_path.read_text()


# ---------------------------------------------------------------------------------------------------------------------
# the sizing and the checks, in-process
# ---------------------------------------------------------------------------------------------------------------------
class Config:
    num_hidden_layers, num_key_value_heads, head_dim, max_position_embeddings = 30, 3, 64, 8192
    exit_layers, draft_vocab_size, draft_table_size = [9, 15, 21], None, None


def test_plan_follows_the_model_lengths_and_budget():
    fp32 = torch.float32
    plan = plan_paged_cache(Config(), fp32)  # 32 requests of 8192 tokens would be 11.25 GiB: capped at 1 GiB
    assert plan.bytes_per_token == 30 * 2 * 3 * 64 * 4 and plan.block_size == 256
    assert plan.num_blocks == DEFAULT_CB_MEMORY // (256 * plan.bytes_per_token) and plan.max_length == 8192
    assert "capped at 1024 MiB" in plan.line()
    tokens = plan.num_blocks * 256  # the attention mask of 1024-token steps, not transformers' 8192
    assert plan.max_batch_tokens == 1024 and plan.mask_bytes == 1024 * (tokens + 1024) * 4
    small = plan_paged_cache(Config(), fp32, max_requests=4, max_length=512)
    assert small.num_blocks == 4 * 2 and small.max_length == 512
    lean = plan_paged_cache(Config(), torch.bfloat16, exit_max_layer=15, num_blocks=10, block_size=16)
    assert lean.bytes_per_token == 16 * 2 * 3 * 64 * 2 and lean.kv_bytes == 10 * 16 * lean.bytes_per_token
    assert lean.max_length == 160  # the whole cache is shorter than the model
    budget = plan_paged_cache(Config(), fp32, memory=parse_bytes("64MiB"))
    assert budget.num_blocks == 64 * 2**20 // (256 * budget.bytes_per_token)
    assert plan_paged_cache(Config(), fp32, memory_percent=0.5).num_blocks is None
    with pytest.raises(ValueError, match="--cb-memory"):
        plan_paged_cache(Config(), fp32, memory=1000)
    with pytest.raises(ValueError, match="--cb-num-blocks and --cb-memory"):
        plan_paged_cache(Config(), fp32, num_blocks=8, memory=2**30)
    with pytest.raises(ValueError, match="--cb-memory and --cb-max-requests"):
        plan_paged_cache(Config(), fp32, memory=2**30, max_requests=4)
    with pytest.raises(ValueError, match="--max-length"):
        plan_paged_cache(Config(), fp32, max_length=9000)
    assert parse_bytes("1GiB") == 2**30 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="--cb-memory"):
        parse_bytes("lots")


def test_checks_name_the_field():
    config = Config()
    assert request_error({"max_tokens": 4, "temperature": 0.7, "stop": ["\n"]}, config, False) is None
    assert request_error({"max_tokens": 4, "stop": ["\n"]}, config, True).param == "stop"  # batching has no stops
    assert request_error([1, 2], config, True) is None  # not an object: transformers answers 422
    cases = {
        "max_tokens": {"max_tokens": True},
        "seed": {"seed": "x"},
        "stream": {"stream": "yes"},
        "stop": {"stop": [1]},
        "frequency_penalty": {"frequency_penalty": -2},
        "generation_config.assistant_early_exit": {"generation_config": json.dumps({"assistant_early_exit": 3})},
        "generation_config.speculative_table_drafts": {
            "generation_config": json.dumps({"prompt_lookup_num_tokens": 2, "speculative_table_drafts": True})
        },
        "generation_config.temperature": {"generation_config": json.dumps({"temperature": "hot"})},
    }
    for param, body in cases.items():
        refused = request_error(body, config, False)
        assert refused is not None and refused.param == param, (body, refused and refused.param)
    assert request_error({"generation_config": json.dumps({"assistant_early_exit": 16})}, config, False) is None
    plan = CachePlan(16, 10, 8, 256, "test")  # 160 tokens in the cache, 256 in the model
    assert length_error(100, 60, plan, "/v1/completions") is None
    assert length_error(100, 61, plan, "/v1/chat/completions").param == "max_completion_tokens"
    assert length_error(160, 1, plan, "/v1/chat/completions").param == "messages"
    assert "paged cache" in length_error(100, 61, plan, "/v1/completions").message


def test_a_transformers_without_the_server_seams_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """The hooks wrap transformers' server as 5.19 to 5.24 have it (all there on the installed release); on a release
    without one of those seams the command refuses in one line naming it, before it loads anything."""
    from transformers.cli.serving import utils

    assert server_seams_missing() == []
    _, folder = served_folders(tmp_path)
    capsys.readouterr()  # the folders' progress bars
    monkeypatch.setattr(utils, "CBGenerateManager", type("CBGenerateManager", (), {}))  # a release that lacks it
    with pytest.raises(SystemExit) as stop:
        main([str(folder), "--continuous-batching"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert "CBGenerateManager.generate_streaming" in err and "transformers 5.19 to 5.24" in err, err


def test_cache_flags_need_continuous_batching(tmp_path, capsys):
    _, folder = served_folders(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main([str(folder), "--cb-num-blocks", "8"])
    assert stop.value.code == 2 and "--continuous-batching" in capsys.readouterr().err
    for flags, message in [
        (["--cb-memory", "lots"], "argument --cb-memory: must be a size in bytes"),
        (["--cb-num-blocks", "-3"], "argument --cb-num-blocks: must be an integer >= 1"),
        (["--cb-memory", "1000"], "--cb-memory 1000 bytes holds no block of 256 tokens"),
    ]:
        with pytest.raises(SystemExit) as stop:
            main([str(folder), "--continuous-batching", *flags])
        assert stop.value.code == 2 and message in capsys.readouterr().err
