"""`ee-transformers bench-speculative`: lossless self-speculative decoding against plain generate, on the same weights.

Everything runs in one process. Per batch size the runs alternate plain, c1, plain, c2, ..., plain (plain = the
family's own `...ForCausalLM.generate` at full depth on the very same modules), and each configuration is compared
with the mean of its two neighbouring plain runs, so drift of a shared machine cancels. Configurations:

* ours: `generate(assistant_early_exit=E + 1, num_assistant_tokens=K)` for every exit E of the model and every K;
* transformers: its own `assistant_early_exit` on the plain twin (batch 1 only: it refuses more), same E, K and
  confidence threshold (it reads them from the model's generation config);
* forced acceptance, apart from the heads: a copy whose layers above E pass the residual through unchanged and whose
  exit head is the final norm accepts every draft; the same copy with the draft head turned wrong at random for a
  share of its drafts accepts at a given rate (`--forced 1.0,0.6`).

Reported per configuration: end-to-end speed-up over plain (prefill included, the same in both), acceptance rate,
tokens per verification round, identical output (greedy: asserted after the report is written), and realised /
ideal under a cost model measured in the same run at the same batch size: a draft step = E + 1 layer steps at one
position + the draft head, a verification pass over q positions = L - E - 1 layer steps at q positions + the final
head at q positions, plain = L layer steps + the final head per token, both plus the prefill. The ideal is what
those pieces allow for the rounds the run actually made; realised / ideal says how much the loop loses around them.

    ee-transformers bench-speculative --model ~/.cache/ee-transformers/smollm2-135m-instruct --exit-layers 7,15,23 \\
        --batch-sizes 1,8 --ks 2,4 --new-tokens 16 --out bench-spec

Python API: `measure_costs`, `ideal_ms`, `pass_through_above`, `ForcedDraftHead`, `run_benchmark`, `format_table`,
`main`.
"""

import argparse
import copy
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from ee_transformers.tools.arguments import run_command
from ee_transformers.tools.bench import heldout_prompts, load_models, make_batches, plain_twin, random_prompts
from ee_transformers.tools.bench.timing import greedy_generation_config, only_these_drafts, without_eos

__all__ = [
    "ForcedDraftHead",
    "format_table",
    "ideal_ms",
    "main",
    "measure_costs",
    "pass_through_above",
    "run_benchmark",
]

TARGET_REALISED_OVER_IDEAL = 0.9


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------------
# forced acceptance
# ----------------------------------------------------------------------------------------------------------------


def pass_through_above(model, exit_layer):
    """A copy of `model` whose layers above `exit_layer` add nothing to the residual stream (zero output projections:
    they still compute, at full cost) and whose exit head there is the final norm: its draft head IS the full model,
    so every greedy draft is accepted."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for j, layer in enumerate(model.family.layers(model)):
            if j > exit_layer:
                for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    for param in module.parameters():
                        param.zero_()
        head = model.exit_heads[model.config.exit_layers.index(exit_layer)]
        head.norm.weight.copy_(model.family.final_norm(model).weight)
        if head.up is not None:
            head.up.weight.zero_()
    return model


class ForcedDraftHead(nn.Module):
    """Wraps an exit head so that each row's draft is right with probability `rate`: otherwise the head's output is
    negated, which turns the drafted argmax into the argmin (never the full model's token on a pass-through copy)."""

    def __init__(self, head, rate, seed=0):
        super().__init__()
        self.head, self.rate = head, rate
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, hidden_states):
        out = self.head(hidden_states)
        right = torch.rand(out.shape[0], generator=self.generator) < self.rate
        sign = torch.where(right, 1.0, -1.0).to(out.device, out.dtype)
        return out * sign.view(-1, *([1] * (out.dim() - 1)))


def forced_model(model, exit_layer, rate, seed=0):
    forced = pass_through_above(model, exit_layer)
    index = forced.config.exit_layers.index(exit_layer)
    if rate < 1.0:
        forced.exit_heads[index] = ForcedDraftHead(forced.exit_heads[index], rate, seed)
    return forced


# ----------------------------------------------------------------------------------------------------------------
# the cost model
# ----------------------------------------------------------------------------------------------------------------


def _median_ms(pieces, device, repeats, warmup=2):
    """Median ms of each piece, timed round-robin (one call of each per round: a slow spell hits all alike)."""
    times = {name: [] for name in pieces}
    for i in range(warmup + repeats):
        for name, (run, after) in pieces.items():
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            if i >= warmup:
                times[name].append(1e3 * (time.perf_counter() - start))
            if after is not None:
                after()
    return {name: statistics.median(values) for name, values in times.items()}


@torch.no_grad()
def measure_costs(model, batch_size, max_positions, prompt_length=64, context=96, repeats=15, seed=0):
    """ms of the pieces at `batch_size` rows: `layer` {q: one decoder layer step with q new positions per row at a
    `context`-token cache} for q = 1..max_positions, `draft_head` (exit head + LM head + softmax, one position),
    `final_head` {q: final norm + LM head at q positions}, `prefill` (a `prompt_length` prompt, full depth)."""
    config, fam, device = model.config, model.family, model.device
    generator = torch.Generator().manual_seed(seed)

    def ids(length):
        return torch.randint(3, config.vocab_size, (batch_size, length), generator=generator).to(device)

    cache = DynamicCache(config=config)
    fam.decoder(model)(input_ids=ids(context), cache=cache, use_cache=True)
    pieces, state = {}, {"j": -1}
    for q in range(1, max_positions + 1):
        position_ids = (torch.arange(q, device=device) + context).expand(batch_size, -1)
        h = fam.embed(model, ids(q), position_ids)
        inputs = fam.layer_inputs(model, h, None, cache, position_ids)

        def layer(h=h, inputs=inputs):  # layers in turn; the step's K/V are cropped off after, see `after`
            state["j"] = (state["j"] + 1) % config.num_hidden_layers
            fam.run_layer(model, state["j"], h, inputs, cache)

        pieces[f"layer_{q}"] = (layer, lambda q=q: cache.layers[state["j"]].crop(-q))
        pieces[f"final_head_{q}"] = (lambda h=h: fam.head_logits(model, fam.final_norm(model)(h)), None)
    last = fam.embed(model, ids(1), torch.full((batch_size, 1), context, device=device))[:, -1]
    pieces["draft_head"] = (lambda: model.exit_logits_from_hidden(0, last).float().softmax(-1).max(-1), None)
    ms = _median_ms(pieces, device, max(repeats, config.num_hidden_layers))  # every layer at least once
    prompt = ids(prompt_length)
    ms.update(
        _median_ms(
            {
                "prefill": (
                    lambda: fam.head_logits(
                        model,
                        fam.decoder(model)(
                            input_ids=prompt, cache=DynamicCache(config=config), use_cache=True
                        ).last_hidden_state[:, -1],
                    ),
                    None,
                )
            },
            device,
            repeats=3,
            warmup=1,
        )
    )  # a whole forward: a few suffice
    return {
        "batch_size": batch_size,
        "context": context,
        "prompt_length": prompt_length,
        "layer": {q: ms[f"layer_{q}"] for q in range(1, max_positions + 1)},
        "final_head": {q: ms[f"final_head_{q}"] for q in range(1, max_positions + 1)},
        "draft_head": ms["draft_head"],
        "prefill": ms["prefill"],
    }


def ideal_ms(costs, num_layers, new_tokens, exit_layer=None, draft_lengths=()):
    """ms of a generate under the cost model: plain (`exit_layer` None: L layer steps + the final head per token after
    the first) or speculative (per round of k drafts: k + 1 draft steps through layers 0..E, k draft heads, one
    verification pass of L - E - 1 layers and the final head at k + 1 positions); the prefill in both."""
    layer, head = costs["layer"], costs["final_head"]
    if exit_layer is None:
        return costs["prefill"] + (new_tokens - 1) * (num_layers * layer[1] + head[1])
    total = costs["prefill"]
    for k in draft_lengths:
        total += (k + 1) * (exit_layer + 1) * layer[1] + k * costs["draft_head"]
        total += (num_layers - exit_layer - 1) * layer[k + 1] + head[k + 1]
    return total


# ----------------------------------------------------------------------------------------------------------------
# runs
# ----------------------------------------------------------------------------------------------------------------


def _greedy(model, new_tokens):
    """Greedy, exactly `new_tokens` tokens (with `without_eos`); without stored confident-exit settings (a
    calibrated folder has them, and they do not combine with `assistant_early_exit`)."""
    return greedy_generation_config(model, new_tokens, clear_exit_settings=True)


@torch.no_grad()
def _timed(run):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def _ours(model, batch, config, new_tokens):
    ids, mask, _ = batch
    settings = dict(
        assistant_early_exit=config["exit_layer"] + 1,
        num_assistant_tokens=config["k"],
        assistant_confidence_threshold=config["threshold"],
    )
    settings = only_these_drafts(settings)  # a folder's stored context drafts do not join in
    return lambda: model.generate(ids, attention_mask=mask, generation_config=_greedy(model, new_tokens), **settings)


def _transformers(plain, batch, config, new_tokens):
    """transformers' own LayerSkip on the plain twin. It reads K and the threshold from the model's stored generation
    config (generate kwargs do not reach its draft loop), so they are set there for the call."""
    ids, mask, _ = batch

    def run():
        stored = plain.generation_config
        plain.generation_config = copy.deepcopy(stored)
        plain.generation_config.update(
            num_assistant_tokens=config["k"],
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=config["threshold"],
        )
        try:
            return plain.generate(
                ids,
                attention_mask=mask,
                generation_config=_greedy(plain, new_tokens),
                assistant_early_exit=config["exit_layer"] + 1,
            )
        finally:
            plain.generation_config = stored

    return run


def _plain(plain, batch, new_tokens):
    ids, mask, _ = batch
    return lambda: plain.generate(ids, attention_mask=mask, generation_config=_greedy(plain, new_tokens))


def _compare(plain_run, runs, repeats, log):
    """plain, r1, plain, r2, ..., plain, `repeats` times (the order flips every repeat). Returns per run (median
    seconds, median paired speed-up: the mean of the two neighbouring plain runs over the run's time, its last
    output), and the plain output."""
    times, ratios, outputs = defaultdict(list), defaultdict(list), {}
    plain_out = None
    for repeat in range(repeats):
        order = list(enumerate(runs)) if repeat % 2 == 0 else list(enumerate(runs))[::-1]
        before, plain_out = _timed(plain_run)
        for i, (name, run) in order:
            seconds, outputs[i] = _timed(run)
            after, plain_out = _timed(plain_run)
            times[i].append(seconds)
            ratios[i].append((before + after) / 2 / seconds)
            log(f"  {name}: {seconds:.2f} s (plain {before:.2f} / {after:.2f} s)")
            before = after
    medians = [(statistics.median(times[i]), statistics.median(ratios[i]), outputs[i]) for i in range(len(runs))]
    return medians, plain_out


def run_benchmark(
    ee_model,
    plain_model,
    prompts,
    batch_sizes=(1, 8),
    exit_layers=None,
    ks=(2, 4),
    new_tokens=16,
    threshold=0.4,
    forced_rates=(1.0, 0.6),
    transformers_baseline=True,
    heads=True,
    repeats=1,
    cost_repeats=15,
    forced_exits=None,
    log=print,
):
    """The side-by-side run; returns the report (`format_table` prints it). heads=False: forced profiles only (for
    random weights, whose heads decide nothing); forced_exits: the exits of the forced profiles (default: all)."""
    plain_model.generation_config = copy.deepcopy(plain_model.generation_config)  # the twin shares ee's otherwise
    with without_eos(ee_model, plain_model):
        return _run(
            ee_model,
            plain_model,
            prompts,
            batch_sizes,
            exit_layers,
            ks,
            new_tokens,
            threshold,
            forced_rates,
            transformers_baseline,
            heads,
            repeats,
            cost_repeats,
            forced_exits,
            log,
        )


def _run(
    ee_model,
    plain_model,
    prompts,
    batch_sizes,
    exit_layers,
    ks,
    new_tokens,
    threshold,
    forced_rates,
    transformers_baseline,
    heads,
    repeats,
    cost_repeats,
    forced_exits,
    log,
):
    exits = list(exit_layers or ee_model.config.exit_layers)
    forced_exits = exits if forced_exits is None else list(forced_exits)
    num_layers = ee_model.config.num_hidden_layers
    results, costs = [], {}
    for batch_size in batch_sizes:
        batch = make_batches(prompts, batch_size, max_batches=1, device=ee_model.device)[0]
        start = time.perf_counter()
        cost = costs[batch_size] = measure_costs(
            ee_model, batch_size, max(ks) + 1, batch[0].shape[1], batch[0].shape[1] + new_tokens // 2, cost_repeats
        )
        log(
            f"[bench-speculative] batch {batch_size}: cost model in {time.perf_counter() - start:.0f} s: layer "
            f"{cost['layer'][1]:.2f} ms, final head {cost['final_head'][1]:.2f} ms, draft head "
            f"{cost['draft_head']:.2f} ms"
        )
        plain_ideal = ideal_ms(cost, num_layers, new_tokens)

        configs = (
            [dict(mode="ours", profile="heads", exit_layer=e, k=k, threshold=threshold) for e in exits for k in ks]
            if heads
            else []
        )
        if transformers_baseline and batch_size == 1:
            configs += [dict(c, mode="transformers") for c in configs]
        runs = [
            (
                f"{c['mode']} E={c['exit_layer']} K={c['k']}",
                _ours(ee_model, batch, c, new_tokens)
                if c["mode"] == "ours"
                else _transformers(plain_model, batch, c, new_tokens),
            )
            for c in configs
        ]
        if runs:
            measured, plain_out = _compare(_plain(plain_model, batch, new_tokens), runs, repeats, log)
            for config, (seconds, speedup, out) in zip(configs, measured):
                results.append(
                    _result(
                        config, batch_size, seconds, speedup, out, plain_out, cost, plain_ideal, num_layers, new_tokens
                    )
                )

        for exit_layer in forced_exits:  # forced acceptance: a copy per exit and rate, on the same pieces of compute
            for rate in forced_rates:
                forced = forced_model(ee_model, exit_layer, rate).eval()
                twin = plain_twin(forced)  # plain generate on the copy's very modules
                twin.generation_config = copy.deepcopy(forced.generation_config)
                forced_configs = [
                    dict(mode="ours", profile=f"forced {rate:g}", exit_layer=exit_layer, k=k, threshold=0.0) for k in ks
                ]
                if transformers_baseline and batch_size == 1 and rate == 1.0:  # its draft head is the final norm
                    forced_configs += [dict(c, mode="transformers") for c in forced_configs]
                runs = [
                    (
                        f"{c['mode']} {c['profile']} E={exit_layer} K={c['k']}",
                        _ours(forced, batch, c, new_tokens)
                        if c["mode"] == "ours"
                        else _transformers(twin, batch, c, new_tokens),
                    )
                    for c in forced_configs
                ]
                measured, plain_out = _compare(_plain(twin, batch, new_tokens), runs, repeats, log)
                for config, (seconds, speedup, out) in zip(forced_configs, measured):
                    results.append(
                        _result(
                            config,
                            batch_size,
                            seconds,
                            speedup,
                            out,
                            plain_out,
                            cost,
                            plain_ideal,
                            num_layers,
                            new_tokens,
                        )
                    )
                del forced, twin
    report = {
        "settings": dict(
            batch_sizes=list(batch_sizes),
            exit_layers=exits,
            ks=list(ks),
            new_tokens=new_tokens,
            threshold=threshold,
            forced_rates=list(forced_rates),
            forced_exits=forced_exits,
            num_layers=num_layers,
            prompt_tokens=len(prompts[0]["ids"]),
            threads=torch.get_num_threads(),
            repeats=repeats,
        ),
        "costs": costs,
        "results": results,
    }
    report["targets"] = evaluate_targets(report)
    return report


def _result(config, batch_size, seconds, speedup, out, plain_out, cost, plain_ideal, num_layers, new_tokens):
    row = dict(
        config,
        batch=batch_size,
        seconds=seconds,
        speedup=speedup,
        identical=bool(torch.equal(out.sequences, plain_out.sequences)),
    )
    if config["mode"] == "ours":
        rounds = out.draft_lengths.tolist()
        ideal = plain_ideal / ideal_ms(cost, num_layers, new_tokens, config["exit_layer"], rounds)
        row.update(
            acceptance=float(out.accepted_tokens.sum() / out.draft_tokens.sum().clamp_min(1)),
            tokens_per_round=float((out.accepted_tokens + out.verify_rounds).sum() / out.verify_rounds.sum()),
            rounds=len(rounds),
            ideal_speedup=ideal,
            realised_over_ideal=row["speedup"] / ideal,
        )
    return row


def evaluate_targets(report):
    """The issue's targets, judged on this run."""
    results, out = report["results"], []
    ours = {(r["profile"], r["exit_layer"], r["k"]): r for r in results if r["mode"] == "ours" and r["batch"] == 1}
    theirs = [r for r in results if r["mode"] == "transformers"]
    if theirs:
        ratios = [ours[(r["profile"], r["exit_layer"], r["k"])]["speedup"] / r["speedup"] for r in theirs]
        out.append(
            dict(
                target="ours >= transformers' assistant_early_exit at batch 1, every setting",
                value=f"min ratio {min(ratios):.2f}",
                met=min(ratios) >= 1.0,
            )
        )
    measured = [r["realised_over_ideal"] for r in results if r["mode"] == "ours"]
    out.append(
        dict(
            target=f"realised / ideal >= {TARGET_REALISED_OVER_IDEAL}",
            value=f"median {statistics.median(measured):.2f}, min {min(measured):.2f}",
            met=min(measured) >= TARGET_REALISED_OVER_IDEAL,
        )
    )
    out.append(
        dict(
            target="identical output to plain greedy, every run",
            value=f"{sum(r['identical'] for r in results)} / {len(results)}",
            met=all(r["identical"] for r in results),
        )
    )
    wide = [r for r in results if r["mode"] == "ours" and r["batch"] > 1]
    if wide:
        best = max(wide, key=lambda r: r["speedup"])
        out.append(
            dict(
                target="lossless early exit at batch > 1 (identical, any speed-up > 1)",
                value=f"best {best['speedup']:.2f}x ({best['profile']}, E={best['exit_layer']}, K={best['k']}, "
                f"batch {best['batch']})",
                met=all(r["identical"] for r in wide) and best["speedup"] > 1.0,
            )
        )
    return out


# ----------------------------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------------------------


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def format_table(report):
    s = report["settings"]
    lines = [
        f"# Self-speculative decoding: {s['num_layers']} layers, exits {s['exit_layers']}, {s['new_tokens']} new "
        f"tokens after a {s['prompt_tokens']}-token prompt, greedy, {s['threads']} threads",
        "",
        "Speed-up: end to end over plain generate on the same weights (median over repeats of the ratio to its "
        "two neighbouring plain runs). "
        "E: the 0-based exit layer that drafts (assistant_early_exit = E + 1). Ideal: under the cost model "
        "measured in this run, for the rounds the run made.",
        "",
        "| batch | implementation | drafts from | E | K | acceptance | tokens / round | speed-up | ideal | "
        "realised / ideal | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['batch']} | {r['mode']} | {r['profile']} | {r['exit_layer']} | {r['k']} | "
            f"{_fmt(r.get('acceptance'))} | {_fmt(r.get('tokens_per_round'))} | {r['speedup']:.2f} | "
            f"{_fmt(r.get('ideal_speedup'))} | {_fmt(r.get('realised_over_ideal'))} | "
            f"{'yes' if r['identical'] else 'NO'} |"
        )
    lines += [
        "",
        "| cost (ms) at batch | layer, 1 position | layer, K+1 positions | final head, 1 / K+1 | "
        "draft head | prefill |",
        "|---|---|---|---|---|---|",
    ]
    for batch, c in report["costs"].items():
        top = max(c["layer"])
        lines.append(
            f"| {batch} | {c['layer'][1]:.2f} | {c['layer'][top]:.2f} ({top}) | {c['final_head'][1]:.2f} / "
            f"{c['final_head'][top]:.2f} | {c['draft_head']:.2f} | {c['prefill']:.1f} |"
        )
    lines += ["", "| target | value | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'no'} |" for t in report["targets"]]
    return "\n".join(lines) + "\n"


def _int_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def _float_list(text):
    return [float(x) for x in text.split(",") if x.strip()]


def build_parser():
    parser = argparse.ArgumentParser(prog="ee-transformers bench-speculative", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an early-exit folder, or a plain one with --exit-layers")
    parser.add_argument(
        "--exit-layers",
        type=_int_list,
        default=None,
        help="convert a plain folder with these exits (e.g. 7,15,23); default: the folder's own",
    )
    parser.add_argument("--exits", type=_int_list, default=None, help="the exits that draft (default: all)")
    parser.add_argument("--ks", type=_int_list, default=[2, 4], help="draft lengths K (num_assistant_tokens)")
    parser.add_argument("--batch-sizes", type=_int_list, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats (median of paired ratios)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument(
        "--threshold",
        type=float,
        default=0.4,
        help="assistant_confidence_threshold for the real heads (transformers' default 0.4)",
    )
    parser.add_argument(
        "--forced",
        type=_float_list,
        default=[1.0, 0.6],
        help="forced acceptance rates (pass-through copies); empty string for none",
    )
    parser.add_argument(
        "--forced-exits", type=_int_list, default=None, help="exits of the forced profiles (default: all)"
    )
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' own assistant_early_exit")
    parser.add_argument("--random-prompts", action="store_true", help="random token prompts (no text assets)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="folder for report.json and results.md")
    return parser


def main(argv=None):
    return run_command(build_parser(), lambda args: _command(args, argv), argv)


def _command(args, argv=None):
    from ee_transformers.convert import check_weights, read_config

    read_config(args.model, "--model")  # before anything loads: one line naming the flag
    check_weights(args.model, "--model")
    if args.threads:
        torch.set_num_threads(args.threads)
    ee_model, plain_model = load_models(args.model, exit_layers=args.exit_layers)
    if args.random_prompts or ee_model.tokenizer is None:
        prompts = random_prompts(ee_model.config.vocab_size, max(8, *args.batch_sizes), args.prompt_tokens)
    else:
        prompts = heldout_prompts(ee_model.tokenizer, num_prompts=max(8, *args.batch_sizes), window=args.prompt_tokens)
    start = time.perf_counter()
    report = run_benchmark(
        ee_model,
        plain_model,
        prompts,
        args.batch_sizes,
        args.exits,
        args.ks,
        args.new_tokens,
        args.threshold,
        args.forced,
        not args.no_transformers,
        repeats=args.repeats,
        forced_exits=args.forced_exits,
        log=lambda m: print(m, flush=True),
    )
    report["command"] = "python -m ee_transformers.tools.bench_speculative " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    report["model"] = str(args.model)
    report["wall_seconds"] = time.perf_counter() - start
    table = format_table(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out / "results.md").write_text(table)
    print(table)
    different = [r for r in report["results"] if not r["identical"]]
    assert not different, f"{len(different)} run(s) differ from plain greedy: {different}"  # after the report is out
    return 0


if __name__ == "__main__":
    sys.exit(main())
