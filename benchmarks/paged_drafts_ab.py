"""Drafts inside continuous batching, in-process: plain `generate_batch` of the base model against the folder's
lossless drafts, round by round, and how well the gate's step-cost model predicted each drafted step (BENCHMARKS.md
section 6e).

    python benchmarks/paged_drafts_ab.py --model runs/gemma3-270m-lossless \
        --base ~/.cache/ee-transformers/gemma3-270m --requests 32 --rounds 3

Every round sends `--requests` new held-out prompts of `--domain` at once (64 tokens each, greedy, 64 new tokens, no
EOS) to the base model, then the same prompts to the folder with drafts (`prompt_lookup_num_tokens`, the folder's
stored draft settings otherwise). Rounds alternate the two, so a drift of the host's speed hits both; each prints wall
seconds, CPU seconds, drafted and accepted tokens, and whether the tokens equal the base model's. A later round's
prompts are new, so the history index only holds earlier rounds' answers, as a server's would.

The gate's predictions: for each drafted step, the seconds `plan_packed` expected for the width it chose against the
seconds the step took, summarised as the median ratio measured / predicted. `--costs table` plans with the width table
keyed by packed tokens alone (the rule before `PackedCosts`); `--with-off` also times the folder with drafts off, to
tell the drafts' cost from the rest of the model's.
"""

import argparse
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

import ee_transformers  # noqa: F401  (registers the early-exit classes with the Auto classes)
from ee_transformers import paged_speculative, record_paged_drafts
from ee_transformers.tools.bench.serve import ServeBenchConfig, _held_out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a lossless folder (the main job's output or a converted one)")
    p.add_argument("--base", required=True, help="the plain checkpoint it was made from")
    p.add_argument("--requests", type=int, default=32, help="requests sent at once per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--drafts", type=int, default=7, help="prompt_lookup_num_tokens")
    p.add_argument("--domain", default="python", choices=["python", "austen"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--costs", default="fit", choices=["fit", "table"], help="the gate's step costs")
    p.add_argument("--with-off", action="store_true", help="also time the folder with drafts off")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base_dir = os.path.expanduser(args.base)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    texts = _held_out(tokenizer, ServeBenchConfig(prompt_domain=args.domain), args.requests * args.rounds + 4)
    prompts = [tokenizer(t)["input_ids"] for t in texts]

    def cb():
        return ContinuousBatchingConfig(auto_switch_to_flash=False, num_blocks=256, page_size=64, max_batch_tokens=1024)

    plain_gc = GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=None)
    draft_gc = GenerationConfig(
        max_new_tokens=64, do_sample=False, eos_token_id=None, prompt_lookup_num_tokens=args.drafts
    )
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    if args.costs == "table":  # never fitted: `PackedCosts.cost` reads the width table
        ours.drafter.packed.coefficients = lambda: None
    arms = [("plain", base, plain_gc), ("drafts", ours, draft_gc)]
    if args.with_off:
        off = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        for name in ("prompt_lookup_num_tokens", "speculative_table_drafts"):  # the stored lossless mode, off
            setattr(off.generation_config, name, None)
        arms.insert(1, ("off", off, plain_gc))
    warm = prompts[-4:]  # not among any round's prompts
    for _, model, gc in arms:
        model.generate_batch(warm, generation_config=gc, continuous_batching_config=cb())

    planned = {}  # trace step index -> the seconds plan_packed expected for the width it chose
    plan = paged_speculative.plan_packed

    def recording_plan(probs, base_tokens, cost):
        ks = plan(probs, base_tokens, cost)
        trace = getattr(ours, "_paged_draft_trace", None)
        if sum(ks) and trace is not None:  # the step's entry, if it drafts (a later plan of a plain step overwrites)
            planned[len(trace.steps)] = cost(base_tokens + sum(ks))
        return ks

    paged_speculative.plan_packed = recording_plan
    ratios, errors = [], []
    for r in range(args.rounds):
        batch = prompts[r * args.requests : (r + 1) * args.requests]
        times = {}
        for name, model, gc in arms:
            planned.clear()
            with record_paged_drafts(model) as trace:
                wall, cpu = time.perf_counter(), time.process_time()
                out = model.generate_batch(batch, generation_config=gc, continuous_batching_config=cb())
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            tokens = [o.generated_tokens for o in out.values()]  # in the order the prompts were sent
            times[name] = (wall, tokens)
            line = f"round {r} {name:6s}: {wall:6.2f} s wall, {cpu:6.2f} s CPU"
            if name != "plain":
                line += f", same tokens as plain: {tokens == times['plain'][1]}"
            if name == "drafts":
                pairs = [(trace.steps[i][3], e) for i, e in planned.items() if i < len(trace.steps)]
                errors += [m / e for m, e in pairs]
                line += f", drafted {trace.drafted}, accepted {trace.accepted}"
                if pairs:
                    line += f", measured/predicted step seconds median {statistics.median(m / e for m, e in pairs):.2f}"
            print(line, flush=True)
        ratios.append(times["plain"][0] / times["drafts"][0])
        off_ratio = f", off {times['plain'][0] / times['off'][0]:.2f}x" if "off" in times else ""
        print(f"round {r}: drafts {ratios[-1]:.2f}x plain{off_ratio}", flush=True)
    print(f"x plain per round: {', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}")
    if errors:
        q = statistics.quantiles(errors, n=4)
        print(
            f"drafted steps, measured / predicted seconds: median {statistics.median(errors):.2f}, "
            f"quartiles {q[0]:.2f} / {q[2]:.2f} ({len(errors)} steps)"
        )


if __name__ == "__main__":
    main()
