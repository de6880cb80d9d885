"""The main job's final screen (`ee-transformers demo`, stage 5): every mode against full depth on held-out prompts,
each with its measured speed and the quality measures against full depth's text (`gains`), and the HELIOS pool's rows
(`pool_rows`). `ee_transformers.tools.demo` runs the stages before it."""

import argparse
import contextlib
import logging
import time
from dataclasses import dataclass

import torch
from transformers.utils import logging as hf_logging


def _minutes(since):
    return round((time.perf_counter() - since) / 60, 1)


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
    definitions of `measure/quality.py`, as the benchmark uses them."""
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

    def not_run(self, mode, b, why):
        self.lines.append(f"| {mode} | {b} | {why} | - | - | - | - | - | - |")

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
    """The main job's final screen: full depth, the stored (calibrated) setting, the lossless modes (ours and
    transformers') and the lean HELIOS model, each with its measured speed against full depth and the quality
    measures, one line of meaning each; with `pool` (a `_PoolSpec`) also the HELIOS pool and its two models alone,
    on the mixed prompts.

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
    part = time.perf_counter()
    for b in batch_sizes:
        _batch_rows(screen, model, reference, report, closest, b)
    print(f"   full depth and calibrated rows: {_minutes(part)} min")
    if lossless is not None:
        part = time.perf_counter()
        _lossless_rows(model, plain, prompts, lossless, batch_sizes, new_tokens, screen, reference)
        print(f"   lossless rows: {_minutes(part)} min")
    lines = screen.lines
    if calibration_texts and folder and (report.get("chosen") or closest is not None):
        part = time.perf_counter()
        settings = {} if report.get("chosen") else _setting(report, closest)
        lines += _lean_lines(model, reference, folder, batch_sizes[-1], config, calibration_texts, settings)
        print(f"   lean rows: {_minutes(part)} min")
    if pool is not None:
        lines += _pool_lines(plain, prompts, pool, new_tokens, quick)
    lines += [
        "",
        EXPLAINER,
        "Speed: paired, interleaved ratios against full depth on the same weights (calibrated and closest: "
        "calibration's own measurement of decode time per token, median and lower quartile; lean: decode time per "
        "token, median; the pool's rows: new "
        f"tokens per second over the whole generate, interleaved with full depth in the same run, on the first "
        f"{POOL_PROMPTS} prompts; the lossless rows: whole generates, paired with full depth, median and summed, "
        "with the share of our drafts the full model accepted; every lossless row reproduced full depth's text "
        "exactly).",
    ]
    return lines


def _calibration_speed(tried, b):
    """What calibration measured for the setting `tried` at batch size `b`."""
    measured = tried["by_batch_size"].get(str(b))
    if measured is None:
        return "not measured at this batch (calibration stopped at the first batch size that missed)"
    return f"{measured['median']:.2f}x (lower quartile {measured['lower_quartile']:.2f}x)"


def _batch_rows(screen, model, reference, report, closest, b):
    """The rows at batch size `b`: full depth, the stored setting and the closest setting calibration turned down
    (when it stored none)."""
    plain, weights = reference.plain, screen.weights
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


def _draft_exit(model) -> int:
    """The exit the final screen's self-speculative rows draft from: the middle one."""
    exits = list(model.config.exit_layers)
    return exits[len(exits) // 2]


# The exit-draft rows, which do not pay on SmolLM2 (transformers' `assistant_early_exit` 0.2-0.3x, ours 0.45-0.7x),
# are timed at batch 1 only, on this many prompts (the first of each domain): on every prompt at every batch size
# they took a third of the final screen.
SLOW_ROW_PROMPTS = 2


def _exit_drafts(model) -> tuple[str, dict]:
    """The self-speculative row: (its name, its generate() arguments): drafts from the middle exit, with the fit's
    most frequent tokens as a cheap draft vocabulary when it stored them."""
    draft = _draft_exit(model)
    spec = {"assistant_early_exit": draft + 1, "num_assistant_tokens": 4}
    vocab = min(8192, model.config.draft_vocab_size or 0)
    if vocab:
        spec["assistant_vocab_size"] = vocab
    return f"self-speculative (drafts from exit {draft}" + (f", top-{vocab} draft vocabulary)" if vocab else ")"), spec


class _Acceptance:
    """The early-exit model as `measure_rows` drives it, keeping each of our outputs' accepted / drafted tokens per
    row setting and batch (greedy runs repeat exactly, so a batch's warm-up and timed run count once)."""

    def __init__(self, model, fields):
        self.model, self.fields, self.seen = model, fields, {}
        # what the timing reads from the model itself: its history index (emptied before each timed run, or a row
        # would draft the answers of the same prompts decoded by the rows before it) and the stored-settings guard
        self.drafter, self.without_stored_settings = model.drafter, model.without_stored_settings

    def key(self, kwargs, generation_config=None) -> tuple:
        return tuple(kwargs[n] if n in kwargs else getattr(generation_config, n, None) for n in self.fields)

    def generate(self, ids, generation_config=None, **kwargs):
        out = self.model.generate(ids, generation_config=generation_config, **kwargs)
        if getattr(out, "draft_tokens", None) is not None:
            self.seen[self.key(kwargs, generation_config), id(ids)] = (out.accepted_tokens, out.draft_tokens)
        return out

    def rate(self, row_kwargs) -> float | None:
        """Share of the drafts the full model accepted, over every batch timed with `row_kwargs`."""
        pairs = [v for (key, _), v in self.seen.items() if key == self.key(row_kwargs)]
        drafted = sum(int(d.sum()) for _, d in pairs)
        return sum(int(a.sum()) for a, _ in pairs) / drafted if drafted else None


def _lossless_rows(model, plain, prompts, lossless, batch_sizes, new_tokens, screen, reference):
    """Adds to `screen` the lossless rows: ours with the setting lossless calibration stored (or came closest
    with) at every batch size, transformers' prompt lookup (batch 1; it refuses more), and self-speculation from an
    exit and transformers' `assistant_early_exit` (batch 1, on `SLOW_ROW_PROMPTS` of the prompts; a row saying why
    where the installed transformers cannot run it), timed against full depth on the final screen's prompts (not
    calibration's), paired and interleaved."""
    from ee_transformers.compat import layer_skip_failure
    from ee_transformers.measure.timing import greedy_generation_config, without_eos
    from ee_transformers.speculative_early_exit import DRAFT_SOURCES, OUR_FIELDS
    from ee_transformers.tools import bench
    from ee_transformers.tools.bench.lossless import measure_rows

    setting = lossless["chosen"] or lossless["closest"]["kwargs"]
    exit_name, exit_drafts = _exit_drafts(model)
    tuned = dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3)  # its best setting on SmolLM2 (BENCHMARKS 5)
    layer_skip = dict(assistant_early_exit=_draft_exit(model) + 1, num_assistant_tokens=4)  # its LayerSkip mode
    rows = {
        "ours": dict(name="ours", who="ours", kwargs=setting),
        "transformers": dict(name="transformers", who="transformers", kwargs=tuned),
        "exit drafts": dict(name="exit drafts", who="ours", kwargs=exit_drafts),
        "transformers-exit": dict(name="transformers-exit", who="transformers", kwargs=layer_skip),
    }
    ours = _Acceptance(model, DRAFT_SOURCES + OUR_FIELDS)  # each row names all of them (`only_these_drafts`)
    with without_eos(model, plain), torch.no_grad():
        config = greedy_generation_config(plain, new_tokens, clear_exit_settings=True)
        for b in batch_sizes:
            batches = bench.make_batches(prompts, b, max(1, len(prompts) // b), device=model.device)
            runs = [(batches, [rows["ours"]])]
            if b == 1:  # transformers' rows refuse batch > 1; the exit-draft rows: see SLOW_ROW_PROMPTS
                runs = [(batches, [rows["ours"], rows["transformers"]])]
                slow = [rows["exit drafts"]] + ([rows["transformers-exit"]] if layer_skip_failure() is None else [])
                runs.append((batches[:SLOW_ROW_PROMPTS], slow))
            q_full = _quality(plain, reference, b, {})
            for timed, these in runs:
                hush = rows["transformers-exit"] in these  # only where transformers makes that call itself
                with _assistants_own_call() if hush else contextlib.nullcontext():
                    measured = measure_rows(ours, plain, timed, these, config, 1, log=lambda *_: None)
                for r in measured:
                    if not r["identical"]:
                        raise AssertionError(f"{r['who']} {r['name']} did not reproduce full depth at batch {b}.")
                    mode, meaning = _lossless_row_text(r["name"], lossless, b, setting, exit_name, layer_skip)
                    if len(timed) < len(batches):
                        meaning += f" (timed at batch 1 only, on {len(timed)} of the {len(batches)} prompts)"
                    screen.row(
                        mode,
                        b,
                        _lossless_speed(r, ours.rate(r["kwargs"]) if r["who"] == "ours" else None),
                        q_full,
                        screen.weights,
                        meaning,
                    )
            if b == 1 and layer_skip_failure() is not None:
                screen.not_run("transformers' assistant_early_exit", b, layer_skip_failure())


class _AssistantCall(logging.Filter):
    """transformers' assisted generation (`assistant_early_exit`) calls its assistant's `generate` with a config and
    generation kwargs (candidate_generator.py), which transformers itself reports as deprecated: a call of
    transformers', not of this screen; every other record passes."""

    def filter(self, record):
        return not record.getMessage().startswith("Passing `generation_config` together with generation-related")


@contextlib.contextmanager
def _assistants_own_call():
    logger, hushed = hf_logging.get_logger("transformers.generation.utils"), _AssistantCall()
    logger.addFilter(hushed)
    try:
        yield
    finally:
        logger.removeFilter(hushed)


def _lossless_speed(r, acceptance) -> str:
    speed = f"{r['median']:.2f}x (sum {r['speedup']:.2f}x)"
    return speed if acceptance is None else f"{speed}, {100 * acceptance:.0f}% of drafts accepted"


def _lossless_row_text(name, lossless, b, setting, exit_name, layer_skip) -> tuple[str, str]:
    """(mode, meaning) of a lossless row of the final screen."""
    if name == "ours":
        limit = lossless.get("max_batch_size")
        if not lossless["chosen"]:
            stored = "not stored: slower than full depth at batch 1"
        elif limit and b > limit:
            stored = f"stored for batch <= {limit}: at this batch generate runs full depth"
        else:
            stored = "stored"
        sources = "context + table drafts" if setting.get("speculative_table_drafts") else "context drafts"
        shown = ", ".join(f"{k}={v}" for k, v in setting.items())
        return f"lossless: {sources} ({stored})", f"`{shown}`: the same text as full depth"
    if name == "exit drafts":
        return exit_name, "lossless: the same text as full depth by construction"
    if name == "transformers":
        return "transformers' prompt lookup", "`prompt_lookup_num_tokens=4, max_matching_ngram_size=3`"
    return (
        "transformers' assistant_early_exit",
        f"`assistant_early_exit={layer_skip['assistant_early_exit']}, num_assistant_tokens=4` on the plain model "
        "(its final norm and LM head after that layer: no exit heads)",
    )


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
POOL_PROMPTS = 4  # the pool's rows use the first 4 prompts (2 per domain, alternating), each interleaved once


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
    lines = pool_rows(models, plain, prompts[:POOL_PROMPTS], new_tokens, repeats=1)  # each prompt once
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
