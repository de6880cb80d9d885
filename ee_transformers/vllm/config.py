"""What an early-exit folder served by vLLM is asked to do, resolved once per process and validated at start-up.

The exit settings are the folder's stored generation settings (`generation_config.json`, what calibration writes),
under vLLM's own precedence: `--generation-config` picks the file (`vllm`: none), `--override-generation-config`
(a JSON object; `LLM(override_generation_config=...)`) overrides single settings, `{"early_exit": false}` turns exits
off. They are resolved by the package's one resolver (`settings.resolve_exit_settings`), so every name and value
`generate` refuses is refused here too, and then checked against what iteration-level exits are:

- `exit_policy` "batch" only: a vLLM step is one iteration of the whole batch (the seed's rule: it stops at an exit
  only when every sequence is confident);
- `exit_kv` "immediate" only: the skipped layers' K/V are written into the paged cache before the step ends;
- no lean quality guard (`exit_breach_limit`, `exit_breach_window`): vLLM loads every layer.

For the benchmark only, `ee_forced_profile` ({depth fraction: share of steps}, as `measure.forced`) with
`ee_forced_seed` forces each all-decode step's exit (the package's `ForcedExits`), so that realised against ideal speed
measures the engine, not the heads. `EE_TRANSFORMERS_VLLM_SKIP_FILL=1` (tests only) skips the K/V fill, to show that a
later full-depth token reads it.
"""

import os
from dataclasses import dataclass

from ..settings import EXIT_ARGUMENTS, LEAN_FIELDS, ExitSettings, resolve_exit_settings

FORCED_FIELDS = ("ee_forced_profile", "ee_forced_seed")
PLUGIN_FIELDS = EXIT_ARGUMENTS + FORCED_FIELDS


@dataclass
class PluginSettings:
    exits: ExitSettings | None  # None: full depth, vLLM's own forward
    fill: bool = True


def requested_values(model_config, names=PLUGIN_FIELDS) -> dict:
    """The settings `names` asked for: the generation config vLLM reads for this model, then the server's
    overrides."""
    stored = {} if model_config.generation_config == "vllm" else model_config.try_get_generation_config()
    values = {**stored, **(model_config.override_generation_config or {})}
    return {name: values.get(name) for name in names}


def _forced(hf_config, spec, seed):
    from ..measure.forced import ForcedExits, forced_profile

    if not isinstance(spec, (str, dict)) or not spec:
        raise ValueError(
            f"`ee_forced_profile` must be a profile name or a non-empty {{depth fraction: share}} object, got {spec!r}."
        )
    if isinstance(spec, dict):
        try:
            spec = {float(depth): float(share) for depth, share in spec.items()}
        except (TypeError, ValueError):
            raise ValueError(
                f"`ee_forced_profile` must map depth fractions to shares (numbers), got {spec!r}."
            ) from None
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"`ee_forced_seed` must be an integer, got {seed!r}.")

    class _Model:  # forced_profile reads the decoder's depth and exits off a model
        config = hf_config

    try:
        profile = forced_profile(spec, _Model, per_row=False, seed=seed or 0)
    except KeyError:
        raise ValueError(f"`ee_forced_profile` {spec!r} is not a known profile name.") from None
    return ForcedExits(profile), profile.check_layers


def resolve_plugin_settings(hf_config, values: dict) -> PluginSettings:
    """Settings from `values` (`PLUGIN_FIELDS` -> value or None); a `ValueError` naming the field for anything
    iteration-level exits cannot honour."""
    values = dict(values)
    forced = values.pop("ee_forced_profile", None)
    seed = values.pop("ee_forced_seed", None)
    if forced is not None:
        if values.get("exit_criterion") not in (None, "forced"):
            raise ValueError("`ee_forced_profile` replaces the exit criterion: leave `exit_criterion` unset.")
        criterion, check_layers = _forced(hf_config, forced, seed)
        values.update(exit_criterion=criterion, exit_threshold=None, exit_check_layers=check_layers)
    elif seed is not None:
        raise ValueError("`ee_forced_seed` was given without `ee_forced_profile`.")
    exits = resolve_exit_settings(hf_config, values)
    if exits is not None:
        if exits.policy != "batch":
            raise ValueError(
                f"`exit_policy`={exits.policy!r} cannot be served by vLLM: a vLLM step is one iteration of the whole "
                "batch, so it exits only when every sequence is confident; allowed values are ['batch']."
            )
        if exits.kv != "immediate":
            raise ValueError(
                f"`exit_kv`={exits.kv!r} cannot be served by vLLM: the skipped layers' K/V are written into the "
                "paged cache before the step ends; allowed values are ['immediate']."
            )
        lean = [name for name in LEAN_FIELDS if values.get(name) is not None]
        if lean:
            raise ValueError(f"`{lean[0]}` (the lean quality guard) cannot be served by vLLM: it loads every layer.")
    return PluginSettings(exits=exits, fill=os.environ.get("EE_TRANSFORMERS_VLLM_SKIP_FILL") != "1")


def plugin_settings(vllm_config) -> PluginSettings:
    """The settings of this server; exits off under speculative decoding (drafts are verified at full depth: a step
    that verifies none would otherwise exit, and the answer would no longer be the full model's)."""
    model_config = vllm_config.model_config
    settings = resolve_plugin_settings(model_config.hf_config, requested_values(model_config))
    if vllm_config.speculative_config is not None:
        settings.exits = None
    return settings


__all__ = ["FORCED_FIELDS", "PLUGIN_FIELDS", "PluginSettings", "plugin_settings", "resolve_plugin_settings"]
