"""Where a context-draft generate's time goes on the GPU machine, by torch.profiler: plain greedy against ours
(`prompt_lookup_num_tokens=4`) at the 8B shape, batch 1 and 8, 64 new tokens, after one warm-up call each; prints each
call's wall time, its host-device synchronisations and copies, and the top operators by host time.

    python benchmarks/gpu_draft_profile.py [--tiny] [--top 25]
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_llama8b_forced import EXITS_8B, EXITS_TINY, LLAMA3_8B, TINY, build_model  # noqa: E402

from ee_transformers.measure.loading import make_batches, random_prompts  # noqa: E402
from ee_transformers.measure.timing import greedy_generation_config, without_eos  # noqa: E402

SYNC_KEYS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaLaunchKernel", "aten::item")


def setup(tiny):
    """(device, early-exit model, its plain twin, random prompts) at the 8B shape on the GPU, or tiny on the CPU."""
    device = "cpu" if tiny else "cuda"
    fields, exits = (TINY, EXITS_TINY) if tiny else (LLAMA3_8B, EXITS_8B)
    ee, plain = build_model(fields, exits, torch.float32 if tiny else torch.bfloat16, device)
    return device, ee, plain, random_prompts(fields["vocab_size"], 8, 64)


def configs(plain):
    """Plain greedy's generation config and ours with context drafts (64 new tokens)."""
    cfg = greedy_generation_config(plain, 64, clear_exit_settings=True)
    drafted = greedy_generation_config(plain, 64, clear_exit_settings=True)
    drafted.update(prompt_lookup_num_tokens=4, max_matching_ngram_size=3, return_dict_in_generate=True)
    return cfg, drafted


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    device, ee, plain, prompts = setup(args.tiny)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    with without_eos(ee, plain), torch.no_grad():
        for b in (1, 8):
            ids, mask, _ = make_batches(prompts, b, 1, device)[0]
            cfg, drafted = configs(plain)
            for name, model, config in (("plain", plain, cfg), ("ours", ee, drafted)):
                model.generate(ids, attention_mask=mask, generation_config=config)  # warm-up (and the gate's costs)
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                with profile(activities=activities) as prof:
                    out = model.generate(ids, attention_mask=mask, generation_config=config)
                    if device == "cuda":
                        torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                averages = prof.key_averages()
                counts = {e.key: e.count for e in averages}
                extra = ""
                if name == "ours":
                    extra = (
                        f", rounds {out.draft_lengths.shape[-1]}, drafted {int(out.draft_tokens.sum())}, "
                        f"accepted {int(out.accepted_tokens.sum())}"
                    )
                print(f"\n=== batch {b} {name}: {seconds:.2f} s under the profiler{extra}")
                print("    " + ", ".join(f"{k} {counts.get(k, 0)}" for k in SYNC_KEYS))
                print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=48))
                if device == "cuda":
                    print(averages.table(sort_by=sort, row_limit=12, max_name_column_width=48))


if __name__ == "__main__":
    main()
