"""Cost-aware calibration: which exits to check, and at which thresholds, for a greedy-agreement target.

    ee-transformers calibrate my-ee-model --data heldout/*.txt --criterion max_prob --target-agreement 0.95
    (the command line: `ee_transformers.tools.calibrate`)

An exit check is not free: a logit criterion runs the full LM head (on SmolLM2-135M at batch 1 on a CPU, about 3.5
decoder-layer steps). So calibration
  1. measures on this machine, in decoder-layer steps: a layer step, a head check, a cheap check (cosine / learned),
     and the K/V backfill of one skipped layer (medians of timed calls);
  2. teacher-forces held-out text once, recording per position and exit the criterion's score and whether the exit's
     argmax equals the final one;
  3. on split A, searches exit subsets x thresholds for the highest predicted tokens/s whose agreement with full
     depth reaches the target (full depth itself is a candidate: if no policy beats it, exits stay off);
  4. optionally (`--verify-prompts N`, on by default in the CLI) really decodes N split-B prompts with the choice and
     asks the full model, on the text produced, what it would have chosen: exits feed their own mistakes back into
     the context, so this on-policy agreement is usually below the teacher-forced one; while it misses the target the
     search reruns with the target raised by the shortfall, and exits stay off if it never passes;
  5. reports agreement, mean exit layer and predicted speed-up of the choice on split B, and stores it in the model's
     generation config (`generation_config.json`: `generate()` with no exit arguments uses it), its card and
     `calibration.json`.

The simulation is per token (batch 1): with `policy="batch"` and larger batches a step exits only when every row is
confident, so real exit rates are lower. The benchmark measures real decoding.

Python use:
    report = calibrate(model, heldout_blocks, CalibrationConfig(criterion="max_prob", target_agreement=0.95))
    apply_calibration(model, report)
"""

import dataclasses
import itertools
import statistics
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from ee_transformers.generation_early_exit import EXIT_CRITERIA, LOGIT_CRITERIA, logit_score
from ee_transformers.measure.costs import measure_costs as measure_cost_pieces
from ee_transformers.measure.quality import full_model_view
from ee_transformers.training.guarantee import learn_then_test
from ee_transformers.utils.arguments import (
    check_fields,
)

CRITERIA = tuple(EXIT_CRITERIA)  # the built-in criteria (a benchmark may register more)


# ------------------------------------------------------------------------------------------------------------ config
@dataclass
class CalibrationConfig:
    """Settings of one calibration; `__post_init__` raises `ValueError` naming a bad field. Limits that depend on the
    model (`block_size`, `verify_prompt_length`, `verify_new_tokens`) default to what fits it: see `for_model`."""

    criterion: str = field(
        default="max_prob", metadata={"help": "the exit criterion calibrated", "choices": tuple(CRITERIA)}
    )
    target_agreement: float = field(
        default=0.95, metadata={"help": "greedy agreement with full depth to reach", "above": 0, "max": 1}
    )
    policy: str = field(
        default="batch", metadata={"help": "exit policy decoding will use", "choices": ("batch", "row")}
    )
    patience: int = field(
        default=0, metadata={"help": "stable-token exits over k checked exits (0 = off, else >= 2)", "min": 0}
    )
    kv: str = field(
        default="immediate", metadata={"help": "K/V of skipped layers", "choices": ("immediate", "deferred")}
    )
    block_size: int | None = field(
        default=None,
        metadata={
            "help": "tokens per held-out block when calibrating on text (default: min(256, the model's positions))",
            "min": 2,
        },
    )
    max_blocks: int = field(default=64, metadata={"help": "use at most this many held-out blocks", "min": 2})
    batch_size: int = field(default=4, metadata={"help": "blocks per forward pass while collecting scores", "min": 1})
    decode_batch_size: int = field(
        default=1,
        metadata={
            "help": "batch size decoding will run at: costs are measured there, and with policy batch rows are simulated "
            "exiting together",
            "min": 1,
        },
    )
    verify_prompts: int = field(
        default=0,
        metadata={
            "help": "really decode this many held-out prompts to check the choice on-policy (0 = skip)",
            "min": 0,
        },
    )
    verify_prompt_length: int | None = field(
        default=None,
        metadata={"help": "tokens of each verification prompt (default: min(32, block_size // 2))", "min": 1},
    )
    verify_new_tokens: int | None = field(
        default=None,
        metadata={
            "help": "tokens decoded per verification prompt (default: min(32, the positions left after the prompt))",
            "min": 1,
        },
    )
    verify_rounds: int = field(
        default=3, metadata={"help": "searches rerun with a raised target while verification misses", "min": 1}
    )
    seed: int = field(default=0, metadata={"help": "seed of the A/B split"})
    guarantee: float | None = field(
        default=None,
        metadata={
            "help": "choose thresholds by Learn then Test so that, with probability 1 - confidence over the calibration "
            "sample, the per-token disagreement rate with full depth is at most this (instead of "
            "target_agreement)",
            "above": 0,
            "below": 1,
        },
    )
    confidence: float = field(
        default=0.1,
        metadata={"help": "delta of the guarantee: the probability the promise may fail", "above": 0, "below": 1},
    )
    measure_speed: bool = field(
        default=False,
        metadata={
            "help": "decode held-out prompts with the choice and full depth, interleaved, and keep exits on only when "
            "the measured speed-up's lower quartile clears 1.0"
        },
    )
    speed_prompts: int = field(default=4, metadata={"help": "held-out prompts per speed measurement", "min": 1})
    speed_new_tokens: int = field(default=32, metadata={"help": "tokens decoded per speed run", "min": 2})
    speed_repeats: int = field(default=3, metadata={"help": "interleaved rounds per speed measurement", "min": 1})
    speed_batch_sizes: list[int] | None = field(
        default=None,
        metadata={
            "help": "batch sizes the speed promise must hold at, each measured (default: decode_batch_size)",
            "min": 1,
        },
    )
    progress: bool = field(default=False, metadata={"help": "show progress bars while collecting exit scores"})
    speed_candidates: int = field(
        default=3,
        metadata={"help": "settings measured at most, fastest predicted first, until one clears 1.0", "min": 1},
    )

    def __post_init__(self):
        check_fields(self)
        if self.patience == 1:
            raise ValueError("`patience` must be 0 (off) or an integer >= 2, got 1.")
        if self.kv == "deferred" and self.policy == "row":
            raise ValueError("`kv`='deferred' works with `policy`='batch' only.")

    def for_model(self, max_position_embeddings: int | None, block_size: int | None = None) -> "CalibrationConfig":
        """This config with the model-dependent limits filled in and checked against the model's positions:
        `block_size` (given here when the blocks are already cut) defaults to min(256, max_position_embeddings), the
        verification prompt to min(32, block_size // 2) tokens and its decoding to min(32, the positions left)."""
        limit = max_position_embeddings
        block_size = block_size or self.block_size or (min(256, limit) if limit else 256)
        if limit is not None and block_size > limit:
            raise ValueError(
                f"`block_size`={block_size} is beyond the model's positions (`max_position_embeddings`="
                f"{limit}); use at most {limit}."
            )
        prompt = self.verify_prompt_length or max(1, min(32, block_size // 2))
        if self.verify_prompts and prompt >= block_size:
            raise ValueError(
                f"`verify_prompt_length`={prompt} needs blocks longer than that (`block_size`={block_size})."
            )
        new = self.verify_new_tokens or max(1, min(32, (limit or prompt + 32) - prompt))
        if self.verify_prompts and limit is not None and prompt + new > limit:
            raise ValueError(
                f"`verify_new_tokens`={new} after a {prompt}-token prompt goes beyond the model's "
                f"positions (`max_position_embeddings`={limit}); use at most {limit - prompt}."
            )
        return dataclasses.replace(self, block_size=block_size, verify_prompt_length=prompt, verify_new_tokens=new)


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


def measure_speed(
    model, prompts: torch.LongTensor, exit_kwargs: dict, config: "CalibrationConfig", batch_size: int | None = None
) -> dict:
    """Decodes `prompts` with `exit_kwargs` and at full depth on the same weights, interleaved in pairs (the
    benchmark's method), at `batch_size` (default `config.decode_batch_size`; prompts are repeated to fill a batch).
    Returns the paired speed-ups (median, lower quartile, all) and the quality of those runs: per-token agreement
    (given its own prefix) and identical-token share against the full-depth text."""
    from ee_transformers.measure.config import BenchConfig
    from ee_transformers.measure.loading import plain_twin
    from ee_transformers.measure.timing import compare

    plain = plain_twin(model)
    batch = batch_size or config.decode_batch_size
    if prompts.shape[0] < batch:
        prompts = prompts.repeat((batch + prompts.shape[0] - 1) // prompts.shape[0], 1)
    bench_config = BenchConfig(
        batch_sizes=[batch],
        max_batches=[max(1, prompts.shape[0] // batch)],
        new_tokens=config.speed_new_tokens,
        repeats=config.speed_repeats,
    )
    rows = [{"domain": "held-out", "ids": row.tolist()} for row in prompts]
    result = compare(model, plain, rows, exit_kwargs, config=bench_config, batch_size=batch)
    values = result["speedup"]["values"]
    quartile = lower_quartile(values)
    return {
        "median": result["speedup"]["median"],
        "lower_quartile": quartile,
        "values": values,
        "pairs": len(values),
        "batch_size": batch,
        "new_tokens": config.speed_new_tokens,
        "per_token_agreement": result["quality"]["per_token_agreement"],
        "identical_token_share": result["agreement"]["share"],
    }


# ---------------------------------------------------------------------------------------------------------- calibrate
def _as_blocks(data, tokenizer, block_size):
    if isinstance(data, torch.Tensor):
        if data.ndim != 2:
            raise ValueError(f"Calibration blocks must be (n, block_size), got shape {tuple(data.shape)}.")
        return data
    if tokenizer is None or block_size is None:
        raise ValueError("Calibrating on texts needs `tokenizer` and `block_size`.")
    from ee_transformers.training.data import tokenize_blocks

    return tokenize_blocks(list(data), tokenizer, block_size)


@torch.no_grad()
def on_policy_agreement(
    model, prompts: torch.LongTensor, exit_kwargs: dict, new_tokens: int = 32, batch_size: int = 1
) -> dict:
    """Per-token agreement, really decoded: decodes `prompts` (n, p) greedily with early exit (`exit_kwargs` as given
    to `generate`), then asks the full model, on the very text it produced, what it would have chosen at each
    generated position (`ee_transformers.measure.quality.full_model_view`). Unlike teacher-forced
    scores this sees the drift early exits cause in their own context. Returns agreement, mean exit layer, exit rate
    and the number of tokens (tokens after EOS are not counted)."""
    was_training = model.training
    model.eval()
    device = model.device
    last = model.config.num_hidden_layers - 1
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    agree = total = exited = 0
    layer_sum = 0.0
    for start in range(0, prompts.shape[0], batch_size):
        ids = prompts[start : start + batch_size].to(device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=pad,
            **exit_kwargs,
        )
        sequences, layers = out.sequences, out.exit_layers.to(device)
        valid = layers >= 0  # decided tokens: up to and including each row's EOS
        view = full_model_view(model, sequences, ids.shape[1], eos_ids=eos)  # per-token agreement, one definition
        agree += view["agree"]
        total += view["tokens"]
        exited += int(((layers < last) & valid).sum())
        layer_sum += float(layers[valid].double().sum())
    model.train(was_training)
    total = max(total, 1)
    return {
        "agreement": agree / total,
        "mean_exit_layer": layer_sum / total,
        "exit_rate": exited / total,
        "tokens": total,
    }


def exit_arguments(criterion, check_layers, thresholds, policy, patience, kv) -> dict:
    """generate() exit arguments of a calibrated setting."""
    return {
        "exit_criterion": criterion,
        "exit_threshold": list(thresholds),
        "exit_check_layers": list(check_layers),
        "exit_policy": policy,
        "exit_patience": patience,
        "exit_kv": kv,
    }


def calibrate(model, data, config: CalibrationConfig | None = None, tokenizer=None, costs: dict | None = None) -> dict:
    """Chooses the exits to check and their thresholds for `model` (an early-exit model, fitted).

    data: held-out blocks `(n, block_size)` (n >= 2), or texts (with `tokenizer`; cut into `config.block_size`
        blocks). At most `config.max_blocks` are used, split in two (seeded): the choice is made on split A and
        reported on split B.
    config: a `CalibrationConfig` (criterion, target agreement, policy...; defaults fit the model's positions).
    costs: measured with `measure_costs` (at `config.decode_batch_size`) when None; pass a dict (head_cost,
        check_cost, backfill_cost in layer steps) to pin them (tests, or another target machine).
    With `config.policy="batch"` rows of a batch exit together, so the simulation groups positions into batches of
    `decode_batch_size`; with `"row"` it simulates rows alone. With `config.verify_prompts` > 0 the choice is also
    checked by really decoding that many split-B prompts and measuring on-policy agreement (see
    `on_policy_agreement`). Exits feed their own errors back into the context, so this is usually lower than the
    teacher-forced figure; while it misses the target the search is rerun with the target raised by the shortfall
    (up to `verify_rounds` times), and exits stay off if it never passes.
    Returns the report (see `calibration.json`); `apply_calibration(model, report)` stores the choice.
    """
    config, blocks = _checked_blocks(model, data, config, tokenizer)
    exit_layers, num_layers = list(model.config.exit_layers), model.config.num_hidden_layers
    order = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(config.seed))
    half = blocks.shape[0] // 2
    split_a, split_b = blocks[order[:half]], blocks[order[half:]]
    if costs is None:
        costs = measure_costs(model, config.criterion, batch_size=config.decode_batch_size)
    costs = check_costs(costs)
    group = config.decode_batch_size if config.policy == "batch" else 1
    bar = "calibrate: exit scores, split {}" if config.progress else None
    data_a = collect_exit_scores(model, split_a, config.criterion, config.batch_size, progress=bar and bar.format("A"))
    data_b = collect_exit_scores(model, split_b, config.criterion, config.batch_size, progress=bar and bar.format("B"))
    report = _new_report(config, exit_layers, num_layers, costs, data_a, data_b)
    verify = config.verify_prompts
    prompts = split_b[:verify, : config.verify_prompt_length] if verify else None
    search_target = config.target_agreement
    if config.guarantee is not None:  # Learn then Test: certified on split A, thresholds from split B's scores
        found, best = _search_guaranteed(model, report, data_a, data_b, exit_layers, num_layers, costs, config, prompts)
    else:
        found, best, search_target = _search_verified(
            model, report, data_a, exit_layers, num_layers, costs, config, prompts, group
        )
    if best is not None and best["speedup"] >= 1.0:
        _choose(report, best, data_b, exit_layers, num_layers, costs, config, group)
        if config.measure_speed:
            speed_prompts = split_b[: config.speed_prompts, : config.verify_prompt_length]
            _keep_if_measured_faster(
                model,
                report,
                best,
                found["candidates"],
                speed_prompts,
                data_b,
                exit_layers,
                num_layers,
                costs,
                config,
                group,
            )
    else:
        report["message"] = _exits_off_message(report, best, exit_layers, config)
    if report["chosen"] is None and search_target > config.target_agreement:
        first = report["verification"][0]
        report["message"] += (
            f" (really decoding, the first choice agreed on only {first['agreement']:.3f}, so the "
            f"teacher-forced target was raised to {search_target:.3f})"
        )
    return report


def _checked_blocks(model, data, config, tokenizer):
    """(the config with the model's limits filled in, the held-out blocks `(n, block_size)` used, n >= 2)."""
    config = config or CalibrationConfig()
    if not isinstance(config, CalibrationConfig):
        raise ValueError(f"`config` must be a CalibrationConfig, got {type(config).__name__}.")
    if config.criterion == "learned" and getattr(model, "confidence_heads", None) is None:
        raise ValueError("`criterion='learned'` needs confidence heads: fit them with `--confidence-steps N`.")
    if not list(model.config.exit_layers):
        raise ValueError("The model has no exit heads to calibrate (`config.exit_layers` is empty).")
    positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(data, torch.Tensor):
        config = config.for_model(positions, block_size=int(data.shape[1]) if data.ndim == 2 else None)
    else:
        config = config.for_model(positions)
    blocks = _as_blocks(data, tokenizer, config.block_size)[: config.max_blocks]
    if blocks.shape[0] < 2:
        raise ValueError(
            f"Calibration needs at least 2 held-out blocks (one to choose on, one to report on), got "
            f"{blocks.shape[0]}; give more text or a smaller block size."
        )
    return config, blocks


def _new_report(config, exit_layers, num_layers, costs, data_a, data_b) -> dict:
    """The report before any search: the settings, the costs, the splits' sizes and each exit's agreement on B."""
    per_exit_b = [
        round(float((data_b["argmax"][:, i] == data_b["final"]).double().mean()), 4) for i in range(len(exit_layers))
    ]
    return {
        "criterion": config.criterion,
        "policy": config.policy,
        "patience": config.patience,
        "kv": config.kv,
        "target_agreement": config.target_agreement,
        "decode_batch_size": config.decode_batch_size,
        "exit_layers": exit_layers,
        "num_hidden_layers": num_layers,
        "costs": costs,
        "config": dataclasses.asdict(config),
        "positions": {"A": int(data_a["final"].numel()), "B": int(data_b["final"].numel())},
        "per_exit_agreement_B": per_exit_b,
        "chosen": None,
        "selection_A": None,
        "heldout_B": None,
        "on_policy_B": None,
        "verification": [],
    }


def _search_guaranteed(model, report, data_a, data_b, exit_layers, num_layers, costs, config, prompts):
    """Learn then Test: settings certified on split A, thresholds from split B's scores; the best one's on-policy
    agreement is reported (not used to choose). Returns (search result, best or None)."""
    group = config.decode_batch_size if config.policy == "batch" else 1
    found = guaranteed_policy(
        data_a,
        data_b,
        exit_layers,
        num_layers,
        costs,
        config.criterion,
        config.guarantee,
        config.confidence,
        config.patience,
        group,
    )
    best = found["best"]
    report["guarantee"] = {
        "epsilon": config.guarantee,
        "delta": config.confidence,
        "positions": found["positions"],
        "tested_exit_sets": found["tested_sets"],
        "certified": len(found["candidates"]),
        "assumption": "held-out positions exchangeable with the text decoded later (same kind of text, many "
        "documents); the rate is per token, teacher-forced",
    }
    report["candidates"] = [_candidate(c, exit_layers) for c in found["candidates"]]
    if best is not None and prompts is not None:
        check_layers = [exit_layers[i] for i in best["check"]]
        report["on_policy_B"] = on_policy_agreement(
            model,
            prompts,
            exit_arguments(
                config.criterion, check_layers, best["thresholds"], config.policy, config.patience, config.kv
            ),
            config.verify_new_tokens,
            config.decode_batch_size,
        )
    return found, best


def _exits_off_message(report, best, exit_layers, config) -> str:
    """Why exits stay off when no setting was chosen: verification missed, too slow, none certified or none found."""
    if report["verification"] and (best is None or best["speedup"] >= 1.0):
        last = report["verification"][-1]
        return (
            f"exits left off: really decoding held-out prompts, the best policy agreed with full "
            f"depth on only {last['agreement']:.3f} of tokens (target {config.target_agreement})"
        )
    if best is not None:
        return (
            f"exits left off: the best policy reaching the quality target "
            f"(exits {[exit_layers[i] for i in best['check']]}) predicts only {best['speedup']:.2f}x, "
            "slower than full depth once check costs are counted"
        )
    if config.guarantee is not None:
        return (
            f"exits left off: no setting is certified to disagree with full depth on at most "
            f"{config.guarantee} of tokens with confidence {1 - config.confidence:.2f} on "
            f"{report['guarantee']['positions']} positions (more held-out text certifies more)"
        )
    return f"exits left off: no exit policy reaches agreement {config.target_agreement} on split A"


def _candidate(c, exit_layers):
    return {**{k: v for k, v in c.items() if k != "check"}, "check_layers": [exit_layers[i] for i in c["check"]]}


def _search_verified(model, report, data_a, exit_layers, num_layers, costs, config, prompts, group):
    """The target-agreement search, verified on-policy: while really decoding misses the target, the search reruns
    with the target raised by the shortfall. Returns (search result, best or None, the target last searched for)."""
    criterion, policy, patience, kv = config.criterion, config.policy, config.patience, config.kv
    target_agreement = search_target = config.target_agreement
    found = best = None
    for _ in range(max(1, config.verify_rounds if prompts is not None else 1)):
        found = search_policy(data_a, exit_layers, num_layers, costs, criterion, search_target, patience, group=group)
        best = found["best"]
        report["candidates"] = [_candidate(c, exit_layers) for c in found["candidates"]]
        if best is None or best["speedup"] < 1.0 or prompts is None:
            break
        check_layers = [exit_layers[i] for i in best["check"]]
        checked = on_policy_agreement(
            model,
            prompts,
            exit_arguments(criterion, check_layers, best["thresholds"], policy, patience, kv),
            config.verify_new_tokens,
            config.decode_batch_size,
        )
        report["verification"].append(
            {
                "search_target": search_target,
                "check_layers": check_layers,
                "thresholds": [float(t) for t in best["thresholds"]],
                **checked,
            }
        )
        if checked["agreement"] >= target_agreement:
            report["on_policy_B"] = checked
            break
        if search_target >= 1.0:
            best = None
            break
        search_target = min(1.0, search_target + (target_agreement - checked["agreement"]))
    else:
        best = None  # every verified round missed the target
    return found, best, search_target


def _choose(report, best, data_b, exit_layers, num_layers, costs, config, group):
    check_layers = [exit_layers[i] for i in best["check"]]
    report["chosen"] = {"check_layers": check_layers, "thresholds": [float(t) for t in best["thresholds"]]}
    report["selection_A"] = {k: best[k] for k in ("agreement", "mean_exit_layer", "exit_rate", "speedup")}
    report["heldout_B"] = simulate(
        data_b,
        exit_layers,
        num_layers,
        best["check"],
        best["thresholds"],
        costs,
        config.criterion,
        config.patience,
        group,
    )
    report["message"] = (
        f"check exits {check_layers} at thresholds {[round(t, 4) for t in best['thresholds']]}: "
        f"predicted {report['heldout_B']['speedup']:.2f}x at per-token agreement "
        f"{report['heldout_B']['agreement']:.3f} (teacher-forced) on held-out split B"
    )
    if report["on_policy_B"] is not None:
        report["message"] += f"; {report['on_policy_B']['agreement']:.3f} given its own prefix when really decoding"


def _keep_if_measured_faster(
    model, report, best, candidates, prompts, data_b, exit_layers, num_layers, costs, config, group
):
    """The speed promise: measure the choice (then the next fastest predicted candidates) against full depth; keep
    the first whose measured speed-up's lower quartile clears 1.0, else store full depth and say how close it came."""
    order = [best] + [c for c in candidates if c is not best and c["speedup"] >= 1.0]
    batch_sizes = config.speed_batch_sizes or [config.decode_batch_size]
    tried, winner = [], None
    for candidate in order[: config.speed_candidates]:
        check_layers = [exit_layers[i] for i in candidate["check"]]
        kwargs = exit_arguments(
            config.criterion, check_layers, candidate["thresholds"], config.policy, config.patience, config.kv
        )
        per_batch = {}
        for b in batch_sizes:  # the promise must hold at every batch size asked for: stop at the first miss
            per_batch[b] = measure_speed(model, prompts, kwargs, config, batch_size=b)
            if per_batch[b]["lower_quartile"] <= 1.0:
                break
        measured = min(per_batch.values(), key=lambda m: m["lower_quartile"])  # the binding batch size
        predicted = simulate(
            data_b,
            exit_layers,
            num_layers,
            candidate["check"],
            candidate["thresholds"],
            costs,
            config.criterion,
            config.patience,
            group,
        )
        tried.append(
            {
                "check_layers": check_layers,
                "thresholds": [float(t) for t in candidate["thresholds"]],
                "predicted_speedup": candidate["speedup"],
                "predicted_B": {k: predicted[k] for k in ("agreement", "mean_exit_layer", "exit_rate", "speedup")},
                "measured": measured,
                "by_batch_size": {str(b): m for b, m in per_batch.items()},
            }
        )
        if len(per_batch) == len(batch_sizes) and measured["lower_quartile"] > 1.0:
            winner = candidate
            break
    report["speed"] = {"tried": tried, "kept": winner is not None}
    if winner is None:
        closest = max(tried, key=lambda t: t["measured"]["lower_quartile"])
        q = closest["measured"]["lower_quartile"]
        report["chosen"] = report["selection_A"] = report["heldout_B"] = None
        report["message"] = (
            f"exits left off: measured against full depth on this machine (batch {closest['measured']['batch_size']},"
            f" {closest['measured']['pairs']} interleaved pairs), no setting's speed-up cleared 1.0 in its lower "
            f"quartile; the closest, exits {closest['check_layers']} at thresholds "
            f"{[round(t, 4) for t in closest['thresholds']]}, measured {closest['measured']['median']:.2f}x median "
            f"({q:.2f}x lower quartile, predicted {closest['predicted_speedup']:.2f}x): it would need its decoding "
            f"steps {100 * (1 - q):.0f}% faster to pay"
        )
        return
    if winner is not best:  # the next candidate paid where the first did not (on-policy check was for the first)
        report["on_policy_B"] = None
        _choose(report, winner, data_b, exit_layers, num_layers, costs, config, group)
    m = tried[-1]["measured"]
    report["message"] += (
        f"; measured {m['median']:.2f}x median ({m['lower_quartile']:.2f}x lower quartile) against "
        f"full depth on this machine"
    )


def apply_calibration(model, report: dict) -> None:
    """Stores the report's choice as the model's generation defaults (`model.generation_config`, saved to
    `generation_config.json`; generate() then uses it with no exit arguments); with no choice, exits are turned off
    (full depth)."""
    chosen = report.get("chosen")
    if chosen:
        thresholds = chosen["thresholds"]
        model.set_exit_defaults(
            exit_criterion=report["criterion"],
            exit_threshold=thresholds[0] if len(set(thresholds)) == 1 else list(thresholds),
            exit_check_layers=list(chosen["check_layers"]),
            exit_policy=report["policy"],
            exit_patience=report["patience"],
            exit_kv=report.get("kv", "immediate"),
        )
    else:
        model.set_exit_defaults(
            exit_criterion=None,
            exit_threshold=None,
            exit_check_layers=None,
            exit_patience=None,
            exit_policy=None,
            exit_kv=None,
        )


def speed_table(report: dict) -> list[str]:
    """The settings whose speed calibration measured: predicted (teacher-forced on split B) next to measured (really
    decoded against full depth, interleaved pairs), both quality measures; markdown lines."""
    lines = [
        "Settings measured against full depth on this machine, fastest predicted first (the speed promise: exits stay "
        "on only if the lower quartile of the measured speed-up clears 1.0 at every batch size):",
        "",
        "| check exits | thresholds | predicted speed-up | predicted per-token agreement (teacher-forced, B) | batch "
        "| measured speed-up: median (lower quartile) | per-token agreement, really decoded | identical-token share "
        "| kept |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    kept = report["speed"].get("kept")
    for k, t in enumerate(report["speed"]["tried"]):
        p = t.get("predicted_B") or {"speedup": t["predicted_speedup"], "agreement": float("nan")}
        last = kept and k == len(report["speed"]["tried"]) - 1
        for b, m in t["by_batch_size"].items():
            agreement = m.get("per_token_agreement")
            lines.append(
                f"| {t['check_layers']} | {', '.join(f'{x:.4g}' for x in t['thresholds'])} | {p['speedup']:.2f}x | "
                f"{p['agreement']:.3f} | {b} | {m['median']:.2f}x ({m['lower_quartile']:.2f}x) | "
                + (f"{agreement:.3f}" if agreement is not None else "-")
                + f" | {m['identical_token_share']:.3f} | {'yes' if last else 'no'} |"
            )
    return lines


def calibration_card(report: dict) -> str:
    """The card's calibration section (markdown). Quality figures are named by the measure they are (see
    `ee_transformers.measure.quality`)."""
    c = report["costs"]
    if report.get("guarantee"):
        g = report["guarantee"]
        goal = (
            f"Thresholds chosen by Learn then Test: with probability >= {1 - g['delta']:.2f} over the calibration "
            f"sample, the per-token disagreement rate with full depth is <= {g['epsilon']} (assumption: "
            f"{g['assumption']}; {g['positions']} positions, {g['tested_exit_sets']} exit sets tested, "
            f"{g['certified']} settings certified)."
        )
    else:
        goal = f"Target per-token agreement with full depth (teacher-forced) >= {report['target_agreement']}."
    lines = [
        f"Criterion `{report['criterion']}`, policy `{report['policy']}`, patience {report['patience']}. {goal}",
        "",
        f"Measured costs on `{c.get('device', '?')}` ({c.get('dtype', '?')}, batch {c.get('batch_size', '?')}), in "
        f"decoder-layer steps: LM head through an exit head {c['head_cost']:.2f}"
        + ("" if report["criterion"] in LOGIT_CRITERIA else f", `{report['criterion']}` check {c['check_cost']:.2f}")
        + f", K/V backfill per skipped layer {c['backfill_cost']:.2f}.",
        "",
    ]
    speed = report.get("speed")
    if report.get("chosen"):
        a, b = report["selection_A"], report["heldout_B"]
        thresholds = ", ".join(
            f"{layer}: {t:.4g}" for layer, t in zip(report["chosen"]["check_layers"], report["chosen"]["thresholds"])
        )
        measured = speed["tried"][-1]["measured"] if speed and speed.get("kept") else None
        lines += [
            f"Chosen: check exits {report['chosen']['check_layers']} with thresholds {{{thresholds}}} "
            "(stored in `generation_config.json`; `generate()` uses them when called without exit arguments).",
            "",
            "| split | positions | per-token agreement | mean exit layer | exit rate | predicted speed-up | measured "
            "speed-up |",
            "|---|---|---|---|---|---|---|",
            f"| A (chosen on), teacher-forced | {report['positions']['A']} | {a['agreement']:.3f} | "
            f"{a['mean_exit_layer']:.2f} | {a['exit_rate']:.3f} | {a['speedup']:.2f}x | - |",
            f"| B (reported), teacher-forced | {report['positions']['B']} | {b['agreement']:.3f} | "
            f"{b['mean_exit_layer']:.2f} | {b['exit_rate']:.3f} | {b['speedup']:.2f}x | "
            + (
                f"{measured['median']:.2f}x (lower quartile {measured['lower_quartile']:.2f}x) |"
                if measured
                else "not measured |"
            ),
        ]
        if report.get("on_policy_B"):
            v = report["on_policy_B"]
            lines.append(
                f"| B, really decoded (own prefix) | {v['tokens']} tokens | {v['agreement']:.3f} | "
                f"{v['mean_exit_layer']:.2f} | {v['exit_rate']:.3f} | - | - |"
            )
    else:
        lines.append(
            f"**Early exit is off by default** ({report['message']}). Pass exit arguments to `generate()` "
            "to try it anyway."
        )
    if speed and speed.get("tried"):
        lines += ["", *speed_table(report)]
    b = report.get("decode_batch_size", 1)
    grouped = " (batch policy: rows of a batch exit together)" if b > 1 and report["policy"] == "batch" else ""
    lines += [
        "",
        f"Predicted speed-ups are teacher-forced simulations at decode batch size {b}{grouped} with the "
        "measured costs"
        + (
            "; measured speed-ups are interleaved pairs of real decoding against full depth on the same weights"
            if speed
            else "; the benchmark measures real decoding"
        )
        + ". Per-token agreement: the share of "
        "early-exit tokens the full model would also choose at that position. Full report: `calibration.json`.",
    ]
    return "\n".join(lines)
