"""Where a context-draft generate spends its time on the GPU machine: one plain and one drafted call at the 8B shape
(batch 1 and 8, 64 new tokens), each timed, with every thread's stack dumped every `--every` seconds while they run.

    python benchmarks/gpu_draft_trace.py [--every 20] [--tiny]
"""

import argparse
import faulthandler
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_llama8b_forced import EXITS_8B, EXITS_TINY, LLAMA3_8B, TINY, build_model  # noqa: E402

from ee_transformers.measure.loading import make_batches, random_prompts  # noqa: E402
from ee_transformers.measure.timing import greedy_generation_config, without_eos  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=float, default=20.0)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    fields, exits = (TINY, EXITS_TINY) if args.tiny else (LLAMA3_8B, EXITS_8B)
    ee, plain = build_model(fields, exits, torch.float32 if args.tiny else torch.bfloat16, device)
    prompts = random_prompts(fields["vocab_size"], 8, 64)
    faulthandler.dump_traceback_later(args.every, repeat=True)
    with without_eos(ee, plain), torch.no_grad():
        for b in (1, 8):
            ids, mask, _ = make_batches(prompts, b, 1, device)[0]
            cfg = greedy_generation_config(plain, 64, clear_exit_settings=True)
            drafted = greedy_generation_config(plain, 64, clear_exit_settings=True)
            drafted.update(prompt_lookup_num_tokens=4, max_matching_ngram_size=3, return_dict_in_generate=True)
            for name, model, config in [("plain", plain, cfg), ("ours", ee, drafted)] * 2:
                start = time.perf_counter()
                out = model.generate(ids, attention_mask=mask, generation_config=config)
                if device == "cuda":
                    torch.cuda.synchronize()
                extra = ""
                if name == "ours":
                    extra = (
                        f" rounds {out.draft_lengths.shape[-1]} drafted {int(out.draft_tokens.sum())}"
                        f" accepted {int(out.accepted_tokens.sum())}"
                    )
                print(f"batch {b} {name}: {time.perf_counter() - start:.2f} s{extra}", flush=True)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
