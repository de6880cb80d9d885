"""The configurations a benchmark measures (calibrated, exits disabled, forced profiles, the sweep), and the run."""

import dataclasses
import os
import platform
from datetime import datetime, timezone

import torch
import transformers

from ee_transformers.measure.config import BenchConfig, Variant
from ee_transformers.measure.costs import measure_costs
from ee_transformers.measure.forced import FORCED_GRID, FORCED_MODES, FORCED_PROFILES
from ee_transformers.measure.loading import make_batches
from ee_transformers.measure.timing import _generate_kwargs, _settings, compare_many
from ee_transformers.tools.bench.report import evaluate_targets
from ee_transformers.tools.bench.step_profile import profile_step

SWEEP_FULL = {
    "max_prob": [0.5, 0.7, 0.9, 0.97],
    "margin": [0.5, 0.8, 0.95],
    "entropy": [0.7, 0.85, 0.95],
    "cosine": [0.95, 0.98, 0.995],
    "learned": [0.5, 0.7, 0.9],
    "patience": [2, 3],  # stable-token exits: the argmax unchanged over k consecutive checked exits
}
SWEEP_MEDIUM = {
    "max_prob": [0.8, 0.9, 0.97],
    "margin": [0.8, 0.95],
    "entropy": [0.9],
    "cosine": [0.98],
    "learned": [0.5, 0.8],
    "patience": [2],
}
SWEEP_SMALL = {
    "max_prob": [0.9],
    "margin": [0.8],
    "entropy": [0.85],
    "cosine": [0.98],
    "learned": [0.7],
    "patience": [2],
}
SWEEP_GRIDS = {"small": SWEEP_SMALL, "medium": SWEEP_MEDIUM, "full": SWEEP_FULL}


def calibrated_variant(model, always=False):
    """generate() with no exit arguments: the calibrated settings the model stores. None when it stores none, unless
    `always` (a calibrated folder whose calibration left exits off: then it decodes at full depth)."""
    if _settings(model, {}) is None:
        return Variant("calibrated (exits off)", "calibrated") if always else None
    return Variant("calibrated", "calibrated")


def sweep_variants(model, batch_size, grid="full", check_sets=None):
    """The sweep: criteria x thresholds x policies (row only at batch > 1) x checked-exit sets. grid: a name of
    `SWEEP_GRIDS` or a dict {criterion: thresholds} (`"patience"`: stable-token exits over k checked exits)."""
    grid = SWEEP_GRIDS[grid] if isinstance(grid, str) else grid
    exits = list(model.config.exit_layers)
    if check_sets is None:
        calibrated = model.exit_defaults["exit_check_layers"]
        check_sets = [exits] + ([[exits[-1]]] if len(exits) > 1 else [])
        if calibrated and list(calibrated) not in check_sets:
            check_sets.append(list(calibrated))
    policies = ["batch"] + (["row"] if batch_size > 1 else [])
    variants = []
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
                    variants.append(Variant(f"{label} {policy} @{','.join(map(str, checks))}", "sweep", kwargs))
    return variants


def forced_variants(profiles=None, modes=FORCED_MODES, batch_size=1):
    """Forced profiles, each under each (policy, kv) mode (row is batch at batch 1, so left out there)."""
    profiles = list(FORCED_PROFILES) if profiles is None else list(profiles)
    modes = [m for m in modes if batch_size > 1 or m[0] != "row"]
    return [
        Variant(
            f"forced {p} {policy}/{kv}", "forced", {"exit_policy": policy, "exit_kv": kv}, {"profile": p, "seed": 0}
        )
        for p in profiles
        for policy, kv in modes
    ]


def machine_info():
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }
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


def run_benchmark(ee_model, plain_model, prompts, config=None, log=print):
    """The whole benchmark of `config` (a `BenchConfig`) on `prompts` (from `heldout_prompts` / `random_prompts`);
    returns the report dict (see `format_table`, `plot_frontier`, `plot_histogram`, `write_outputs`)."""
    config = config or BenchConfig()
    prompt_length = len(prompts[0]["ids"])
    report = _new_report(ee_model, prompts, config)
    profiles = list(FORCED_GRID) if config.forced_grid == "full" else list(FORCED_PROFILES)
    modes = config.modes()
    for batch_size, n_batches in zip(config.batch_sizes, config.batches_per_size()):
        batches = make_batches(prompts, batch_size, n_batches, device=ee_model.device)
        costs = report["costs"][str(batch_size)] = _cost_model(ee_model, batch_size, prompt_length, config, log)
        for variants, repeats in _variant_groups(ee_model, batch_size, config, profiles, modes):
            if not variants:
                continue
            log(
                f"[bench] batch {batch_size}: {len(variants)} configurations ({variants[0].kind}...), {repeats} "
                f"repeats x {len(batches)} batches"
            )
            report["results"] += compare_many(ee_model, plain_model, batches, variants, config, repeats, costs, log)
        if config.profile:
            log(f"[bench] batch {batch_size}: step profiles")
            report["profiles"] += _step_profiles(ee_model, plain_model, batches[0], batch_size, config, modes)
    report["targets"] = evaluate_targets(report)
    return report


def _new_report(ee_model, prompts, config: BenchConfig) -> dict:
    """The report before any measurement: machine, model, settings, config, and a note when the model stores no
    calibrated settings."""
    calibrated = _settings(ee_model, {}) is not None
    report = {
        "machine": machine_info(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "class": type(ee_model).__name__,
            "num_hidden_layers": ee_model.config.num_hidden_layers,
            "exit_layers": list(ee_model.config.exit_layers),
            "exit_head": ee_model.config.exit_head,
            "dtype": str(ee_model.dtype).replace("torch.", ""),
            "calibrated": calibrated,
        },
        "settings": {
            "batch_sizes": list(config.batch_sizes),
            "new_tokens": config.new_tokens,
            "repeats": config.repeats,
            "prompt_length": len(prompts[0]["ids"]),
            "prompts": len(prompts),
            "max_batches": config.batches_per_size(),
            "domains": sorted({p["domain"] for p in prompts}),
        },
        "config": dataclasses.asdict(config),
        "costs": {},
        "results": [],
        "profiles": [],
        "notes": [],
    }
    if not calibrated and config.calibrated != "off":
        report["notes"].append(
            "The model's calibration left exits off (its config holds no exit settings): 'calibrated' decodes at full "
            "depth."
            if config.calibrated == "always"
            else "The model has no calibrated exit settings in its config: the calibrated target is not measured."
        )
    return report


def _cost_model(ee_model, batch_size, prompt_length, config: BenchConfig, log) -> dict:
    log(f"[bench] batch {batch_size}: measuring the cost model")
    costs = measure_costs(
        ee_model,
        batch_size,
        prompt_length=prompt_length,
        context=prompt_length + config.new_tokens // 2,
        repeats=config.cost_repeats,
    )
    le = costs["layer_equivalents"]
    log(
        f"[bench]   layer {costs['ms']['layer'][str(batch_size)]:.3f} ms; in layer steps: head check "
        f"{le['head_check']:.2f}, head {le['head']:.2f}, final head {le['final_head']:.2f}, backfill "
        f"{le['backfill']:.3f}, deferred extra {le['deferred_extra']:.3f}"
    )
    return costs


def _variant_groups(ee_model, batch_size, config: BenchConfig, profiles, modes) -> list[tuple[list, int]]:
    """[(variants, repeats)] measured at `batch_size`: calibrated and exits disabled (more repeats: their targets sit
    near 1.0x), forced profiles, the sweep."""
    main = []
    if config.calibrated != "off":
        main.append(calibrated_variant(ee_model, always=config.calibrated == "always"))
    if config.disabled:
        main.append(Variant("exits disabled", "disabled", {"early_exit": False}))
    groups = [([v for v in main if v is not None], config.main_repeats or 2 * config.repeats)]
    if config.forced:
        groups.append((forced_variants(profiles, modes, batch_size), config.repeats))
    if config.sweep and (config.sweep_batch_sizes is None or batch_size in config.sweep_batch_sizes):
        groups.append((sweep_variants(ee_model, batch_size, config.sweep_grid), config.sweep_repeats or config.repeats))
    return groups


def _step_profiles(ee_model, plain_model, batch, batch_size, config: BenchConfig, modes) -> list[dict]:
    """Where a decoding step's time goes: plain, the calibrated settings and the mixed forced profile."""
    profiles = [profile_step(plain_model, batch, config.new_tokens, None, "plain")]
    to_profile = [v for v in [calibrated_variant(ee_model)] if v is not None]
    if config.forced:
        to_profile += forced_variants(["mixed"], modes, batch_size)
    for variant in to_profile:
        profiles.append(
            profile_step(ee_model, batch, config.new_tokens, _generate_kwargs(ee_model, variant), variant.name)
        )
    return profiles
