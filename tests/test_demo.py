"""The main job's final screen (`ee_transformers.tools.demo`): the HELIOS pool's rows on a mixed prompt set."""

import torch
from helpers import ALWAYS, NEVER, model_with

from ee_transformers.compat import layer_skip_failure
from ee_transformers.lean_early_exit import resident_parameter_bytes
from ee_transformers.measure.timing import greedy_generation_config, only_these_drafts, without_eos
from ee_transformers.tools import bench
from ee_transformers.tools.demo import pool_rows
from ee_transformers.utils.generation import generate_kwargs


def test_pool_rows_show_each_model_alone_and_the_pool_that_moves_to_the_one_that_exits(base_dirs):
    never = model_with(base_dirs, seed=5, **NEVER)
    always = model_with(base_dirs, seed=7, **ALWAYS)
    alone_bytes = resident_parameter_bytes(never) + resident_parameter_bytes(always)
    plain = bench.plain_twin(never)
    prompts = bench.random_prompts(99, 2, window=6)
    lines = pool_rows(
        {"never": never, "always": always}, plain, prompts, new_tokens=8, repeats=1, settings={}, interval=4
    )
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert [c[0] for c in cells] == ["never alone", "always alone", "pool [never, always]"]
    never_row, always_row, pool_row = cells
    assert never_row[3:6] == ["1.000", "1.000", "8.0"], "a model that never exits decodes the full-depth text"
    assert float(always_row[3]) < 1.0 or float(always_row[4]) < 1.0, "exiting at layer 0 changes tokens"
    assert "switched in 2 of 2 requests" in pool_row[-1], pool_row[-1]
    assert "x the best single model (" in pool_row[-1]  # which one is a timing: not asserted on tiny models
    assert all(c[2].endswith("x (tok/s)") and float(c[2].split("x")[0]) > 0 for c in cells)
    # the pool holds the backbone once: the second model now uses the first one's modules
    assert always.model is never.model and always.get_output_embeddings() is never.get_output_embeddings()
    assert resident_parameter_bytes(never, always) < alone_bytes


def _report(chosen):
    measured = {"median": 0.98, "lower_quartile": 0.95}
    tried = {"check_layers": [1], "thresholds": [0.05], "measured": measured, "by_batch_size": {"1": measured}}
    return {
        "chosen": {"check_layers": [1], "thresholds": [0.05]} if chosen else None,
        "criterion": "max_prob",
        "policy": "row",
        "patience": 0,
        "kv": "immediate",
        "message": "exits left off: measured slower than full depth",
        "speed": {"tried": [tried], "kept": chosen},
    }


def test_final_screen_shows_full_depth_when_stored_and_the_setting_calibration_turned_down(base_dirs):
    from ee_transformers.tools.demo import gains

    model = model_with(base_dirs, seed=5)
    plain = bench.plain_twin(model)
    prompts = bench.random_prompts(99, 2, window=6)
    lines = gains(model, plain, prompts, _report(chosen=False), [1, 2], new_tokens=6, quick=True)
    table = [line for line in lines[2:] if line.startswith("| ")]
    rows = {(c[0], c[1]): c for c in ([x.strip() for x in line.strip("|").split("|")] for line in table)}
    assert len(rows) == 6, "full depth, stored, closest at each batch size"  # lossless=None: no lossless rows
    assert rows["full depth", "1"][3:6] == ["1.000", "1.000", "6.0"]
    assert rows["calibrated (stored)", "1"][2] == "= full depth"
    closest = rows["closest setting (not stored)", "1"]
    assert closest[2] == "0.98x (lower quartile 0.95x)" and "turned down" in closest[-1]
    assert rows["closest setting (not stored)", "2"][2].startswith("not measured at this batch")
    assert any("identical-token share compares whole texts" in line for line in lines)


def test_final_screen_shows_the_stored_setting_with_calibrations_measured_speed(base_dirs):
    from ee_transformers.tools.demo import gains

    model = model_with(base_dirs, seed=5, exit_criterion="max_prob", exit_threshold=0.05, exit_check_layers=[1])
    plain = bench.plain_twin(model)
    lines = gains(model, plain, bench.random_prompts(99, 2, window=6), _report(chosen=True), [1], 6, quick=True)
    stored = next(line for line in lines if line.startswith("| calibrated (stored) | 1 |"))
    assert "0.98x (lower quartile 0.95x)" in stored and not any("closest setting" in line for line in lines)


def test_final_screen_times_the_lossless_setting_and_transformers_prompt_lookup(base_dirs, monkeypatch):
    from ee_transformers import drafts
    from ee_transformers.tools.demo import gains
    from ee_transformers.training import calibrate_lossless as lossless

    # the gate prices drafts from this machine's timings, and under load it may draft nothing in a run, so that a row
    # has no acceptance to show: drafting that gains anything is taken here, and the screen's rows are what is tested
    monkeypatch.setattr(drafts, "MARGIN", 0.0)

    model = model_with(base_dirs, seed=5)
    plain = bench.plain_twin(model)
    prompts = bench.random_prompts(99, 4, window=6)
    config = lossless.LosslessCalibrationConfig(
        batch_sizes=[1, 2], lookup_tokens=[2], ngram_sizes=[3], num_prompts=2, new_tokens=6
    )
    report = lossless.calibrate_lossless(model, plain, prompts[:2], config, log=lambda *_: None)
    lines = gains(model, plain, prompts, _report(chosen=False), [1, 2], new_tokens=6, quick=True, lossless=report)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    ours = [r for r in rows if r[0].startswith("lossless: context drafts")]
    theirs = [r for r in rows if r[0] == "transformers' prompt lookup"]
    layer_skip = [r for r in rows if r[0] == "transformers' assistant_early_exit"]
    exit_drafts = [r for r in rows if r[0].startswith("self-speculative (drafts from exit 1")]
    assert [r[1] for r in ours] == ["1", "2"] and [r[1] for r in theirs] == ["1"]  # transformers refuses batch 2
    assert [r[1] for r in layer_skip] == ["1"] and [r[1] for r in exit_drafts] == ["1"]
    if layer_skip_failure() is not None:  # transformers before 5.22: its own exit drafts fail; the row says so
        assert layer_skip[0][2:] == [layer_skip_failure()] + ["-"] * 6
        layer_skip = []
    else:
        assert "assistant_early_exit=" in layer_skip[0][-1]
    lossless_rows = ours + theirs + layer_skip + exit_drafts
    assert all(r[3:5] == ["1.000", "1.000"] and "x (sum " in r[2] for r in lossless_rows)
    # the exit-draft rows are timed at batch 1 on SLOW_ROW_PROMPTS (2) of the 4 prompts, and say so; the others on all
    assert all(r[-1].endswith("(timed at batch 1 only, on 2 of the 4 prompts)") for r in layer_skip + exit_drafts)
    assert not any("timed on" in r[-1] for r in ours + theirs)
    # acceptance next to speed for our rows (transformers' assisted loop does not report it)
    assert all("% of drafts accepted" in r[2] for r in ours + exit_drafts)
    assert not any("accepted" in r[2] for r in theirs + layer_skip)
    # ... and it is the share the outputs report: the exit-draft row at batch 1, on the 2 prompts it was timed on
    with without_eos(model, plain):
        greedy = greedy_generation_config(plain, 6, clear_exit_settings=True)
        settings = generate_kwargs(
            model, greedy, **only_these_drafts({"assistant_early_exit": 2, "num_assistant_tokens": 4})
        )
        outs = [model.generate(torch.tensor([p["ids"]]), **settings) for p in prompts[:2]]
    accepted, drafted = sum(int(o.accepted_tokens.sum()) for o in outs), sum(int(o.draft_tokens.sum()) for o in outs)
    assert drafted > 0 and f", {100 * accepted / drafted:.0f}% of drafts accepted" in exit_drafts[0][2]
    stored = "stored" if report["chosen"] else "not stored"
    assert all(f"({stored}" in r[0] for r in ours) and "prompt_lookup_num_tokens=2" in ours[0][-1]
