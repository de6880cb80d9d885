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

import torch

from ee_transformers.measure.quality import full_model_view
from ee_transformers.training.calibration_config import (  # noqa: F401 (also importable from here, as before)
    CalibrationConfig,
)
from ee_transformers.training.calibration_report import (  # noqa: F401 (also importable from here, as before)
    apply_calibration,
    calibration_card,
    speed_table,
)
from ee_transformers.training.simulation import (  # noqa: F401 (also importable from here, as before)
    COST_KEYS,
    CRITERIA,
    check_costs,
    collect_exit_scores,
    guaranteed_policy,
    lower_quartile,
    measure_costs,
    scores_from_logits,
    search_policy,
    simulate,
    simulated_exits,
)


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
