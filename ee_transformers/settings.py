"""The exit settings of a `generate` call, validated where they enter: confident exits (`EXIT_FIELDS`,
`check_exit_argument`, `merged_exit_values`, `resolve_exit_settings` -> `ExitSettings`) and the lean quality guard
(`LEAN_FIELDS`, `check_lean_argument`, `resolve_guard`, `keeps_exit_states`). `request.py`, the one resolver of a
call, decides the mode with them; every name here stays importable from `request` as before.

Part of the Hub runtime: imports only torch, transformers and its siblings.
"""

import math
from dataclasses import dataclass

from .decode_core import EXIT_CRITERIA, ExitCriterion, _is_int, is_lean

LEAN_FIELDS = ("exit_breach_limit", "exit_breach_window")  # generation settings of the quality guard


# ---------------------------------------------------------------------------------------------------------------------
# the lean quality guard
# ---------------------------------------------------------------------------------------------------------------------
def check_lean_argument(name: str, value) -> None:
    """Validates one quality-guard setting alone (None = not set)."""
    if value is None:
        return
    if name == "exit_breach_limit":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0 <= value <= 1:
            raise ValueError(
                f"`exit_breach_limit` must be a share of greedy exits: allowed values are "
                f"0 <= exit_breach_limit <= 1, got {value!r}."
            )
    elif name == "exit_breach_window":
        if not _is_int(value) or value < 1:
            raise ValueError(
                f"`exit_breach_window` must be a number of decided tokens: allowed values are integers "
                f">= 1, got {value!r}."
            )
    else:
        raise ValueError(f"Unknown quality-guard setting `{name}`: allowed names are {list(LEAN_FIELDS)}.")


def resolve_guard(values: dict) -> tuple[float | None, int | None]:
    """(breach limit, breach window) from exit setting values; both or neither."""
    limit, window = values.get("exit_breach_limit"), values.get("exit_breach_window")
    for name in LEAN_FIELDS:
        check_lean_argument(name, values.get(name))
    if (limit is None) != (window is None):
        given, missing = LEAN_FIELDS if window is None else LEAN_FIELDS[::-1]
        raise ValueError(
            f"`{missing}` is required with `{given}`: the guard "
            "deepens when more than `exit_breach_limit` of the last `exit_breach_window` decided tokens "
            "were greedy exits; give both, or neither."
        )
    return (None if limit is None else float(limit)), window


def keeps_exit_states(model, settings) -> bool:
    """Whether this decode keeps the states leaving the deepest loaded layer (the guard is on and can deepen)."""
    return getattr(settings, "breach_window", None) is not None and is_lean(model)


# ---------------------------------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------------------------------
# exit settings: generation settings (GenerationConfig attributes, generate kwargs, from_pretrained kwargs)
EXIT_FIELDS = (
    "exit_criterion",
    "exit_threshold",
    "exit_policy",
    "exit_patience",
    "exit_kv",
    "exit_check_layers",
    *LEAN_FIELDS,
)
EXIT_ARGUMENTS = ("early_exit",) + EXIT_FIELDS
EXIT_POLICIES = ("batch", "row")
EXIT_KV_MODES = ("immediate", "deferred")


def check_exit_argument(name: str, value, exit_layers=None) -> None:
    """Validates one exit setting alone (None = not set); a `ValueError` naming it and the allowed values."""
    if value is None:
        return
    if name == "early_exit":
        if not isinstance(value, bool):
            raise ValueError(f"`early_exit` must be True, False or None, got {value!r}.")
    elif name == "exit_criterion":
        if not isinstance(value, ExitCriterion) and value not in EXIT_CRITERIA:
            raise ValueError(
                f"`exit_criterion` must be one of {list(EXIT_CRITERIA)} (a str), an ExitCriterion or None, "
                f"got {value!r}."
            )
    elif name == "exit_threshold":
        values = value if isinstance(value, (list, tuple)) else [value]
        if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) for v in values):
            raise ValueError(
                f"`exit_threshold` must be a float or a non-empty list of floats (one per checked exit), got {value!r}."
            )
    elif name == "exit_policy":
        if value not in EXIT_POLICIES:
            raise ValueError(f"`exit_policy` must be one of {list(EXIT_POLICIES)}, got {value!r}.")
    elif name == "exit_kv":
        if value not in EXIT_KV_MODES:
            raise ValueError(f"`exit_kv` must be one of {list(EXIT_KV_MODES)}, got {value!r}.")
    elif name == "exit_patience":
        if not _is_int(value) or value < 0 or value == 1:
            raise ValueError(f"`exit_patience` must be 0 (off) or an integer >= 2, got {value!r}.")
    elif name == "exit_check_layers":
        if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
            raise ValueError(f"`exit_check_layers` must be a list of exit layer indices (ints), got {value!r}.")
        if exit_layers is not None:
            layers = list(value)
            if not layers or layers != sorted(set(layers)) or any(v not in exit_layers for v in layers):
                raise ValueError(
                    f"`exit_check_layers` must be a sorted, non-empty subset of the exits {exit_layers}, got {value!r}."
                )
    elif name in LEAN_FIELDS:
        check_lean_argument(name, value)
    else:
        raise ValueError(f"Unknown exit setting `{name}`: allowed names are {list(EXIT_ARGUMENTS)}.")


@dataclass
class ExitSettings:
    """Resolved early-exit decoding settings (see `resolve_exit_settings`)."""

    criterion: ExitCriterion
    thresholds: dict  # checked exit layer -> threshold (inf: only the stable-token rule can fire)
    policy: str = "batch"
    patience: int = 0
    kv: str = "immediate"
    breach_limit: float | None = None  # lean models: deepen when more than this share of ...
    breach_window: int | None = None  # ... the last `breach_window` decided tokens were greedy exits

    @property
    def check_layers(self) -> list[int]:
        return sorted(self.thresholds)

    @property
    def needs_logits(self) -> bool:
        return self.criterion.needs_logits or self.patience > 0


def merged_exit_values(model, generation_config=None, kwargs=None) -> dict:
    """Exit settings with transformers' precedence: `generate(**kwargs)` over `generate(generation_config=...)` over
    `model.generation_config` (`generation_config.json`). Pops the exit names from `kwargs`."""
    kwargs = {} if kwargs is None else kwargs
    values = {}
    for name in EXIT_ARGUMENTS:
        value = kwargs.pop(name, None)
        for source in (generation_config, getattr(model, "generation_config", None)):
            if value is None and source is not None:
                value = getattr(source, name, None)
        values[name] = value
    return values


def resolve_exit_settings(config, values: dict) -> ExitSettings | None:
    """Exit settings from `values` (EXIT_ARGUMENTS -> value or None), or None for full depth.

    Raises a `ValueError` naming the argument, the bad value and the allowed values; exit settings given without a
    criterion or threshold to act on raise too (never a silent full-depth decode).
    """
    exit_layers = list(config.exit_layers or [])
    for name, value in values.items():
        check_exit_argument(name, value, exit_layers or None)
    early_exit = values.get("early_exit")
    named = [name for name in EXIT_FIELDS if values.get(name) is not None]
    if early_exit is False:
        return None
    if not exit_layers:
        if early_exit or named:
            raise ValueError(
                f"`{named[0] if named else 'early_exit'}` was given but this model has no exit heads "
                "(`config.exit_layers` is empty); build one with "
                "`ee_transformers.from_base(path, exit_layers=[...])`."
            )
        return None

    criterion, threshold = values.get("exit_criterion"), values.get("exit_threshold")
    patience = values.get("exit_patience") or 0
    if criterion is None and threshold is None and not patience:
        if early_exit or named:
            raise ValueError(
                f"`{named[0] if named else 'early_exit'}` was given but no exit criterion is set: pass "
                "`exit_criterion` and `exit_threshold` (or `exit_patience`), or store them in "
                "`model.generation_config`."
            )
        return None
    policy, kv = values.get("exit_policy") or "batch", values.get("exit_kv") or "immediate"
    if kv == "deferred" and policy == "row":
        raise ValueError(
            "`exit_kv='deferred'` is supported with `exit_policy='batch'` only (rows of a batch would hold "
            "different numbers of deferred tokens); use `exit_kv='immediate'` with `exit_policy='row'`."
        )
    criterion = EXIT_CRITERIA[criterion or "max_prob"] if not isinstance(criterion, ExitCriterion) else criterion
    criterion.validate(config)

    check_layers = list(values.get("exit_check_layers") or exit_layers)
    thresholds = _resolve_thresholds(criterion, threshold, patience, check_layers)
    breach_limit, breach_window = resolve_guard(values)
    return ExitSettings(
        criterion=criterion,
        thresholds=thresholds,
        policy=policy,
        patience=patience,
        kv=kv,
        breach_limit=breach_limit,
        breach_window=breach_window,
    )


def _resolve_thresholds(criterion, threshold, patience, check_layers) -> dict:
    """{checked exit layer: threshold} from `exit_threshold` (one float, or one per checked exit; the criterion's
    default when None; inf with patience alone: only the stable-token rule can fire), each in the criterion's range."""
    if threshold is None:
        threshold = criterion.default_threshold
    if threshold is None:
        if not patience:
            raise ValueError(
                "`exit_threshold` is required with `exit_criterion`; give a float or one per checked exit."
            )
        threshold = math.inf  # stable-token exits only
    thresholds = list(threshold) if isinstance(threshold, (list, tuple)) else [threshold] * len(check_layers)
    if len(thresholds) != len(check_layers):
        raise ValueError(
            f"`exit_threshold` has {len(thresholds)} values but {len(check_layers)} exits are checked "
            f"({check_layers}); give one float or one per checked exit."
        )
    low, high = criterion.score_range
    for value in thresholds:
        if value != math.inf and not low <= value <= high:
            raise ValueError(
                f"`exit_threshold`={value!r} is outside the range of the criterion's score: allowed "
                f"values are {low} <= exit_threshold <= {high}."
            )
    return dict(zip(check_layers, map(float, thresholds)))
