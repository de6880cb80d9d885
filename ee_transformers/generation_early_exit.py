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

from collections import deque
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache_early_exit import EarlyExitCache, RowSubsetCache
from .compat import CACHE, cache_of
from .decode_core import (
    EXIT_CRITERIA,
    LOGIT_CRITERIA,
    Check,
    Decided,
    ExitCriterion,
    StepState,
    backfill_kv,
    check_exit,
    decide,
    decide_deepest,
    exit_at,
    first_confident_exit,
    loaded_depth,
    logit_score,
    register_exit_criterion,
    run_layers,
)
from .decode_loop import DecodeLoop, GenerateEarlyExitOutput, exit_layers_after_eos, require_cache
from .request import (
    EXIT_ARGUMENTS,
    EXIT_FIELDS,
    EXIT_KV_MODES,
    EXIT_POLICIES,
    ExitSettings,
    check_exit_argument,
    keeps_exit_states,
    merged_exit_values,
    resolve_exit_settings,
)


# ---------------------------------------------------------------------------------------------------------------------
# a lean model's quality guard (its deepening is the model's: `model.deepen`, lean_early_exit.py)
# ---------------------------------------------------------------------------------------------------------------------
def keep_exit_states(model, settings, cache, states, position_ids) -> None:
    """Keeps `states` `(B, n, D)`, the residual stream leaving the deepest loaded layer at positions `position_ids`
    `(B, n)`, as deferred states of the layers above it, for a later deepening."""
    if keeps_exit_states(model, settings):
        cache.add_pending(loaded_depth(model), states, position_ids)


class BreachGuard:
    """Counts greedy exits over the last `window` decided tokens (all rows of the batch, in decoding order); breached
    when more than `limit * window` of them were greedy."""

    def __init__(self, limit: float, window: int):
        self.limit, self.window = limit, window
        self.recent = deque(maxlen=window)

    def update(self, greedy: torch.Tensor) -> bool:
        """`greedy`: `(n,)` bools, this step's decided tokens. Returns whether the guard is breached."""
        self.recent.extend(greedy.tolist())
        return sum(self.recent) > self.limit * self.window

    def reset(self):
        self.recent.clear()


# ---------------------------------------------------------------------------------------------------------------------
# the prefill and the decoding step
# ---------------------------------------------------------------------------------------------------------------------
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
def _step_inputs(model, input_ids, model_kwargs, first):
    """The next forward's ids, mask and positions, prepared by transformers' own `prepare_inputs_for_generation`:
    the prompt first (only its part beyond what a passed-in cache already holds), then one token per step."""
    if first:
        past = cache_of(model_kwargs).get_seq_length()
        length = input_ids.shape[1] - past if past else None
        inputs = model.prepare_inputs_for_generation(
            input_ids, next_sequence_length=length, is_first_iteration=True, **model_kwargs
        )
    else:
        inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
        if cache_of(inputs) is None:  # the family restarts from the whole sequence (Phi-3 past its original
            cache_of(model_kwargs).reset()  # max positions, where its rotary changes): a full-depth prefill again
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
        self.deepenings.append((len(self.exit_layers), old, model.deepen(cache, attention_mask)))
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
    cache = model_kwargs[CACHE] = EarlyExitCache.from_cache(cache_of(model_kwargs))
    trace = _ExitTrace(model, exit_settings)
    loop = DecodeLoop(input_ids, logits_processor, stopping_criteria, generation_config, exit_streamer)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    first = True
    while model._has_unfinished_sequences(not bool(unfinished.max()), synced_gpus, device=input_ids.device):
        if exit_switch is not None:
            switch = exit_switch(input_ids, model_kwargs.get("attention_mask"), trace.exit_layers, unfinished)
            if switch is not None:  # the new model's cache may lack more than the last token: its step prefills them
                model, cache, exit_settings = switch
                model_kwargs[CACHE], first = cache, True
        ids, mask, position_ids = _step_inputs(model, input_ids, model_kwargs, first)
        logits, exit_layers, greedy = early_exit_step(
            model, ids, mask, position_ids, cache, exit_settings, unfinished, mask_2d=model_kwargs.get("attention_mask")
        )
        first = False
        model_kwargs = model._update_model_kwargs_for_generation(CausalLMOutputWithPast(**{CACHE: cache}), model_kwargs)
        next_tokens = loop.pad_finished(loop.next_tokens(input_ids, logits), unfinished)  # (B,)
        greedy = trace.add(loop, exit_layers, greedy, unfinished, input_ids.device)
        trace.guard_step(model, cache, exit_settings, greedy, unfinished, model_kwargs.get("attention_mask"))
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        loop.stream(next_tokens)
        unfinished = loop.still_unfinished(input_ids, unfinished)
    return loop.finish(input_ids, GenerateEarlyExitOutput, **{CACHE: cache}, **trace.fields())


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
    "BreachGuard",
    "keep_exit_states",
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
