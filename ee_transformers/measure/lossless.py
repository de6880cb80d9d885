"""Lossless decoding timed against plain greedy generate, paired and interleaved: what `ee-transformers
bench-lossless` and lossless calibration (`calibrate --lossless`) share.

`measure_rows`: per batch, plain, c1, plain, c2, ... with each configuration timed against the mean of its two
neighbouring plain runs, so drift of a shared machine cancels; every run of ours starts from an empty history index
(the same prompts run many times: a history of their own outputs would measure memory of the answer).
`measure_workload`: whole passes over batches in order, the history kept within a pass, as a process serving those
requests in turn would.
"""

import copy
import statistics
import time
from contextlib import nullcontext

import torch

from ee_transformers.measure.timing import only_these_drafts
from ee_transformers.request import MAX_BATCH_FIELD, OUR_FIELDS

__all__ = ["measure_rows", "measure_workload"]


def _timed(model, ids, mask, generation_config, kwargs, keep_history=False):
    """One run. Ours starts from an empty history index (unless `keep_history`): the same prompts run many times
    here, and a history of their own earlier outputs would measure memory of the answer, not drafts on unseen text
    (the acceptance statistics and step costs the gate learned are kept: they hold no text)."""
    if hasattr(model, "drafter") and not keep_history:
        model.drafter.history.clear()
    config = copy.deepcopy(generation_config)
    ours = {k: v for k, v in kwargs.items() if k in OUR_FIELDS}  # not GenerationConfig fields: our loop's arguments
    config.update(**{k: v for k, v in kwargs.items() if k not in ours})  # transformers deprecates mixing the two
    # the stored draft settings the row does not name stay out of it (hidden while it runs)
    off = [k for k, v in only_these_drafts(kwargs).items() if v is None] + [MAX_BATCH_FIELD]
    hidden = model.without_stored_settings(off) if hasattr(model, "without_stored_settings") else nullcontext()
    start = time.perf_counter()
    with torch.no_grad(), hidden:
        out = model.generate(ids, attention_mask=mask, generation_config=config, **ours)
    return time.perf_counter() - start, out


def _forwards(out, new_tokens):
    """Full-depth forwards after the prefill: a round each for ours; one per token for transformers' and plain."""
    rounds = getattr(out, "draft_lengths", None)
    return len(rounds) if rounds is not None else new_tokens - 1


def _count(outs, name):
    return sum(int(getattr(o, name).sum()) for o in outs if getattr(o, name, None) is not None)


def _result(row, batch_size, plain_times, times, outs, identical, new_tokens, runs_per_time=1, suffix=""):
    """One row's figures from its paired timings and its outputs `outs` (every run's)."""
    ratios = [p / t for p, t in zip(plain_times, times)]
    return dict(
        name=row["name"] + suffix,
        who=row["who"],
        batch_size=batch_size,
        kwargs=row["kwargs"],
        speedup=sum(plain_times) / sum(times),
        median=statistics.median(ratios),
        low=min(ratios),
        high=max(ratios),
        tokens_per_forward=(new_tokens - 1) / statistics.mean(_forwards(o, new_tokens) for o in outs),
        identical=identical,
        drafted=_count(outs, "draft_tokens"),
        accepted=_count(outs, "accepted_tokens"),
        plain_ms_per_token=1000 * statistics.mean(plain_times) / (new_tokens * runs_per_time),
    )


def measure_rows(ee, plain, batches, rows, generation_config, rounds, log=print) -> list[dict]:
    """Paired, interleaved timing of `rows` (see `lossless_rows`) against plain generate on `batches`; returns one
    result per row: speed-up (summed plain time / summed row time), median / min / max of the per-batch ratios,
    full-depth forwards per token, and whether every output equalled plain greedy's."""
    new_tokens = generation_config.max_new_tokens
    reference = {}  # a batch's full-depth output: its first paired plain run's
    _timed(plain, *batches[0][:2], generation_config, {})  # warm-up
    for row in rows:  # warm-up of every row
        _timed(ee if row["who"] == "ours" else plain, *batches[0][:2], generation_config, row["kwargs"])
    times, plain_times, outs = ([[] for _ in rows] for _ in range(3))
    identical = [True] * len(rows)
    for round_ in range(rounds):
        order = list(range(len(rows)))[:: 1 if round_ % 2 == 0 else -1]
        for ids, mask, _ in batches:
            before, first = _timed(plain, ids, mask, generation_config, {})
            reference.setdefault(id(ids), first.sequences)
            for i in order:
                model = ee if rows[i]["who"] == "ours" else plain
                seconds, out = _timed(model, ids, mask, generation_config, rows[i]["kwargs"])
                after, _ = _timed(plain, ids, mask, generation_config, {})
                times[i].append(seconds)
                plain_times[i].append((before + after) / 2)
                identical[i] &= torch.equal(out.sequences, reference[id(ids)])
                outs[i].append(out)
                before = after
        log(f"  batch {batches[0][0].shape[0]}: round {round_ + 1}/{rounds} done")
    size = int(batches[0][0].shape[0])
    return [
        _result(row, size, plain_times[i], times[i], outs[i], identical[i], new_tokens) for i, row in enumerate(rows)
    ]


def measure_workload(ee, plain, batches, rows, generation_config, rounds, log=print) -> list[dict]:
    """Whole passes over `batches` in order, paired and interleaved like `measure_rows` (plain, row, plain, ...): a
    pass of ours starts from an empty history index and keeps what each batch generates for the batches after it,
    as a process serving these requests in turn would."""

    def run(model, kwargs):
        if hasattr(model, "drafter"):
            model.drafter.history.clear()
        seconds, outs = 0.0, []
        for ids, mask, _ in batches:
            t, out = _timed(model, ids, mask, generation_config, kwargs, keep_history=True)
            seconds, outs = seconds + t, outs + [out]
        return seconds, outs

    new_tokens = generation_config.max_new_tokens
    _, reference = run(plain, {})
    for row in rows:  # warm-up
        run(ee if row["who"] == "ours" else plain, row["kwargs"])
    times, plain_times, stats = ([[] for _ in rows] for _ in range(3))
    identical = [True] * len(rows)
    for round_ in range(rounds):
        before, _ = run(plain, {})
        for i, row in enumerate(rows):
            seconds, outs = run(ee if row["who"] == "ours" else plain, row["kwargs"])
            after, _ = run(plain, {})
            times[i].append(seconds)
            plain_times[i].append((before + after) / 2)
            before = after
            identical[i] &= all(torch.equal(o.sequences, r.sequences) for o, r in zip(outs, reference))
            stats[i] += outs
        log(f"  repeated workload: round {round_ + 1}/{rounds} done")
    size, runs = int(batches[0][0].shape[0]), len(batches)
    suffix = ", repeated workload"
    return [
        _result(row, size, plain_times[i], times[i], stats[i], identical[i], new_tokens, runs, suffix)
        for i, row in enumerate(rows)
    ]
