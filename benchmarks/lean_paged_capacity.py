"""Requests in flight at one memory budget: a full early-exit model against its lean (HELIOS) version in transformers'
continuous batching (BENCHMARKS.md section 6).

    python benchmarks/lean_paged_capacity.py --model runs/smollm2-135m-ee --exit-max-layer 15 --budget-mib 512

Loads the folder full and lean (`exit_max_layer`), lets `init_continuous_batching` build each one's paged cache for
the same number of blocks, and measures what is resident: parameter bytes (`memory_report`) and the paged cache's
bytes per token (its tensor over its token capacity). At a budget for weights plus cache it prints how many tokens,
and requests of `--request-tokens` tokens, each model holds in flight. A lean model's layers above `exit_max_layer`
hold neither weights nor cache pages, so both terms shrink.
"""

import argparse

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import ee_transformers as eet


def measure(folder, exit_max_layer, blocks, page_size):
    kwargs = {} if exit_max_layer is None else {"exit_max_layer": exit_max_layer}
    model = eet.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32, **kwargs)
    cb = ContinuousBatchingConfig(auto_switch_to_flash=False, num_blocks=blocks, page_size=page_size)
    manager = model.init_continuous_batching(GenerationConfig(max_new_tokens=8), continuous_batching_config=cb)
    if manager.batch_processor is None:
        manager.warmup()
    cache = manager.batch_processor.cache
    tokens = cache.num_blocks * page_size
    report = eet.memory_report(model)
    return {
        "layers paged": len(cache.layer_to_allocator),
        "weights MiB": report["resident_parameter_bytes"] / 2**20,
        "cache bytes / token": cache.cache_tensor.numel() / tokens,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an early-exit folder")
    parser.add_argument("--exit-max-layer", type=int, required=True)
    parser.add_argument("--budget-mib", type=float, default=512, help="weights + paged cache")
    parser.add_argument("--request-tokens", type=int, default=128, help="prompt + new tokens of one request")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    args = parser.parse_args()
    rows = {
        "full": measure(args.model, None, args.blocks, args.page_size),
        f"lean (exit_max_layer={args.exit_max_layer})": measure(
            args.model, args.exit_max_layer, args.blocks, args.page_size
        ),
    }
    budget = args.budget_mib * 2**20
    print(
        f"| model | layers paged | weights MiB | cache bytes/token | tokens in {args.budget_mib:.0f} MiB | requests |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        tokens = max(0, budget - r["weights MiB"] * 2**20) / r["cache bytes / token"]
        print(
            f"| {name} | {r['layers paged']} | {r['weights MiB']:.1f} | {r['cache bytes / token']:.0f} | "
            f"{tokens:.0f} | {int(tokens // args.request_tokens)} |"
        )


if __name__ == "__main__":
    main()
