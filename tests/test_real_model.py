"""Issue 5: on the real SmolLM2-135M (fetched and cached by `ee_transformers.tools.assets`), a brief fit and a calibration
give early-exit decoding that skips layers while holding agreement with full depth on held-out text."""

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def smollm2():
    from ee_transformers import from_base
    from ee_transformers.tools import assets

    model_dir = assets.fetch_model(progress=False)
    text = assets.fetch_text(progress=False)
    model = from_base(model_dir, exit_layers=[23, 26], exit_head="adapter", exit_adapter_rank=32).eval()
    return model, text


def _blocks(tokenizer, path, region, count, block_size=128):
    from ee_transformers.training.data import tokenize_blocks

    text = Path(path).read_text(encoding="utf-8")
    start = int(region * len(text))
    return tokenize_blocks([text[start : start + 40 * block_size * count]], tokenizer, block_size)[:count]


def test_fit_calibrate_and_skip_layers_on_held_out_text(smollm2):
    from ee_transformers import ExitStats
    from ee_transformers.tools import assets
    from ee_transformers.training.calibrate import CalibrationConfig, apply_calibration, calibrate
    from ee_transformers.training.fit_exit_heads import FitConfig, fit_exit_heads

    torch.manual_seed(0)
    model, text = smollm2
    tokenizer = model.tokenizer
    novels = {Path(p).stem: p for p in text["austen"]}
    train = _blocks(tokenizer, novels["emma"], 0.1, 16)
    heldout = _blocks(tokenizer, novels["persuasion"], 0.5, 4)
    result = fit_exit_heads(
        model,
        train,
        heldout,
        FitConfig(
            steps=8, batch_size=2, lr=1e-3, warmup_steps=1, positions_per_block=32, eval_blocks=4, progress=False
        ),
    )
    assert result.agreement_after[-1] > 0.3  # exit 26 already agrees with the final layer on a third of tokens

    # calibrate on one held-out novel; cheap pinned costs keep the test about mechanics, not this machine's speed
    calibration = _blocks(tokenizer, novels[assets.AUSTEN_HELDOUT], 0.0, 12)
    report = calibrate(
        model,
        calibration,
        CalibrationConfig(target_agreement=0.9, policy="row"),
        costs={"head_cost": 0.5, "check_cost": 0.0, "backfill_cost": 0.05},
    )
    assert report["chosen"], report["message"]
    assert report["heldout_B"]["agreement"] >= 0.8
    apply_calibration(model, report)

    prompts = _blocks(tokenizer, novels[assets.AUSTEN_HELDOUT], 0.7, 4, block_size=48)
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=24,
        min_new_tokens=24,
        do_sample=False,
        return_dict_in_generate=True,
    )  # the calibrated settings (row policy), from the config
    stats = ExitStats.from_generate(out, model)
    assert stats.mean_exit_layer < model.config.num_hidden_layers - 1, str(stats)
    # quality: each early-exit token against the full-depth argmax on the same prefix (teacher-forced)
    with torch.no_grad():
        full = model(out.sequences[:, :-1]).logits[:, prompts.shape[1] - 1 :].argmax(-1)
    agreement = (full == out.sequences[:, prompts.shape[1] :]).double().mean().item()
    assert agreement >= 0.75, f"agreement {agreement:.3f} with full depth; {stats}"
