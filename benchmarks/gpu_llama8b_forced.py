"""Forced-profile benchmark at Llama-3-8B's shape on a GPU: early-exit generate vs plain transformers generate.

Only the repository travels to the GPU machine (no model hub), so the weights are random bf16, built directly on the
GPU with Llama-3-8B's config (32 layers, hidden 4096, 32 heads / 8 KV heads, FFN 14336, vocab 128256). Random weights
decide nothing, which is the point: forced exits draw each token's exit layer from a profile (25% / 50% / 75% of the
tokens at a quarter / half / three quarters of the depth, and a mixed profile) and decode through the same code path
as real exits, so what is measured is the implementation: realised speed-up against the ideal one of the measured
cost model (layer step, head, backfill), at batch 1/8/32/64, for both policies and both KV modes, and the overhead of
the early-exit class with exits disabled. Plain `LlamaForCausalLM.generate` runs on the very same modules.

    python benchmarks/gpu_llama8b_forced.py                            # the full GPU run: batch 1, 8, 32, 64
    python benchmarks/gpu_llama8b_forced.py --batch-sizes 1,8 --new-tokens 64 --repeats 2   # a shorter one
    python benchmarks/gpu_llama8b_forced.py --tiny                     # CPU smoke run of the same code
    python benchmarks/gpu_llama8b_forced.py --lean-only                # HELIOS row: lean (layers 0..23) vs full
                                                                       # at a 40 GiB budget, context 1024
    python benchmarks/gpu_llama8b_forced.py --speculative only --batch-sizes 1,8,32   # self-speculative rows only

Self-speculative decoding (`generate(assistant_early_exit=E + 1)`, lossless) gets its own rows (`--speculative`, on by
default, written to `speculative.md` / `speculative.json`): forced acceptance only, as the heads are random: a copy of
the model whose layers above E pass the residual through (still computed, at full cost) accepts every draft, and the
same copy with the draft head turned wrong for 40% of its drafts accepts ~60%; for E in the exits and K = 2, 4, against
plain generate, and at batch 1 against transformers' own `assistant_early_exit`, with realised / ideal under the cost
model measured in the same run (`ee_transformers.tools.bench.speculative`). Batch 1 of these rows was run on an
H200 (BENCHMARKS.md section 3); batch 8 and above were not reached.

Each batch size runs plain, c1, plain, c2, ... (13 configurations at batch > 1, 9 at batch 1) per repeat, so one
batch size takes roughly 27 x repeats generate calls plus the cost model and profiles; where one command may only run
for a few minutes, run the batch sizes in separate commands (`--batch-sizes 1`, then `--batch-sizes 8`, ...: each
writes its own `--out`). Results (JSON, markdown table) are written after every batch size, so a run cut short keeps
what it finished. One short run (batch 1, 8, 32, one repeat) is in BENCHMARKS.md section 3, with its machine.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a bare checkout, without installing the package
    sys.path.insert(0, str(ROOT))

from ee_transformers.configuration_early_exit import EarlyExitLlamaConfig  # noqa: E402
from ee_transformers.modeling_early_exit import EarlyExitLlamaForCausalLM  # noqa: E402
from ee_transformers.tools import bench  # noqa: E402
from ee_transformers.tools.bench import speculative as bench_speculative  # noqa: E402
from ee_transformers.utils.arguments import comma_list  # noqa: E402

LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
    pad_token_id=128001,
)
EXITS_8B = [7, 15, 23]  # a quarter, half and three quarters of the depth
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
EXITS_TINY = [1, 3, 5]


def build_model(fields, exit_layers, dtype, device, seed=0):
    """A random-weight early-exit Llama built in place on `device` (no CPU copy), and its plain twin."""
    torch.manual_seed(seed)
    config = EarlyExitLlamaConfig(**fields, exit_layers=exit_layers, exit_head="norm")
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = EarlyExitLlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    return model, bench.plain_twin(model)


def lean_row(fields, exits, dtype, device, prompts, exit_max_layer, budget, context, prompt_tokens, repeats):
    """HELIOS's trade at this shape: the full model (plain full depth, every layer resident) against a lean one holding
    layers 0..exit_max_layer (every token exits there greedily; random weights decide nothing, so no criterion), each
    at its largest batch whose weights + measured generate peak (K/V, activations) fit `budget` bytes, interleaved."""
    from ee_transformers.tools.bench import lean as bench_lean

    full, _ = build_model(fields, exits, dtype, device)
    lean, _ = build_model(fields, exits, dtype, device)  # same seed: the same weights
    lean.set_exit_max_layer(exit_max_layer)  # sheds the layers above it (their memory is freed)
    ids = [p["ids"][:prompt_tokens] for p in prompts]
    new_tokens = context - prompt_tokens
    memory = {
        name: bench_lean.measure_memory(m, ids, new_tokens, {"early_exit": False} if name == "full" else {})
        for name, m in (("full", full), ("lean", lean))
    }
    batch = {name: bench_lean.fit_batch(m, budget) for name, m in memory.items()}
    row = {"exit_max_layer": exit_max_layer, "budget": budget, "context": context, "memory": memory, "batch": batch}
    if min(batch.values()) > 0:
        runs = {"full": (full, batch["full"], {"early_exit": False}), "lean": (lean, batch["lean"], {})}
        speed = bench_lean.interleaved_throughput(runs, ids, new_tokens, repeats, log=lambda m: print(m, flush=True))
        row.update(
            tokens_per_s=speed,
            batch_ratio=batch["lean"] / batch["full"],
            throughput_ratio=sorted(lv / fv for lv, fv in zip(speed["lean"], speed["full"]))[repeats // 2],
        )
    del full, lean
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small config on CPU in fp32: a smoke run of this script")
    parser.add_argument("--batch-sizes", type=comma_list(int), default=None, help="default 1,8,32,64 (tiny: 1,4)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 128 (tiny: 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (tiny: 1)")
    parser.add_argument("--forced-grid", choices=["profiles", "full"], default="profiles")
    parser.add_argument("--device", default=None, help="default cuda (tiny: cpu)")
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"], default=None, help="default bfloat16 (tiny: float32)"
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the per-step time profiles")
    parser.add_argument(
        "--speculative",
        choices=["on", "off", "only"],
        default="on",
        help="self-speculative forced-acceptance rows after (on) or instead of (only) the early-exit ones",
    )
    parser.add_argument(
        "--lean-max-layer",
        type=int,
        default=None,
        help="also run the lean row (HELIOS): layers 0..this resident (default 23, tiny: 5)",
    )
    parser.add_argument(
        "--lean-budget-gb",
        type=float,
        default=None,
        help="memory budget of the lean row, GiB (default 40, tiny: 0.003)",
    )
    parser.add_argument("--lean-context", type=int, default=None, help="tokens per sequence (default 1024, tiny: 64)")
    parser.add_argument("--lean-only", action="store_true", help="run only the lean row")
    parser.add_argument(
        "--out",
        default=None,
        help="output folder (default benchmarks/results/gpu_llama8b_forced, "
        "tiny: benchmarks/results/gpu_llama8b_forced_tiny)",
    )
    args = parser.parse_args(argv)
    tiny = args.tiny
    batch_sizes = args.batch_sizes or ([1, 4] if tiny else [1, 8, 32, 64])
    new_tokens = args.new_tokens or (8 if tiny else 128)
    repeats = args.repeats or (1 if tiny else 3)
    device = torch.device(args.device or ("cpu" if tiny else "cuda"))
    dtype = getattr(torch, args.dtype or ("float32" if tiny else "bfloat16"))
    out_dir = Path(
        args.out or ROOT / "benchmarks" / "results" / ("gpu_llama8b_forced_tiny" if tiny else "gpu_llama8b_forced")
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "No CUDA device: run on a GPU machine, or pass --tiny for a CPU smoke run.\n")

    start = time.perf_counter()
    fields, exits = (TINY, EXITS_TINY) if tiny else (LLAMA3_8B, EXITS_8B)
    ee_model, plain_model = build_model(fields, exits, dtype, device)
    print(
        f"[gpu-bench] built {'tiny' if tiny else 'Llama-3-8B-shaped'} random model on {device} ({dtype}) in "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )
    prompts = bench.random_prompts(ee_model.config.vocab_size, max(batch_sizes), args.prompt_tokens)
    merged = None
    if args.lean_only or args.lean_max_layer is not None:
        del ee_model, plain_model  # the lean row builds its own pair
        row = lean_row(
            fields,
            exits,
            dtype,
            device,
            prompts,
            args.lean_max_layer or (5 if tiny else 23),
            int((args.lean_budget_gb or (0.003 if tiny else 40.0)) * 2**30),
            args.lean_context or (64 if tiny else 1024),
            min(args.prompt_tokens, 32 if tiny else 64),
            repeats,
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "lean.json").write_text(json.dumps(row, indent=1, default=str) + "\n")
        print(
            f"[gpu-bench] lean row: batch {row['batch']}, throughput ratio {row.get('throughput_ratio')}; wrote "
            f"{out_dir / 'lean.json'}",
            flush=True,
        )
        if args.lean_only:
            return 0
        ee_model, plain_model = build_model(fields, exits, dtype, device)
    for batch_size in batch_sizes if args.speculative != "only" else []:
        config = bench.BenchConfig(
            batch_sizes=[batch_size],
            max_batches=[1],
            new_tokens=new_tokens,
            repeats=repeats,
            main_repeats=repeats,
            calibrated="off",
            sweep=False,
            forced_grid=args.forced_grid,
            profile=not args.no_profile,
        )
        report = bench.run_benchmark(ee_model, plain_model, prompts, config, log=lambda m: print(m, flush=True))
        if merged is None:
            merged = report
            merged["model"]["shape"] = "tiny" if tiny else "Llama-3-8B (random bf16 weights)"
            merged["command"] = "python benchmarks/gpu_llama8b_forced.py " + " ".join(
                sys.argv[1:] if argv is None else argv
            )
            merged["notes"] = [n for n in merged["notes"] if "calibrated" not in n]
        else:
            merged["settings"]["batch_sizes"].append(batch_size)
            merged["costs"].update(report["costs"])
            merged["results"] += report["results"]
            merged["profiles"] += report["profiles"]
        merged["targets"] = [
            t for t in bench.evaluate_targets(merged) if not t["target"].startswith(("calibrated", "frontier"))
        ]
        merged["wall_seconds"] = time.perf_counter() - start
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "report.json").write_text(json.dumps(bench.jsonable(merged), indent=1) + "\n")
        (out_dir / "results.md").write_text(bench.format_table(merged))
        print(f"[gpu-bench] batch {batch_size} done ({merged['wall_seconds']:.0f} s); wrote {out_dir}", flush=True)
    if merged is not None:
        print(bench.format_table(merged))
    if args.speculative != "off":
        speculative(ee_model, plain_model, prompts, batch_sizes, new_tokens, out_dir, start, argv)
    return 0


def speculative(ee_model, plain_model, prompts, batch_sizes, new_tokens, out_dir, start, argv):
    """Self-speculative rows, one batch size at a time (each written as it finishes)."""
    merged = None
    for batch_size in batch_sizes:
        report = bench_speculative.run_benchmark(
            ee_model,
            plain_model,
            prompts,
            [batch_size],
            ks=(2, 4),
            new_tokens=new_tokens,
            forced_rates=(1.0, 0.6),
            heads=False,
            log=lambda m: print(m, flush=True),
        )
        if merged is None:
            merged = report
            merged["command"] = "python benchmarks/gpu_llama8b_forced.py " + " ".join(
                sys.argv[1:] if argv is None else argv
            )
        else:
            merged["settings"]["batch_sizes"].append(batch_size)
            merged["costs"].update(report["costs"])
            merged["results"] += report["results"]
        merged["targets"] = bench_speculative.evaluate_targets(merged)
        merged["wall_seconds"] = time.perf_counter() - start
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "speculative.json").write_text(json.dumps(merged, indent=1, default=str) + "\n")
        (out_dir / "speculative.md").write_text(bench_speculative.format_table(merged))
        print(f"[gpu-bench] speculative batch {batch_size} done ({merged['wall_seconds']:.0f} s)", flush=True)
    print(bench_speculative.format_table(merged))


if __name__ == "__main__":
    sys.exit(main())
