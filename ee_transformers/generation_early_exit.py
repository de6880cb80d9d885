"""Early-exit decoding, top to bottom: settings, criteria, one decoding step, and the `generate` loop.

`model.generate(...)` of an early-exit model resolves the exit settings (generate kwargs over a passed
`GenerationConfig` over `model.generation_config`) and, when exits are on, hands transformers the callable
`early_exit_generate` through its public seam, `generate(custom_generate=...)`. One step of it reads as:

    prefill(model, ids)          every layer runs for every prompt position (the prompt's K/V are complete); each row's
                                 first token comes from the first exit whose criterion holds at the last position
                                 (`first_confident_exit`)
    decode_one_token(model, id)  the layers run from one checked exit to the next; at each, the exit rule (`exit_at`)
                                 decides which running rows stop; stopped rows leave the running batch (row policy) or
                                 the step ends (batch policy); their K/V in the skipped layers are backfilled from the
                                 exit state (or deferred)
    Decided.finish(model)        the step's one LM-head call for every row that was decided without logits

The layer loop itself is `decode_core.run_layers`, the one every mode runs; the exit rule is `exit_at` (one checked
exit) and `first_confident_exit` (over states already computed at the checked exits), which continuous batching, the
pool's profiles and `ee-transformers profile` use too. Around the steps, `early_exit_generate` is the shared
`generate`-loop skeleton (`decode_loop.DecodeLoop`: EOS / pad handling, logits processors, the draw, scores, the
streamer, the output) plus what only this mode keeps: each step's exit layers and a lean model's quality guard
(`_ExitTrace`).

Part of the Hub runtime: imports only torch, transformers and its siblings.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache_early_exit import EarlyExitCache, RowSubsetCache
from .decode_core import run_layers
from .decode_loop import DecodeLoop, require_cache
from .lean_early_exit import (
    LEAN_FIELDS,
    BreachGuard,
    _is_int,
    check_lean_argument,
    deepen,
    keep_exit_states,
    keeps_exit_states,
    loaded_depth,
    resolve_guard,
)


# ---------------------------------------------------------------------------------------------------------------------
# criteria
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Check:
    """What one exit check sees, for the `n` running rows at the last position.

    layer: the decoder layer just run; exit_index: its position in `config.exit_layers`; h_out / h_in: `(n, D)` the
    residual stream leaving / entering it; rows: `(n,)` batch indices; logits: `(n, V)` the exit head's logits (when
    the criterion or patience needs them); head_out: `(n, D)` the exit head's output (when the criterion needs it);
    step: what the criterion's `begin_step` returned for this step.
    """

    model: nn.Module
    layer: int
    exit_index: int
    h_out: torch.Tensor
    h_in: torch.Tensor
    rows: torch.Tensor
    logits: torch.Tensor | None = None
    head_out: torch.Tensor | None = None
    step: object = None


class ExitCriterion:
    """A confidence score for an exit: a row exits when `score(check) >= threshold`.

    Subclass and register (`register_exit_criterion`) to add one; `generate(exit_criterion=...)` also takes an instance.
    """

    name = "custom"  # the cost model prices a check by name: logit criteria, "cosine", "learned"; others as decisions
    needs_logits = False  # the check runs the LM head (a logit criterion)
    needs_head_output = False  # the check needs the exit head's output (norm / adapter), not its logits
    score_range = (0.0, 1.0)  # allowed thresholds
    default_threshold = None  # used when no `exit_threshold` is given

    def validate(self, config) -> None:
        """Raises a `ValueError` when `config`'s model cannot use this criterion."""

    def begin_step(self, batch_size: int, device):
        """Called once per decoding step; whatever it returns is `check.step`."""
        return None

    def score(self, check: Check) -> torch.Tensor:
        """`(n,)` scores, higher = more confident."""
        raise NotImplementedError


def logit_score(logits: torch.Tensor, criterion: str) -> torch.Tensor:
    """Confidence of a logit criterion: `(..., V)` logits -> `(...)` scores in [0, 1], higher = more confident.
    The one definition used by decoding and by calibration."""
    probs = logits.float().softmax(-1)
    if criterion == "max_prob":
        return probs.max(-1).values
    if criterion == "margin":
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    if criterion == "entropy":  # 1 - H / log(V)
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
        return 1.0 - entropy / math.log(probs.shape[-1])
    raise ValueError(f"`criterion` {criterion!r} is not a logit criterion: allowed values are {list(LOGIT_CRITERIA)}.")


class LogitCriterion(ExitCriterion):
    needs_logits = True

    def __init__(self, name):
        self.name = name

    def score(self, check):
        return logit_score(check.logits, self.name)


class CosineCriterion(ExitCriterion):
    """Cosine of the states leaving and entering the exit layer: no LM head needed to decide."""

    name = "cosine"
    score_range = (-1.0, 1.0)

    def score(self, check):
        return nn.functional.cosine_similarity(check.h_out.float(), check.h_in.float(), dim=-1)


class LearnedCriterion(ExitCriterion):
    """CALM's meta classifier on the exit head's output (a trained confidence head per exit)."""

    name = "learned"
    needs_head_output = True

    def validate(self, config):
        if not getattr(config, "exit_confidence_heads", False):
            raise ValueError(
                "`exit_criterion='learned'` needs trained confidence heads, and this model has none; fit "
                "them with the training script's confidence stage, or use one of "
                f"{[c for c in EXIT_CRITERIA if c != 'learned']}."
            )

    def score(self, check):
        return check.model.confidence_heads[check.exit_index](check.head_out)


LOGIT_CRITERIA = ("max_prob", "margin", "entropy")
EXIT_CRITERIA: dict[str, ExitCriterion] = {
    **{name: LogitCriterion(name) for name in LOGIT_CRITERIA},
    "cosine": CosineCriterion(),
    "learned": LearnedCriterion(),
}


def register_exit_criterion(name: str, criterion: ExitCriterion) -> None:
    """Makes `exit_criterion=name` available to `generate` (in this process)."""
    if not isinstance(criterion, ExitCriterion):
        raise ValueError(f"`criterion` must be an ExitCriterion instance, got {type(criterion).__name__}.")
    EXIT_CRITERIA[name] = criterion


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


# ---------------------------------------------------------------------------------------------------------------------
# one decoding step: its state, the exit check, the decided rows
# ---------------------------------------------------------------------------------------------------------------------
class StepState:
    """What one decoding step remembers across its exit checks, for its `batch_size` rows on `device`: stable-token
    runs, finished rows, the criterion's per-step state."""

    def __init__(self, settings, batch_size, device, unfinished):
        self.batch_size, self.device = batch_size, device
        self.prev_argmax = self.run = None
        if settings.patience:
            self.prev_argmax = torch.full((batch_size,), -1, dtype=torch.long, device=device)
            self.run = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.finished = None if unfinished is None else unfinished.to(device) == 0
        self.criterion_state = settings.criterion.begin_step(batch_size, device)


class Decided:
    """The rows decided in one step: each group's layer and logits, or its LM-head input when no logits were needed to
    decide; those groups share one LM-head call when the step ends (one weight read instead of one per exit)."""

    def __init__(self, batch_size):
        self.batch_size, self.groups = batch_size, []

    def add(self, rows, layer, logits=None, head_input=None, greedy=False):
        self.groups.append((rows, layer, logits, head_input, greedy))

    def finish(self, model):
        """-> logits `(batch, vocab)`, exit layers `(batch,)` and greedy exits `(batch,)` (decided at the deepest
        loaded layer of a lean model because nothing deeper is loaded)."""
        waiting = [g for g in self.groups if g[2] is None]
        if waiting:
            with record_function("ee::final_head"):
                head_input = torch.cat([g[3] for g in waiting])
                computed = iter(model.family.head_logits(model, head_input).split([g[0].numel() for g in waiting]))
            self.groups = [
                (r, layer, next(computed) if x is None else x, None, greedy) for r, layer, x, _, greedy in self.groups
            ]
        first = self.groups[0][2]
        logits = first.new_zeros(self.batch_size, first.shape[-1])
        exit_layers = torch.full((self.batch_size,), -1, dtype=torch.long, device=first.device)
        greedy_exits = torch.zeros(self.batch_size, dtype=torch.bool, device=first.device)
        for rows, layer, group_logits, _, greedy in self.groups:
            logits.index_copy_(0, rows, group_logits)
            exit_layers.index_fill_(0, rows, layer)
            greedy_exits.index_fill_(0, rows, greedy)
        return logits, exit_layers, greedy_exits


def check_exit(model, settings, layer, h_out, h_in, rows, state):
    """One exit check for the running rows; h_out / h_in `(n, D)`, rows `(n,)`. Returns (a boolean `(n,)` exit
    decision, logits `(n, V)` or None, the exit head's output `(n, D)` or None): whatever the check computed, so
    `decide` does not compute it again."""
    index = model.config.exit_layers.index(layer)
    criterion = settings.criterion
    with record_function("ee::head_check"):
        logits = model.exit_logits_from_hidden(index, h_out) if settings.needs_logits else None
        head_out = model.exit_heads[index](h_out) if criterion.needs_head_output else None
        check = Check(model, layer, index, h_out, h_in, rows, logits, head_out, state.criterion_state)
        confident = criterion.score(check) >= settings.thresholds[layer]
        if settings.patience:  # stable-token rule: this head and the k-1 checked before it agree on the argmax
            argmax = logits.argmax(-1)
            same = argmax == state.prev_argmax.index_select(0, rows)
            run = torch.where(same, state.run.index_select(0, rows) + 1, torch.ones_like(argmax))
            state.prev_argmax.index_copy_(0, rows, argmax)
            state.run.index_copy_(0, rows, run)
            confident = confident | (run >= settings.patience)
        if state.finished is not None:  # a finished row never holds anything back
            confident = confident | state.finished.index_select(0, rows)
        if settings.policy == "batch":
            confident = confident.all().expand_as(confident)
    return confident, logits, head_out


def decide(model, decided, layer, h_last, idx, rows, logits=None, head_out=None, greedy=False):
    """Records rows `rows[idx]` as decided at `layer`: with the check's logits when it computed them, else with the
    exit head's (or final norm's) output, for the one LM-head call at the end of the step. `greedy`: decided there
    only because no deeper layer is loaded."""
    with record_function("ee::exit_heads"):
        if logits is not None:
            decided.add(rows.index_select(0, idx), layer, logits=logits.index_select(0, idx), greedy=greedy)
        elif head_out is not None:
            decided.add(rows.index_select(0, idx), layer, head_input=head_out.index_select(0, idx), greedy=greedy)
        else:
            decided.add(
                rows.index_select(0, idx),
                layer,
                head_input=model.head_input(layer, h_last.index_select(0, idx)),
                greedy=greedy,
            )


# ---------------------------------------------------------------------------------------------------------------------
# the exit rule: the first checked exit whose criterion holds, else the deepest loaded layer
# ---------------------------------------------------------------------------------------------------------------------
def exit_at(model, settings, layer, h_out, h_in, rows, state, depth, decided=None, slots=None):
    """The exit rule at one checked exit, for the running rows `rows` `(n,)` (indices into `state`) with states
    h_out / h_in `(n, D)` leaving / entering `layer`: `check_exit`, then, with `decided`, `decide` for the confident
    rows (recorded under `slots` `(n,)`, default `rows`). `depth`: the loaded layers.

    Returns (exited, kept, left): the confident rows' positions among the n; the others' (None when no row exited, so
    all go on; no second host sync is spent); and, when `layer` is the deepest loaded one, what the check computed for
    the rows that go on (for `decide_deepest`), else (None, None)."""
    confident, logits, head_out = check_exit(model, settings, layer, h_out, h_in, rows, state)
    exited = confident.nonzero().squeeze(1)  # the one host sync of this check
    deepest = layer == depth - 1
    if exited.numel() == 0:
        return exited, None, (logits, head_out) if deepest else (None, None)
    if decided is not None:
        decide(model, decided, layer, h_out, exited, rows if slots is None else slots, logits, head_out)
    if exited.numel() == confident.numel():  # every running row exits
        return exited, exited[:0], (None, None)
    kept = (~confident).nonzero().squeeze(1)
    if not deepest:
        return exited, kept, (None, None)
    return exited, kept, tuple(None if t is None else t.index_select(0, kept) for t in (logits, head_out))


def decide_deepest(model, decided, depth, h_last, rows, left=(None, None)):
    """Records rows `rows` `(n,)`, which no checked exit took, as decided at the deepest loaded layer `depth - 1`: from
    `left`, what its check computed for them, else from their states leaving it, h_last `(n, D)`. Greedy when a lean
    model loads no deeper layer."""
    idx = torch.arange(rows.numel(), device=h_last.device)
    decide(model, decided, depth - 1, h_last, idx, rows, *left, greedy=depth < model.config.num_hidden_layers)


def first_confident_exit(model, settings, at_exit, state, depth, decided=None, last=None, slots=None):
    """The exit rule over states already computed at the checked exits, for the rows of `state`: each row exits at the
    first checked exit below `depth` whose criterion holds (`exit_at`: patience and the batch policy included), else at
    the deepest loaded layer `depth - 1`. at_exit: checked exit -> (h_out, h_in), `(n, D)` each.

    Returns the exit layers `(n,)`. With `decided`, each row is recorded there too (under `slots[i]`, default i): at
    its exit with what the check computed, or by `decide_deepest` from `last` `(n, D)`, the states leaving the deepest
    loaded layer."""
    rows = torch.arange(state.batch_size, device=state.device)  # undecided rows
    exits = torch.full_like(rows, depth - 1)
    left = (None, None)
    for j in settings.check_layers:
        if j >= depth:  # lean: not loaded
            break
        h_out, h_in = (t.index_select(0, rows) for t in at_exit[j])
        row_slots = None if slots is None else slots.index_select(0, rows)
        exited, kept, left = exit_at(model, settings, j, h_out, h_in, rows, state, depth, decided, row_slots)
        if kept is None:
            continue
        exits.index_fill_(0, rows.index_select(0, exited), j)
        rows = rows.index_select(0, kept)
        if rows.numel() == 0:
            return exits
    if decided is not None:
        row_slots = rows if slots is None else slots.index_select(0, rows)
        decide_deepest(model, decided, depth, last.index_select(0, rows), row_slots, left)
    return exits


# ---------------------------------------------------------------------------------------------------------------------
# the prefill and the decoding step
# ---------------------------------------------------------------------------------------------------------------------
def backfill_kv(model, layer_idx, states, inputs):
    """K/V of layer `layer_idx` for exit states `(n, q, D)` that skipped it: its input norm, K/V projections, k-norm,
    rotary, through the module calls (so LoRA / quantized projections work)."""
    with record_function("ee::backfill"):
        return model.family.key_value(model, layer_idx, states, inputs)


def prefill(model, h, attention_mask, position_ids, cache, settings, state):
    """Every layer runs for every position of h `(B, q, D)`, so the prompt's K/V are complete; the token of each row
    comes from the first checked exit whose criterion holds at the last position (`first_confident_exit`)."""
    depth = loaded_depth(model)
    inputs = model.family.layer_inputs(model, h, attention_mask, cache, position_ids)
    h, _, states = run_layers(model, h, inputs, cache, 0, depth, keep=settings.thresholds, label="ee::layer")
    keep_exit_states(model, settings, cache, h, inputs.position_ids)  # lean, guard on: for a later deepening
    at_exit = {j: (h_out[:, -1], h_in[:, -1]) for j, (h_out, h_in) in states.items()}  # (B, D), the last position
    decided = Decided(h.shape[0])
    first_confident_exit(model, settings, at_exit, state, depth, decided, last=h[:, -1])
    return decided.finish(model)


def decode_one_token(model, h, attention_mask, mask_2d, position_ids, cache, settings, state):
    """One decoding step, h `(B, 1, D)`, that stops each row at its exit: the layers run from one checked exit to the
    next (`run_layers`), and at each the exit rule (`exit_at`) decides which running rows stop.

    Row policy: exited rows leave the running batch; a deeper layer runs only for the rows still going, and the cache
    still gets one full-batch update per layer (exited rows' K/V backfilled from their exit states). Batch policy: the
    same, with all rows leaving together. Deferred K/V: skipped layers get no K/V now; the exit states wait in the
    cache and join the next token that runs those layers.
    """
    batch, depth = h.shape[0], loaded_depth(model)  # lean models run only their loaded layers
    deferred = settings.kv == "deferred"
    step_inputs = model.family.layer_inputs(model, h, attention_mask, cache, position_ids)  # the full batch's
    inputs = step_inputs  # the running rows' (and, deferred, the pending tokens')
    rows = torch.arange(batch, device=h.device)  # running rows (batch indices)
    exited_rows, exited_states = [], []  # row policy: rows that stopped so far, their exit states (n, 1, D)
    decided = Decided(batch)
    layer_cache = cache  # what the layers see: the cache, or a view of it for the running rows
    left, start = (None, None), 0  # left: what the check at the deepest loaded exit computed for the rows it left
    options = dict(join=deferred, mask_2d=mask_2d, label="ee::layer")  # deferred: pending tokens join at their layer
    for j in [c for c in settings.check_layers if c < depth]:
        h, inputs, states = run_layers(model, h, inputs, layer_cache, start, j + 1, keep=(j,), **options)
        start, h_in = j + 1, states[j][1]
        exited, kept, left = exit_at(model, settings, j, h[:, -1], h_in[:, -1], rows, state, depth, decided)
        if kept is None:
            continue
        if kept.numel() == 0:  # every running row has exited at j
            whole, positions = _whole_batch(h, inputs, step_inputs, rows, exited_rows, exited_states)
            if deferred:
                cache.add_pending(j + 1, whole, positions)
                return decided.finish(model)
            for skipped in range(j + 1, depth):
                cache.update(*backfill_kv(model, skipped, whole, step_inputs), skipped)
            keep_exit_states(model, settings, cache, whole, positions)
            return decided.finish(model)
        # some rows exit: the rest go on as a smaller batch, through a view of the cache that backfills the others
        exited_rows.append(rows.index_select(0, exited))
        exited_states.append(h.index_select(0, exited))
        rows, h = rows.index_select(0, kept), h.index_select(0, kept)
        done_rows, done_states = torch.cat(exited_rows), torch.cat(exited_states)
        done_inputs, inputs = step_inputs.select(done_rows, batch), step_inputs.select(rows, batch)
        layer_cache = RowSubsetCache(cache, rows, _filler(model, batch, done_rows, done_states, done_inputs))

    h, inputs, _ = run_layers(model, h, inputs, layer_cache, start, depth, **options)
    decide_deepest(model, decided, depth, h[:, -1], rows, left)
    if keeps_exit_states(model, settings):  # lean, guard on: the states leaving the deepest layer, in batch order
        cache.add_pending(depth, *_whole_batch(h, inputs, step_inputs, rows, exited_rows, exited_states))
    return decided.finish(model)


def _whole_batch(h, inputs, step_inputs, rows, exited_rows, exited_states):
    """The states of every row `(B, q, D)`, in batch order, and their position ids: the running rows' h, with the exit
    states of the rows that left the running batch (row policy) when any did."""
    if not exited_rows:
        return h, inputs.position_ids
    return _in_batch_order(exited_rows + [rows], exited_states + [h]), step_inputs.position_ids


def _in_batch_order(row_groups, state_groups):
    """The states of row groups that left the running batch at different layers, `(n_i, q, D)` each, back in batch
    order: `(B, q, D)`."""
    return torch.cat(state_groups).index_select(0, torch.argsort(torch.cat(row_groups)))


def _filler(model, batch, done_rows, done_states, done_inputs):
    """`fill(layer_idx)`: full-batch K/V at `layer_idx` with the exited rows backfilled (zeros elsewhere)."""

    def fill(layer_idx):
        k, v = backfill_kv(model, layer_idx, done_states, done_inputs)
        shape = (batch, *k.shape[1:])
        return (k.new_zeros(shape).index_copy_(0, done_rows, k), v.new_zeros(shape).index_copy_(0, done_rows, v))

    return fill


def early_exit_step(model, input_ids, attention_mask, position_ids, cache, settings, unfinished=None, mask_2d=None):
    """One forward of early-exit decoding: `input_ids` `(B, q)` -> logits `(B, V)` of each row's deciding head, its
    exit layers `(B,)` and greedy exits `(B,)`. The prefill (q > 1 or an empty cache) runs every loaded layer; a
    decoding step stops early."""
    if position_ids is None:  # before embedding: absolute-position families (GPT-2) embed them
        past = cache.get_seq_length()
        position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device) + past).unsqueeze(0)
    h = model.family.embed(model, input_ids, position_ids)  # (B, q, D)
    state = StepState(settings, h.shape[0], h.device, unfinished)
    if h.shape[1] > 1 or cache.get_seq_length() == 0:
        return prefill(model, h, attention_mask, position_ids, cache, settings, state)
    mask_2d = attention_mask if mask_2d is None else mask_2d
    return decode_one_token(model, h, attention_mask, mask_2d, position_ids, cache, settings, state)


# ---------------------------------------------------------------------------------------------------------------------
# the generate loop
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class GenerateEarlyExitOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `exit_layers`: `(batch, new_tokens)` decoder-layer index at which each token
    was decided (`num_hidden_layers - 1` = full depth, -1 where the row had already finished)."""

    exit_layers: torch.LongTensor | None = None
    greedy_exits: torch.BoolTensor | None = None  # (batch, new_tokens): decided at a lean model's deepest loaded layer
    deepenings: list | None = None  # lean, guard on: (decoding steps before it, old exit_max_layer, new) per deepening


def exit_layers_after_eos(new_tokens: torch.Tensor, eos_token_id, full_depth: int) -> torch.LongTensor:
    """Exit layers of a full-depth generation: `full_depth` for every token a row decided, -1 after its EOS."""
    layers = torch.full_like(new_tokens, full_depth)
    if eos_token_id is None:
        return layers
    eos = torch.as_tensor(eos_token_id, device=new_tokens.device).flatten()
    is_eos = torch.isin(new_tokens, eos).long()
    finished_before = (is_eos.cumsum(-1) - is_eos) > 0  # an EOS strictly before this position
    return layers.masked_fill(finished_before, -1)


def _step_inputs(model, input_ids, model_kwargs, first):
    """The next forward's ids, mask and positions, prepared by transformers' own `prepare_inputs_for_generation`:
    the prompt first (only its part beyond what a passed-in cache already holds), then one token per step."""
    if first:
        past = model_kwargs["cache"].get_seq_length()
        length = input_ids.shape[1] - past if past else None
        inputs = model.prepare_inputs_for_generation(
            input_ids, next_sequence_length=length, is_first_iteration=True, **model_kwargs
        )
    else:
        inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
        if inputs.get("cache") is None:  # the family restarts from the whole sequence (Phi-3 past its original
            model_kwargs["cache"].reset()  # max positions, where its rotary changes): a full-depth prefill again
    return inputs["input_ids"], inputs.get("attention_mask"), inputs.get("position_ids")


class _ExitTrace:
    """Where each step's tokens were decided: per step, the rows' exit layers `(B,)` and greedy exits `(B,)` (-1 /
    False where a row had finished), and, for a lean model with its quality guard on, the deepenings it made."""

    def __init__(self, model, settings):
        self.exit_layers, self.greedy, self.deepenings = [], [], []
        keeps = keeps_exit_states(model, settings)
        self.guard = BreachGuard(settings.breach_limit, settings.breach_window) if keeps else None

    def add(self, loop, exit_layers, greedy, unfinished, device):
        exit_layers, greedy = exit_layers.to(device), greedy.to(device)
        if loop.pad_mode:
            exit_layers = exit_layers.masked_fill(unfinished == 0, -1)
            greedy = greedy & unfinished.bool()
        self.exit_layers.append(exit_layers)
        self.greedy.append(greedy)
        return greedy

    def guard_step(self, model, cache, settings, greedy, unfinished, attention_mask):
        """The lean quality guard on this step's greedy exits `(B,)` of the unfinished rows: past its limit, deeper
        layers load."""
        if self.guard is None or not self.guard.update(greedy[unfinished.bool()]):
            return
        old = loaded_depth(model) - 1
        self.deepenings.append((len(self.exit_layers), old, deepen(model, cache, attention_mask)))
        self.guard.reset()  # the new depth is judged on its own tokens
        self.guard = self.guard if keeps_exit_states(model, settings) else None  # at full depth: nothing left to load

    def fields(self) -> dict:
        return dict(
            exit_layers=torch.stack(self.exit_layers, dim=1),
            greedy_exits=torch.stack(self.greedy, dim=1),
            deepenings=self.deepenings,
        )


def early_exit_generate(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    exit_settings=None,
    exit_streamer=None,
    exit_switch=None,
    **model_kwargs,
):
    """The decoding loop `generate` runs with early exit (passed as `custom_generate`): transformers' sampling loop
    (`decode_loop.DecodeLoop`), except that each step's logits come from the head each row exited at
    (`early_exit_step`).

    exit_switch: a model pool's (`pool_early_exit.py`): called before every step with `(input_ids, attention_mask, exit
    layers so far, unfinished)`; when it returns `(model, cache, settings)` the loop goes on with that model."""
    require_cache(model_kwargs, "Early-exit decoding")
    cache = model_kwargs["cache"] = EarlyExitCache.from_cache(model_kwargs["cache"])
    trace = _ExitTrace(model, exit_settings)
    loop = DecodeLoop(input_ids, logits_processor, stopping_criteria, generation_config, exit_streamer)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    first = True
    while model._has_unfinished_sequences(not bool(unfinished.max()), synced_gpus, device=input_ids.device):
        if exit_switch is not None:
            switch = exit_switch(input_ids, model_kwargs.get("attention_mask"), trace.exit_layers, unfinished)
            if switch is not None:  # the new model's cache may lack more than the last token: its step prefills them
                model, cache, exit_settings = switch
                model_kwargs["cache"], first = cache, True
        ids, mask, position_ids = _step_inputs(model, input_ids, model_kwargs, first)
        logits, exit_layers, greedy = early_exit_step(
            model, ids, mask, position_ids, cache, exit_settings, unfinished, mask_2d=model_kwargs.get("attention_mask")
        )
        first = False
        model_kwargs = model._update_model_kwargs_for_generation({"cache": cache}, model_kwargs)
        next_tokens = loop.pad_finished(loop.next_tokens(input_ids, logits), unfinished)  # (B,)
        greedy = trace.add(loop, exit_layers, greedy, unfinished, input_ids.device)
        trace.guard_step(model, cache, exit_settings, greedy, unfinished, model_kwargs.get("attention_mask"))
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        loop.stream(next_tokens)
        unfinished = loop.still_unfinished(input_ids, unfinished)
    return loop.finish(input_ids, GenerateEarlyExitOutput, cache=cache, **trace.fields())


# ---------------------------------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class ExitStats:
    """Summary of where generated tokens exited.

    mean_exit_layer: mean 0-based decoder-layer index of the deciding layer; histogram: {layer index: token count};
    compute_saved: share of decoder-layer forward passes skipped, relative to running every token at full depth
    (backfill and head checks are not counted here; the benchmark measures them); greedy_exits: tokens a lean model
    decided at its deepest loaded layer because nothing deeper was loaded (`greedy_rate` of `num_tokens`);
    deepenings: the quality guard's deepening events, (decoding steps before it, old exit_max_layer, new).
    Self-speculative decoding (`assistant_early_exit`) decides every token at full depth; draft_tokens /
    accepted_tokens / verify_rounds then sum its drafts, the drafts the full model kept, and the rows' verification
    rounds (None otherwise).
    """

    num_tokens: int
    num_layers: int
    mean_exit_layer: float
    histogram: dict
    compute_saved: float
    greedy_exits: int = 0
    deepenings: tuple = ()
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    verify_rounds: int | None = None

    @property
    def greedy_rate(self) -> float:
        return self.greedy_exits / self.num_tokens if self.num_tokens else float("nan")

    @property
    def acceptance_rate(self) -> float | None:
        """Share of the drafts the full model accepted."""
        return None if self.draft_tokens is None else self.accepted_tokens / max(self.draft_tokens, 1)

    @property
    def mean_accepted_length(self) -> float | None:
        """Accepted drafts per verification round (a round gives one more token: the full model's own)."""
        return None if self.verify_rounds is None else self.accepted_tokens / max(self.verify_rounds, 1)

    @classmethod
    def from_exit_layers(
        cls, exit_layers: torch.Tensor, num_layers: int, greedy_exits: torch.Tensor | None = None, deepenings=()
    ) -> "ExitStats":
        decided = exit_layers[exit_layers >= 0]
        greedy = 0 if greedy_exits is None else int(greedy_exits[exit_layers >= 0].sum())
        if decided.numel() == 0:
            return cls(0, num_layers, float("nan"), {}, 0.0, greedy, tuple(deepenings))
        values, counts = decided.unique(return_counts=True)
        layers_run = (decided + 1).double()
        return cls(
            num_tokens=int(decided.numel()),
            num_layers=num_layers,
            mean_exit_layer=float(decided.double().mean()),
            histogram={int(v): int(c) for v, c in zip(values.tolist(), counts.tolist())},
            compute_saved=float(1.0 - layers_run.mean() / num_layers),
            greedy_exits=greedy,
            deepenings=tuple(deepenings),
        )

    @classmethod
    def from_generate(cls, output, model, last: int | None = None) -> "ExitStats":
        """From a `generate(..., return_dict_in_generate=True)` output of an early-exit model; `last=k`: the running
        distribution, over the last `k` decoding steps only."""
        if getattr(output, "exit_layers", None) is None:
            raise ValueError("`output` has no `exit_layers`: call generate with `return_dict_in_generate=True`.")
        steps = slice(-last, None) if last else slice(None)
        greedy = getattr(output, "greedy_exits", None)
        stats = cls.from_exit_layers(
            output.exit_layers[:, steps],
            model.config.num_hidden_layers,
            None if greedy is None else greedy[:, steps],
            getattr(output, "deepenings", None) or (),
        )
        if getattr(output, "draft_tokens", None) is not None:
            stats.draft_tokens, stats.accepted_tokens, stats.verify_rounds = (
                int(getattr(output, name).sum()) for name in ("draft_tokens", "accepted_tokens", "verify_rounds")
            )
        return stats

    def __str__(self):
        hist = ", ".join(f"{layer}: {count}" for layer, count in sorted(self.histogram.items()))
        text = (
            f"{self.num_tokens} tokens, mean exit layer {self.mean_exit_layer:.2f} of {self.num_layers - 1}, "
            f"{100 * self.compute_saved:.1f}% of layer compute skipped; histogram {{{hist}}}"
        )
        if self.greedy_exits:
            text += f"; {self.greedy_exits} greedy exits ({100 * self.greedy_rate:.1f}%)"
        if self.deepenings:
            text += "; deepened " + ", ".join(f"{old}->{new} after {n} steps" for n, old, new in self.deepenings)
        if self.draft_tokens is not None:
            text += (
                f"; speculative: {100 * self.acceptance_rate:.1f}% of {self.draft_tokens} drafts accepted, "
                f"{self.mean_accepted_length:.2f} per round"
            )
        return text


__all__ = [
    "EXIT_ARGUMENTS",
    "EXIT_CRITERIA",
    "EXIT_FIELDS",
    "EXIT_KV_MODES",
    "EXIT_POLICIES",
    "LOGIT_CRITERIA",
    "Check",
    "Decided",
    "ExitCriterion",
    "ExitSettings",
    "ExitStats",
    "GenerateEarlyExitOutput",
    "StepState",
    "backfill_kv",
    "check_exit",
    "check_exit_argument",
    "decide",
    "decide_deepest",
    "decode_one_token",
    "early_exit_generate",
    "early_exit_step",
    "exit_at",
    "exit_layers_after_eos",
    "first_confident_exit",
    "logit_score",
    "merged_exit_values",
    "prefill",
    "register_exit_criterion",
    "resolve_exit_settings",
]
