"""Paired A/B of the padded gate with and without its pace ledger (`drafts.PaceLedger`: the valuation of a round's
drafts scaled by how far drafted rounds really moved the batch's frontier). Per batch: plain `generate`, the gate
without the ledger (its factor held at 1) and with it, interleaved (order reversed every other batch), identical
output asserted; each variant keeps a ledger of its own across the run, the measured step costs are shared (the same
machine); history off, 64 new tokens, no EOS, prompt lookup N=4 G=3 with table drafts from `--table-from`, held-out
prompts of `--domain` (16 windows of 64 tokens).

    python benchmarks/gate_pace_ab.py --model ~/.cache/ee-transformers/smollm2-135m-instruct \
        --table-from python --domain austen --batch-size 8 --reps 3

Prints per batch the speed-ups against plain and the drafted rounds of each variant, then the sums and each ledger's
factor per number of live rows.
"""

import argparse
import time

import torch
from transformers import AutoTokenizer

import ee_transformers.drafts as drafts
from ee_transformers.measure.loading import load_models, make_batches
from ee_transformers.tools.assets.text import text_slice
from ee_transformers.tools.bench.loading import default_text_files, heldout_prompts
from ee_transformers.tools.bench.lossless import store_table_from


class _Untrusting(drafts.PaceLedger):
    """The gate before the ledger: it records, but its factor is always 1."""

    def factor(self, rows):
        return 1.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--table-from", default="python", help='"none": no table drafts')
    parser.add_argument("--domain", default="austen")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    ee, plain = load_models(args.model, exit_layers=[0])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    table = args.table_from != "none"
    if table:
        print("table entries, tokens:", store_table_from(ee, tokenizer, args.table_from))
    path, region = default_text_files()[args.domain]
    texts = {args.domain: text_slice(path, region, 10**9)}
    prompts = heldout_prompts(tokenizer, num_prompts=16, window=64, seed=0, texts=texts)
    batches = make_batches(prompts, args.batch_size, max_batches=16 // args.batch_size)
    kwargs = dict(max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
    ledgers = {"off": _Untrusting(), "on": drafts.PaceLedger()}
    totals, drafted = {"plain": 0.0, "off": 0.0, "on": 0.0}, {"off": 0, "on": 0}
    with torch.inference_mode():
        for rep in range(args.reps):
            for i, (ids, mask, _) in enumerate(batches):
                order = ["plain", "off", "on"] if (i + rep) % 2 == 0 else ["on", "off", "plain"]
                seconds, rounds, reference = {}, {}, None
                for name in order:
                    start = time.perf_counter()
                    if name == "plain":
                        out = plain.generate(ids, attention_mask=mask, **kwargs)
                    else:
                        ee.drafter.pace = ledgers[name]
                        out = ee.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=4,
                                          max_matching_ngram_size=3, speculative_table_drafts=table,
                                          speculative_history_tokens=0, return_dict_in_generate=True, **kwargs)  # fmt: skip
                        rounds[name] = sum(int(k > 0) for k in out.draft_lengths.tolist())
                        drafted[name] += rounds[name]
                        out = out.sequences
                    seconds[name] = time.perf_counter() - start
                    totals[name] += seconds[name]
                    reference = out if reference is None else reference
                    assert torch.equal(out, reference), name
                ratios = {k: round(seconds["plain"] / v, 3) for k, v in seconds.items() if k != "plain"}
                print(f"rep {rep} batch {i}: x plain {ratios}, drafted rounds {rounds}", flush=True)
    ratios = {k: round(totals["plain"] / v, 3) for k, v in totals.items() if k != "plain"}
    print("sum: x plain", ratios, "seconds", {k: round(v, 1) for k, v in totals.items()}, "drafted rounds", drafted)
    for name, ledger in ledgers.items():
        factors = {rows: round(drafts.PaceLedger.factor(ledger, rows), 3) for rows in sorted(ledger.rounds)}
        print(f"ledger {name}: factor by live rows {factors}")


if __name__ == "__main__":
    main()
