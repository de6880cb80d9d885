"""The decode core, the bottom floor every mode stands on: the layer loop, the exit rule and the K/V fill, each
written once.

- `run_layers` runs decoder layers `start..stop-1` through the family's own layer calls (`families.py`), joins the
  tokens of deferred K/V at their layer, and keeps the states entering and leaving the layers its caller checks;
- the exit rule: the confidence criteria (`ExitCriterion`, `EXIT_CRITERIA`), one check at one exit (`exit_at`) and
  the first confident exit over states already computed at the checked exits (`first_confident_exit`), recording
  the decided rows for the step's one LM-head call (`Decided`);
- `backfill_kv`: the K/V of a layer a token skipped, from its exit state.

Its callers are the modes, siblings that import the core and the resolver (`request.py`) and no other mode:
confident exits (`generation_early_exit.py`), lean depth (`lean_early_exit.py`), speculative rounds
(`speculative_early_exit.py`), the paged step (`paged_early_exit.py`) and the pool (`pool_early_exit.py`). What the
`generate` loops do around their steps is shared too (`decode_loop.py`).

Part of the Hub runtime: imports only torch, transformers and its siblings.
"""

import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.profiler import record_function

from .families import LayerInputs


class LayerRun(NamedTuple):
    """What `run_layers` returns. h: `(B, q, D)`, leaving the last layer run; inputs: the layer inputs it ended with
    (with the joined deferred tokens' when any joined); states: {kept layer: (h_out, h_in)}, the `(B, q, D)` states
    leaving and entering it."""

    h: torch.Tensor
    inputs: LayerInputs
    states: dict


def run_layers(model, h, inputs, cache, start, stop, keep=(), join=False, mask_2d=None, label=None) -> LayerRun:
    """Runs decoder layers `start..stop-1` of `model` on the residual stream h `(B, q, D)`, writing their K/V to `cache`.

    keep: the layers whose entering and leaving states are returned (`LayerRun.states`). join (deferred K/V): before
    layer j, the exit states waiting in `cache` for it (`pop_pending`) join h ahead of its tokens (they are earlier
    positions), with layer inputs built again for them from the 2D attention mask `mask_2d`. label: a profiler label
    for each layer call (the decoding steps' `"ee::layer"`, which the step profile counts); None: no label.
    """
    fam, states = model.family, {}
    for j in range(start, stop):
        if join and (entry := cache.pop_pending(j)) is not None:
            h = torch.cat([entry.states, h], dim=1)  # (B, pending + q, D)
            position_ids = torch.cat([entry.position_ids, inputs.position_ids], dim=1)
            inputs = fam.layer_inputs(model, h, mask_2d, cache, position_ids, layer_idx=j)
        h_in = h
        with record_function(label) if label else nullcontext():
            h = fam.run_layer(model, j, h, inputs, cache)
        if j in keep:
            states[j] = (h, h_in)
    return LayerRun(h, inputs, states)


# ---------------------------------------------------------------------------------------------------------------------
# depth
# ---------------------------------------------------------------------------------------------------------------------
def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def loaded_depth(model) -> int:
    """Number of decoder layers the layer loop runs: `exit_max_layer + 1` (all of them for a full model)."""
    max_layer = getattr(model, "exit_max_layer", None)
    return model.config.num_hidden_layers if max_layer is None else max_layer + 1


def is_lean(model) -> bool:
    return loaded_depth(model) < model.config.num_hidden_layers


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
# the K/V fill
# ---------------------------------------------------------------------------------------------------------------------
def backfill_kv(model, layer_idx, states, inputs):
    """K/V of layer `layer_idx` for exit states `(n, q, D)` that skipped it: its input norm, K/V projections, k-norm,
    rotary, through the module calls (so LoRA / quantized projections work)."""
    with record_function("ee::backfill"):
        return model.family.key_value(model, layer_idx, states, inputs)


def deprecated_aliases(module: str, namespace: dict, renamed: dict):
    """A module `__getattr__` that serves each old name of `renamed` ({old: new}) as `namespace[new]` with a
    `DeprecationWarning` (for one release)."""

    def __getattr__(name):
        if name in renamed:
            warnings.warn(
                f"`{module}.{name}` is deprecated: use `{renamed[name]}` (this alias goes away in the next release).",
                DeprecationWarning,
                stacklevel=2,
            )
            return namespace[renamed[name]]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


__all__ = [
    "EXIT_CRITERIA",
    "LOGIT_CRITERIA",
    "Check",
    "Decided",
    "ExitCriterion",
    "LayerRun",
    "StepState",
    "backfill_kv",
    "check_exit",
    "decide",
    "decide_deepest",
    "exit_at",
    "first_confident_exit",
    "is_lean",
    "loaded_depth",
    "logit_score",
    "register_exit_criterion",
    "run_layers",
]
