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

from gpu_draft_profile import configs, setup  # noqa: E402

from ee_transformers.measure.loading import make_batches  # noqa: E402
from ee_transformers.measure.timing import without_eos  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=float, default=20.0)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device, ee, plain, prompts = setup(args.tiny)
    faulthandler.dump_traceback_later(args.every, repeat=True)
    with without_eos(ee, plain), torch.no_grad():
        for b in (1, 8):
            ids, mask, _ = make_batches(prompts, b, 1, device)[0]
            cfg, drafted = configs(plain)
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
