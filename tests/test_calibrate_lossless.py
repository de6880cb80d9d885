"""Issue 20: lossless calibration chooses draft settings by measured speed and stores them where a plain generate
finds them."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import ee_transformers as eet
from ee_transformers.tools.bench import plain_twin, random_prompts
from ee_transformers.tools.calibrate import main
from ee_transformers.training import calibrate_lossless as lossless
from ee_transformers.training.fit_exit_heads import save_model_folder
from ee_transformers.training.tiny import save_tiny_base, tiny_texts, tiny_tokenizer, write_texts

SMALL = dict(batch_sizes=[1, 2], lookup_tokens=[1, 2], ngram_sizes=[2], num_prompts=2, prompt_tokens=8, new_tokens=8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless")
    model = eet.from_base(save_tiny_base(root / "base"), exit_layers=[0, 1, 2]).eval()
    return save_model_folder(model, root / "ee", tiny_tokenizer()), write_texts(root / "text", tiny_texts(n_docs=4))


def _fake_speed(monkeypatch, speed):
    """measure_rows with the real decoding (identity is still checked) and a given speed-up per setting."""
    real = lossless.measure_rows

    def measured(ee, plain, batches, rows, generation_config, rounds, log=print):
        out = real(ee, plain, batches, rows, generation_config, rounds, log=lambda *_: None)
        for r in out:
            r["speedup"] = r["median"] = r["low"] = r["high"] = speed(r["kwargs"], r["batch_size"])
        return out

    monkeypatch.setattr(lossless, "measure_rows", measured)


def _calibrate(model):
    config = lossless.LosslessCalibrationConfig(**SMALL)
    return lossless.calibrate_lossless(model, plain_twin(model), random_prompts(99, 2, 8), config, log=lambda *_: None)


def test_candidates_cover_every_source_and_count():
    config = lossless.LosslessCalibrationConfig(lookup_tokens=[2, 4], ngram_sizes=[3], exits=[2])
    names = [sorted(k) for k in lossless.lossless_candidates(config)]
    assert names.count(["max_matching_ngram_size", "prompt_lookup_num_tokens"]) == 2
    assert ["assistant_early_exit", "num_assistant_tokens"] in names
    assert (
        names.count(
            ["assistant_early_exit", "max_matching_ngram_size", "num_assistant_tokens", "prompt_lookup_num_tokens"]
        )
        == 2
    )


def test_the_best_worst_case_is_stored_and_used_by_a_plain_generate(folder, monkeypatch, tmp_path):
    path, _ = folder
    model = eet.from_base(path).eval()
    # N=2 is fast at batch 1 and slow at batch 2; N=1 a little faster than full depth at both: N=1 is chosen
    _fake_speed(monkeypatch, lambda k, b: {(2, 1): 1.6, (2, 2): 0.9}.get((k["prompt_lookup_num_tokens"], b), 1.1))
    report = _calibrate(model)
    assert report["chosen"] == {"prompt_lookup_num_tokens": 1, "max_matching_ngram_size": 2}
    assert {c["worst"] for c in report["candidates"]} == {1.1, 0.9}
    lossless.apply_lossless_calibration(model, report)
    save_model_folder(model, tmp_path / "out", tiny_tokenizer())
    stored = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert stored["prompt_lookup_num_tokens"] == 1 and stored["max_matching_ngram_size"] == 2
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    out = loaded.generate(ids, max_new_tokens=12, return_dict_in_generate=True)
    assert out.context_draft_tokens is not None  # the stored setting decoded speculatively
    assert torch.equal(out.sequences, loaded.generate(ids, max_new_tokens=12, prompt_lookup_num_tokens=None))


def test_a_setting_that_pays_at_batch_1_only_is_stored_for_batch_1_only(folder, monkeypatch):
    path, _ = folder
    model = eet.from_base(path).eval()
    _fake_speed(monkeypatch, lambda k, b: 1.3 if b == 1 else 0.95)
    report = _calibrate(model)
    assert report["chosen"] and report["max_batch_size"] == 1 and "up to batch 1" in report["message"]
    lossless.apply_lossless_calibration(model, report)
    assert model.generation_config.speculative_max_batch_size == 1
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    one = model.generate(ids, max_new_tokens=8, return_dict_in_generate=True)
    two = model.generate(ids.repeat(2, 1), max_new_tokens=8, return_dict_in_generate=True)
    assert getattr(one, "context_draft_tokens", None) is not None  # batch 1: the stored drafts
    assert getattr(two, "context_draft_tokens", None) is None  # batch 2: full depth, as measured best
    assert torch.equal(two.sequences[0], one.sequences[0])
    # asked for in the call, drafts run at any batch size
    asked = model.generate(ids.repeat(2, 1), max_new_tokens=8, prompt_lookup_num_tokens=2, return_dict_in_generate=True)
    assert asked.context_draft_tokens is not None
    assert "up to batch size 1" in lossless.lossless_calibration_card(report)


def test_nothing_is_stored_when_no_setting_beats_full_depth_at_batch_1(folder, monkeypatch):
    path, _ = folder
    model = eet.from_base(path).eval()
    model.generation_config.prompt_lookup_num_tokens = 3  # a stale stored setting is cleared
    _fake_speed(monkeypatch, lambda k, b: 0.95 if b == 1 else 1.3)
    report = _calibrate(model)
    assert report["chosen"] is None and "no lossless setting beat full depth at batch 1" in report["message"]
    lossless.apply_lossless_calibration(model, report)
    assert model.generation_config.prompt_lookup_num_tokens is None
    card = lossless.lossless_calibration_card(report)
    assert "Nothing is stored" in card and "prompt_lookup_num_tokens=" in card and "0.95x" in card


def test_cli_lossless_calibration_writes_the_folder_report_and_card(folder, tmp_path):
    path, files = folder
    argv = [str(path), "--data", *files, "--lossless", "--out", str(tmp_path / "fast"), "--batch-sizes", "1"]
    argv += ["--lookup-tokens", "2", "--ngram-sizes", "2", "--num-prompts", "1", "--prompt-tokens", "8"]
    argv += ["--new-tokens", "6"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "fast" / "calibration_lossless.json").read_text())
    assert len(report["candidates"]) == 1 and report["candidates"][0]["by_batch_size"]["1"]["identical"]
    stored = json.loads((tmp_path / "fast" / "generation_config.json").read_text())
    assert stored.get("prompt_lookup_num_tokens") == (2 if report["chosen"] else None)
    card = (tmp_path / "fast" / "README.md").read_text()
    assert "Lossless calibration" in card


def test_bad_lossless_calibration_settings():
    with pytest.raises(ValueError, match="`lookup_tokens`"):
        lossless.LosslessCalibrationConfig(lookup_tokens=[0])
    with pytest.raises(ValueError, match="`batch_sizes`"):
        lossless.LosslessCalibrationConfig(batch_sizes=[])


def test_width_candidates_only_widen_rounds_narrower_than_the_width():
    config = lossless.LosslessCalibrationConfig(lookup_tokens=[2, 7], ngram_sizes=[3], verify_widths=[0, 8])
    widths = [
        (k["prompt_lookup_num_tokens"], k.get("speculative_verify_width")) for k in lossless.lossless_candidates(config)
    ]
    assert widths == [(2, None), (2, 8), (7, None)]  # N=7 feeds 8 positions anyway
    assert "speculative_verify_width" in lossless.STORED_FIELDS
