"""`ee-transformers bench`: early-exit generate against plain transformers generate on the same weights.

Everything runs in one process, interleaved: for every repeat and every batch the runs go plain, c1, plain, c2, ...,
plain (plain = the family's `...ForCausalLM.generate` at full depth on the very same modules; the configurations'
order flips every repeat), and each early-exit run is compared with the mean of its two neighbouring plain runs, so
drift of a shared machine cancels. Reported per configuration:

* speed-up: median (min, max) over the paired ratios of milliseconds per decoding step (the prefill, identical in
  both, is timed apart and left out; `speedup_end_to_end` keeps it);
* greedy agreement with full depth: share of identical tokens and tokens until the first divergence;
* where tokens exited: mean exit layer, histogram;
* the ideal speed-up of those exits under the measured cost model (`costs.py`), and realised / ideal.

Configurations: the model's calibrated settings (from its config), exits disabled (overhead of the class), a sweep of
criteria / thresholds / policies (the speed-versus-agreement frontier), and forced exit profiles (exit layers drawn
from a given profile, decoded through the same code path: the implementation-efficiency half).

Python API: `load_models`, `plain_twin`, `heldout_prompts`, `compare`, `compare_many`, `measure_costs`,
`forced_profile`, `profile_step`, `run_benchmark`, `plot_frontier`, `plot_histogram`, `format_table`, `main`.

    ee-transformers bench --model runs/smollm2-135m-ee --batch-sizes 1,8 --new-tokens 128 --out bench-out
    ee-transformers bench --model PLAIN_FOLDER --exit-layers 7,15,23,26 --exit-head norm --quick
"""

import argparse
import copy
import json
import math
import os
import platform
import random
import re
import shlex
import statistics
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers

from ee_transformers.tools.costs import ideal_speedup, measure_costs
from ee_transformers.generation_early_exit import ExitCriterion, ExitStats, merged_exit_values, resolve_exit_settings
from ee_transformers.modeling_early_exit import EarlyExitMixin

__all__ = [
    "FORCED_PROFILES",
    "HELDOUT_REGIONS",
    "agreement",
    "compare",
    "compare_many",
    "evaluate_targets",
    "forced_configs",
    "forced_profile",
    "format_table",
    "heldout_prompts",
    "load_models",
    "main",
    "make_batches",
    "measure_costs",
    "plain_twin",
    "plot_frontier",
    "plot_histogram",
    "profile_step",
    "random_prompts",
    "run_benchmark",
    "sweep_configs",
    "write_outputs",
]

# Held-out regions of the default text (fractions of each file, by characters): text neither fitting (Austen 1-5)
# nor calibration should see. Calibration may use the front of the held-out novel and of the manual, so the
# benchmark takes its prompts from their tails: the second half of Sense and Sensibility, and the last tenth of the
# Python manual's body (its index starts at about 0.89 of the file and is not prose).
HELDOUT_REGIONS = {"austen": (0.5, 1.0), "python": (0.8, 0.88)}

# forced profiles: name -> {depth fraction (of the decoder) or 1.0 for full depth: share of tokens}
FORCED_PROFILES = {
    "25% at 1/4": {0.25: 0.25, 1.0: 0.75},
    "50% at 1/2": {0.5: 0.5, 1.0: 0.5},
    "75% at 3/4": {0.75: 0.75, 1.0: 0.25},
    "mixed": {0.25: 0.25, 0.5: 0.25, 0.75: 0.25, 1.0: 0.25},
}
# the full grid (--forced-grid full): every share at every depth
FORCED_GRID = {f"{int(share * 100)}% at {label}": {depth: share, 1.0: 1.0 - share}
               for depth, label in ((0.25, "1/4"), (0.5, "1/2"), (0.75, "3/4")) for share in (0.25, 0.5, 0.75)}
FORCED_GRID["mixed"] = FORCED_PROFILES["mixed"]
# forced modes: (policy, kv). Deferred KV is batch-policy only.
FORCED_MODES = (("batch", "immediate"), ("batch", "deferred"), ("row", "immediate"))

SWEEP_FULL = {
    "max_prob": [0.5, 0.7, 0.9, 0.97],
    "margin": [0.5, 0.8, 0.95],
    "entropy": [0.7, 0.85, 0.95],
    "cosine": [0.95, 0.98, 0.995],
    "learned": [0.5, 0.7, 0.9],
    "patience": [2, 3],  # stable-token exits: the argmax unchanged over k consecutive checked exits
}
SWEEP_MEDIUM = {"max_prob": [0.8, 0.9, 0.97], "margin": [0.8, 0.95], "entropy": [0.9], "cosine": [0.98],
                "learned": [0.5, 0.8], "patience": [2]}
SWEEP_SMALL = {"max_prob": [0.9], "margin": [0.8], "entropy": [0.85], "cosine": [0.98], "learned": [0.7],
               "patience": [2]}

TARGETS = {"calibrated_min_speedup": 0.98, "frontier": ((0.95, 1.0), (0.90, 1.05)), "forced_realised_over_ideal": 0.9,
           "disabled_max_overhead": 0.02}


# ----------------------------------------------------------------------------------------------------------------
# models and prompts
# ----------------------------------------------------------------------------------------------------------------


def plain_twin(ee_model):
    """The family's plain `...ForCausalLM` running on the very same modules (no copy): plain transformers generate
    on the same weights. Exit heads are not part of it."""
    plain_cls = next(c for c in type(ee_model).__mro__[1:]
                     if not issubclass(c, EarlyExitMixin) and issubclass(c, transformers.PreTrainedModel))
    fields = {k: v for k, v in ee_model.config.to_dict().items() if not k.startswith("exit_")
              and k not in ("model_type", "architectures", "auto_map", "transformers_version")}
    config = plain_cls.config_class(**fields)
    config._attn_implementation = ee_model.config._attn_implementation
    with torch.device("meta"):  # no second copy of the weights: the modules are shared below
        plain = plain_cls(config)
    plain.model = ee_model.model
    plain.lm_head = ee_model.lm_head
    plain.generation_config = ee_model.generation_config
    return plain.eval()


def load_models(path, exit_layers=None, exit_head=None, dtype=torch.float32, device="cpu"):
    """(early-exit model, plain twin) from an early-exit folder, or from a plain folder converted on the fly."""
    from ee_transformers.convert import from_base

    ee = from_base(path, exit_layers=exit_layers, exit_head=exit_head, dtype=dtype).to(device).eval()
    if not ee.config.exit_layers:
        raise ValueError(f"`{path}` has no exit layers: pass `exit_layers` (--exit-layers) to convert it.")
    return ee, plain_twin(ee)


def _default_text_files():
    from ee_transformers.tools import assets

    text = assets.fetch_text()
    novel = next(p for p in text["austen"] if Path(p).stem == assets.AUSTEN_HELDOUT)
    return {"austen": (novel, HELDOUT_REGIONS["austen"]), "python": (text["python"][0], HELDOUT_REGIONS["python"])}


def heldout_prompts(tokenizer, files=None, num_prompts=16, window=64, seed=0):
    """`num_prompts` windows of `window` tokens, alternating between domains, from held-out text.

    files: None (the default held-out regions of `assets.fetch_text()`), or paths of text files (domain = file name,
    the whole file is used). Windows start at evenly spaced points of each region (shifted by `seed`), at a word
    boundary. Returns a list of `{"domain": str, "ids": [int] * window}`.
    """
    if files is None:
        sources = _default_text_files()
    else:
        sources = {Path(f).stem: (f, (0.0, 1.0)) for f in files}
    rng = random.Random(seed)
    per_domain = {}
    domains = list(sources)
    counts = [num_prompts // len(domains) + (i < num_prompts % len(domains)) for i in range(len(domains))]
    for (domain, (path, (lo, hi))), count in zip(sources.items(), counts):
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        start, stop = int(lo * len(text)), int(hi * len(text))
        chunk = 12 * window  # characters: comfortably more than `window` tokens of English
        span = max(stop - start - chunk, 1)
        offset = rng.randrange(max(span // max(count, 1), 1))
        windows = []
        for k in range(count):
            at = start + offset + k * span // max(count, 1)
            piece = text[at: at + chunk]
            cut = re.search(r"\s\S", piece[:80])  # start at a word
            piece = piece[cut.start() + 1:] if cut else piece
            ids = tokenizer(piece, add_special_tokens=False)["input_ids"][:window]
            if len(ids) == window:
                windows.append(ids)
        if not windows:
            raise ValueError(f"No {window}-token window found in `{path}`.")
        per_domain[domain] = windows
    prompts = []
    for k in range(max(len(w) for w in per_domain.values())):
        prompts += [{"domain": d, "ids": w[k]} for d, w in per_domain.items() if k < len(w)]
    return prompts[:num_prompts]


def random_prompts(vocab_size, num_prompts, window=64, seed=0):
    """Random token windows (for random-weight models: no tokenizer, no text)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (num_prompts, window), generator=generator)
    return [{"domain": "random", "ids": row.tolist()} for row in ids]


def make_batches(prompts, batch_size, max_batches=2, device="cpu"):
    """Up to `max_batches` batches of `batch_size` consecutive prompts (prompts alternate domains, so a batch mixes
    them); prompts recycle when there are too few. Returns `[(input_ids, attention_mask, domains)]`."""
    batches = []
    count = max(1, min(max_batches, math.ceil(len(prompts) / batch_size)))
    for b in range(count):
        rows = [prompts[(b * batch_size + i) % len(prompts)] for i in range(batch_size)]
        length = max(len(r["ids"]) for r in rows)
        ids = torch.zeros(batch_size, length, dtype=torch.long)
        mask = torch.zeros(batch_size, length, dtype=torch.long)
        for i, r in enumerate(rows):  # left padding (windows have equal length, so usually none)
            ids[i, length - len(r["ids"]):] = torch.tensor(r["ids"])
            mask[i, length - len(r["ids"]):] = 1
        batches.append((ids.to(device), mask.to(device), [r["domain"] for r in rows]))
    return batches


# ----------------------------------------------------------------------------------------------------------------
# forced exits
# ----------------------------------------------------------------------------------------------------------------


def _profile_layers(spec, model):
    """{depth fraction: share} -> {decoder layer: share}: each depth goes to the nearest exit layer (1.0 = full)."""
    num_layers = model.config.num_hidden_layers
    exits = list(model.config.exit_layers)
    layers = defaultdict(float)
    for depth, share in spec.items():
        if depth >= 1.0:
            layers[num_layers - 1] += share
        else:
            want = depth * num_layers - 1  # layer index after which `depth` of the decoder has run
            layers[min(exits, key=lambda e: (abs(e - want), e))] += share
    return dict(sorted(layers.items()))


class ForcedExits(ExitCriterion):
    """An exit criterion that ignores confidence: `targets(batch_size, device)` gives, once per decoding step, each
    row's exit layer `(batch,)`, and a row exits at the first checked exit at or above its target. The benchmark's
    forced profiles measure the implementation apart from the heads with it; pass it as `exit_criterion=`."""

    name = "forced"
    default_threshold = 1.0

    def __init__(self, targets):
        self.targets = targets

    def begin_step(self, batch_size, device):
        return self.targets(batch_size, device).to(device)

    def score(self, check):
        return (check.step.index_select(0, check.rows) <= check.layer).float()


class ForcedProfile:
    """Targets for `ForcedExits`, drawing each token's exit layer from a profile, stratified: every block of `block`
    draws holds the profile's shares exactly (in a random order), so short runs follow the profile closely.

    per_row: a draw per row (row policy); otherwise one draw per step shared by the batch (batch policy, where a
    batch exits only when every row may).
    """

    def __init__(self, name, layers, per_row=True, seed=0, block=20):
        self.name, self.layers, self.per_row = name, dict(layers), per_row
        self.generator = torch.Generator().manual_seed(seed)
        counts = {layer: round(share * block) for layer, share in self.layers.items()}
        deepest = max(counts)
        counts[deepest] += block - sum(counts.values())
        self.block = [layer for layer, n in counts.items() for _ in range(n)]
        self.queue = []

    @property
    def check_layers(self):
        return [layer for layer in self.layers if layer != max(self.layers)] or [min(self.layers)]

    @property
    def mean_exit_layer(self):
        return sum(layer * share for layer, share in self.layers.items()) / sum(self.layers.values())

    def _draw(self, n):
        while len(self.queue) < n:
            order = torch.randperm(len(self.block), generator=self.generator).tolist()
            self.queue += [self.block[i] for i in order]
        out, self.queue = self.queue[:n], self.queue[n:]
        return out

    def __call__(self, batch_size, device):
        values = self._draw(batch_size) if self.per_row else self._draw(1) * batch_size
        return torch.tensor(values, dtype=torch.long, device=device)


def forced_profile(name, model, per_row=True, seed=0):
    """The targets for profile `name` (a key of `FORCED_PROFILES` / `FORCED_GRID`, or a dict {depth fraction: share})
    on `model`'s exits. Pass `exit_criterion=ForcedExits(profile)` with `exit_check_layers=profile.check_layers`."""
    spec = name if isinstance(name, dict) else {**FORCED_GRID, **FORCED_PROFILES}[name]
    label = name if isinstance(name, str) else "custom"
    return ForcedProfile(label, _profile_layers(spec, model), per_row=per_row, seed=seed)


# ----------------------------------------------------------------------------------------------------------------
# timing and comparison
# ----------------------------------------------------------------------------------------------------------------


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate_kwargs(model, config):
    """generate() exit arguments of a configuration (a fresh forced-profile callable for forced ones)."""
    kwargs = dict(config.get("exit_kwargs", {}))
    forced = config.get("forced")
    if forced is not None:
        profile = forced_profile(forced["profile"], model, per_row=kwargs.get("exit_policy") == "row",
                                 seed=forced.get("seed", 0))
        kwargs.update(exit_criterion=ForcedExits(profile), exit_check_layers=profile.check_layers)
    return kwargs


def _generation_config(model, new_tokens):
    """Greedy, exactly `new_tokens` tokens: EOS does not stop a row, so plain and early-exit runs decode the same
    number of steps whatever they generate (agreement is still scored up to the plain row's first EOS)."""
    config = copy.deepcopy(model.generation_config)
    eos = _eos_ids(model)
    if config.pad_token_id is None:
        config.pad_token_id = eos[0] if eos else 0
    config.update(max_new_tokens=new_tokens, min_new_tokens=None, do_sample=False, num_beams=1,
                  return_dict_in_generate=True, eos_token_id=None, temperature=None, top_p=None, top_k=None)
    return config


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


@torch.no_grad()
def _timed_generate(model, batch, new_tokens, kwargs):
    """One greedy generate. Returns (total seconds, prefill seconds, new tokens, output)."""
    ids, mask, _ = batch
    generation_config = _generation_config(model, new_tokens)
    with _PrefillTimer(model) as prefill:
        _sync(ids.device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, generation_config=generation_config, **kwargs)
        _sync(ids.device)
        seconds = time.perf_counter() - start
    steps = out.sequences.shape[1] - ids.shape[1]
    return seconds, prefill.seconds, steps, out


def _decode_ms(seconds, prefill_seconds, steps):
    """ms per decoding step after the prefill (the prefill makes the first token; `steps - 1` steps follow)."""
    return 1e3 * (seconds - prefill_seconds) / max(steps - 1, 1)


def _eos_ids(model):
    eos = model.generation_config.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def agreement(plain_new, ee_new, eos_ids=()):
    """Greedy agreement of early-exit tokens with full depth, `(batch, steps)` each.

    Compared per row: positions up to the plain row's first EOS (included). Returns per-row matches, compared counts
    and tokens until the first divergence (the compared length when none).
    """
    rows = []
    for p, e in zip(plain_new.tolist(), ee_new.tolist()):
        length = len(p)
        for i, token in enumerate(p):
            if token in eos_ids:
                length = i + 1
                break
        length = min(length, len(e))
        same = [p[i] == e[i] for i in range(length)]
        first = next((i for i, s in enumerate(same) if not s), length)
        rows.append({"matches": sum(same), "compared": length, "first_divergence": first})
    return rows


def _summarise(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "values": []}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": [round(v, 4) for v in values]}


def _exit_summary(model, exit_layers):
    """Exit statistics of measured exit layers (a list of `(batch, steps)` tensors, one per run)."""
    stats = ExitStats.from_exit_layers(torch.cat([e.flatten() for e in exit_layers]), model.config.num_hidden_layers)
    return {"mean_exit_layer": stats.mean_exit_layer, "histogram": {str(k): v for k, v in stats.histogram.items()},
            "compute_saved": stats.compute_saved, "tokens": stats.num_tokens}


def _settings(model, exit_kwargs):
    """The resolved exit settings of generate(**exit_kwargs) on `model` (None: full depth)."""
    return resolve_exit_settings(model.config, merged_exit_values(model, None, dict(exit_kwargs)))


def _ideal(settings, exit_layers, costs):
    if settings is None or costs is None:
        return 1.0 if settings is None else math.nan
    return ideal_speedup(costs, exit_layers, settings.check_layers, settings.criterion.name, settings.needs_logits,
                         settings.kv, include_prefill=False)


def compare_many(ee_model, plain_model, batches, new_tokens, configs, repeats=3, costs=None, warmup=True,
                 log=None):
    """Times plain generate and each configuration in `configs`, interleaved, on every batch, `repeats` times.

    configs: list of `{"name", "kind", "exit_kwargs": {...}, "forced": None | {"profile": name}}`. Each round runs
    plain, c1, plain, c2, ..., plain (the configurations reversed on odd repeats); a configuration's ratio is the mean
    ms per decoding step of its two neighbouring plain runs over its own. Returns one result dict per configuration.
    """
    batch_size = batches[0][0].shape[0]
    eos = _eos_ids(plain_model)
    if warmup:  # first calls pay one-off allocation and dispatch costs
        for batch in batches[:1]:
            _timed_generate(plain_model, batch, min(new_tokens, 3), {})
            for config in configs:
                _timed_generate(ee_model, batch, min(new_tokens, 3), _generate_kwargs(ee_model, config))
    per = [defaultdict(list) for _ in configs]
    plain_ms = []
    # one set of generate arguments per configuration for the whole comparison: a forced profile's stratified draws
    # run on across its runs, so together they follow the profile's shares
    config_kwargs = [_generate_kwargs(ee_model, config) for config in configs]
    for r in range(repeats):
        for b, batch in enumerate(batches):
            # plain, c1, plain, c2, ..., ck, plain: each configuration sits between two plain runs, so a slow
            # drift of the machine cancels in its ratio; the configurations' order flips every repeat
            order = list(range(len(configs)))
            if r % 2:
                order.reverse()
            plain_runs, timings = [], {}
            seconds, prefill, steps, plain_out = _timed_generate(plain_model, batch, new_tokens, {})
            plain_out = SimpleNamespace(sequences=plain_out.sequences.cpu())
            plain_runs.append((_decode_ms(seconds, prefill, steps), 1e3 * seconds))
            for k in order:
                seconds, prefill, steps, out = _timed_generate(ee_model, batch, new_tokens, config_kwargs[k])
                out = SimpleNamespace(sequences=out.sequences.cpu(), exit_layers=out.exit_layers.cpu())  # no cache
                before = plain_runs[-1]
                seconds_p, prefill_p, steps_p, _ = _timed_generate(plain_model, batch, new_tokens, {})
                plain_runs.append((_decode_ms(seconds_p, prefill_p, steps_p), 1e3 * seconds_p))
                after = plain_runs[-1]
                timings[k] = (_decode_ms(seconds, prefill, steps), 1e3 * seconds, out,
                              (before[0] + after[0]) / 2, (before[1] + after[1]) / 2)
            plain_ms += [ms for ms, _ in plain_runs]
            prompt_length = batch[0].shape[1]
            for k, config in enumerate(configs):
                ee_step_ms, ee_total_ms, out, plain_step_ms, plain_total_ms = timings[k]
                record = per[k]
                record["ratio"].append(plain_step_ms / ee_step_ms)
                record["e2e_ratio"].append(plain_total_ms / ee_total_ms)
                record["ee_ms"].append(ee_step_ms)
                record["exit_layers"].append(out.exit_layers.cpu())
                settings = _settings(ee_model, config_kwargs[k])
                ideal = _ideal(settings, out.exit_layers.cpu(), costs)
                record["ideal"].append(ideal)
                record["realised_over_ideal"].append(plain_step_ms / ee_step_ms / ideal if ideal else math.nan)
                if r == 0:  # greedy decoding is deterministic: one repeat gives the agreement
                    rows = agreement(plain_out.sequences[:, prompt_length:].cpu(),
                                     out.sequences[:, prompt_length:].cpu(), eos)
                    for row, domain in zip(rows, batch[2]):
                        record["agreement_rows"].append({**row, "domain": domain})
            if log:
                log(f"  batch {batch_size} repeat {r + 1}/{repeats} batch {b + 1}/{len(batches)}: plain "
                    f"{statistics.median(ms for ms, _ in plain_runs):.1f} ms/step; " + ", ".join(
                        f"{configs[k]['name']} {per[k]['ratio'][-1]:.2f}x" for k in range(len(configs))))
    results = []
    for config, record in zip(configs, per):
        settings = _settings(ee_model, _generate_kwargs(ee_model, config))
        rows = record["agreement_rows"]
        compared = sum(r["compared"] for r in rows)
        by_domain = {}
        for domain in sorted({r["domain"] for r in rows}):
            sub = [r for r in rows if r["domain"] == domain]
            by_domain[domain] = sum(r["matches"] for r in sub) / max(sum(r["compared"] for r in sub), 1)
        result = {
            "name": config["name"],
            "kind": config.get("kind", "custom"),
            "batch_size": batch_size,
            "new_tokens": new_tokens,
            "repeats": repeats,
            "exit_kwargs": {k: v for k, v in config.get("exit_kwargs", {}).items()},
            "forced": config.get("forced"),
            "criterion": None if settings is None else settings.criterion,
            "policy": None if settings is None else settings.policy,
            "kv": None if settings is None else settings.kv,
            "check_layers": None if settings is None else settings.check_layers,
            "speedup": _summarise(record["ratio"]),
            "speedup_end_to_end": _summarise(record["e2e_ratio"]),
            "plain_ms_per_step": _summarise(plain_ms),  # decoding steps, prefill excluded
            "ee_ms_per_step": _summarise(record["ee_ms"]),
            "agreement": {
                "share": sum(r["matches"] for r in rows) / max(compared, 1),
                "first_divergence": statistics.mean(r["first_divergence"] for r in rows) if rows else math.nan,
                "compared_tokens": compared,
                "by_domain": by_domain,
            },
            "exits": _exit_summary(ee_model, record["exit_layers"]),
            "ideal_speedup": _summarise(record["ideal"]),
            "realised_over_ideal": _summarise(record["realised_over_ideal"]),
        }
        if config.get("forced") is not None:
            profile = _generate_kwargs(ee_model, config)["exit_criterion"].targets
            result["forced"] = {**config["forced"], "layers": {str(k): v for k, v in profile.layers.items()},
                                "requested_mean_exit_layer": profile.mean_exit_layer}
        results.append(result)
    return results


def compare(ee_model, plain_model, prompts, batch_size=1, new_tokens=128, exit_kwargs=None, repeats=3, costs=None,
            max_batches=2, name="early exit"):
    """Paired, interleaved comparison of one early-exit configuration with plain generate (see `compare_many`).

    prompts: from `heldout_prompts` (or `[{"domain", "ids"}]`); exit_kwargs: generate() exit arguments, e.g.
    `{"exit_criterion": "max_prob", "exit_threshold": 0.9}`, `{}` for the calibrated settings in the config,
    `{"early_exit": False}` for full depth through the early-exit class. `exit_forced` may be a profile name.
    """
    exit_kwargs = dict(exit_kwargs or {})
    config = {"name": name, "kind": "custom", "exit_kwargs": exit_kwargs}
    if isinstance(exit_kwargs.get("exit_forced"), (str, dict)):
        config["forced"] = {"profile": exit_kwargs.pop("exit_forced")}
    batches = make_batches(prompts, batch_size, max_batches, device=ee_model.device)
    return compare_many(ee_model, plain_model, batches, new_tokens, [config], repeats, costs)[0]


# ----------------------------------------------------------------------------------------------------------------
# where the time goes in one step
# ----------------------------------------------------------------------------------------------------------------


PROFILE_LABELS = {"ee::layer": "layers", "ee::head_check": "head_checks", "ee::exit_heads": "exit_heads",
                  "ee::backfill": "backfill", "ee::final_head": "final_head"}


class _PlainLabels:
    """Gives a plain model the runtime's `record_function` labels (decoder layers, the LM head), through module
    hooks, so one profile reads both; the early-exit runtime carries its labels itself."""

    def __init__(self, model):
        self.model, self.handles, self.open = model, [], []

    def _pre(self, label):
        def hook(*args):
            scope = torch.profiler.record_function(label)
            scope.__enter__()
            self.open.append(scope)
        return hook

    def _post(self, *args):
        self.open.pop().__exit__(None, None, None)

    def __enter__(self):
        if not isinstance(self.model, EarlyExitMixin):
            for module, label in [(layer, "ee::layer") for layer in self.model.model.layers] + [
                    (self.model.lm_head, "ee::final_head")]:
                self.handles += [module.register_forward_pre_hook(self._pre(label)),
                                 module.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def profile_step(model, batch, new_tokens, exit_kwargs=None, name=None):
    """Where the time of one decoding step goes: ms per step in layers, head checks, exit heads, backfill, final
    head, and other (Python: the decoding loop, masks, sampling). Read from `torch.profiler` events carrying the
    runtime's `record_function` labels (`PROFILE_LABELS`); the prefill is left out. Profiling adds overhead, so the
    total is a bit above an unprofiled step. Works on the plain model too (`exit_kwargs` None)."""
    kwargs = dict(exit_kwargs or {})
    with _PlainLabels(model), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        seconds, prefill, steps, _ = _timed_generate(model, batch, new_tokens, kwargs)
    # the prefill ends where the second forward starts: the second time a step embeds its input
    starts = sorted(e.time_range.start for e in prof.events() if e.name == "aten::embedding")
    decode_from = starts[1] if len(starts) > 1 else math.inf
    labeled = sorted((e for e in prof.events() if e.name in PROFILE_LABELS and e.time_range.start >= decode_from),
                     key=lambda e: e.time_range.start)
    totals, stack = defaultdict(float), []  # exclusive time: a labeled event inside another is the inner one's
    for event in labeled:
        while stack and stack[-1].time_range.end <= event.time_range.start:
            stack.pop()
        ms = event.time_range.elapsed_us() / 1e3
        totals[PROFILE_LABELS[event.name]] += ms
        if stack:
            totals[PROFILE_LABELS[stack[-1].name]] -= ms
        stack.append(event)
    decode_steps = max(steps - 1, 1)
    step_ms = _decode_ms(seconds, prefill, steps)
    parts = {k: totals.get(k, 0.0) / decode_steps for k in PROFILE_LABELS.values()}
    parts["other"] = step_ms - sum(parts.values())
    return {"name": name or ("plain" if not isinstance(model, EarlyExitMixin) else "early exit"),
            "batch_size": batch[0].shape[0], "ms_per_step": step_ms, "parts_ms": parts,
            "shares": {k: v / step_ms for k, v in parts.items()}}


# ----------------------------------------------------------------------------------------------------------------
# configurations and the whole benchmark
# ----------------------------------------------------------------------------------------------------------------


def calibrated_config(model, always=False):
    """generate() with no exit arguments: the calibrated settings stored in the model's config. None when the config
    has none, unless `always` (a calibrated folder whose calibration left exits off: then it decodes at full depth)."""
    if _settings(model, {}) is None:
        if not always:
            return None
        return {"name": "calibrated (exits off)", "kind": "calibrated", "exit_kwargs": {}}
    return {"name": "calibrated", "kind": "calibrated", "exit_kwargs": {}}


def sweep_configs(model, batch_size, grid=None, check_sets=None):
    """Sweep configurations: criteria x thresholds x policies (row only at batch > 1) x checked-exit sets."""
    grid = SWEEP_FULL if grid is None else grid
    exits = list(model.config.exit_layers)
    if check_sets is None:
        calibrated = model.exit_defaults["exit_check_layers"]
        check_sets = [exits] + ([[exits[-1]]] if len(exits) > 1 else [])
        if calibrated and list(calibrated) not in check_sets:
            check_sets.append(list(calibrated))
    policies = ["batch"] + (["row"] if batch_size > 1 else [])
    configs = []
    for criterion, values in grid.items():
        if criterion == "learned" and not getattr(model.config, "exit_confidence_heads", False):
            continue
        for value in values:
            for policy in policies:
                for checks in check_sets:
                    if criterion == "patience":
                        if len(checks) < value:
                            continue
                        kwargs = {"exit_patience": value, "exit_criterion": "max_prob", "exit_threshold": None}
                        label = f"stable x{value}"
                    else:
                        kwargs = {"exit_criterion": criterion, "exit_threshold": value}
                        label = f"{criterion}>={value}"
                    kwargs.update(exit_policy=policy, exit_check_layers=list(checks))
                    if criterion == "patience":
                        kwargs.pop("exit_threshold")
                    configs.append({"name": f"{label} {policy} @{','.join(map(str, checks))}", "kind": "sweep",
                                    "exit_kwargs": kwargs, "sweep_criterion": "stable" if criterion == "patience"
                                    else criterion})
    return configs


def forced_configs(profiles=None, modes=FORCED_MODES, batch_size=1):
    """Forced-profile configurations: each profile under each (policy, kv) mode (row = batch at batch 1)."""
    profiles = list(FORCED_PROFILES) if profiles is None else list(profiles)
    modes = [m for m in modes if batch_size > 1 or m[0] != "row"]
    return [{"name": f"forced {p} {policy}/{kv}", "kind": "forced", "forced": {"profile": p, "seed": 0},
             "exit_kwargs": {"exit_policy": policy, "exit_kv": kv}} for p in profiles for policy, kv in modes]


def machine_info():
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "torch_threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu"] = names[0]
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_benchmark(ee_model, plain_model, prompts, batch_sizes=(1, 8), new_tokens=128, repeats=3, sweep=True,
                  forced=True, calibrated=True, disabled=True, max_batches=2, sweep_grid=None, sweep_batch_sizes=None,
                  forced_profiles=None, forced_modes=FORCED_MODES, profile=True, cost_repeats=30, sweep_repeats=None,
                  main_repeats=None, log=print):
    """The whole benchmark; returns the report dict (see `format_table`, `plot_frontier`, `plot_histogram`).

    max_batches: batches per batch size, an int or one per batch size. sweep_repeats: repeats of the sweep (default
    `repeats`); main_repeats: repeats of the calibrated and exits-disabled runs, whose targets sit within a few
    percent of 1.0x (default `2 * repeats`)."""
    device = ee_model.device
    prompt_length = len(prompts[0]["ids"])
    report = {"machine": machine_info(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": {"class": type(ee_model).__name__, "num_hidden_layers": ee_model.config.num_hidden_layers,
                        "exit_layers": list(ee_model.config.exit_layers), "exit_head": ee_model.config.exit_head,
                        "dtype": str(ee_model.dtype).replace("torch.", ""),
                        "calibrated": _settings(ee_model, {}) is not None},
              "settings": {"batch_sizes": list(batch_sizes), "new_tokens": new_tokens, "repeats": repeats,
                           "prompt_length": prompt_length, "prompts": len(prompts), "max_batches": max_batches,
                           "domains": sorted({p["domain"] for p in prompts})},
              "costs": {}, "results": [], "profiles": [], "notes": []}
    if not report["model"]["calibrated"]:
        report["notes"].append(
            "The model's calibration left exits off (its config holds no exit settings): 'calibrated' decodes at full "
            "depth." if calibrated == "always" else
            "The model has no calibrated exit settings in its config: the calibrated target is not measured.")
    per_size = list(max_batches) if isinstance(max_batches, (list, tuple)) else [max_batches] * len(batch_sizes)
    for batch_size, n_batches in zip(batch_sizes, per_size + per_size[-1:] * len(batch_sizes)):
        batches = make_batches(prompts, batch_size, n_batches, device=device)
        log(f"[bench] batch {batch_size}: measuring the cost model")
        costs = measure_costs(ee_model, batch_size, prompt_length=prompt_length,
                              context=prompt_length + new_tokens // 2, repeats=cost_repeats)
        report["costs"][str(batch_size)] = costs
        le = costs["layer_equivalents"]
        log(f"[bench]   layer {costs['ms']['layer'][str(batch_size)]:.3f} ms; in layer steps: head check "
            f"{le['head_check']:.2f}, head {le['head']:.2f}, final head {le['final_head']:.2f}, backfill "
            f"{le['backfill']:.3f}, deferred extra {le['deferred_extra']:.3f}")
        main_configs = []
        if calibrated and calibrated_config(ee_model, calibrated == "always") is not None:
            main_configs.append(calibrated_config(ee_model, calibrated == "always"))
        if disabled:
            main_configs.append({"name": "exits disabled", "kind": "disabled", "exit_kwargs": {"early_exit": False}})
        groups = [(main_configs, main_repeats or 2 * repeats)]
        if forced:
            groups.append((forced_configs(forced_profiles, forced_modes, batch_size), repeats))
        if sweep and (sweep_batch_sizes is None or batch_size in sweep_batch_sizes):
            groups.append((sweep_configs(ee_model, batch_size, sweep_grid), sweep_repeats or repeats))
        for configs, n_repeats in groups:
            if not configs:
                continue
            log(f"[bench] batch {batch_size}: {len(configs)} configurations ({configs[0]['kind']}...), "
                f"{n_repeats} repeats x {len(batches)} batches")
            report["results"] += compare_many(ee_model, plain_model, batches, new_tokens, configs, n_repeats, costs,
                                              log=log)
        if profile:
            log(f"[bench] batch {batch_size}: step profiles")
            report["profiles"].append(profile_step(plain_model, batches[0], new_tokens, None, "plain"))
            to_profile = []
            if calibrated_config(ee_model) is not None:
                to_profile.append(calibrated_config(ee_model))
            if forced:
                to_profile += [c for c in forced_configs(["mixed"], forced_modes, batch_size)]
            for config in to_profile:
                report["profiles"].append(profile_step(ee_model, batches[0], new_tokens,
                                                       _generate_kwargs(ee_model, config), config["name"]))
    report["targets"] = evaluate_targets(report)
    return report


def frontier_points(results, batch_size):
    """Sweep (and calibrated) results at `batch_size` and the Pareto frontier (agreement up, speed-up up). A
    calibrated run with exits off is full depth, not a point of the early-exit frontier, and is left out."""
    points = [r for r in results if r["batch_size"] == batch_size and (
        r["kind"] == "sweep" or (r["kind"] == "calibrated" and r["criterion"] is not None))]
    frontier, best = [], -math.inf
    for r in sorted(points, key=lambda r: (-r["agreement"]["share"], -r["speedup"]["median"])):
        if r["speedup"]["median"] > best:
            frontier.append(r)
            best = r["speedup"]["median"]
    return points, frontier


def evaluate_targets(report):
    """Each target of the issue, met or missed, with the numbers behind it (None where it was not measured)."""
    results = report["results"]
    out = []
    for batch_size in report["settings"]["batch_sizes"]:
        at = [r for r in results if r["batch_size"] == batch_size]
        cal = [r for r in at if r["kind"] == "calibrated"]
        out.append({"target": f"calibrated >= {TARGETS['calibrated_min_speedup']}x", "batch_size": batch_size,
                    "value": cal[0]["speedup"]["median"] if cal else None,
                    "met": (cal[0]["speedup"]["median"] >= TARGETS["calibrated_min_speedup"]) if cal else None})
        points, _ = frontier_points(results, batch_size)
        for min_agree, min_speed in TARGETS["frontier"]:
            ok = [r["speedup"]["median"] for r in points if r["agreement"]["share"] >= min_agree]
            out.append({"target": f"frontier >= {min_speed}x at >= {int(min_agree * 100)}% agreement",
                        "batch_size": batch_size, "value": max(ok) if ok else None,
                        "met": (max(ok) >= min_speed) if ok else (False if points else None)})
        forced = [r for r in at if r["kind"] == "forced"]
        for r in forced:
            value = r["realised_over_ideal"]["median"]
            out.append({"target": f"{r['name']}: realised/ideal >= {TARGETS['forced_realised_over_ideal']}",
                        "batch_size": batch_size, "value": value,
                        "met": None if math.isnan(value) else value >= TARGETS["forced_realised_over_ideal"]})
        dis = [r for r in at if r["kind"] == "disabled"]
        if dis:
            overhead = 1.0 / dis[0]["speedup"]["median"] - 1.0
            out.append({"target": f"exits disabled: overhead <= {int(TARGETS['disabled_max_overhead'] * 100)}%",
                        "batch_size": batch_size, "value": overhead,
                        "met": overhead <= TARGETS["disabled_max_overhead"]})
    return out


# ----------------------------------------------------------------------------------------------------------------
# output: tables and plots
# ----------------------------------------------------------------------------------------------------------------


def _fmt(x, spec=".2f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(report, include_sweep=True):
    """Markdown: cost model, results, step profiles, targets."""
    lines = []
    lines.append("**Cost model** (direct timed calls at decode shape, median; layer-equivalents in brackets)\n")
    lines.append("| batch | layer step ms | head check | exit head | final head | backfill / layer | deferred extra "
                 "/ layer | prefill ms |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for b, c in report["costs"].items():
        ms, le = {k: v[b] for k, v in c["ms"].items()}, c["layer_equivalents"]
        cell = lambda k: f"{ms[k]:.3f} ({le[k]:.2f})"  # noqa: E731
        lines.append(f"| {b} | {ms['layer']:.3f} | {cell('head_check')} | {cell('head')} | {cell('final_head')} | "
                     f"{cell('backfill')} | {cell('deferred_extra')} | {ms['prefill']:.1f} |")
    lines.append("")
    lines.append("**Results** (speed-up = plain ms/step over early-exit ms/step, median [min, max] of the paired "
                 "ratios; agreement = share of greedy tokens identical to plain full depth)\n")
    lines.append("| configuration | batch | speed-up | agreement | tokens to 1st divergence | mean exit layer | "
                 "ideal | realised / ideal |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in report["results"]:
        if r["kind"] == "sweep" and not include_sweep:
            continue
        s, a = r["speedup"], r["agreement"]
        lines.append(f"| {r['name']} | {r['batch_size']} | {_fmt(s['median'])}x [{_fmt(s['min'])}, {_fmt(s['max'])}]"
                     f" | {_fmt(a['share'], '.3f')} | {_fmt(a['first_divergence'], '.1f')} | "
                     f"{_fmt(r['exits']['mean_exit_layer'], '.1f')} | {_fmt(r['ideal_speedup']['median'])}x | "
                     f"{_fmt(r['realised_over_ideal']['median'])} |")
    if report.get("profiles"):
        lines.append("")
        lines.append("**Where one decoding step's time goes** (ms per step, hooks; prefill excluded)\n")
        lines.append("| run | batch | step ms | layers | head checks | exit heads | backfill | final head | "
                     "other (Python) |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for p in report["profiles"]:
            q = p["parts_ms"]
            lines.append(f"| {p['name']} | {p['batch_size']} | {p['ms_per_step']:.2f} | {q['layers']:.2f} | "
                         f"{q['head_checks']:.2f} | {q['exit_heads']:.2f} | {q['backfill']:.2f} | "
                         f"{q['final_head']:.2f} | {q['other']:.2f} ({100 * p['shares']['other']:.0f}%) |")
    if report.get("targets"):
        lines.append("")
        lines.append("**Targets**\n")
        lines.append("| target | batch | value | met |")
        lines.append("|---|---|---|---|")
        for t in report["targets"]:
            met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
            lines.append(f"| {t['target']} | {t['batch_size']} | {_fmt(t['value'], '.3f')} | {met} |")
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_frontier(results, path):
    """Speed-up (median, min-max bars) versus agreement of the sweep, one panel per batch size, frontier drawn."""
    plt = _pyplot()
    results = results["results"] if isinstance(results, dict) else results
    sizes = sorted({r["batch_size"] for r in results if frontier_points(results, r["batch_size"])[0]}) or [None]
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
    colors = {"max_prob": "C0", "margin": "C1", "entropy": "C2", "cosine": "C3", "learned": "C4", "stable": "C5"}
    for ax, batch_size in zip(axes[0], sizes):
        points, frontier = frontier_points(results, batch_size) if batch_size else ([], [])
        seen = set()
        for r in points:
            crit = r.get("exit_kwargs", {}).get("exit_patience") and "stable" or r["criterion"] or "calibrated"
            label = "calibrated" if r["kind"] == "calibrated" else f"{crit} ({r['policy']})"
            marker = "*" if r["kind"] == "calibrated" else ("o" if r["policy"] == "batch" else "s")
            s = r["speedup"]
            ax.errorbar(r["agreement"]["share"], s["median"], yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]],
                        fmt=marker, color="k" if r["kind"] == "calibrated" else colors.get(crit, "C7"),
                        markersize=11 if r["kind"] == "calibrated" else 5, alpha=0.8, capsize=2,
                        label=None if label in seen else label)
            seen.add(label)
        if frontier:
            ax.plot([r["agreement"]["share"] for r in frontier], [r["speedup"]["median"] for r in frontier], "k--",
                    lw=1, label="frontier")
        ax.axhline(1.0, color="gray", lw=0.8)
        for i, (agree, speed) in enumerate(TARGETS["frontier"]):
            ax.plot([agree], [speed], marker="x", color="red", markersize=9, linestyle="none",
                    label="targets" if i == 0 else None)
        ax.set_xlabel("greedy agreement with full depth")
        ax.set_ylabel("speed-up vs plain generate")
        ax.set_title(f"batch {batch_size}" if batch_size else "no sweep results")
        ax.grid(alpha=0.3)
        if points:
            ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_histogram(results, path, names=None):
    """Exit-layer histograms (share of tokens per deciding layer) of the chosen results, one panel per batch size.

    names: result names to draw; default the calibrated result, else the sweep result with the best speed-up at
    >= 90% agreement, plus the forced "mixed" profile (batch/immediate)."""
    plt = _pyplot()
    results = results["results"] if isinstance(results, dict) else results
    sizes = sorted({r["batch_size"] for r in results})
    chosen = {}
    for b in sizes:
        at = [r for r in results if r["batch_size"] == b]
        if names is not None:
            picks = [r for r in at if r["name"] in names]
        else:
            picks = [r for r in at if r["kind"] == "calibrated"]
            if not picks:
                good = [r for r in at if r["kind"] == "sweep" and r["agreement"]["share"] >= 0.9]
                picks = sorted(good, key=lambda r: -r["speedup"]["median"])[:1]
            picks += [r for r in at if r["kind"] == "forced" and r["name"].startswith("forced mixed batch/immediate")]
        chosen[b] = [r for r in picks if r["exits"]["histogram"]]
    fig, axes = plt.subplots(1, max(len(sizes), 1), figsize=(5.5 * max(len(sizes), 1), 3.6), squeeze=False)
    for ax, b in zip(axes[0], sizes):
        picks = chosen[b]
        width = 0.8 / max(len(picks), 1)
        for i, r in enumerate(picks):
            hist = {int(k): v for k, v in r["exits"]["histogram"].items()}
            total = sum(hist.values())
            xs = sorted(hist)
            ax.bar([x + (i - (len(picks) - 1) / 2) * width for x in xs], [hist[x] / total for x in xs], width=width,
                   label=f"{r['name']} (mean {r['exits']['mean_exit_layer']:.1f})")
        ax.set_xlabel("deciding decoder layer (last = full depth)")
        ax.set_ylabel("share of tokens")
        ax.set_title(f"batch {b}")
        ax.grid(alpha=0.3, axis="y")
        if picks:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, (torch.Tensor,)):
        return x.tolist()
    if callable(x) or isinstance(x, ExitCriterion):
        return getattr(x, "name", repr(x))
    return x


def write_outputs(report, out_dir):
    """report.json, results.md, frontier.png, exit_histogram.png under `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "table": out_dir / "results.md",
             "frontier": out_dir / "frontier.png", "histogram": out_dir / "exit_histogram.png"}
    paths["json"].write_text(json.dumps(_jsonable(report), indent=1) + "\n")
    paths["table"].write_text(format_table(report))
    plot_frontier(report, paths["frontier"])
    plot_histogram(report, paths["histogram"])
    return paths


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


def _int_list(text):
    return [int(x) for x in str(text).split(",") if x.strip()]


def build_parser():
    parser = argparse.ArgumentParser(
        prog="ee-transformers bench",
        description="Benchmark early exit against plain transformers generate on the same weights, interleaved in "
                    "one process: speed-up, greedy agreement, exits, ideal vs realised, overhead, sweep, forced "
                    "profiles. Writes report.json, results.md and PNG plots.")
    parser.add_argument("--model", required=True, help="early-exit folder (fitted/calibrated or not), or a plain "
                        "checkpoint folder together with --exit-layers")
    parser.add_argument("--exit-layers", type=_int_list, default=None,
                        help="convert on the fly with these exits (e.g. 7,15,23,26); overrides the folder's")
    parser.add_argument("--exit-head", choices=["norm", "adapter"], default=None)
    parser.add_argument("--prompts-from", nargs="+", default=None, metavar="FILE",
                        help="held-out text files (default: the held-out tails of Austen's Sense and Sensibility "
                             "and the Python manual, from ee_transformers.tools.assets.fetch_text())")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=_int_list, default=[1, 8])
    parser.add_argument("--max-batches", type=_int_list, default=[2],
                        help="batches per batch size: one value, or one per batch size (e.g. 2,1)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--sweep-repeats", type=int, default=None, help="repeats of the sweep (default --repeats)")
    parser.add_argument("--sweep-grid", choices=["small", "medium", "full"], default=None,
                        help="thresholds per criterion (default full; small with --quick)")
    parser.add_argument("--sweep-batch-sizes", type=_int_list, default=None,
                        help="run the sweep at these batch sizes only (default: all)")
    parser.add_argument("--forced", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--forced-modes", default=None,
                        help="policy/kv pairs, e.g. row/immediate,batch/deferred (default: batch/immediate, "
                             "batch/deferred, row/immediate)")
    parser.add_argument("--forced-grid", choices=["profiles", "full"], default="profiles",
                        help="profiles: 25%%@1/4, 50%%@1/2, 75%%@3/4, mixed; full: every share at every depth")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="profile where one step's time goes")
    parser.add_argument("--quick", action="store_true",
                        help="small settings (CI): 8 new tokens, 1 repeat, 4 prompts, 1 batch per size, small sweep")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-out", help="output folder for report.json, results.md, PNGs")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        defaults = dict(new_tokens=8, repeats=1, num_prompts=4, max_batches=[1])
        for name, value in defaults.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    sweep_grid = {"small": SWEEP_SMALL, "medium": SWEEP_MEDIUM, "full": SWEEP_FULL}[args.sweep_grid or ("small" if args.quick else "full")]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    try:
        ee_model, plain_model = load_models(args.model, args.exit_layers, args.exit_head, dtype, args.device)
    except ValueError as error:
        parser.exit(2, f"ee-transformers bench: error: {error}\n")
    tokenizer = ee_model.tokenizer
    if tokenizer is None:
        prompts = random_prompts(ee_model.config.vocab_size, args.num_prompts, args.prompt_tokens, args.seed)
        print("[bench] the model folder has no tokenizer: random token prompts")
    else:
        prompts = heldout_prompts(tokenizer, args.prompts_from, args.num_prompts, args.prompt_tokens, args.seed)
    profiles = list(FORCED_GRID) if args.forced_grid == "full" else list(FORCED_PROFILES)
    forced_modes = FORCED_MODES
    if args.forced_modes:
        forced_modes = [tuple(m.split("/")) for m in args.forced_modes.split(",")]
        if any(len(m) != 2 or m not in FORCED_MODES for m in forced_modes):
            parser.error(f"--forced-modes must be policy/kv pairs among {['/'.join(m) for m in FORCED_MODES]}")
    calibration_file = Path(args.model) / "calibration.json"
    calibration = json.loads(calibration_file.read_text()) if calibration_file.is_file() else None
    start = time.perf_counter()
    report = run_benchmark(ee_model, plain_model, prompts, args.batch_sizes, args.new_tokens, args.repeats,
                           sweep=args.sweep, forced=args.forced, calibrated="always" if calibration else True,
                           max_batches=args.max_batches, sweep_grid=sweep_grid, forced_modes=forced_modes,
                           sweep_batch_sizes=args.sweep_batch_sizes, forced_profiles=profiles,
                           profile=args.profile, cost_repeats=10 if args.quick else 30,
                           sweep_repeats=args.sweep_repeats)
    home = str(Path.home())
    report["command"] = "ee-transformers bench " + " ".join(  # no machine-specific home folder in the record
        "~" + a[len(home):] if a.startswith(home + os.sep) else shlex.quote(a)
        for a in (sys.argv[2:] if argv is None else argv))
    report["model"]["path"] = Path(args.model).name
    if calibration is not None:
        report["model"]["calibration"] = {k: calibration.get(k) for k in ("criterion", "policy", "target_agreement",
                                                                          "chosen", "heldout_B", "message")}
    report["wall_seconds"] = time.perf_counter() - start
    paths = write_outputs(report, args.out)
    print(format_table(report))
    print(f"[bench] wrote {', '.join(str(p) for p in paths.values())} ({report['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
