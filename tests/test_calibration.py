"""Tests for training/calibrate.py: the cost model and simulation on hand-made scores, the search, storing the choice
so that `generate()` uses it, and the `calibrate` command. Tiny random models only."""

import json
import os
from pathlib import Path

import pytest
import torch

import ee_transformers as eet
from ee_transformers.tools.calibrate import main
from ee_transformers.training.calibrate import (
    CalibrationConfig,
    apply_calibration,
    calibrate,
    calibration_card,
    collect_exit_scores,
    measure_costs,
    scores_from_logits,
    search_policy,
    simulate,
)
from ee_transformers.training.data import load_blocks
from ee_transformers.training.fit_exit_heads import FitConfig, fit_exit_heads, save_model_folder
from ee_transformers.training.tiny import save_tiny_base, tiny_texts, tiny_tokenizer, write_texts

torch.set_num_threads(1)
FREE = {"head_cost": 0.0, "check_cost": 0.0, "backfill_cost": 0.0}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A tiny Llama with fitted adapter exits after layers 0, 1, 2, saved with its tokenizer; and held-out blocks."""
    root = tmp_path_factory.mktemp("cal")
    base = save_tiny_base(root / "base")
    files = write_texts(root / "text", tiny_texts(n_docs=10))
    splits = load_blocks(files, tiny_tokenizer(), 32, heldout_fraction=0.4)
    torch.manual_seed(0)
    model = eet.from_base(base, exit_layers=[0, 1, 2], exit_head="adapter", exit_adapter_rank=8)
    fit_exit_heads(model, splits.train, None, FitConfig(steps=15, batch_size=4, lr=1e-2, progress=False))
    folder = save_model_folder(model, root / "ee", tiny_tokenizer())
    return folder, files, splits.heldout


def hand_data():
    # 4 positions, exits at layers 1 and 3 of a 6-layer model
    return {
        "scores": torch.tensor([[0.9, 0.9], [0.2, 0.8], [0.1, 0.1], [0.6, 0.2]]),
        "argmax": torch.tensor([[5, 5], [4, 7], [1, 2], [3, 9]]),
        "final": torch.tensor([5, 7, 8, 9]),
    }


def test_simulate_cost_model_by_hand():
    costs = {"head_cost": 2.0, "check_cost": 0.5, "backfill_cost": 0.1}
    r = simulate(hand_data(), [1, 3], 6, [0, 1], [0.5, 0.5], costs, "max_prob")
    # exits: pos0 at layer 1 (right), pos1 at 3 (right), pos2 full depth (right), pos3 at 1 (wrong: 3 != 9)
    assert r["agreement"] == 0.75 and r["exit_rate"] == 0.75
    assert r["mean_exit_layer"] == pytest.approx((1 + 3 + 5 + 1) / 4)
    # cost = layers run + checks x head (reused on exit) + backfill x skipped; never-exit pays both checks + final head
    costs_by_hand = [2 + 1 * 2 + 0.1 * 4, 4 + 2 * 2 + 0.1 * 2, 6 + 2 * 2 + 2, 2 + 1 * 2 + 0.1 * 4]
    assert r["speedup"] == pytest.approx((6 + 2) / (sum(costs_by_hand) / 4))
    cheap = simulate(hand_data(), [1, 3], 6, [0, 1], [0.5, 0.5], costs, "cosine")
    costs_by_hand = [2 + 0.5 + 2 + 0.4, 4 + 1.0 + 2 + 0.2, 6 + 1.0 + 2, 2 + 0.5 + 2 + 0.4]
    assert cheap["speedup"] == pytest.approx(8 / (sum(costs_by_hand) / 4)), "cosine checks are cheap, head paid once"


def test_simulate_patience():
    data = hand_data()
    r = simulate(data, [1, 3], 6, [0, 1], [2.0, 2.0], FREE, "max_prob", patience=2)
    # thresholds never fire; only position 0 has the same argmax at both exits -> exits at layer 3
    assert r["exit_rate"] == 0.25 and r["mean_exit_layer"] == pytest.approx((3 + 5 + 5 + 5) / 4)


def test_simulate_batch_policy_groups_exit_together():
    data = {
        "scores": torch.tensor([[0.9], [0.1], [0.9], [0.9]]),
        "argmax": torch.tensor([[1], [2], [3], [4]]),
        "final": torch.tensor([1, 2, 3, 0]),
    }
    alone = simulate(data, [1], 4, [0], [0.5], FREE, "max_prob")
    assert alone["exit_rate"] == 0.75 and alone["agreement"] == 0.75  # row 3 exits with a wrong token
    together = simulate(data, [1], 4, [0], [0.5], FREE, "max_prob", group=4)
    assert together["exit_rate"] == 0.0 and together["agreement"] == 1.0, "one unconfident row holds the batch back"
    assert together["mean_exit_layer"] == 3


def test_search_meets_target_on_its_own_data():
    data = hand_data()
    found = search_policy(data, [1, 3], 6, FREE, "max_prob", target_agreement=1.0)
    best = found["best"]
    r = simulate(data, [1, 3], 6, best["check"], best["thresholds"], FREE, "max_prob")
    assert r["agreement"] == 1.0 and r["speedup"] == pytest.approx(best["speedup"])
    assert best["speedup"] > 1.0, "with free checks, exiting pos 0 at layer 1 and pos 1 at layer 3 is right and faster"


def test_scores_from_logits():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    assert scores_from_logits(logits, "max_prob").item() == pytest.approx(0.7)
    assert scores_from_logits(logits, "margin").item() == pytest.approx(0.5)
    uniform = scores_from_logits(torch.zeros(1, 3), "entropy").item()
    assert uniform == pytest.approx(0.0, abs=1e-6)


def test_collect_scores_match_forward(fitted):
    folder, _, heldout = fitted
    model = eet.from_base(folder)
    data = collect_exit_scores(model, heldout[:2], "max_prob")
    with torch.no_grad():
        out = model(heldout[:2], output_exit_logits=True)
    assert torch.equal(data["final"], out.logits.argmax(-1).flatten())
    assert torch.equal(data["argmax"][:, 1], out.exit_logits[1].argmax(-1).flatten())
    assert torch.allclose(data["scores"][:, 1], out.exit_logits[1].softmax(-1).max(-1).values.flatten(), atol=1e-5)


def test_measure_costs_reports_layer_equivalents(fitted):
    model = eet.from_base(fitted[0])
    costs = measure_costs(model, repeats=5)
    assert costs["layer_ms"] > 0 and costs["head_cost"] > 0 and costs["backfill_cost"] > 0
    assert costs["head_cost"] == pytest.approx(costs["head_ms"] / costs["layer_ms"], rel=1e-2)


def test_calibrate_meets_target_and_generate_uses_it(fitted, tmp_path):
    folder, _, heldout = fitted
    model = eet.from_base(folder)
    report = calibrate(model, heldout, CalibrationConfig(target_agreement=0.6), costs=FREE)
    assert report["chosen"] is not None, report["message"]
    assert report["selection_A"]["agreement"] >= 0.6, "the choice must meet the target on the split it was chosen on"
    assert set(report["heldout_B"]) >= {"agreement", "mean_exit_layer", "speedup"}
    apply_calibration(model, report)
    out = save_model_folder(model, tmp_path / "calibrated", tiny_tokenizer())
    reloaded = eet.from_base(out)
    assert reloaded.exit_defaults["exit_check_layers"] == report["chosen"]["check_layers"]
    gen = reloaded.generate(heldout[:2, :8], max_new_tokens=12, return_dict_in_generate=True)  # no exit arguments
    allowed = set(report["chosen"]["check_layers"]) | {reloaded.config.num_hidden_layers - 1}
    used = set(gen.exit_layers.flatten().tolist()) - {-1}
    assert used <= allowed, f"exits not chosen must be skipped at decode time: used {used}, allowed {allowed}"
    assert used - {reloaded.config.num_hidden_layers - 1}, "a calibrated model should exit early sometimes"


def test_calibrate_leaves_exits_off_when_nothing_pays(fitted):
    folder, _, heldout = fitted
    model = eet.from_base(folder)
    model.set_exit_defaults(exit_criterion="max_prob", exit_threshold=0.5)  # stale settings must be cleared
    report = calibrate(
        model,
        heldout,
        CalibrationConfig(target_agreement=0.99),
        costs={"head_cost": 50.0, "check_cost": 50.0, "backfill_cost": 1.0},
    )
    assert report["chosen"] is None and "off" in report["message"]
    apply_calibration(model, report)
    assert model.exit_defaults["exit_criterion"] is None and model.exit_defaults["exit_threshold"] is None
    gen = model.generate(heldout[:1, :6], max_new_tokens=4, return_dict_in_generate=True)
    assert (gen.exit_layers == model.config.num_hidden_layers - 1).all()


def test_calibrate_needs_two_blocks(fitted):
    model = eet.from_base(fitted[0])
    with pytest.raises(ValueError, match="at least 2 held-out blocks"):
        calibrate(model, fitted[2][:1], costs=FREE)


def test_cli_calibrate_in_place(fitted, tmp_path):
    folder, files, _ = fitted
    work = tmp_path / "model"
    import shutil

    shutil.copytree(folder, work)
    (work / "fit_report.json").write_text(json.dumps({"card": {"training": "FITTED-HERE"}}))
    argv = [
        str(work),
        "--data",
        *files,
        "--block-size",
        "32",
        "--target-agreement",
        "0.6",
        "--costs",
        json.dumps(FREE),
        "--no-measure-speed",
    ]
    assert main(argv) == 0
    report = json.loads((work / "calibration.json").read_text())
    stored = json.loads((work / "generation_config.json").read_text())  # exit settings are generation settings
    assert stored["exit_criterion"] == "max_prob" and stored["exit_check_layers"] == report["chosen"]["check_layers"]
    assert "exit_criterion" not in json.loads((work / "config.json").read_text())
    card = (work / "README.md").read_text()
    assert "FITTED-HERE" in card, "the training section survives calibration"
    assert "B (reported)" in card
    assert (work / "fit_report.json").exists() and not [n for n in os.listdir(tmp_path) if "partial" in n]


def test_cli_calibrate_defaults_fit_a_model_with_128_positions(fitted, tmp_path):
    folder, files, _ = fitted
    assert json.loads(Path(folder, "config.json").read_text())["max_position_embeddings"] == 128
    out = tmp_path / "calibrated"
    assert main([str(folder), "--data", *files, "--out", str(out)]) == 0, "defaults only: nothing but the data"
    used = json.loads((out / "calibration.json").read_text())["config"]
    assert used["block_size"] == 128, "the block size defaults to min(256, max_position_embeddings)"
    assert used["verify_prompts"] == 8 and used["verify_prompt_length"] + used["verify_new_tokens"] <= 128
    assert eet.from_base(out).config.exit_layers == [0, 1, 2]


def test_cli_calibrate_rejects_plain_folder(tmp_path, capsys):
    base = save_tiny_base(tmp_path / "plain")
    texts = write_texts(tmp_path / "t", tiny_texts(n_docs=2))
    with pytest.raises(SystemExit):
        main([base, "--data", *texts, "--block-size", "32"])
    assert "has no exit heads" in capsys.readouterr().err


def test_calibrate_learned_and_cosine_criteria(fitted):
    from ee_transformers.training.fit_exit_heads import fit_confidence_heads

    folder, _, heldout = fitted
    model = eet.from_base(folder)
    with pytest.raises(ValueError, match="confidence heads"):
        calibrate(model, heldout, CalibrationConfig(criterion="learned"), costs=FREE)
    fit_confidence_heads(model, heldout, None, FitConfig(confidence_steps=10, batch_size=2, progress=False))
    for criterion in ("learned", "cosine"):
        report = calibrate(model, heldout, CalibrationConfig(criterion=criterion, target_agreement=0.5), costs=FREE)
        assert report["chosen"] is not None and report["selection_A"]["agreement"] >= 0.5, report["message"]
        apply_calibration(model, report)
        out = model.generate(heldout[:1, :6], max_new_tokens=4, return_dict_in_generate=True)
        assert out.exit_layers.shape[0] == 1 and model.exit_defaults["exit_criterion"] == criterion  # (may stop at EOS)


def test_on_policy_agreement_full_depth_is_exact(fitted):
    from ee_transformers.training.calibrate import on_policy_agreement

    folder, _, heldout = fitted
    model = eet.from_base(folder)
    prompts = heldout[:2, :8]
    full = on_policy_agreement(model, prompts, {"early_exit": False}, new_tokens=6)
    assert full["agreement"] == 1.0 and full["exit_rate"] == 0.0, "full depth must agree with itself on its own text"
    eager = on_policy_agreement(model, prompts, {"exit_criterion": "max_prob", "exit_threshold": 0.0}, new_tokens=6)
    assert eager["exit_rate"] == 1.0 and eager["mean_exit_layer"] == 0.0


def test_calibrate_verifies_by_decoding(fitted):
    folder, _, heldout = fitted
    model = eet.from_base(folder)
    config = CalibrationConfig(target_agreement=0.6, verify_prompts=2, verify_new_tokens=6, verify_prompt_length=8)
    report = calibrate(model, heldout, config, costs=FREE)
    assert report["verification"], "verification rounds are recorded"
    if report["chosen"] is not None:
        assert report["on_policy_B"]["agreement"] >= 0.6, "a verified choice meets the target when really decoding"
    else:
        assert all(v["agreement"] < 0.6 for v in report["verification"]) and "really decoding" in report["message"]


# -- issue 14: the speed promise and the guarantee ------------------------------------------------------------------
def _calibrate_with_measured(fitted, monkeypatch, measured_quartiles, **config):
    """calibrate() whose speed measurements return the given lower quartiles, in order."""
    import ee_transformers.training.calibrate as cal

    folder, _, heldout = fitted
    calls = []

    def fake_measure(model, prompts, exit_kwargs, cfg, batch_size=None):
        q = measured_quartiles[len(calls)]
        calls.append(exit_kwargs)
        return {
            "median": q + 0.05,
            "lower_quartile": q,
            "values": [q, q + 0.1],
            "pairs": 2,
            "batch_size": 1,
            "new_tokens": 8,
            "per_token_agreement": 0.8,
            "identical_token_share": 0.5,
        }

    monkeypatch.setattr(cal, "measure_speed", fake_measure)
    model = eet.from_base(folder)
    report = calibrate(
        model, heldout, CalibrationConfig(target_agreement=0.6, measure_speed=True, **config), costs=FREE
    )
    return model, report, calls


def test_a_setting_slower_than_full_depth_by_measurement_is_not_kept(fitted, monkeypatch):
    model, report, calls = _calibrate_with_measured(fitted, monkeypatch, [0.97, 0.9, 0.95], speed_candidates=3)
    assert len(calls) == 3 and report["chosen"] is None and not report["speed"]["kept"]
    assert "lower quartile" in report["message"] and "0.97x lower quartile" in report["message"]
    apply_calibration(model, report)
    assert model.exit_defaults["exit_criterion"] is None, "full depth is stored"
    card = calibration_card(report)
    assert "Early exit is off by default" in card
    # every measured setting is in the card: predicted next to measured, both quality measures, none kept
    rows = [line for line in card.splitlines() if line.endswith("| no |")]
    assert len(rows) == 3 and all("| 0.800 | 0.500 |" in row for row in rows)
    assert "0.97x)" in rows[0] and "0.90x)" in rows[1]


def test_the_next_candidate_is_kept_when_it_measures_faster(fitted, monkeypatch):
    model, report, calls = _calibrate_with_measured(fitted, monkeypatch, [0.9, 1.1], speed_candidates=3)
    assert len(calls) == 2 and report["speed"]["kept"]
    second = report["speed"]["tried"][1]
    assert report["chosen"]["check_layers"] == second["check_layers"]
    assert report["chosen"]["thresholds"] == second["thresholds"]
    card = calibration_card(report)
    assert "1.15x (lower quartile 1.10x)" in card
    assert card.count("| no |") == 1 and card.count("| yes |") == 1 and "1.15x (1.10x)" in card


def test_lower_quartile_stays_within_the_measured_values():
    from ee_transformers.training.calibrate import lower_quartile

    assert abs(lower_quartile([0.9, 21.0]) - (0.9 + 0.25 * 20.1)) < 1e-12  # one outlier pair: not below the slower
    assert lower_quartile([1.2]) == 1.2
    values = [0.95, 1.0, 1.05, 1.1, 1.2]
    assert lower_quartile(values) == 1.0 and min(values) <= lower_quartile(values[::-1]) <= max(values)


def test_measured_speed_of_a_real_run_is_recorded(fitted):
    folder, _, heldout = fitted
    report = calibrate(
        eet.from_base(folder),
        heldout,
        CalibrationConfig(
            target_agreement=0.6,
            measure_speed=True,
            speed_prompts=2,
            speed_new_tokens=4,
            speed_repeats=1,
            speed_candidates=1,
        ),
        costs=FREE,
    )
    assert report["speed"]["tried"], "the chosen setting was measured"
    tried = report["speed"]["tried"][0]
    measured = tried["measured"]
    assert measured["pairs"] >= 1 and measured["lower_quartile"] > 0
    assert 0 <= measured["per_token_agreement"] <= 1 and 0 <= tried["predicted_B"]["agreement"] <= 1
    assert report["speed"]["kept"] == (measured["lower_quartile"] > 1.0) == (report["chosen"] is not None)


def test_guarantee_certifies_a_setting_whose_teacher_forced_disagreement_is_within_epsilon(fitted):
    folder, _, heldout = fitted
    model = eet.from_base(folder)
    report = calibrate(model, heldout, CalibrationConfig(guarantee=0.5, confidence=0.2), costs=FREE)
    g = report["guarantee"]
    assert g["epsilon"] == 0.5 and g["certified"] >= 1 and "exchangeable" in g["assumption"]
    assert report["chosen"] is not None
    assert 1 - report["selection_A"]["agreement"] <= 0.5
    strict = calibrate(model, heldout, CalibrationConfig(guarantee=1e-6, confidence=0.01), costs=FREE)
    assert strict["chosen"] is None and "certified" in strict["message"]
    assert "Learn then Test" in calibration_card(report)


def test_the_speed_promise_must_hold_at_every_batch_size_asked(fitted, monkeypatch):
    import ee_transformers.training.calibrate as cal

    folder, _, heldout = fitted
    seen = []

    def fake_measure(model, prompts, exit_kwargs, cfg, batch_size=None):
        seen.append(batch_size)
        q = 1.2 if batch_size == 1 else 0.9  # pays alone, not at batch 2
        return {
            "median": q,
            "lower_quartile": q,
            "values": [q, q],
            "pairs": 2,
            "batch_size": batch_size,
            "new_tokens": 8,
            "identical_token_share": 0.5,
        }

    monkeypatch.setattr(cal, "measure_speed", fake_measure)
    report = calibrate(
        eet.from_base(folder),
        heldout,
        CalibrationConfig(target_agreement=0.6, measure_speed=True, speed_batch_sizes=[1, 2], speed_candidates=1),
        costs=FREE,
    )
    assert seen == [1, 2] and report["chosen"] is None
    assert report["speed"]["tried"][0]["measured"]["batch_size"] == 2, "the binding batch size is reported"
    assert "batch 2" in report["message"]
