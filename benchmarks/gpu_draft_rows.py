"""The lossless drafts' GPU rows at Llama-3-8B's shape (random bf16 weights, built on the GPU like
`gpu_llama8b_forced.py`): what a verification costs by width, and context drafts against plain greedy.

    python benchmarks/gpu_draft_rows.py                  # batch 1, 8, 32: writes benchmarks/results/gpu_draft_rows/
    python benchmarks/gpu_draft_rows.py --tiny           # CPU smoke run of the same code (small config, fp32)

1. **Verification cost by width.** After a 64-token prefill at batch B, one full-depth forward of w positions per
   row (w = 1 is a plain decode step), median of timed calls with the device synchronised, as a ratio to w = 1. This
   is what the gate (`drafts.plan_padded`) weighs: a round of w positions pays when the batch's expected advance
   beyond one token exceeds cost(w) / cost(1) - 1.
2. **Context drafts end to end** (`ee_transformers.measure.lossless.measure_rows`, the `bench-lossless` rows):
   `prompt_lookup_num_tokens=4, max_matching_ngram_size=3` with the gate and without it, and transformers' own prompt
   lookup at batch 1, each paired with plain greedy generate on the same modules, identical output asserted. The
   weights are random, so what the model generates (and so how many drafts it accepts) says nothing about text:
   read the acceptance column next to the speed, and the cost table for what a GPU round costs.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a bare checkout, without installing the package
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_llama8b_forced import EXITS_8B, EXITS_TINY, LLAMA3_8B, TINY, build_model  # noqa: E402

from ee_transformers.measure.loading import make_batches, random_prompts  # noqa: E402
from ee_transformers.tools.bench.lossless import LosslessConfig, format_lossless, run_lossless  # noqa: E402
from ee_transformers.utils.arguments import comma_list  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def width_costs(plain, prompts, batch_size, widths, calls, device):
    """{width: median ms} of one full-depth forward of `width` positions per row after a prefill of the prompts."""
    ids, mask, _ = make_batches(prompts, batch_size, max_batches=1, device=device)[0]
    cache = DynamicCache(config=plain.config)
    plain(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    out = {}
    for w in widths:
        step = ids[:, -w:] if w <= ids.shape[1] else ids[:, :1].repeat(1, w)
        step_mask = torch.cat([mask, mask.new_ones(batch_size, w)], dim=1)
        times = []
        for i in range(3 + calls):
            _sync(device)
            start = time.perf_counter()
            plain(input_ids=step, attention_mask=step_mask, cache=cache, use_cache=True)
            _sync(device)
            if i >= 3:
                times.append(time.perf_counter() - start)
            cache.crop(-w)  # back to the prefill
        out[w] = 1000 * statistics.median(times)
    return out


def format_costs(costs):
    widths = sorted(next(iter(costs.values())))
    lines = [
        "| batch | " + " | ".join(f"w={w}" for w in widths) + " |",
        "|---|" + "---|" * len(widths),
    ]
    for b, row in costs.items():
        cells = [f"{row[w]:.2f} ms ({row[w] / row[1]:.2f}x)" for w in widths]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small config on CPU in fp32: a smoke run of this script")
    parser.add_argument("--batch-sizes", type=comma_list(int), default=None, help="default 1,8,32 (tiny: 1,4)")
    parser.add_argument("--widths", type=comma_list(int), default=[1, 2, 3, 5, 9, 17])
    parser.add_argument("--calls", type=int, default=10, help="timed forwards per width")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 64 (tiny: 16)")
    parser.add_argument("--rounds", type=int, default=1, help="paired rounds of the end-to-end rows")
    parser.add_argument("--skip-rows", action="store_true", help="the cost table only")
    parser.add_argument("--out", default=None, help="default benchmarks/results/gpu_draft_rows (tiny: ..._tiny)")
    args = parser.parse_args(argv)
    if 1 not in args.widths:
        parser.error("--widths must include 1 (the plain step every ratio is taken against)")
    tiny = args.tiny
    batch_sizes = args.batch_sizes or ([1, 4] if tiny else [1, 8, 32])
    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    out_dir = Path(args.out or ROOT / "benchmarks" / "results" / ("gpu_draft_rows_tiny" if tiny else "gpu_draft_rows"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "No CUDA device: run on a GPU machine, or pass --tiny for a CPU smoke run.\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fields, exits = (TINY, EXITS_TINY) if tiny else (LLAMA3_8B, EXITS_8B)
    ee, plain = build_model(fields, exits, dtype, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {
        "command": "python benchmarks/gpu_draft_rows.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": name,
        "torch": torch.__version__,
        "shape": "tiny" if tiny else "Llama-3-8B (random bf16 weights)",
    }
    print(f"[gpu-drafts] built on {name} in {time.perf_counter() - start:.0f} s", flush=True)
    prompts = random_prompts(ee.config.vocab_size, max(batch_sizes), 64)
    report["width_costs_ms"] = {b: width_costs(plain, prompts, b, args.widths, args.calls, device) for b in batch_sizes}
    (out_dir / "width_costs.md").write_text(format_costs(report["width_costs_ms"]))
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(format_costs(report["width_costs_ms"]), flush=True)
    if args.skip_rows:
        return 0
    config = LosslessConfig(
        batch_sizes=batch_sizes,
        num_prompts=max(batch_sizes),
        new_tokens=args.new_tokens or (16 if tiny else 64),
        rounds=args.rounds,
        lookup=["4:3"],
        gate_ablation=True,
        threads=torch.get_num_threads(),
    )
    for batch_size in batch_sizes:  # one batch size at a time, each written as it finishes
        config.batch_sizes = [batch_size]
        part = run_lossless(ee, plain, prompts, config, log=lambda m: print(m, flush=True))
        report.setdefault("rows", []).extend(part["results"])
        report["wall_seconds"] = time.perf_counter() - start
        (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out_dir / "rows.md").write_text(format_lossless({"config": part["config"], "results": report["rows"]}))
        print(f"[gpu-drafts] batch {batch_size} done ({report['wall_seconds']:.0f} s)", flush=True)
    print((out_dir / "rows.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
