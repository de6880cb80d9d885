"""What calibration predicts from: the exit scores of teacher-forced text (`collect_exit_scores`), the measured
costs in decoder-layer steps (`measure_costs`), the per-token simulation of a policy (`simulate`, on the decode
core's rule: `simulated_exits`) and the searches over exit subsets and thresholds (`search_policy`,
`guaranteed_policy`). `ee_transformers.training.calibrate` chooses, verifies and measures with them."""

import itertools
import statistics

import torch
from torch.nn import functional as F

from ee_transformers.generation_early_exit import EXIT_CRITERIA, LOGIT_CRITERIA, logit_score
from ee_transformers.measure.costs import measure_costs as measure_cost_pieces
from ee_transformers.training.guarantee import learn_then_test

CRITERIA = tuple(EXIT_CRITERIA)  # the built-in criteria (a benchmark may register more)


# ------------------------------------------------------------------------------------------------------------ scores
scores_from_logits = logit_score  # (..., V) logits -> (...) scores, the runtime's own definition


@torch.no_grad()
def collect_exit_scores(
    model, blocks: torch.LongTensor, criterion: str, batch_size: int = 4, skip_positions: int = 0, progress=None
) -> dict:
    """Teacher-forced over `blocks` (n, T): per position, each exit's score under `criterion` and argmax, and the
    final layer's argmax. Returns {"scores": (N, E) float, "argmax": (N, E) long, "final": (N,) long}. `progress`: a
    description to show a progress bar under (None: no bar)."""
    if criterion not in CRITERIA:
        raise ValueError(f"`criterion` must be one of {list(CRITERIA)}, got {criterion!r}.")
    if criterion == "learned" and model.confidence_heads is None:
        raise ValueError("`criterion='learned'` needs confidence heads: fit them with `--confidence-steps N`.")
    device = model.device
    was_training = model.training
    model.eval()
    scores, argmaxes, finals = [], [], []
    starts = range(0, blocks.shape[0], batch_size)
    if progress is not None:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=progress, dynamic_ncols=True)
    for start in starts:
        ids = blocks[start : start + batch_size].to(device)
        hidden = model.family.decoder(model)(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        keep = slice(skip_positions, None)
        finals.append(model.family.head_logits(model, hidden[-1][:, keep]).argmax(-1).flatten().cpu())
        s_row, a_row = [], []
        for i, layer in enumerate(model.config.exit_layers):
            h_out = hidden[layer + 1][:, keep]
            x = model.exit_heads[i](h_out)
            logits = model.family.head_logits(model, x)
            a_row.append(logits.argmax(-1).flatten().cpu())
            if criterion in LOGIT_CRITERIA:
                s = scores_from_logits(logits, criterion)
            elif criterion == "cosine":  # leaving vs entering the exit layer
                s = F.cosine_similarity(h_out.float(), hidden[layer][:, keep].float(), dim=-1)
            else:
                s = model.confidence_heads[i](x)
            s_row.append(s.float().flatten().cpu())
        scores.append(torch.stack(s_row, 1))
        argmaxes.append(torch.stack(a_row, 1))
    model.train(was_training)
    return {"scores": torch.cat(scores), "argmax": torch.cat(argmaxes), "final": torch.cat(finals)}


# -------------------------------------------------------------------------------------------------------------- costs
@torch.no_grad()
def measure_costs(
    model, criterion: str = "max_prob", batch_size: int = 1, context: int = 32, repeats: int = 20
) -> dict:
    """Costs on this machine, in decoder-layer steps, of what calibration's simulation charges: an LM-head call
    through an exit head (`head_cost`), a check of `criterion` (`check_cost`: the head plus the score for a logit
    criterion, the cosine or confidence head otherwise) and one skipped layer's K/V backfill (`backfill_cost`), at
    `batch_size` rows behind a `context`-token cache. Timed by the benchmark's cost model (`ee_transformers.measure.costs`)."""
    if criterion == "learned" and getattr(model, "confidence_heads", None) is None:
        raise ValueError("`criterion='learned'` needs confidence heads.")
    pieces = measure_cost_pieces(model, batch_size, context=context, repeats=repeats)
    ms = {name: by_rows[str(batch_size)] for name, by_rows in pieces["ms"].items()}
    check = "head_check" if criterion in LOGIT_CRITERIA else f"{criterion}_check"
    layer_ms = max(ms["layer"], 1e-6)
    head_ms, check_ms, backfill_ms = ms["head"], ms[check], ms["backfill"]
    return {
        "device": str(model.device),
        "dtype": str(model.dtype),
        "batch_size": batch_size,
        "context": context,
        "layer_ms": round(layer_ms, 5),
        "head_ms": round(head_ms, 5),
        "check_ms": round(check_ms, 5),
        "backfill_ms": round(backfill_ms, 5),
        "head_cost": round(head_ms / layer_ms, 4),
        "check_cost": round(check_ms / layer_ms, 4),
        "backfill_cost": round(backfill_ms / layer_ms, 4),
    }


COST_KEYS = ("head_cost", "check_cost", "backfill_cost")


def check_costs(costs) -> dict:
    """`costs` as the simulation uses them: non-negative numbers `head_cost`, `backfill_cost` and (for the criteria
    that decide without logits) `check_cost`, in decoder-layer steps; missing `check_cost` is 0. A `ValueError`
    names what is wrong."""
    if not isinstance(costs, dict):
        raise ValueError(
            f"`costs` must be an object with {', '.join(COST_KEYS)} (decoder-layer steps), got {type(costs).__name__}."
        )
    costs = {"check_cost": 0.0, **costs}
    for key in COST_KEYS:
        value = costs.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise ValueError(
                f"`costs` must give `{key}` as a number >= 0 (decoder-layer steps), got "
                f"{'nothing' if key not in costs else repr(value)}."
            )
    return costs


# --------------------------------------------------------------------------------------------------------- simulation
def simulate(
    data: dict,
    exit_layers: list,
    num_layers: int,
    check: list,
    thresholds: list,
    costs: dict,
    criterion: str,
    patience: int = 0,
    group: int = 1,
) -> dict:
    """Teacher-forced simulation of decoding with exits `check` (indices into `exit_layers`, increasing) at
    `thresholds`. A token exits at the first checked exit whose score >= threshold (or, with patience k, whose argmax
    the k-1 checked exits before it share). Cost per decoding step, in layer steps: layers run + checks made x check
    cost (a logit criterion reuses the head on exit; the others pay the head once) + backfill x skipped layers.

    group: batch policy at batch size `group`: positions are drawn into seeded random groups of that size that decide
    together (a group exits at the first checked exit where every row is confident), as `exit_policy="batch"` does.
    Returns agreement, mean exit layer (0-based, full depth = num_layers - 1), exit rate and predicted speed-up."""
    rows, first, fired, exit_layer = simulated_exits(data, exit_layers, num_layers, check, thresholds, patience, group)
    argmax, final = data["argmax"][:, check], data["final"]
    # per row: the group's exit decides which head's argmax a row emits
    row_first = first[:, None].expand_as(rows).reshape(-1)
    row_fired = fired[:, None].expand_as(rows).reshape(-1)
    flat = rows.reshape(-1)
    chosen = torch.where(row_fired, argmax[flat].gather(1, row_first[:, None]).squeeze(1), final[flat])
    checks = (first + 1).double()
    logit_check = criterion in LOGIT_CRITERIA or patience > 0
    per_check = costs["head_cost"] if logit_check else costs["check_cost"]
    head_once = torch.where(fired, 0.0 if logit_check else costs["head_cost"], costs["head_cost"]).double()
    cost = (
        (exit_layer + 1).double()
        + checks * per_check
        + head_once
        + costs["backfill_cost"] * (num_layers - 1 - exit_layer).double()
    )
    full = num_layers + costs["head_cost"]
    return {
        "agreement": float((chosen == final[flat]).double().mean()),
        "mean_exit_layer": float(exit_layer.double().mean()),
        "exit_rate": float(fired.double().mean()),
        "speedup": float(full / cost.mean()),
        "positions": int(flat.numel()),
    }


def simulated_exits(data, exit_layers, num_layers, check, thresholds, patience=0, group=1):
    """The exit rule of `simulate`, vectorised over recorded scores (the runtime's `first_confident_exit` on the same
    scores decides the same layers): a position exits at the first checked exit whose score >= threshold (or, with
    patience k, whose argmax the k-1 checked exits before it share), else at full depth; with `group` > 1, seeded random
    groups of positions exit together, at the first checked exit where every one of them is confident.

    Returns (rows `(units, group)`: each unit's positions, one unit per position in order when `group` is 1; first
    `(units,)`: the index into `check` of its exit, the last where none fired; fired `(units,)`; exit_layer `(units,)`).
    """
    scores, argmax = data["scores"][:, check], data["argmax"][:, check]
    n, m = scores.shape
    fire = scores >= torch.tensor(thresholds, dtype=scores.dtype)
    if patience:
        run = torch.ones_like(argmax)
        for j in range(1, m):
            run[:, j] = torch.where(argmax[:, j] == argmax[:, j - 1], run[:, j - 1] + 1, torch.ones_like(run[:, j]))
        fire |= run >= patience
    if group > 1:
        units = n // group
        if units == 0:
            raise ValueError(f"Cannot simulate batches of {group} with only {n} positions.")
        rows = torch.randperm(n, generator=torch.Generator().manual_seed(0))[: units * group].view(units, group)
        fire_units = fire[rows].all(1)  # (units, m): the whole group is confident
    else:
        rows, units, fire_units = torch.arange(n).view(n, 1), n, fire
    fired = fire_units.any(1)  # (units,)
    first = torch.where(fired, fire_units.float().argmax(1), torch.full((units,), m - 1))
    layers_t = torch.tensor([exit_layers[c] for c in check])
    exit_layer = torch.where(fired, layers_t[first], torch.full((units,), num_layers - 1))  # (units,)
    return rows, first, fired, exit_layer


def _threshold_grid(values: torch.Tensor, count: int = 40) -> list[float]:
    """Candidate thresholds: quantiles of the observed scores, denser near the top, plus the maximum."""
    if values.numel() == 0:
        return []
    qs = torch.cat([torch.linspace(0, 0.9, count // 2), 1 - torch.logspace(-1, -4, count - count // 2)])
    grid = torch.quantile(values.double()[:1_000_000], qs.double()).tolist()
    return sorted(set(float(v) for v in grid))


def _subsets(num_exits: int) -> list[tuple]:
    if num_exits <= 4:
        return [c for k in range(1, num_exits + 1) for c in itertools.combinations(range(num_exits), k)]
    return (
        [(i,) for i in range(num_exits)] + list(itertools.combinations(range(num_exits), 2)) + [tuple(range(num_exits))]
    )


def search_policy(
    data: dict,
    exit_layers: list,
    num_layers: int,
    costs: dict,
    criterion: str,
    target_agreement: float,
    patience: int = 0,
    refine_passes: int = 2,
    group: int = 1,
) -> dict:
    """The fastest (predicted) exit subset and thresholds whose agreement on `data` reaches the target. Searches
    small subsets with one shared threshold, then refines the best subsets exit by exit. Returns {"best": dict or
    None, "candidates": best per subset}."""

    def better(a, b):
        return (
            b is None
            or a["speedup"] > b["speedup"]
            or (a["speedup"] == b["speedup"] and a["agreement"] > b["agreement"])
        )

    per_subset = []
    for subset in _subsets(len(exit_layers)):
        check = list(subset)
        grid = _threshold_grid(data["scores"][:, check].flatten())
        best = None
        for t in grid:
            r = simulate(data, exit_layers, num_layers, check, [t] * len(check), costs, criterion, patience, group)
            if r["agreement"] >= target_agreement and better(r, best):
                best = dict(r, check=check, thresholds=[t] * len(check))
        if best is not None:
            per_subset.append(best)
    per_subset.sort(key=lambda r: -r["speedup"])
    for start in per_subset[:3]:  # coordinate refinement: one threshold at a time
        current = start
        for _ in range(refine_passes):
            for k, c in enumerate(current["check"]):
                for t in _threshold_grid(data["scores"][:, c]):
                    thresholds = list(current["thresholds"])
                    thresholds[k] = t
                    r = simulate(
                        data, exit_layers, num_layers, current["check"], thresholds, costs, criterion, patience, group
                    )
                    if r["agreement"] >= target_agreement and better(r, current):
                        current = dict(r, check=current["check"], thresholds=thresholds)
        if better(current, start):
            per_subset.append(current)
    per_subset.sort(key=lambda r: -r["speedup"])
    return {"best": per_subset[0] if per_subset else None, "candidates": per_subset[:10]}


def guaranteed_policy(
    data: dict,
    grid_data: dict,
    exit_layers: list,
    num_layers: int,
    costs: dict,
    criterion: str,
    epsilon: float,
    delta: float,
    patience: int = 0,
    group: int = 1,
) -> dict:
    """Learn then Test (see `guarantee.py`): every exit subset with one shared threshold is a sequence of hypotheses
    "disagreement rate > epsilon", thresholds from the most conservative down, taken from `grid_data`'s scores (the
    other split: the hypotheses do not depend on the errors they are tested on); errors are counted on `data`. The
    fastest predicted certified setting is returned as "best" (None: nothing certified, full depth)."""
    errors, results = {}, {}
    for subset in _subsets(len(exit_layers)):
        check = list(subset)
        pairs = []
        for t in sorted(_threshold_grid(grid_data["scores"][:, check].flatten()), reverse=True):
            r = simulate(data, exit_layers, num_layers, check, [t] * len(check), costs, criterion, patience, group)
            pairs.append((t, round((1.0 - r["agreement"]) * r["positions"])))
            results[(subset, t)] = dict(r, check=check, thresholds=[t] * len(check))
        errors[subset] = pairs
    n = next(iter(results.values()))["positions"] if results else 0
    certified = learn_then_test(errors, n, epsilon, delta) if n else {}
    passed = [
        dict(results[(subset, c.threshold)], p_value=c.p_value) for subset, found in certified.items() for c in found
    ]
    passed.sort(key=lambda r: -r["speedup"])
    return {
        "best": passed[0] if passed else None,
        "candidates": passed[:10],
        "tested_sets": len(errors),
        "positions": n,
    }


def lower_quartile(values: list[float]) -> float:
    """The lower quartile of measured speed-ups, interpolated between measured values and never below the smallest
    (statistics' default "exclusive" method extrapolates: with few pairs one fast outlier drags it below zero)."""
    return statistics.quantiles(values, n=4, method="inclusive")[0] if len(values) >= 2 else values[0]
