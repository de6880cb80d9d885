"""The configurations a benchmark measures (calibrated, exits disabled, forced profiles, the sweep), and the run."""

import os
import platform
from datetime import datetime, timezone

import torch
import transformers

from ee_transformers.tools.bench.forced import FORCED_MODES, FORCED_PROFILES
from ee_transformers.tools.bench.loading import make_batches
from ee_transformers.tools.bench.report import evaluate_targets
from ee_transformers.tools.bench.step_profile import profile_step
from ee_transformers.tools.bench.timing import _generate_kwargs, _settings, compare_many
from ee_transformers.tools.costs import measure_costs

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
