"""Seconds of one plain forward that feeds q positions per row after a 96-token prefix, per q (BENCHMARKS.md 5g): where
the CPU's kernels are slower at a narrower round than at a wider one, the gate feeds the wider one. `--head-only`:
the LM head alone on q rows of random states.

    python benchmarks/verify_widths.py --model ~/.cache/ee-transformers/smollm2-135m-instruct --batch-size 1
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--widths", default="1,2,3,4,5,6,8")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--head-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    with torch.inference_mode():
        prefix = torch.randint(0, vocab, (args.batch_size, 96))
        for q in map(int, args.widths.split(",")):
            seconds = []
            for _ in range(args.reps):
                if args.head_only:
                    head, states = (
                        model.get_output_embeddings(),
                        torch.randn(args.batch_size, q, model.config.hidden_size),
                    )
                    start = time.perf_counter()
                    head(states)
                else:
                    cache = DynamicCache(config=model.config)
                    model(prefix, past_key_values=cache, use_cache=True)
                    fed = torch.randint(0, vocab, (args.batch_size, q))
                    start = time.perf_counter()
                    model(fed, past_key_values=cache, use_cache=True, logits_to_keep=q)
                seconds.append(time.perf_counter() - start)
            what = "LM head" if args.head_only else "forward"
            median = sorted(seconds)[len(seconds) // 2] * 1000
            print(f"{what}, batch {args.batch_size}, width {q}: {median:.1f} ms (median)")


if __name__ == "__main__":
    main()
