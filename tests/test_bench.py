"""The benchmark end to end on a tiny random model: outputs present and internally consistent (no speed asserts)."""

import json
import math
import sys

import pytest
import torch
from conftest import make_base

import ee_transformers as eet
from ee_transformers.measure.costs import full_step_cost, ideal_speedup, step_cost
from ee_transformers.tools import bench


@pytest.fixture(scope="module")
def ee_folder(tmp_path_factory):
    base = tmp_path_factory.mktemp("bench-base")
    make_base("llama").save_pretrained(base)
    model = eet.from_base(base, exit_layers=[1, 2], exit_head="norm")
    folder = tmp_path_factory.mktemp("bench-ee")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    """Two small 'domains' of text; the tiny model has no tokenizer, so the bench falls back to random tokens."""
    folder = tmp_path_factory.mktemp("text")
    paths = []
    for name in ("prose", "code"):
        path = folder / f"{name}.txt"
        path.write_text(" ".join(f"{name}{i}" for i in range(2000)))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def quick_report(ee_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    code = bench.main(
        [
            "--model",
            str(ee_folder),
            "--quick",
            "--batch-sizes",
            "1,2",
            "--new-tokens",
            "12",
            "--out",
            str(out),
            "--threads",
            "1",
        ]
    )
    assert code == 0
    return json.loads((out / "report.json").read_text()), out


def test_quick_benchmark_writes_everything(quick_report):
    report, out = quick_report
    for key in ("machine", "model", "settings", "costs", "results", "profiles", "targets", "command"):
        assert key in report, f"report.json lacks {key!r}"
    for name in ("frontier.png", "exit_histogram.png", "results.md"):
        assert (out / name).stat().st_size > 500, f"{name} is (nearly) empty"
    kinds = {r["kind"] for r in report["results"]}
    assert {"disabled", "forced", "sweep"} <= kinds, kinds
    assert set(report["costs"]) == {"1", "2"}
    # the row policy only exists at batch > 1
    assert any(r["policy"] == "row" for r in report["results"] if r["batch_size"] == 2)
    assert not any(r["policy"] == "row" for r in report["results"] if r["batch_size"] == 1)


def test_disabled_exits_agree_exactly_and_run_full_depth(quick_report):
    report, _ = quick_report
    for r in [r for r in report["results"] if r["kind"] == "disabled"]:
        assert r["agreement"]["share"] == 1.0, "full depth through the early-exit class must equal plain generate"
        assert r["exits"]["mean_exit_layer"] == 3.0
        assert r["ideal_speedup"]["median"] == 1.0


def test_forced_profiles_exit_where_requested(quick_report):
    report, _ = quick_report
    forced = [r for r in report["results"] if r["kind"] == "forced"]
    assert len(forced) == 4 * 2 + 4 * 3, "4 profiles x (2 modes at batch 1, 3 at batch 2)"
    for r in forced:
        # stratified draws: every 20 draws hold the profile's shares exactly; only EOS rows (-1) can blur it
        assert abs(r["exits"]["mean_exit_layer"] - r["forced"]["requested_mean_exit_layer"]) < 0.35, r["name"]
        assert set(map(int, r["exits"]["histogram"])) <= set(map(int, r["forced"]["layers"])), r["name"]
        assert r["ideal_speedup"]["median"] > 0 and r["realised_over_ideal"]["median"] > 0


def test_speedup_summary_is_consistent(quick_report):
    report, _ = quick_report
    for r in report["results"]:
        s = r["speedup"]
        assert s["min"] <= s["median"] <= s["max"]
        assert len(s["values"]) == r["repeats"] * 1  # one batch per size with --quick
        assert 0.0 <= r["agreement"]["share"] <= 1.0
        assert r["agreement"]["first_divergence"] <= r["new_tokens"]
    for p in report["profiles"]:
        assert p["ms_per_step"] > 0 and p["parts_ms"]["layers"] > 0


def test_cost_model_ideal_is_one_at_full_depth_and_grows_with_earlier_exits():
    costs = {
        "num_layers": 4,
        "ms": {
            name: {"1": 1.0}
            for name in (
                "layer",
                "final_head",
                "head",
                "head_check",
                "backfill",
                "deferred_extra",
                "decision",
                "cosine_check",
                "learned_check",
                "prefill",
            )
        },
    }
    costs["ms"]["backfill"] = {"1": 0.1}
    costs["ms"]["decision"] = {"1": 0.0}
    full = torch.full((1, 5), 3)
    assert ideal_speedup(costs, full, [1, 2], "forced") == pytest.approx(1.0)
    # exiting at layer 1 after one free check: 2 layers + head + 2 backfills vs 4 layers + head
    assert step_cost(costs, [1], [1, 2], "forced") == pytest.approx(2 + 1 + 0.2)
    assert full_step_cost(costs, 1) == pytest.approx(5.0)
    # a logit criterion pays a head per check, reused at exit
    assert step_cost(costs, [2], [1, 2], "max_prob") == pytest.approx(3 + 2 + 0.1)
    early = torch.full((1, 5), 1)
    assert ideal_speedup(costs, early, [1], "forced") > 1.0
    assert not math.isnan(ideal_speedup(costs, early, [1], "max_prob"))


def test_forced_profile_draws_match_shares(ee_folder):
    model = eet.from_base(ee_folder)
    profile = bench.forced_profile("mixed", model, per_row=True)
    draws = torch.cat([profile(4, "cpu") for _ in range(10)])  # 40 draws = two full blocks
    assert sorted(set(draws.tolist())) == [1, 2, 3]
    assert draws.float().mean().item() == pytest.approx(profile.mean_exit_layer)
    shared = bench.forced_profile("50% at 1/2", model, per_row=False)
    row = shared(3, "cpu")
    assert len(set(row.tolist())) == 1, "batch-policy profiles draw one target per step"


def test_heldout_prompts_alternate_domains(text_files):
    class WordTokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [hash(w) % 90 + 3 for w in text.split()]}

    prompts = bench.heldout_prompts(WordTokenizer(), text_files, num_prompts=6, window=16)
    assert [p["domain"] for p in prompts] == ["prose", "code"] * 3
    assert all(len(p["ids"]) == 16 for p in prompts)


def test_instrumentation_leaves_the_models_as_they_were(ee_folder):
    ee, plain = bench.load_models(ee_folder)
    assert plain.model is ee.model and plain.lm_head is ee.lm_head, "the plain twin must run on the same modules"
    batch = bench.make_batches(bench.random_prompts(99, 2, window=6), 2, 1)[0]
    prof = bench.profile_step(
        ee,
        batch,
        4,
        {
            "exit_criterion": bench.ForcedExits(bench.forced_profile("mixed", ee)),
            "exit_check_layers": [1, 2],
            "exit_policy": "row",
        },
    )
    assert prof["parts_ms"]["layers"] > 0
    for model in (ee, plain):
        assert not {"forward", "_check", "_decide", "_backfill_kv"} & set(vars(model)), "a wrapper was left on"
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()), "a hook was left on"


def test_report_without_matplotlib_writes_the_json_and_table_and_says_how_to_get_the_plots(
    tmp_path, monkeypatch, caplog
):
    from ee_transformers.tools.bench.report import write_outputs

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.delitem(sys.modules, "matplotlib.pyplot", raising=False)
    with caplog.at_level("WARNING"):
        paths = write_outputs({"costs": {}, "results": []}, tmp_path)
    assert sorted(paths) == ["json", "table"], "the plots were not drawn, so they are not among the outputs"
    assert json.loads((tmp_path / "report.json").read_text()) == {"costs": {}, "results": []}
    assert (tmp_path / "results.md").is_file() and not list(tmp_path.glob("*.png"))
    warnings = [r.getMessage() for r in caplog.records if "matplotlib" in r.getMessage()]
    assert len(warnings) == 1 and "frontier.png" in warnings[0] and "exit_histogram.png" in warnings[0], warnings
    assert "pip install 'ee-transformers[bench]'" in warnings[0], warnings
