"""Lossless drafts in vLLM, in one process, no HTTP: plain vLLM of the base, vLLM's `ngram` and the package's proposer
on the same held-out prompts (BENCHMARKS.md section 7; issue 47).

    .venv-vllm/bin/python benchmarks/vllm_drafts_probe.py --model FOLDER --base BASE --batch 16 --which ours

One engine per process (run it once per `--which`): eager mode, fp32, greedy, 64 new tokens for each of `--requests`
held-out passages of the Python manual (the prompts bench-serve sends), submitted `--batch` at a time, after one
warm-up request; with `--max-seqs` below `--batch` the rest of a batch waits for a seat (a steady load: a request
that finishes gives its seat to the next). `--override` sets stored settings of ours the way
`--override-generation-config` does (e.g. '{"speculative_table_drafts": false}'). Prints tokens/s over the timed
batches and, for ours, the proposer's counts, its step-cost fit and its timed steps by width; writes the tokens
to `--out/{which}-{batch}.json` so that the runs' texts can be compared.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its proposer is readable
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

PROPOSER = {"method": "custom_class", "model": "ee_transformers.vllm.proposer.EarlyExitProposer"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the early-exit folder (ours)")
    parser.add_argument("--base", required=True, help="its base checkpoint (plain, ngram)")
    parser.add_argument("--which", choices=("plain", "ngram", "ours"), required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--drafts", type=int, default=4, help="num_speculative_tokens of ours")
    parser.add_argument(
        "--max-seqs", type=int, default=32, help="vLLM's max_num_seqs: below --batch, the rest of a batch waits in line"
    )
    parser.add_argument(
        "--override",
        default=None,
        help="ours: JSON of stored settings to override, vLLM's precedence ('{\"speculative_gate\": false}': every draft)",
    )
    parser.add_argument("--out", default="vllm-drafts-probe")
    args = parser.parse_args()
    if args.override is not None and args.which != "ours":
        parser.error(f"--override sets the folder's stored settings: it applies to --which ours, not {args.which}")

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from ee_transformers.tools.bench.serve import ServeBenchConfig, _held_out

    texts = _held_out(AutoTokenizer.from_pretrained(args.base), ServeBenchConfig(), args.requests + 1)
    model, spec = {
        "plain": (args.base, None),
        "ngram": (args.base, NGRAM),
        "ours": (args.model, {**PROPOSER, "num_speculative_tokens": args.drafts}),
    }[args.which]
    llm = LLM(
        model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=args.max_seqs,
        seed=0,
        distributed_executor_backend="uni",
        enable_prefix_caching=False,
        speculative_config=spec,
        override_generation_config=json.loads(args.override or "{}"),
    )
    params = SamplingParams(max_tokens=64, min_tokens=64, temperature=0)
    llm.generate(texts[:1], params, use_tqdm=False)  # warm-up
    tokens, seconds = [], 0.0
    for i in range(1, len(texts), args.batch):
        start = time.perf_counter()
        answers = llm.generate(texts[i : i + args.batch], params, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens += [list(a.outputs[0].token_ids) for a in answers]
    line = {"which": args.which, "batch": args.batch, "max_seqs": args.max_seqs}
    line["tokens_per_s"] = round(sum(map(len, tokens)) / seconds, 1)
    line["async_scheduling"] = llm.llm_engine.vllm_config.scheduler_config.async_scheduling  # off with uni, here
    if args.which == "ours":
        proposer = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
        line.update(proposer.stats(), gate=proposer.settings.gate, fit=proposer.drafter.packed.coefficients())
        by_width = {}  # the timed steps' seconds by scheduled tokens: what a drafted position costs here
        for features, step_seconds in proposer.drafter.packed.samples:
            by_width.setdefault(int(features[1]), []).append(step_seconds)
        line["step_ms_by_tokens"] = {
            w: [len(v), round(1e3 * statistics.median_high(v), 1)] for w, v in sorted(by_width.items())
        }
    llm.llm_engine.engine_core.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.which}-{args.batch}.json").write_text(json.dumps(tokens))
    print(json.dumps(line))


if __name__ == "__main__":
    main()
