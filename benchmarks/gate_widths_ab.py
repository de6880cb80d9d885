"""Paired A/B of the gate with and without feeding a round at its cheapest trusted width (BENCHMARKS.md 5g): plain
generate, the old rule and the new one per batch, interleaved (order reversed every other batch), identical output
asserted, history off, 64 new tokens, prompt lookup N=4 G=3 with table drafts from `TABLE_FROM` ("none": no table).

    python benchmarks/gate_widths_ab.py BATCH_SIZE DOMAIN TABLE_FROM [REPS]

The runs of 5g were made before the rule was limited to one live row; at batch > 1 "new" now equals "old".
"""

import os
import sys
import time

import torch
from transformers import AutoTokenizer

import ee_transformers.drafts as drafts
from ee_transformers.measure.loading import load_models, make_batches
from ee_transformers.tools.assets.text import text_slice
from ee_transformers.tools.bench.loading import default_text_files, heldout_prompts
from ee_transformers.tools.bench.lossless import store_table_from

MODEL = os.path.expanduser("~/.cache/ee-transformers/smollm2-135m-instruct")
NEW_CHEAPEST = drafts.StepCosts.cheapest


def use(new):
    """The new rule, or the old one: no width beyond the drafts'."""
    drafts.StepCosts.cheapest = NEW_CHEAPEST if new else (lambda self, group, least, most=0: least)


def main():
    batch_size, domain, table_from = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    reps = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    torch.set_num_threads(2)
    ee, plain = load_models(MODEL, exit_layers=[0])
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    table = table_from != "none"
    if table:
        store_table_from(ee, tokenizer, table_from)
    path, region = default_text_files()[domain]
    texts = {domain: text_slice(path, region, 10**9)}
    prompts = heldout_prompts(tokenizer, num_prompts=16, window=64, seed=0, texts=texts)
    batches = make_batches(prompts, batch_size, max_batches=16 // batch_size)
    kwargs = dict(max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
    totals = {"plain": 0.0, "old": 0.0, "new": 0.0}
    with torch.inference_mode():
        for rep in range(reps):
            for i, (ids, mask, _) in enumerate(batches):
                order = ["plain", "old", "new"] if (i + rep) % 2 == 0 else ["new", "old", "plain"]
                seconds, reference = {}, None
                for name in order:
                    start = time.perf_counter()
                    if name == "plain":
                        out = plain.generate(ids, attention_mask=mask, **kwargs)
                    else:
                        use(name == "new")
                        out = ee.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=4,
                                          max_matching_ngram_size=3, speculative_table_drafts=table,
                                          speculative_history_tokens=0, **kwargs)  # fmt: skip
                    seconds[name] = time.perf_counter() - start
                    totals[name] += seconds[name]
                    reference = out if reference is None else reference
                    assert torch.equal(out, reference), name
                print(i, {k: round(seconds["plain"] / v, 3) for k, v in seconds.items() if k != "plain"}, flush=True)
    ratios = {k: round(totals["plain"] / v, 3) for k, v in totals.items() if k != "plain"}
    print("sum", ratios, {k: round(v, 1) for k, v in totals.items()})
    for group, widths in ee.drafter.costs.samples.items():
        print(group, {w: round(sorted(v)[len(v) // 2] * 1000, 1) for w, v in sorted(widths.items())})


if __name__ == "__main__":
    main()
