"""One request, resolved once: which mode a `generate` call runs, with which settings, and what it refuses.

    request = resolve_request(model, generation_config, kwargs, batch_size)
    request.mode           # "full_depth", "exits" or "speculative"
    request.exit_settings  # ExitSettings (mode "exits")
    request.speculative    # our speculative arguments (mode "speculative")
    request.kwargs         # what transformers' `generate` is handed (our names removed)

Every entry point calls it once and only reads the result: `EarlyExitMixin.generate`, continuous batching
(`init_continuous_batching`, the paged forward), the pool and the server. Precedence is transformers': settings given
to `generate(**kwargs)` over a passed `GenerationConfig` over `model.generation_config` (`generation_config.json`); a
passed copy of the stored config carries the stored settings, not settings of the call. Every setting is validated
where it enters, with a `ValueError` naming it and the allowed values; what a mode cannot honour raises, never a
silent full-depth decode.

The settings of every mode live here (speculative rounds: `speculation_requested`, `resolve_speculative_settings`)
and in its one sibling `settings.py` (confident exits and the lean guard: `resolve_exit_settings`; importable from
here as before), so that the modes, siblings on the decode core, import this module and never each other.

Part of the Hub runtime: imports only torch, transformers and its siblings.
"""

from dataclasses import dataclass, field

from transformers.utils import logging

from .decode_core import EXIT_CRITERIA, _is_int, is_lean
from .drafts import DEFAULT_HISTORY_TOKENS
from .settings import (  # the exit settings and the lean guard, validated where they enter; importable from here
    EXIT_ARGUMENTS,
    EXIT_FIELDS,
    EXIT_KV_MODES,
    EXIT_POLICIES,
    LEAN_FIELDS,
    ExitSettings,
    check_exit_argument,
    check_lean_argument,
    keeps_exit_states,
    merged_exit_values,
    resolve_exit_settings,
    resolve_guard,
)

logger = logging.get_logger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# speculative settings
# ---------------------------------------------------------------------------------------------------------------------
SCHEDULES = ("constant", "heuristic", "heuristic_transient")
DRAFT_SOURCES = ("assistant_early_exit", "prompt_lookup_num_tokens")  # transformers' arguments
# ours: stored draft settings apply up to this batch size (calibration stores where they were measured to pay)
MAX_BATCH_FIELD = "speculative_max_batch_size"
# ours: exit-head drafts score only the n most frequent tokens the folder stores (`model.set_draft_vocab`)
VOCAB_FIELD = "assistant_vocab_size"
# ours: a context round feeds at least this many positions per row (fillers after the drafts, never accepted)
WIDTH_FIELD = "speculative_verify_width"
# ours: rows without a context match draft from the model's stored table of frequent continuations
TABLE_FIELD = "speculative_table_drafts"
# ours: the token budget of the model's history index of earlier generations (0: no history drafts)
HISTORY_FIELD = "speculative_history_tokens"
# ours: a round drafts only where the expected accepted tokens pay for the wider verification (False: always)
GATE_FIELD = "speculative_gate"
OUR_FIELDS = (
    VOCAB_FIELD,
    WIDTH_FIELD,
    TABLE_FIELD,
    HISTORY_FIELD,
    GATE_FIELD,
)  # not transformers' GenerationConfig fields: passed to the loop as arguments


def _requested(name, model, generation_config, kwargs):
    """`name` from `kwargs` (an explicit None turns a stored value off, as in transformers), else from
    `generation_config`, else from `model.generation_config`."""
    if name in kwargs:
        return kwargs[name]
    sources = [c for c in (generation_config, model.generation_config) if c is not None]
    return next((getattr(c, name) for c in sources if getattr(c, name, None) is not None), None)


def _stored(name, model):
    return getattr(getattr(model, "generation_config", None), name, None)


def _passed(name, model, generation_config):
    """`name` as the passed `generation_config` sets it, None where that is the model's stored value (a passed copy
    of `model.generation_config` carries the stored settings, not settings of this call)."""
    value = getattr(generation_config, name, None)
    return None if value is None or value == _stored(name, model) else value


def stored_draft_settings(model, generation_config, kwargs) -> list[str]:
    """The draft settings (`DRAFT_SOURCES`) only `model.generation_config` sets, not this call."""
    return [
        n
        for n in DRAFT_SOURCES
        if n not in kwargs and _passed(n, model, generation_config) is None and _stored(n, model) is not None
    ]


def speculation_requested(model, generation_config, kwargs, batch_size=None) -> bool:
    """Whether `generate(generation_config=..., **kwargs)` decodes speculatively: `assistant_early_exit` (exit-head
    drafts) or `prompt_lookup_num_tokens` (context drafts) set in `kwargs`, `generation_config` or
    `model.generation_config`. Settings of the call win over stored ones, as in transformers: confident-exit settings
    in the call turn stored draft settings off, and stored confident-exit settings are not used with drafts. Stored
    draft settings apply up to `speculative_max_batch_size` rows (when set). Raises a `ValueError` for what one call
    cannot combine."""
    names = [n for n in DRAFT_SOURCES if _requested(n, model, generation_config, kwargs) is not None]
    if not names:
        return False
    stored = stored_draft_settings(model, generation_config, kwargs)
    if set(names) <= set(stored) and is_lean(model):
        logger.warning_once(
            f"The stored draft settings {names} are not used by a lean model (verification needs every layer): it "
            "decodes at its loaded depth."
        )
        return False
    limit = _requested(MAX_BATCH_FIELD, model, generation_config, kwargs)
    if limit is not None and (not _is_int(limit) or limit < 1):
        raise ValueError(f"`{MAX_BATCH_FIELD}` must be an integer >= 1 or None, got {limit!r}.")
    if set(names) <= set(stored) and limit is not None and batch_size is not None and batch_size > limit:
        return False  # stored drafts were measured to pay up to `limit` rows only: full depth here
    mode = " and ".join(f"`{n}`" for n in names)

    def given(name):  # in this call
        return kwargs.get(name) is not None or getattr(generation_config, name, None) is not None

    for name in EXIT_ARGUMENTS:
        if given(name):
            if set(names) <= set(stored):
                return False  # the call asks for confident exits (or full depth): stored drafts give way
            raise ValueError(
                f"{mode} cannot be combined with `{name}`: self-speculative decoding always decides at full "
                "depth, confident exits stop early. Pass one or the other (stored confident-exit defaults are not "
                "used with speculative decoding)."
            )
    if given("assistant_model"):
        raise ValueError(f"{mode} drafts with the model itself; it cannot be combined with `assistant_model`.")
    return True


def our_speculative_arguments(model, generation_config, kwargs, speculative: bool) -> dict:
    """Pops `OUR_FIELDS` (`assistant_vocab_size`, `speculative_verify_width`, `speculative_table_drafts`) from
    `kwargs` and returns them (kwargs over `generation_config` over `model.generation_config`) for a speculative
    decode; without speculation a value given in this call is refused (a stored one belongs to the stored draft
    settings, and so does the same value in a passed copy of `model.generation_config`)."""
    values = {}
    for name in OUR_FIELDS:
        values[name] = _requested(name, model, generation_config, kwargs)
        given = kwargs.pop(name, None) is not None or _passed(name, model, generation_config) is not None
        if not speculative and given:
            raise ValueError(
                f"`{name}` is a setting of speculative decoding (`assistant_early_exit` or "
                "`prompt_lookup_num_tokens`); this generate call does not decode speculatively."
            )
    return values


@dataclass
class SpeculativeSettings:
    """Resolved self-speculative settings.

    exit_layer: E, the 0-based layer whose exit head drafts (None: no exit-head drafts); exit_index: its position in
    `config.exit_layers`; num_tokens: K, the most exit-head drafts per round; lookup_tokens: N, the most context drafts
    per round (0: none); ngram_size: the longest n-gram matched in the context; schedule: "constant" or "heuristic"
    (a row's budget + 2 after a round that accepted every draft, else - 1); threshold: a row stops drafting from the
    exit head when its draft's confidence falls below it (0: never); vocab_size: the exit head drafts from the
    model's `vocab_size` most frequent stored tokens only (0: the full vocabulary); verify_width: a context round
    that verifies drafts feeds at least this many positions per row (0: as many as the drafts need); table: rows
    without a context match draft from the model's stored table (`draft_table.py`); history: the budget of the
    model's history index of earlier generations (0: off); gate: rounds draft only where they are expected to pay."""

    exit_layer: int | None
    exit_index: int | None
    num_tokens: int
    schedule: str = "constant"
    threshold: float = 0.0
    lookup_tokens: int = 0
    ngram_size: int = 2
    vocab_size: int = 0
    verify_width: int = 0
    table: bool = False
    history: int = 0
    gate: bool = True

    @property
    def mode(self) -> str:
        names = ["assistant_early_exit"] if self.exit_layer is not None else []
        return " and ".join(f"`{n}`" for n in names + (["prompt_lookup_num_tokens"] if self.lookup_tokens else []))


def _positive_int(generation_config, name, default=None):
    value = getattr(generation_config, name, None)
    value = default if value is None else value
    if not _is_int(value) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    return value


def _resolve_exit_draft(model, value):
    """(E, its index in `config.exit_layers`) of `assistant_early_exit=value`, or (None, None) for None."""
    if value is None:
        return None, None
    exits = list(model.config.exit_layers or [])
    if not _is_int(value) or value - 1 not in exits:
        raise ValueError(
            f"`assistant_early_exit` is the number of decoder layers that draft and must end at an exit "
            f"of this model: allowed values are {[e + 1 for e in exits]} (the exits after 0-based layers "
            f"{exits}), got {value!r}."
        )
    return value - 1, exits.index(value - 1)


def _resolve_draft_vocab(model, value, exit_layer) -> int:
    """The draft vocabulary size of `assistant_vocab_size=value` (0 for None)."""
    if value is None:
        return 0
    stored = model.config.draft_vocab_size or 0
    if exit_layer is None:
        raise ValueError(f"`{VOCAB_FIELD}` sizes the exit head's draft vocabulary and needs `assistant_early_exit`.")
    if not _is_int(value) or not 1 <= value <= model.config.vocab_size:
        raise ValueError(
            f"`{VOCAB_FIELD}` must be an integer in [1, {model.config.vocab_size}] (the model's vocabulary), "
            f"got {value!r}."
        )
    if value > stored:
        raise ValueError(
            f"`{VOCAB_FIELD}={value}` needs the {value} most frequent tokens stored in the model, which stores "
            f"{stored} (`config.draft_vocab_size`): allowed values are 1..{stored}"
            + (
                " (store them with `model.set_draft_vocab(ids)`, or fit with `--draft-vocab-size`)."
                if not stored
                else "."
            )
        )
    return int(value)


def _resolve_verify_width(value, lookup_tokens) -> int:
    """The verification width of `speculative_verify_width=value` (0 for None)."""
    if value is None:
        return 0
    if not _is_int(value) or value < 1:
        raise ValueError(f"`{WIDTH_FIELD}` must be an integer >= 1 or None, got {value!r}.")
    if not lookup_tokens:
        raise ValueError(f"`{WIDTH_FIELD}` widens context rounds and needs `prompt_lookup_num_tokens`.")
    return int(value)


def _resolve_table(model, value, lookup_tokens) -> bool:
    """Whether `speculative_table_drafts=value` drafts from the stored table (False for None)."""
    if value is None or value is False:
        return False
    if value is not True:
        raise ValueError(f"`{TABLE_FIELD}` must be True, False or None, got {value!r}.")
    if not lookup_tokens:
        raise ValueError(
            f"`{TABLE_FIELD}` drafts for the rows that context drafts leave without a match and needs "
            "`prompt_lookup_num_tokens`."
        )
    if not model.config.draft_table_size:
        raise ValueError(
            f"`{TABLE_FIELD}=True` needs a draft table stored in the model (`config.draft_table_size`), which has "
            "none: store one with `model.set_draft_table(blocks)`, or fit with `--draft-table`."
        )
    return True


def _resolve_history(value, lookup_tokens) -> int:
    """The history index's budget of `speculative_history_tokens=value` (None: the default wherever context drafts
    are on)."""
    if value is None:
        return DEFAULT_HISTORY_TOKENS if lookup_tokens else 0
    if not _is_int(value) or value < 0:
        raise ValueError(f"`{HISTORY_FIELD}` must be an integer >= 0 (0: no history drafts) or None, got {value!r}.")
    if value and not lookup_tokens:
        raise ValueError(f"`{HISTORY_FIELD}` sizes the history of copied drafts and needs `prompt_lookup_num_tokens`.")
    return int(value)


def _resolve_gate(value) -> bool:
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ValueError(f"`{GATE_FIELD}` must be True, False or None, got {value!r}.")
    return value


def _refuse_unsupported(model, generation_config, mode):
    config = model.config
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            f"{mode} does not support beam search (`num_beams={generation_config.num_beams}`); use greedy or "
            "sampling (`num_beams=1`)."
        )
    for name in ("output_hidden_states", "output_attentions"):
        if getattr(generation_config, name, False):
            raise ValueError(
                f"`{name}=True` is not available with {mode}: tokens are computed in drafts and verification "
                "passes, not one forward per token. Pass `output_hidden_states=False`, `output_attentions=False`."
            )
    sliding = any(model.family.layer_type(config, j) == "sliding_attention" for j in range(config.num_hidden_layers))
    if sliding and generation_config.max_length > config.sliding_window:
        raise ValueError(
            f"{mode} with sliding-window attention needs the whole generation inside the "
            f"window: `max_length`={generation_config.max_length} > `sliding_window`="
            f"{config.sliding_window} (rows of a batch keep gaps in the cache, and a window counted in "
            "cache slots would see other tokens than plain generate)."
        )


def resolve_speculative_settings(
    model, generation_config, vocab_size=None, verify_width=None, table=None, history=None, gate=None
) -> SpeculativeSettings:
    """Settings from a prepared `GenerationConfig` (transformers' defaults filled in), `assistant_vocab_size`,
    `speculative_verify_width`, `speculative_table_drafts`, `speculative_history_tokens` and `speculative_gate`.
    Raises a `ValueError` naming the argument, the bad
    value and the allowed values, or what the mode cannot do."""
    exit_layer, exit_index = _resolve_exit_draft(model, generation_config.assistant_early_exit)
    lookup = generation_config.prompt_lookup_num_tokens
    lookup = 0 if lookup is None else _positive_int(generation_config, "prompt_lookup_num_tokens")
    ngram = _positive_int(generation_config, "max_matching_ngram_size", default=2)  # transformers' default
    num_tokens = _positive_int(generation_config, "num_assistant_tokens")
    schedule = generation_config.num_assistant_tokens_schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"`num_assistant_tokens_schedule` must be one of {list(SCHEDULES)}, got {schedule!r}.")
    threshold = generation_config.assistant_confidence_threshold
    threshold = 0.0 if threshold is None else threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise ValueError(f"`assistant_confidence_threshold` must be a float in [0, 1], got {threshold!r}.")
    settings = SpeculativeSettings(
        exit_layer,
        exit_index,
        num_tokens,
        "heuristic" if schedule.startswith("heuristic") else schedule,
        float(threshold),
        lookup,
        ngram,
        _resolve_draft_vocab(model, vocab_size, exit_layer),
        _resolve_verify_width(verify_width, lookup),
        _resolve_table(model, table, lookup),
        _resolve_history(history, lookup),
        _resolve_gate(gate),
    )  # a heuristic K never outlives the call here
    if not settings.mode:
        raise ValueError("Speculative decoding needs `assistant_early_exit` or `prompt_lookup_num_tokens`.")
    _refuse_unsupported(model, generation_config, settings.mode)
    return settings


# ours, for generate's padded / exit-head rounds and its batch size: a packed step's budget is `plan_packed`'s
NOT_PACKED = (WIDTH_FIELD, VOCAB_FIELD, MAX_BATCH_FIELD)


@dataclass(frozen=True)
class PagedDraftSettings:
    """Drafts in continuous batching (`paged_speculative.py`). max_drafts: K, the most drafts per request and step;
    ngram_size: the longest n-gram matched in a request's own text; table: draft from the model's stored table where
    nothing else matches; history: the budget (tokens) of the history index of earlier generations (0: off); gate:
    choose the drafts with `plan_packed` (False: up to K)."""

    max_drafts: int
    ngram_size: int = 2  # transformers' prompt-lookup default
    table: bool = False
    history: int = DEFAULT_HISTORY_TOKENS
    gate: bool = True


DRAFT_FIELDS = (
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    TABLE_FIELD,
    HISTORY_FIELD,
    GATE_FIELD,
    *NOT_PACKED,
)


def paged_draft_settings(model, generation_config=None) -> PagedDraftSettings | None:
    """The draft settings continuous batching uses (each from `generation_config`, else `model.generation_config`),
    None when `prompt_lookup_num_tokens` is unset; validated by the same rules as `generate`'s."""

    def get(name):
        return _requested(name, model, generation_config, {})

    lookup = get("prompt_lookup_num_tokens")
    if lookup is None:
        return None
    for name, value in (
        ("prompt_lookup_num_tokens", lookup),
        ("max_matching_ngram_size", get("max_matching_ngram_size")),
    ):
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"`{name}` must be an integer >= 1 or None, got {value!r}.")
    unused = [name for name in NOT_PACKED if get(name) is not None]
    if unused:
        logger.warning_once(
            f"Continuous batching packs copied drafts without padding and plans them per step: {unused} do not "
            "apply there and are not used."
        )
    return PagedDraftSettings(
        lookup,
        get("max_matching_ngram_size") or 2,
        _resolve_table(model, get(TABLE_FIELD), lookup),
        _resolve_history(get(HISTORY_FIELD), lookup),
        _resolve_gate(get(GATE_FIELD)),
    )


# ---------------------------------------------------------------------------------------------------------------------
# the request
# ---------------------------------------------------------------------------------------------------------------------
MODES = ("full_depth", "exits", "speculative")


@dataclass(frozen=True)
class GenerationRequest:
    """What one `generate` call runs. mode: one of `MODES`; exit_settings: the resolved confident-exit settings (mode
    "exits"); speculative: our speculative arguments for `speculative_generate` (`OUR_FIELDS`, mode "speculative");
    kwargs: the arguments transformers' `generate` is handed (our names removed); stored_off: the stored draft
    settings this call turned off (confident exits or full depth asked), which transformers must not see while it
    runs (`EarlyExitMixin.generate` hides them for the call: a None in a passed config would be refilled from the
    stored one, and None kwargs next to a passed config are a pattern transformers deprecates)."""

    mode: str
    kwargs: dict = field(default_factory=dict)
    exit_settings: ExitSettings | None = None
    speculative: dict = field(default_factory=dict)
    stored_off: tuple = ()


def exit_settings_for(model, generation_config=None, kwargs=None) -> ExitSettings | None:
    """The exit settings a decode uses (kwargs over `generation_config` over `model.generation_config`), validated;
    None for full depth. Pops the exit names from `kwargs`. A lean model without exit settings exits every token at
    its deepest loaded layer."""
    values = merged_exit_values(model, generation_config, kwargs)
    settings = resolve_exit_settings(model.config, values)
    if settings is None and is_lean(model):
        if values["early_exit"] is False:
            raise ValueError(
                f"`early_exit=False` asks for full depth, but this model holds decoder layers "
                f"0..{model.exit_max_layer} only; load the rest with `model.set_exit_max_layer("
                f"{model.config.num_hidden_layers - 1})`, or leave exit settings out to exit every "
                "token at `exit_max_layer`."
            )
        settings = ExitSettings(criterion=EXIT_CRITERIA["max_prob"], thresholds={})
    return settings


def refuse_with_exits(model, generation_config, kwargs) -> None:
    """What confident-exit decoding cannot honour raises here, never silently."""

    def given(name):
        value = kwargs.get(name)
        if value is None and generation_config is not None:
            value = getattr(generation_config, name, None)
        return value if value is not None else getattr(model.generation_config, name, None)

    if (given("num_beams") or 1) > 1:
        raise ValueError(
            f"Early-exit decoding does not support beam search (`num_beams={given('num_beams')}`); "
            "pass `early_exit=False` or `num_beams=1`."
        )
    for name in ("assistant_model", "custom_generate"):  # drafts with exits: `speculation_requested` refuses
        if given(name) is not None:
            raise ValueError(f"Early-exit decoding cannot be combined with `{name}`; pass `early_exit=False`.")
    for name in ("output_hidden_states", "output_attentions"):
        if given(name):
            raise ValueError(
                f"`{name}=True` is not available with early exit: rows stop at different layers, so "
                "there is no per-layer tensor for the whole batch. Pass `early_exit=False` for them, "
                "or read `exit_layers` (return_dict_in_generate=True) for where each token exited."
            )
    if given("compile_config") is not None:
        raise ValueError(
            "`compile_config` is not available with early exit: the layer loop stops at "
            "data-dependent depths, which transformers' compiled forward cannot follow. Pass "
            "`early_exit=False` to compile the full-depth forward."
        )


def resolve_request(model, generation_config=None, kwargs=None, batch_size=None) -> GenerationRequest:
    """The one resolution of a `generate(inputs, generation_config, **kwargs)` call on `model` (`batch_size`: its
    rows, when known): speculative rounds when draft settings ask for them (`speculation_requested`), else confident
    exits when exit settings are on, else full depth. `kwargs` is not changed."""
    kwargs = dict(kwargs or {})
    speculative = speculation_requested(model, generation_config, kwargs, batch_size)
    kwargs.pop(MAX_BATCH_FIELD, None)  # ours, read just now: not a generate() argument of transformers
    ours = our_speculative_arguments(model, generation_config, kwargs, speculative)
    if speculative:
        if is_lean(model):
            raise ValueError(
                f"`assistant_early_exit` verifies with every layer above the draft exit, but this model "
                f"holds decoder layers 0..{model.exit_max_layer} only; load them with "
                f"`model.set_exit_max_layer({model.config.num_hidden_layers - 1})` first."
            )
        return GenerationRequest("speculative", kwargs, speculative=ours)
    # stored draft settings the call turned off (confident exits or full depth asked): not transformers' either
    off = tuple(stored_draft_settings(model, generation_config, kwargs))
    for name in off:
        kwargs.pop(name, None)  # an explicit None of the call: its stored value is hidden instead
    settings = exit_settings_for(model, generation_config, kwargs)
    if settings is None:
        return GenerationRequest("full_depth", kwargs, stored_off=off)
    refuse_with_exits(model, generation_config, kwargs)
    return GenerationRequest("exits", kwargs, exit_settings=settings, stored_off=off)


__all__ = [
    "DRAFT_SOURCES",
    "EXIT_ARGUMENTS",
    "EXIT_FIELDS",
    "EXIT_KV_MODES",
    "EXIT_POLICIES",
    "GATE_FIELD",
    "HISTORY_FIELD",
    "LEAN_FIELDS",
    "MAX_BATCH_FIELD",
    "MODES",
    "NOT_PACKED",
    "OUR_FIELDS",
    "SCHEDULES",
    "TABLE_FIELD",
    "VOCAB_FIELD",
    "WIDTH_FIELD",
    "ExitSettings",
    "GenerationRequest",
    "DRAFT_FIELDS",
    "PagedDraftSettings",
    "SpeculativeSettings",
    "check_exit_argument",
    "check_lean_argument",
    "exit_settings_for",
    "keeps_exit_states",
    "merged_exit_values",
    "our_speculative_arguments",
    "paged_draft_settings",
    "refuse_with_exits",
    "resolve_exit_settings",
    "resolve_guard",
    "resolve_request",
    "resolve_speculative_settings",
    "speculation_requested",
    "stored_draft_settings",
]
