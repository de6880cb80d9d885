"""Where context-draft decoding spends its time on this machine (BENCHMARKS.md section 5, "Where the time goes").

    python benchmarks/lossless_costs.py [--model ~/.cache/ee-transformers/smollm2-135m-instruct] [--threads 2]

Prints, for the real model: the LM head's, the top-8192 draft head's (`assistant_vocab_size=8192`; the folder's
stored draft vocabulary, or the first 8192 ids when it stores none: the cost does not depend on which) and one layer
MLP's cost per number of rows (median of timed calls); then,
at batch 1 and 8 on held-out prompts (64 tokens, 64 new, EOS off), plain greedy's ms per step against the rounds of
`prompt_lookup_num_tokens=N, max_matching_ngram_size=3`: rounds, the median verification forward per width, and each
row's rounds (a batch decodes until its slowest row has its tokens).
"""

import argparse
import collections
import os
import statistics
import time

import torch
from transformers import AutoTokenizer

import ee_transformers.speculative_early_exit as spec
from ee_transformers.convert import read_config
from ee_transformers.measure.timing import greedy_generation_config, without_eos
from ee_transformers.tools.bench.loading import heldout_prompts, load_models, make_batches


def ee_folder(path):
    return bool(read_config(path).get("exit_layers"))


def median_ms(fn, calls=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@torch.no_grad()
def piece_costs(model, draft):
    head, mlp = model.lm_head, model.model.layers[3].mlp
    print("| rows | LM head ms | top-8192 draft head ms | layer MLP ms |\n|---|---|---|---|")
    for rows in (1, 2, 3, 4, 5, 8, 12, 16, 24, 40):
        x = torch.randn(rows, model.config.hidden_size)
        head_ms, mlp_ms = median_ms(lambda x=x: head(x)), median_ms(lambda x=x: mlp(x[None]))
        print(f"| {rows} | {head_ms:.2f} | {median_ms(lambda x=x: draft(x)):.2f} | {mlp_ms:.2f} |")


@torch.no_grad()
def rounds(ee, plain, prompts, batch_size, lookup):
    ids, mask, _ = make_batches(prompts, batch_size, max_batches=1)[0]
    widths = []
    verify = spec.verify

    def timed_verify(*args, **kwargs):
        start = time.perf_counter()
        out = verify(*args, **kwargs)
        widths.append((args[2].shape[1], 1000 * (time.perf_counter() - start)))
        return out

    with without_eos(ee, plain):
        config = greedy_generation_config(plain, 64, clear_exit_settings=True)
        plain.generate(ids, attention_mask=mask, generation_config=config)  # warm-up
        start = time.perf_counter()
        plain.generate(ids, attention_mask=mask, generation_config=config)
        step = 1000 * (time.perf_counter() - start) / 64
        config.update(prompt_lookup_num_tokens=lookup, max_matching_ngram_size=3)
        ee.generate(ids, attention_mask=mask, generation_config=config)  # warm-up
        spec.verify = timed_verify
        try:
            start = time.perf_counter()
            out = ee.generate(ids, attention_mask=mask, generation_config=config)
            total = 1000 * (time.perf_counter() - start)
        finally:
            spec.verify = verify
    by_width = collections.defaultdict(list)
    for q, ms in widths:
        by_width[q].append(ms)
    shown = ", ".join(f"{q} positions: {len(v)} x {statistics.median(v):.1f} ms" for q, v in sorted(by_width.items()))
    print(
        f"batch {batch_size}, N={lookup}: plain {step:.1f} ms per step; ours {total:.0f} ms against plain "
        f"{64 * step:.0f} ms, {len(out.draft_lengths)} rounds ({shown}); rounds per row {out.verify_rounds.tolist()}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/ee-transformers/smollm2-135m-instruct"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ee, plain = load_models(args.model, exit_layers=None if ee_folder(args.model) else [0])
    if (ee.config.draft_vocab_size or 0) < 8192:
        ee.set_draft_vocab(torch.arange(8192))
    piece_costs(plain, spec.draft_vocab_head(ee, 8192))
    prompts = heldout_prompts(AutoTokenizer.from_pretrained(args.model), num_prompts=8, window=64)
    for batch_size, lookup in ((1, 2), (1, 4), (8, 2)):
        rounds(ee, plain, prompts, batch_size, lookup)


if __name__ == "__main__":
    main()
