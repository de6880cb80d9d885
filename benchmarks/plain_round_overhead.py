"""What a round of ours costs where nothing is drafted (BENCHMARKS.md 5g): every round forced plain (the gate's plan
returns 0), against plain `generate` on the same modules, interleaved, identical output asserted; then one profiled
generate of each, counting aten ops.

    python benchmarks/plain_round_overhead.py --model ~/.cache/ee-transformers/smollm2-135m-instruct --batch-size 1
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoTokenizer

import ee_transformers.speculative_early_exit as spec
from ee_transformers.measure.loading import load_models, make_batches
from ee_transformers.tools.assets.text import text_slice
from ee_transformers.tools.bench.loading import default_text_files, heldout_prompts


def aten_ops(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    ee, plain = load_models(args.model, exit_layers=[0])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    path, region = default_text_files()["python"]
    texts = {"python": text_slice(path, region, 10**9)}
    prompts = heldout_prompts(tokenizer, num_prompts=8, window=64, seed=0, texts=texts)
    ids, mask, _ = make_batches(prompts, args.batch_size, max_batches=1)[0]
    spec.plan_padded_fresh = lambda *a, **k: 0  # every round plain
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)

    def ours():
        return ee.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=4, max_matching_ngram_size=3,
                           speculative_history_tokens=0, **kwargs)  # fmt: skip

    def base():
        return plain.generate(ids, attention_mask=mask, **kwargs)

    with torch.inference_mode():
        assert torch.equal(ours(), base())
        seconds = {"plain": [], "ours": []}
        for _ in range(args.reps):
            for name, fn in (("plain", base), ("ours", ours)):
                start = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - start)
        medians = {k: statistics.median(v) for k, v in seconds.items()}
        ops = {"plain": aten_ops(base), "ours": aten_ops(ours)}
    steps = args.new_tokens - 1
    print(f"batch {args.batch_size}: plain {medians['plain']:.3f} s, ours {medians['ours']:.3f} s, "
          f"{medians['plain'] / medians['ours']:.3f}x; aten ops plain {ops['plain']}, ours {ops['ours']}, "
          f"{(ops['ours'] - ops['plain']) / steps:.0f} more per round")  # fmt: skip


if __name__ == "__main__":
    main()
