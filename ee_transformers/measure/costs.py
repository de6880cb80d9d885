"""The measured cost model of early-exit decoding: what a layer step, an exit check, a head and a backfill cost.

`measure_costs(model, batch_size)` times each piece with direct calls at decode shape (one new token per row, a
KV cache of `context` tokens behind it), median of many calls. `step_cost(...)` turns the exit layers of one decoding
step into milliseconds under that model, and `ideal_speedup(...)` compares a whole generation against full depth.
Python overhead (sampling, masks, the decoding loop) is deliberately left out: the ideal is what the measured pieces
allow, so realised / ideal says how much the runtime loses around them.

Used by the benchmark only; imports the runtime, never the reverse.
"""

import math
import statistics
import time

import torch
from torch import nn
from transformers import DynamicCache

from ee_transformers.compat import cache_kwargs
from ee_transformers.generation_early_exit import LOGIT_CRITERIA

__all__ = ["measure_costs", "step_cost", "full_step_cost", "ideal_speedup", "interp"]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_round_robin(pieces, device, repeats, warmup=2):
    """Median ms of each piece, timed in turn (one call of each per round), so that a slow spell of a shared machine
    hits every piece alike instead of one. pieces: {name: (fn, after, every)}: `after()` runs untimed after each
    call; a piece with `every=k` is timed on every k-th round only (the expensive prefill)."""
    times = {name: [] for name in pieces}
    for i in range(warmup + repeats):
        for name, (fn, after, every) in pieces.items():
            if i >= warmup and (i - warmup) % every:
                continue
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if i >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
            if after is not None:
                after()
    return {name: statistics.median(values) for name, values in times.items()}


def _cycle(values):
    """A function returning the next of `values` on every call, round and round."""
    state = {"i": -1}

    def next_value():
        state["i"] += 1
        return values[state["i"] % len(values)]

    return next_value


@torch.no_grad()
def _measure_rows(model, rows, prompt_length, context, repeats, seed):
    """Costs in ms at `rows` rows: keys are the cost names used by `step_cost`."""
    config, decoder, device = model.config, model.family.decoder(model), model.device
    num_layers = config.num_hidden_layers
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, config.vocab_size, (rows, prompt_length), generator=generator).to(device)
    ids = torch.randint(3, config.vocab_size, (rows, context), generator=generator).to(device)
    cache = DynamicCache(config=config)
    decoder(input_ids=ids, **cache_kwargs(cache), use_cache=True)  # a real context's K/V behind the timed step

    fam = model.family

    def step_inputs(q):
        new = torch.randint(3, config.vocab_size, (rows, q), generator=generator).to(device)
        position_ids = (torch.arange(q, device=device) + context).unsqueeze(0).expand(rows, -1)
        h = fam.embed(model, new, position_ids)  # (rows, q, D)
        return h, fam.layer_inputs(model, h, None, cache, position_ids)

    def layer_piece(q):
        """One decoder layer step with q new tokens per row (layers taken in turn); its K/V are cropped off after,
        so every call sees the same `context`-token cache."""
        h, inputs = step_inputs(q)
        next_layer, current = _cycle(list(range(num_layers))), {}

        def run():
            j = current["j"] = next_layer()
            fam.run_layer(model, j, h, inputs, cache)

        return run, lambda: cache.layers[current["j"]].crop(-q), 1

    h, inputs = step_inputs(1)
    last = h[:, -1]  # (rows, D)
    exit_index = len(config.exit_layers) - 1
    targets = torch.zeros(rows, dtype=torch.long, device=device)
    index = torch.arange(rows, device=device)
    next_skipped = _cycle(list(range(1, num_layers)))
    confidence = getattr(model, "confidence_heads", None)
    pieces = {
        # the prompt through every layer, plus the final head at its last position
        "prefill": (
            lambda: fam.head_logits(
                model,
                decoder(
                    input_ids=prompt, **cache_kwargs(DynamicCache(config=config)), use_cache=True
                ).last_hidden_state[:, -1],
            ),
            None,
            10,
        ),
        "layer": layer_piece(1),
        # deferred KV: a token that skipped a layer rides along as one more query of a later step at that layer
        "layer_q2": layer_piece(2),
        # what a logit criterion pays per check: exit head, LM head, softmax, the decision (a host sync)
        "head_check": (
            lambda: (
                model.exit_logits_from_hidden(exit_index, last).float().softmax(-1).max(-1).values.ge(0.5).nonzero()
            ),
            None,
            1,
        ),
        "head": (lambda: model.exit_logits_from_hidden(exit_index, last), None, 1),
        "final_head": (lambda: fam.head_logits(model, fam.final_norm(model)(last)), None, 1),
        "decision": (lambda: (targets.index_select(0, index) <= 1).nonzero(), None, 1),
        "cosine_check": (
            lambda: nn.functional.cosine_similarity(last.float(), last.float(), dim=-1).ge(0.9).nonzero(),
            None,
            1,
        ),
        # one skipped layer's K/V for the exited rows: input norm, K/V projections, rotary
        "backfill": (lambda: fam.key_value(model, next_skipped(), h, inputs), None, 1),
    }
    if confidence is not None:
        pieces["learned_check"] = (
            lambda: confidence[exit_index](model.exit_heads[exit_index](last)).ge(0.5).nonzero(),
            None,
            1,
        )
    out = _time_round_robin(pieces, device, max(repeats, num_layers))
    out["deferred_extra"] = max(out.pop("layer_q2") - out["layer"], 0.0)
    out.setdefault("learned_check", out["cosine_check"])
    return out


def measure_costs(
    model, batch_size: int = 1, prompt_length: int = 64, context: int = 128, repeats: int = 30, seed: int = 0
) -> dict:
    """Measures the cost pieces of early-exit decoding on `model` (an early-exit model) at `batch_size` rows.

    Returns `{"batch_size", "num_layers", "context", "ms": {name: {rows: ms}}, "layer_equivalents": {name: value}}`,
    with names `prefill` (a `prompt_length` prompt through the model), `layer` (one decoder layer step at a
    `context`-token cache), `head_check` (exit head + LM head + softmax + decision: a logit
    criterion's check), `head` (exit head + LM head), `final_head` (final norm + LM head), `backfill` (one skipped
    layer's K/V), `deferred_extra` (one more query in a layer step), `decision` (the forced-exit test),
    `cosine_check`, `learned_check`. Rows are measured at 1 and `batch_size` (row policy runs layers on fewer rows);
    `interp` fills the rows in between. Layer-equivalents are at `batch_size` rows.
    """
    was_training = model.training
    model.eval()
    sizes = sorted({1, int(batch_size)})
    per_rows = {n: _measure_rows(model, n, prompt_length, context, repeats, seed) for n in sizes}
    model.train(was_training)
    names = list(per_rows[sizes[0]])
    ms = {name: {str(n): per_rows[n][name] for n in sizes} for name in names}
    layer = per_rows[sizes[-1]]["layer"]
    return {
        "batch_size": int(batch_size),
        "num_layers": model.config.num_hidden_layers,
        "prompt_length": prompt_length,
        "context": context,
        "ms": ms,
        "layer_equivalents": {name: per_rows[sizes[-1]][name] / layer for name in names},
    }


def interp(costs: dict, name: str, rows: int) -> float:
    """Cost `name` in ms at `rows` rows: linear between the measured row counts (0 rows cost nothing)."""
    if rows <= 0:
        return 0.0
    table = sorted((int(n), v) for n, v in costs["ms"][name].items())
    if len(table) == 1 or rows <= table[0][0]:
        return table[0][1] if rows >= table[0][0] else table[0][1] * rows / table[0][0]
    for (n0, v0), (n1, v1) in zip(table, table[1:]):
        if rows <= n1:
            return v0 + (v1 - v0) * (rows - n0) / (n1 - n0)
    (n0, v0), (n1, v1) = table[-2], table[-1]
    return v1 + (v1 - v0) * (rows - n1) / (n1 - n0)


def full_step_cost(costs: dict, rows: int) -> float:
    """ms of one full-depth decoding step of `rows` rows: every layer and the final head."""
    return costs["num_layers"] * interp(costs, "layer", rows) + interp(costs, "final_head", rows)


def _check_cost_name(criterion: str, needs_logits: bool) -> str:
    if needs_logits or criterion in LOGIT_CRITERIA:
        return "head_check"
    return {"cosine": "cosine_check", "learned": "learned_check"}.get(criterion, "decision")


def step_cost(
    costs: dict, exits, check_layers, criterion: str, needs_logits: bool = False, kv: str = "immediate"
) -> float:
    """ms of one decoding step whose rows exit at decoder layers `exits` (a list; num_layers-1 = full depth).

    A layer runs for the rows still going; each checked layer a row reaches costs one check for it (a logit criterion
    computes its head there, reused at exit); a row that stops at e has its K/V backfilled for layers e+1..
    (immediate) or rides along as an extra query there later (deferred). Rows whose decision computed no logits (full
    depth, or a criterion without logits) share one LM-head call at the end of the step, as the runtime does.
    """
    num_layers = costs["num_layers"]
    last = num_layers - 1
    # a finished row (-1) never holds the batch back: it leaves at the first check
    exits = [int(e) if e >= 0 else (min(check_layers) if check_layers else last) for e in exits]
    check_name = _check_cost_name(criterion, needs_logits)
    reuse_head = check_name == "head_check"
    total = 0.0
    for j in range(num_layers):
        running = sum(e >= j for e in exits)
        total += interp(costs, "layer", running)
        if j in check_layers and j != last and running:
            total += interp(costs, check_name, running)
        skipped = sum(e < j for e in exits)
        if skipped:
            total += interp(costs, "deferred_extra" if kv == "deferred" else "backfill", skipped)
    exited_early = sum(e < last for e in exits)
    total += interp(costs, "final_head", sum(e == last for e in exits) + (0 if reuse_head else exited_early))
    return total


def _prefill_extra(costs, exits, check_layers, criterion, needs_logits):
    """What the early-exit prefill adds to a plain one: its checks; rows whose check computed logits skip the final
    head (the others share its one LM-head call)."""
    last = costs["num_layers"] - 1
    exits = [int(e) if e >= 0 else (min(check_layers) if check_layers else last) for e in exits]
    check_name = _check_cost_name(criterion, needs_logits)
    extra = sum(interp(costs, check_name, sum(e >= j for e in exits)) for j in check_layers if j != last)
    if check_name == "head_check":
        rows, full = len(exits), sum(e == last for e in exits)
        extra += interp(costs, "final_head", full) - interp(costs, "final_head", rows)
    return extra


def ideal_speedup(
    costs: dict,
    exit_layers: torch.Tensor,
    check_layers,
    criterion: str,
    needs_logits: bool = False,
    kv: str = "immediate",
    include_prefill: bool = True,
) -> float:
    """Full-depth cost / early-exit cost of a generation whose `exit_layers` `(batch, steps)` were measured.

    include_prefill: count step 0 (the prefill and its exit checks); False compares the decoding steps only."""
    exit_layers = exit_layers.tolist()
    rows, steps = len(exit_layers), len(exit_layers[0]) if exit_layers else 0
    # step 0 is the prefill: every layer for every prompt position in both models; the early-exit model then checks
    # its exits at the last position, which is all it adds there
    full = ee = interp(costs, "prefill", rows) if steps and include_prefill else 0.0
    if steps and include_prefill:
        ee += _prefill_extra(
            costs, [exit_layers[r][0] for r in range(rows)], list(check_layers), criterion, needs_logits
        )
    for t in range(1, steps):
        exits = [exit_layers[r][t] for r in range(rows)]
        full += full_step_cost(costs, rows)
        ee += step_cost(costs, exits, list(check_layers), criterion, needs_logits, kv)
    return full / ee if ee > 0 else math.nan
