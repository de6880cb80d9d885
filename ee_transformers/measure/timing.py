"""Timing and comparison: plain and early-exit generate interleaved on the same batches, paired ratios of decoding
milliseconds per step, greedy agreement, exit statistics and the ideal speed-up of the exits that happened."""

import contextlib
import copy
import math
import statistics
import time
from collections import defaultdict
from types import SimpleNamespace

import torch

from ee_transformers.generation_early_exit import EXIT_ARGUMENTS, ExitStats, merged_exit_values, resolve_exit_settings
from ee_transformers.measure.config import BenchConfig, Variant
from ee_transformers.measure.costs import ideal_speedup
from ee_transformers.measure.forced import ForcedExits, forced_profile
from ee_transformers.measure.loading import make_batches
from ee_transformers.measure.quality import eos_token_ids, full_model_view, identical_share, summarise_views
from ee_transformers.modeling_early_exit import EarlyExitMixin
from ee_transformers.speculative_early_exit import DRAFT_SOURCES, MAX_BATCH_FIELD, OUR_FIELDS
from ee_transformers.utils.generation import generate_kwargs


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate_kwargs(model, variant):
    """generate() exit arguments of a variant (a fresh forced-profile callable for forced ones)."""
    kwargs = dict(variant.exit_kwargs)
    forced = variant.forced
    if forced is not None:
        profile = forced_profile(
            forced["profile"], model, per_row=kwargs.get("exit_policy") == "row", seed=forced.get("seed", 0)
        )
        kwargs.update(exit_criterion=ForcedExits(profile), exit_check_layers=profile.check_layers)
    return kwargs


@contextlib.contextmanager
def without_eos(*models):
    """No EOS stop while the block runs, so every run decodes the same number of steps. (An `eos_token_id=None` in a
    passed GenerationConfig does not do it: generate refills unset fields from `model.generation_config`.)"""
    stored = [m.generation_config.eos_token_id for m in models]
    for m in models:
        m.generation_config.eos_token_id = None
    try:
        yield
    finally:
        for m, eos in reversed(list(zip(models, stored))):  # models may share one config: restore in reverse
            m.generation_config.eos_token_id = eos


def greedy_generation_config(model, new_tokens, clear_exit_settings=False):
    """Greedy, `new_tokens` tokens; inside `without_eos` exactly that many, so plain and early-exit runs decode the
    same number of steps whatever they generate (agreement is still scored up to the plain row's first EOS). With
    `clear_exit_settings`, without the model's stored exit settings (they do not combine with other modes)."""
    config = copy.deepcopy(model.generation_config)
    eos = eos_token_ids(model)
    if config.pad_token_id is None:
        config.pad_token_id = eos[0] if eos else 0
    if clear_exit_settings:
        for name in EXIT_ARGUMENTS:
            if hasattr(config, name):
                setattr(config, name, None)
    if clear_exit_settings or not isinstance(model, EarlyExitMixin):  # the plain twin is the greedy reference: stored
        for name in DRAFT_SOURCES + OUR_FIELDS + (MAX_BATCH_FIELD,):  # draft settings (it shares the early-exit
            setattr(config, name, None)  # model's config) would make it assisted
    config.update(
        max_new_tokens=new_tokens,
        min_new_tokens=None,
        do_sample=False,
        num_beams=1,
        return_dict_in_generate=True,
        eos_token_id=None,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    return config


_generation_config = greedy_generation_config


class _PrefillTimer:
    """Times the prefill of a generate: from the first input-embedding call to the second (the start of the first
    decoding step), through a forward pre-hook on the embeddings, so it works alike for the plain loop and the
    early-exit loop (which does not call `model.forward`)."""

    def __init__(self, model):
        self.model, self.calls, self.seconds = model, 0, 0.0

    def _hook(self, module, args):
        self.calls += 1
        if self.calls <= 2:
            _sync(self.model.device)
            now = time.perf_counter()
            self.seconds = now - self.start if self.calls == 2 else 0.0
            self.start = now

    def __enter__(self):
        self.handle = self.model.get_input_embeddings().register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def only_these_drafts(kwargs) -> dict:
    """generate() arguments that ask for exactly the draft sources in `kwargs` (when they name any): the others as
    explicit None, since transformers refills a passed config's unset fields from the model's stored ones."""
    if not any(name in kwargs for name in DRAFT_SOURCES):
        return dict(kwargs)
    return {**dict.fromkeys(DRAFT_SOURCES + OUR_FIELDS), **kwargs}


@torch.no_grad()
def _timed_generate(model, batch, new_tokens, kwargs):
    """One greedy generate. Returns (total seconds, prefill seconds, new tokens, output)."""
    ids, mask, _ = batch
    # stored confident-exit settings do not combine with self-speculation: its runs start from a config without them
    speculative = any(name in kwargs for name in DRAFT_SOURCES)
    generation_config = _generation_config(model, new_tokens, clear_exit_settings=speculative)
    with _PrefillTimer(model) as prefill:
        _sync(ids.device)
        start = time.perf_counter()
        settings = generate_kwargs(model, generation_config, **only_these_drafts(kwargs))
        out = model.generate(ids, attention_mask=mask, **settings)
        _sync(ids.device)
        seconds = time.perf_counter() - start
    steps = out.sequences.shape[1] - ids.shape[1]
    return seconds, prefill.seconds, steps, out


def _decode_ms(seconds, prefill_seconds, steps):
    """ms per decoding step after the prefill (the prefill makes the first token; `steps - 1` steps follow)."""
    return 1e3 * (seconds - prefill_seconds) / max(steps - 1, 1)


def agreement(plain_new, ee_new, eos_ids=()):
    """Identical-token share with full depth, per row (`ee_transformers.measure.quality.identical_share`): matches,
    compared positions (up to the plain row's first EOS) and tokens until the first divergence."""
    return identical_share(plain_new, ee_new, eos_ids)


def _summarise(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "values": []}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": [round(v, 4) for v in values],
    }


def _exit_summary(model, exit_layers):
    """Exit statistics of measured exit layers (a list of `(batch, steps)` tensors, one per run)."""
    stats = ExitStats.from_exit_layers(torch.cat([e.flatten() for e in exit_layers]), model.config.num_hidden_layers)
    return {
        "mean_exit_layer": stats.mean_exit_layer,
        "histogram": {str(k): v for k, v in stats.histogram.items()},
        "compute_saved": stats.compute_saved,
        "tokens": stats.num_tokens,
    }


def _settings(model, exit_kwargs):
    """The resolved exit settings of generate(**exit_kwargs) on `model` (None: full depth)."""
    return resolve_exit_settings(model.config, merged_exit_values(model, None, dict(exit_kwargs)))


def _ideal(settings, exit_layers, costs):
    if settings is None or costs is None:
        return 1.0 if settings is None else math.nan
    return ideal_speedup(
        costs,
        exit_layers,
        settings.check_layers,
        settings.criterion.name,
        settings.needs_logits,
        settings.kv,
        include_prefill=False,
    )


def compare_many(ee_model, plain_model, batches, variants, config=None, repeats=None, costs=None, log=None):
    """Times plain generate and each of `variants`, interleaved, on every batch, `repeats` rounds.

    batches: from `make_batches`; variants: `Variant`s; config: a `BenchConfig` (its `new_tokens`, `warmup`, and
    `repeats` unless `repeats` is given); costs: `measure_costs(...)` for the ideal speed-ups (NaN without).
    Each round runs plain, v1, plain, v2, ..., plain (the variants reversed on odd rounds); a variant's ratio is the
    mean ms per decoding step of its two neighbouring plain runs over its own. Returns one result dict per variant.
    """
    config = config or BenchConfig()
    eos = eos_token_ids(plain_model)  # read before `without_eos`: agreement is scored up to the plain row's EOS
    with without_eos(ee_model, plain_model):
        return _compare_many(
            ee_model, plain_model, batches, variants, config, repeats or config.repeats, costs, log, eos
        )


def _compare_many(ee_model, plain_model, batches, variants, config, repeats, costs, log, eos):
    new_tokens = config.new_tokens
    batch_size = batches[0][0].shape[0]
    if config.warmup:  # first calls pay one-off allocation and dispatch costs
        # on a GPU a 3-token warm-up left plain's first full-length run at twice its later ms per step (H200, the
        # 8B shape: 47.8 against 22.8, BENCHMARKS.md section 3): warm up at the timed length there
        steps = new_tokens if plain_model.device.type == "cuda" else min(new_tokens, 3)
        for batch in batches[:1]:
            _warm_up(ee_model, plain_model, batch, variants, steps)
    per = [defaultdict(list) for _ in variants]
    plain_ms = []
    # one set of generate arguments per variant for the whole comparison: a forced profile's stratified draws run on
    # across its runs, so together they follow the profile's shares
    variant_kwargs = [_generate_kwargs(ee_model, variant) for variant in variants]
    for r in range(repeats):
        for b, batch in enumerate(batches):
            order = list(range(len(variants)))
            if r % 2:  # the configurations' order flips every repeat
                order.reverse()
            plain_out, plain_runs, timings = _interleaved(
                ee_model, plain_model, batch, new_tokens, variant_kwargs, order
            )
            plain_ms += [ms for ms, _ in plain_runs]
            for k in range(len(variants)):
                _record_speed(per[k], timings[k], _settings(ee_model, variant_kwargs[k]), costs)
                if r == 0:  # greedy decoding is deterministic: one repeat gives the quality figures
                    _record_quality(per[k], plain_model, batch, timings[k][2], plain_out, eos)
            if log:
                log(
                    f"  batch {batch_size} repeat {r + 1}/{repeats} batch {b + 1}/{len(batches)}: plain "
                    f"{statistics.median(ms for ms, _ in plain_runs):.1f} ms/step; "
                    + ", ".join(f"{variants[k].name} {per[k]['ratio'][-1]:.2f}x" for k in range(len(variants)))
                )
    return [
        _variant_result(ee_model, variant, record, batch_size, new_tokens, repeats, plain_ms)
        for variant, record in zip(variants, per)
    ]


def _warm_up(ee_model, plain_model, batch, variants, new_tokens):
    _timed_generate(plain_model, batch, new_tokens, {})
    for variant in variants:
        _timed_generate(ee_model, batch, new_tokens, _generate_kwargs(ee_model, variant))


def _interleaved(ee_model, plain_model, batch, new_tokens, variant_kwargs, order):
    """plain, c1, plain, c2, ..., ck, plain on one batch: each configuration sits between two plain runs, so a slow
    drift of the machine cancels in its ratio. Returns (plain's output, plain's (ms per step, total ms) per run,
    {k: (ms per step, total ms, output, the neighbouring plain runs' mean ms per step, mean total ms)})."""
    plain_runs, timings = [], {}
    seconds, prefill, steps, plain_out = _timed_generate(plain_model, batch, new_tokens, {})
    plain_out = SimpleNamespace(sequences=plain_out.sequences.cpu())
    plain_runs.append((_decode_ms(seconds, prefill, steps), 1e3 * seconds))
    for k in order:
        seconds, prefill, steps, out = _timed_generate(ee_model, batch, new_tokens, variant_kwargs[k])
        out = SimpleNamespace(sequences=out.sequences.cpu(), exit_layers=out.exit_layers.cpu())  # no cache
        before = plain_runs[-1]
        seconds_p, prefill_p, steps_p, _ = _timed_generate(plain_model, batch, new_tokens, {})
        plain_runs.append((_decode_ms(seconds_p, prefill_p, steps_p), 1e3 * seconds_p))
        after = plain_runs[-1]
        timings[k] = (
            _decode_ms(seconds, prefill, steps),
            1e3 * seconds,
            out,
            (before[0] + after[0]) / 2,
            (before[1] + after[1]) / 2,
        )
    return plain_out, plain_runs, timings


def _record_speed(record, timing, settings, costs):
    """Adds one run's paired ratios, exit layers and ideal speed-up to a variant's `record`."""
    ee_step_ms, ee_total_ms, out, plain_step_ms, plain_total_ms = timing
    record["ratio"].append(plain_step_ms / ee_step_ms)
    record["e2e_ratio"].append(plain_total_ms / ee_total_ms)
    record["ee_ms"].append(ee_step_ms)
    record["exit_layers"].append(out.exit_layers.cpu())
    ideal = _ideal(settings, out.exit_layers.cpu(), costs)
    record["ideal"].append(ideal)
    record["realised_over_ideal"].append(plain_step_ms / ee_step_ms / ideal if ideal else math.nan)


def _record_quality(record, plain_model, batch, out, plain_out, eos):
    """Adds one run's agreement rows (with their domains) and the full model's views to a variant's `record`."""
    prompt_length, mask = batch[0].shape[1], batch[1]
    rows = agreement(plain_out.sequences[:, prompt_length:].cpu(), out.sequences[:, prompt_length:].cpu(), eos)
    for row, domain in zip(rows, batch[2]):
        record["agreement_rows"].append({**row, "domain": domain})
    record["views"].append(full_model_view(plain_model, out.sequences.to(mask.device), prompt_length, mask, eos))
    record["plain_views"].append(
        full_model_view(plain_model, plain_out.sequences.to(mask.device), prompt_length, mask, eos)
    )


def _agreement_summary(rows):
    """Identical-token share overall and per domain, and mean tokens to the first divergence, of agreement rows."""
    compared = sum(r["compared"] for r in rows)
    by_domain = {}
    for domain in sorted({r["domain"] for r in rows}):
        sub = [r for r in rows if r["domain"] == domain]
        by_domain[domain] = sum(r["matches"] for r in sub) / max(sum(r["compared"] for r in sub), 1)
    return {
        "share": sum(r["matches"] for r in rows) / max(compared, 1),
        "first_divergence": statistics.mean(r["first_divergence"] for r in rows) if rows else math.nan,
        "compared_tokens": compared,
        "by_domain": by_domain,
    }


def _variant_result(ee_model, variant, record, batch_size, new_tokens, repeats, plain_ms):
    """The result dict of one variant from what its runs recorded."""
    settings = _settings(ee_model, _generate_kwargs(ee_model, variant))
    result = {
        "name": variant.name,
        "kind": variant.kind,
        "batch_size": batch_size,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "exit_kwargs": dict(variant.exit_kwargs),
        "forced": variant.forced,
        "criterion": None if settings is None else settings.criterion.name,
        "policy": None if settings is None else settings.policy,
        "kv": None if settings is None else settings.kv,
        "check_layers": None if settings is None else settings.check_layers,
        "speedup": _summarise(record["ratio"]),
        "speedup_end_to_end": _summarise(record["e2e_ratio"]),
        "plain_ms_per_step": _summarise(plain_ms),  # decoding steps, prefill excluded
        "ee_ms_per_step": _summarise(record["ee_ms"]),
        "agreement": _agreement_summary(record["agreement_rows"]),
        "quality": summarise_views(record["views"], record["plain_views"]),
        "exits": _exit_summary(ee_model, record["exit_layers"]),
        "ideal_speedup": _summarise(record["ideal"]),
        "realised_over_ideal": _summarise(record["realised_over_ideal"]),
    }
    if variant.forced is not None:
        profile = _generate_kwargs(ee_model, variant)["exit_criterion"].targets
        result["forced"] = {
            **variant.forced,
            "layers": {str(k): v for k, v in profile.layers.items()},
            "requested_mean_exit_layer": profile.mean_exit_layer,
        }
    return result


def compare(ee_model, plain_model, prompts, exit_kwargs=None, config=None, batch_size=1, name="early exit", costs=None):
    """Paired, interleaved comparison of one early-exit way of decoding with plain generate (see `compare_many`).

    prompts: from `heldout_prompts` (or `[{"domain", "ids"}]`); exit_kwargs: generate() exit arguments, e.g.
    `{"exit_criterion": "max_prob", "exit_threshold": 0.9}`, `{}` for the calibrated settings the model stores,
    `{"early_exit": False}` for full depth through the early-exit class; `exit_forced` may be a profile name.
    config: a `BenchConfig` (`new_tokens`, `repeats`, `max_batches[0]` batches of `batch_size`).
    """
    config = config or BenchConfig()
    exit_kwargs = dict(exit_kwargs or {})
    forced = None
    if isinstance(exit_kwargs.get("exit_forced"), (str, dict)):
        forced = {"profile": exit_kwargs.pop("exit_forced")}
    variant = Variant(name, "custom", exit_kwargs, forced)
    batches = make_batches(prompts, batch_size, config.max_batches[0], device=ee_model.device)
    return compare_many(ee_model, plain_model, batches, [variant], config, costs=costs)[0]
