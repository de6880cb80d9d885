"""Where a batch's lossless rounds go when drafts rarely pay: each round's width, seconds and how far it moved the
batch's slowest row, next to what the gate (`drafts.plan_padded`) expected of it (BENCHMARKS.md section 5e).

    python benchmarks/gate_rounds.py --model ~/.cache/ee-transformers/smollm2-135m-instruct \
        --table-from python --domain austen --batch-size 8 --reps 3

The setting of 5e's batch-8 rows: a plain model (one untrained exit head, unused), the table stored from
`--table-from`, held-out prompts of `--domain` (16 windows of 64 tokens, batches of `--batch-size`), 64 new tokens,
greedy, no EOS, prompt lookup N=`--lookup` G=3 with table drafts. Each batch runs plain `generate` and ours in turn,
ours from an empty history index (the same prompts repeat: remembering its own answers would measure memory). Per
run it prints both wall times, the median plain step, the median seconds of our rounds that did not draft (a round's
seconds: its verification and commit; the lookups are printed apart, the rest of a round is not timed), every
drafted round as `k<width>:<ms>/+<slowest row's advance>`, what the gate expected of each drafted round (the mean
tokens of the rows that set the pace, and its cost against a plain round's) and the per-round seconds of the lookups.
The gate's measured costs persist in the process across runs, as in `bench-lossless`.

`--rule gate` is the library's gate (`drafts.plan_padded_fresh`: the plain width timed afresh where it is stale or
was never timed; a pace row's drafts beyond the slowest row's weighted by `BEYOND_SLOWEST`); `--rule fresh-mean` the
same with every pace row's drafts counted in full (the rows' mean); `--rule slowest` with the slowest row's alone;
`--rule unrefreshed` the gate before the refresh (the rows' mean, on whatever plain timings it has). The outputs of
5e's first probes (`mean.txt`, `slowest.txt`, `python-*.txt`) came from the unrefreshed mean and slowest rules.
"""

import argparse
import collections
import copy
import statistics
import time

import torch
from transformers import AutoTokenizer, LogitsProcessorList

import ee_transformers.drafts as drafts
import ee_transformers.speculative_early_exit as spec
from ee_transformers.measure.loading import load_models, make_batches
from ee_transformers.measure.timing import greedy_generation_config, without_eos
from ee_transformers.tools.assets.text import text_slice
from ee_transformers.tools.bench.loading import default_text_files, heldout_prompts
from ee_transformers.tools.bench.lossless import store_table_from


class _Stamps:
    """A logits processor that only records when each plain step's logits arrive."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--table-from", default="python")
    parser.add_argument("--domain", default="austen")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lookup", type=int, default=4, help="prompt_lookup_num_tokens")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--rule",
        choices=["gate", "fresh-mean", "unrefreshed", "slowest"],
        default="gate",
        help="the gate's rule (see above)",
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    ee, plain = load_models(args.model, exit_layers=[0])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    print("table entries, tokens:", store_table_from(ee, tokenizer, args.table_from))
    path, region = default_text_files()[args.domain]
    texts = {args.domain: text_slice(path, region, 10**9)}
    prompts = heldout_prompts(tokenizer, num_prompts=16, window=64, seed=0, texts=texts)
    batches = make_batches(prompts, args.batch_size, max_batches=16 // args.batch_size)

    gate_log, rounds, lookup = [], [], collections.Counter()
    fresh, mean_rule = drafts.plan_padded_fresh, drafts.plan_padded
    beyond = {"gate": drafts.BEYOND_SLOWEST, "fresh-mean": 1.0, "slowest": 0.0}.get(args.rule)
    verify_and_commit, copied_drafts = spec._verify_and_commit, spec.copied_drafts

    def logged_plan(probs, pace, costs, group, most_fed=0):
        cost = lambda width: costs.cost((*group, width))  # noqa: E731
        if args.rule == "unrefreshed":  # the gate before plan_padded_fresh: the mean, plain costs as old as they are
            w = mean_rule(probs, pace, cost)
        else:
            saved, drafts.BEYOND_SLOWEST = drafts.BEYOND_SLOWEST, beyond
            try:
                w = fresh(probs, pace, costs, group, most_fed)
            finally:
                drafts.BEYOND_SLOWEST = saved
        lead = [p for p, a in zip(probs, pace) if a]
        expected = 1 + sum(sum(p[:w]) for p in lead) / len(lead) if w else 1.0  # the mean rule's expectation
        gate_log.append(dict(w=w, plain=cost(1), cost=cost(w + 1), expected=expected, pace=len(lead)))
        return w

    def logged_round(model, loop, batch, cache, r):
        active = batch.active.clone()
        slowest = int(batch.length[active].min())
        start = time.perf_counter()
        out = verify_and_commit(model, loop, batch, cache, r)
        seconds = time.perf_counter() - start
        rounds.append(dict(k=r.drafts.shape[1], s=seconds, advance=int(batch.length[active].min()) - slowest))
        return out

    def timed_lookup(*a, **k):
        start = time.perf_counter()
        out = copied_drafts(*a, **k)
        lookup["seconds"] += time.perf_counter() - start
        return out

    spec.plan_padded_fresh, spec._verify_and_commit, spec.copied_drafts = logged_plan, logged_round, timed_lookup
    with without_eos(ee, plain):
        config = greedy_generation_config(plain, 64, clear_exit_settings=True)
        ours = copy.deepcopy(config)
        ours.prompt_lookup_num_tokens, ours.max_matching_ngram_size = args.lookup, 3
        for rep in range(args.reps):
            for b, (ids, mask, _) in enumerate(batches):
                stamps = _Stamps()
                start = time.perf_counter()
                expected = plain.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=config,
                    logits_processor=LogitsProcessorList([stamps]),
                )
                plain_s = time.perf_counter() - start
                steps = [t1 - t0 for t0, t1 in zip(stamps.times, stamps.times[1:])]
                ee.drafter.history.clear()
                gate_log.clear(), rounds.clear(), lookup.clear()
                start = time.perf_counter()
                got = ee.generate(
                    input_ids=ids, attention_mask=mask, generation_config=ours, speculative_table_drafts=True
                )
                ours_s = time.perf_counter() - start
                same = torch.equal(getattr(expected, "sequences", expected), getattr(got, "sequences", got))
                flat = [r["s"] for r in rounds if not r["k"]]
                drafted = [r for r in rounds if r["k"]]
                print(
                    f"rep {rep} batch {b}: plain {plain_s:.2f} s (step median {1000 * statistics.median(steps):.0f} ms)"
                    f", ours {ours_s:.2f} s: {plain_s / ours_s:.2f}x plain, identical={same}; {len(rounds)} rounds, "
                    f"{len(drafted)} drafted; lookups {1000 * lookup['seconds'] / len(rounds):.2f} ms per round"
                )
                if flat:
                    print(f"  rounds without drafts: median {1000 * statistics.median(flat):.0f} ms")
                print(
                    "  drafted rounds: " + " ".join(f"k{r['k']}:{1000 * r['s']:.0f}ms/+{r['advance']}" for r in drafted)
                )
                print(
                    "  the gate expected: "
                    + " ".join(
                        f"w{g['w']} {g['expected']:.2f} tok ({g['pace']} pace) at {g['cost'] / g['plain']:.2f}x"
                        for g in gate_log
                        if g["w"]
                    )
                )


if __name__ == "__main__":
    main()
