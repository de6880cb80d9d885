"""What table drafts can reach, counted on the model's own greedy text (BENCHMARKS.md section 5, "Table drafts").

    python benchmarks/table_drafts_probe.py [--model ~/.cache/ee-transformers/smollm2-135m-instruct] [--prompts 16]

Generates the full-depth greedy continuations (64 tokens) of held-out prompts (the benchmark's), then replays
prompt-lookup rounds on them without the model: each round drafts up to N tokens (the row's own text first, as
`context_drafts` does; else a table of the training text), keeps the longest prefix equal to the greedy text, plus one
token. Output is exact for greedy decoding, so the counts are what the engine would do. Prints, per N and table
variant: tokens per round (batch 1) and the rounds a batch of 8 takes (its slowest row), and a batch-1 speed-up
predicted from this machine's cost of a forward per width (measured here, in the same run).

Variants: no table; the pair table `set_draft_table` stores (contexts of 2 tokens, else 1); contexts of 3, 2, 1
tokens; and those two keeping only continuations with at least 30% / 50% of their context's count.
"""

import argparse
import collections
import os
import statistics
import time

import torch
from transformers import AutoTokenizer

from ee_transformers.compat import cache_of
from ee_transformers.measure.timing import greedy_generation_config, without_eos
from ee_transformers.tools.assets import token_sequences, training_texts
from ee_transformers.tools.bench.loading import heldout_prompts, load_models, make_batches


def own_drafts(text, n, g=3):
    """`context_drafts` on one row, in Python."""
    for size in range(min(g, len(text) - 1), 0, -1):
        tail, latest, earliest = text[-size:], None, None
        for s in range(len(text) - size):
            if text[s : s + size] == tail:
                earliest = s if earliest is None else earliest
                latest = s if s + size + n <= len(text) else latest
        at = latest if latest is not None else earliest
        if at is not None:
            return text[at + size : at + size + n]
    return []


def build(corpus, order):
    """{context of `order` tokens: (most frequent next token, its share)}, continuations seen twice or more."""
    counts = collections.defaultdict(collections.Counter)
    for seq in corpus:
        for i in range(order, len(seq)):
            counts[tuple(seq[i - order : i])][seq[i]] += 1
    table = {}
    for context, c in counts.items():
        (token, n), total = min(c.items(), key=lambda kv: (-kv[1], kv[0])), sum(c.values())
        if n >= 2:
            table[context] = (token, n / total)
    return table


def table_drafts(tables, text, n, orders, share):
    out, t = [], list(text)
    for _ in range(n):
        hit = next((tables[o][tuple(t[-o:])] for o in orders if tuple(t[-o:]) in tables[o]), None)
        if hit is None or hit[1] < share:
            break
        out.append(hit[0])
        t.append(hit[0])
    return out


def replay(seq, prompt, drafts):
    """(rounds, fed width of each round) of one row."""
    text, target, done, widths = list(seq[: prompt + 1]), seq[prompt + 1 :], 0, []  # the first token: prefill
    while done < len(target):
        d = drafts(text)
        kept = 0
        while kept < len(d) and done + kept < len(target) and d[kept] == target[done + kept]:
            kept += 1
        step = min(kept + 1, len(target) - done)
        text += target[done : done + step]
        done += step
        widths.append(len(d) + 1)
    return len(widths), widths


@torch.no_grad()
def width_costs(model, ids, widths=(1, 2, 3, 4, 5)):
    """ms of one full-depth forward of `w` positions after a 64-token prefix, batch 1 (median of 10)."""
    out = {}
    for w in widths:
        times = []
        for _ in range(12):
            cache = cache_of(model(ids[:1, :64], use_cache=True))
            start = time.perf_counter()
            model(ids[:1, 64 : 64 + w], cache=cache, use_cache=True)
            times.append(time.perf_counter() - start)
        out[w] = 1000 * statistics.median(times[2:])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/ee-transformers/smollm2-135m-instruct"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ee, plain = load_models(args.model, exit_layers=[0])
    prompts = heldout_prompts(tokenizer, num_prompts=args.prompts, window=64)
    seqs = []
    with without_eos(ee, plain):
        config = greedy_generation_config(plain, 64, clear_exit_settings=True)
        for ids, mask, _ in make_batches(prompts, 8, max_batches=len(prompts) // 8):
            seqs += plain.generate(ids, attention_mask=mask, generation_config=config).sequences.tolist()
    cost = width_costs(plain, torch.tensor(seqs))
    print("batch-1 forward ms per fed width: " + ", ".join(f"{w}: {ms:.1f}" for w, ms in cost.items()))
    corpus = token_sequences(training_texts(), tokenizer)
    tables = {o: build(corpus, o) for o in (1, 2, 3)}
    variants = {
        "no table": None,
        "pairs (set_draft_table)": ((2, 1), 0.0),
        "contexts of 3, 2, 1": ((3, 2, 1), 0.0),
        "pairs, share >= 0.3": ((2, 1), 0.3),
        "contexts of 3, 2, 1, share >= 0.5": ((3, 2, 1), 0.5),
    }
    print("| N | table | tokens per round (batch 1) | predicted batch-1 speed-up | rounds of the batches of 8 |")
    print("|---|---|---|---|---|")
    for n in (2, 3, 4):
        for name, v in variants.items():

            def drafts(text, v=v, n=n):
                return own_drafts(text, n) or ([] if v is None else table_drafts(tables, text, n, *v))

            runs = [replay(s, 64, drafts) for s in seqs]
            rounds = [r for r, _ in runs]
            fed = sum(cost[min(w, 5)] for _, widths in runs for w in widths)
            batches = [max(rounds[b : b + 8]) for b in range(0, len(rounds), 8)]
            print(
                f"| {n} | {name} | {63 * len(seqs) / sum(rounds):.2f} | {63 * len(seqs) * cost[1] / fed:.2f}x | "
                f"{' + '.join(map(str, batches))} = {sum(batches)} |"
            )


if __name__ == "__main__":
    main()
