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

Python API: `SpeculativeConfig` (the settings; the CLI's flags are generated from it), `run_speculative`,
`run_benchmark` (the same with keyword settings), `measure_costs`, `ideal_ms`, `pass_through_above`, `forced_model`,
`ForcedDraftHead`, `evaluate_targets`, `format_table`, `main`.
"""

import copy
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ee_transformers.compat import layer_skip_failure
from ee_transformers.measure.timing import greedy_generation_config, only_these_drafts, without_eos
from ee_transformers.tools.bench.loading import heldout_prompts, load_models, make_batches, plain_twin, random_prompts
from ee_transformers.tools.bench.speculative_costs import (  # noqa: F401 (also importable from here, as before)
    ForcedDraftHead,
    forced_model,
    ideal_ms,
    measure_costs,
    pass_through_above,
)
from ee_transformers.utils.arguments import (
    ArgumentParser,
    add_config_arguments,
    check_fields,
    comma_list,
    config_from_args,
    run_command,
)
from ee_transformers.utils.generation import generate_kwargs

__all__ = [
    "TARGET_REALISED_OVER_IDEAL",
    "ForcedDraftHead",
    "SpeculativeConfig",
    "build_parser",
    "evaluate_targets",
    "forced_model",
    "format_table",
    "ideal_ms",
    "main",
    "measure_costs",
    "pass_through_above",
    "run_benchmark",
    "run_speculative",
]

TARGET_REALISED_OVER_IDEAL = 0.9


@dataclass
class SpeculativeConfig:
    """Settings of one `bench-speculative` run; `__post_init__` raises `ValueError` naming a bad field.

    `heads=False` measures the forced profiles only (random weights, whose heads decide nothing); it and
    `cost_repeats` are Python-only settings, not flags."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 8], metadata={"help": "batch sizes measured", "min": 1})
    exits: list[int] | None = field(
        default=None, metadata={"help": "the exits that draft (default: all)", "min": 0, "empty": True}
    )
    ks: list[int] = field(
        default_factory=lambda: [2, 4], metadata={"help": "draft lengths K (num_assistant_tokens)", "min": 1}
    )
    new_tokens: int = field(default=16, metadata={"help": "greedy tokens generated per run", "min": 1})
    repeats: int = field(default=1, metadata={"help": "interleaved repeats (median of paired ratios)", "min": 1})
    prompt_tokens: int = field(default=64, metadata={"help": "tokens per prompt", "min": 1})
    threshold: float = field(
        default=0.4,
        metadata={
            "help": "assistant_confidence_threshold for the real heads (transformers' default 0.4)",
            "min": 0,
            "max": 1,
        },
    )
    forced: list[float] = field(
        default_factory=lambda: [1.0, 0.6],
        metadata={
            "help": "forced acceptance rates (pass-through copies); empty string for none",
            "min": 0,
            "max": 1,
            "empty": True,
        },
    )
    forced_exits: list[int] | None = field(
        default=None, metadata={"help": "exits of the forced profiles (default: all)", "min": 0, "empty": True}
    )
    transformers: bool = field(
        default=True, metadata={"help": "measure transformers' own assistant_early_exit (batch 1)"}
    )
    random_prompts: bool = field(default=False, metadata={"help": "random token prompts (no text assets)"})
    threads: int | None = field(default=None, metadata={"help": "torch threads (default: torch's choice)", "min": 1})
    heads: bool = field(default=True, metadata={"help": "draft from the model's exit heads (False: forced only)"})
    cost_repeats: int = field(default=15, metadata={"help": "timed calls per piece of the cost model", "min": 1})

    def __post_init__(self):
        check_fields(self)


PYTHON_ONLY = ("heads", "cost_repeats")  # settings of `run_benchmark` that are not flags


# ----------------------------------------------------------------------------------------------------------------
# forced acceptance
# ----------------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------------
# the cost model
# ----------------------------------------------------------------------------------------------------------------


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
    return lambda: model.generate(
        ids, attention_mask=mask, **generate_kwargs(model, _greedy(model, new_tokens), **settings)
    )


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
            settings = generate_kwargs(plain, _greedy(plain, new_tokens), assistant_early_exit=config["exit_layer"] + 1)
            return plain.generate(ids, attention_mask=mask, **settings)
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
    """`run_speculative` with its settings as keywords: `exit_layers` are the exits that draft (`exits`),
    `forced_rates` the forced acceptance rates (`forced`), `transformers_baseline` is `transformers`."""
    config = SpeculativeConfig(
        batch_sizes=batch_sizes,
        exits=exit_layers,
        ks=ks,
        new_tokens=new_tokens,
        threshold=threshold,
        forced=forced_rates,
        forced_exits=forced_exits,
        transformers=transformers_baseline,
        heads=heads,
        repeats=repeats,
        cost_repeats=cost_repeats,
    )
    return run_speculative(ee_model, plain_model, prompts, config, log)


def run_speculative(ee_model, plain_model, prompts, config: SpeculativeConfig | None = None, log=print) -> dict:
    """The side-by-side run of `config` on `prompts` (from `heldout_prompts` / `random_prompts`); returns the report
    (`format_table` prints it)."""
    config = config or SpeculativeConfig()
    plain_model.generation_config = copy.deepcopy(plain_model.generation_config)  # the twin shares ee's otherwise
    with without_eos(ee_model, plain_model):
        return _run(ee_model, plain_model, prompts, config, log)


@dataclass
class _AtBatch:
    """What every run at one batch size shares: its batch, its cost model and plain's ideal ms under it."""

    size: int
    batch: tuple
    cost: dict
    plain_ideal: float
    num_layers: int
    new_tokens: int


def _run(ee_model, plain_model, prompts, config: SpeculativeConfig, log):
    exits = list(config.exits or ee_model.config.exit_layers)
    forced_exits = exits if config.forced_exits is None else list(config.forced_exits)
    results, costs = [], {}
    for batch_size in config.batch_sizes:
        at = _at_batch(ee_model, prompts, batch_size, config, log)
        costs[batch_size] = at.cost
        if config.heads:
            results += _head_results(ee_model, plain_model, exits, at, config, log)
        for exit_layer in forced_exits:  # forced acceptance: a copy per exit and rate, on the same pieces of compute
            for rate in config.forced:
                results += _forced_results(ee_model, exit_layer, rate, at, config, log)
    report = {
        "settings": dict(
            batch_sizes=list(config.batch_sizes),
            exit_layers=exits,
            ks=list(config.ks),
            new_tokens=config.new_tokens,
            threshold=config.threshold,
            forced_rates=list(config.forced),
            forced_exits=forced_exits,
            num_layers=ee_model.config.num_hidden_layers,
            prompt_tokens=len(prompts[0]["ids"]),
            threads=torch.get_num_threads(),
            repeats=config.repeats,
        ),
        "costs": costs,
        "results": results,
    }
    if config.transformers and layer_skip_failure() is not None:
        report["not_run"] = {"transformers' assistant_early_exit": layer_skip_failure()}
        log(f"[bench-speculative] transformers' assistant_early_exit: {layer_skip_failure()}")
    report["targets"] = evaluate_targets(report)
    return report


def _at_batch(ee_model, prompts, batch_size, config: SpeculativeConfig, log) -> _AtBatch:
    """The batch of `batch_size` prompts and the cost model measured on it."""
    batch = make_batches(prompts, batch_size, max_batches=1, device=ee_model.device)[0]
    prompt_length, new_tokens = batch[0].shape[1], config.new_tokens
    start = time.perf_counter()
    cost = measure_costs(
        ee_model, batch_size, max(config.ks) + 1, prompt_length, prompt_length + new_tokens // 2, config.cost_repeats
    )
    log(
        f"[bench-speculative] batch {batch_size}: cost model in {time.perf_counter() - start:.0f} s: layer "
        f"{cost['layer'][1]:.2f} ms, final head {cost['final_head'][1]:.2f} ms, draft head "
        f"{cost['draft_head']:.2f} ms"
    )
    num_layers = ee_model.config.num_hidden_layers
    return _AtBatch(batch_size, batch, cost, ideal_ms(cost, num_layers, new_tokens), num_layers, new_tokens)


def _head_results(ee_model, plain_model, exits, at: _AtBatch, config: SpeculativeConfig, log) -> list[dict]:
    """Drafts from the model's own heads: ours at every exit and K, and transformers' at batch 1."""
    cases = [
        dict(mode="ours", profile="heads", exit_layer=e, k=k, threshold=config.threshold)
        for e in exits
        for k in config.ks
    ]
    if config.transformers and at.size == 1 and layer_skip_failure() is None:
        cases += [dict(c, mode="transformers") for c in cases]
    if not cases:
        return []
    runs = [(f"{c['mode']} E={c['exit_layer']} K={c['k']}", _case_run(c, ee_model, plain_model, at)) for c in cases]
    return _measured(cases, runs, _plain(plain_model, at.batch, at.new_tokens), at, config, log)


def _forced_results(ee_model, exit_layer, rate, at: _AtBatch, config: SpeculativeConfig, log) -> list[dict]:
    """Forced acceptance at `rate` from `exit_layer`, on a pass-through copy and its plain twin."""
    forced = forced_model(ee_model, exit_layer, rate).eval()
    twin = plain_twin(forced)  # plain generate on the copy's very modules
    twin.generation_config = copy.deepcopy(forced.generation_config)
    cases = [
        dict(mode="ours", profile=f"forced {rate:g}", exit_layer=exit_layer, k=k, threshold=0.0) for k in config.ks
    ]
    if config.transformers and at.size == 1 and rate == 1.0 and layer_skip_failure() is None:  # draft head: final norm
        cases += [dict(c, mode="transformers") for c in cases]
    runs = [(f"{c['mode']} {c['profile']} E={exit_layer} K={c['k']}", _case_run(c, forced, twin, at)) for c in cases]
    return _measured(cases, runs, _plain(twin, at.batch, at.new_tokens), at, config, log)


def _case_run(case, model, plain, at: _AtBatch):
    """The generate call of one case: ours on `model`, or transformers' on `plain`."""
    if case["mode"] == "ours":
        return _ours(model, at.batch, case, at.new_tokens)
    return _transformers(plain, at.batch, case, at.new_tokens)


def _measured(cases, runs, plain_run, at: _AtBatch, config: SpeculativeConfig, log) -> list[dict]:
    measured, plain_out = _compare(plain_run, runs, config.repeats, log)
    return [
        _result(case, seconds, speedup, out, plain_out, at) for case, (seconds, speedup, out) in zip(cases, measured)
    ]


def _result(case, seconds, speedup, out, plain_out, at: _AtBatch):
    row = dict(
        case,
        batch=at.size,
        seconds=seconds,
        speedup=speedup,
        identical=bool(torch.equal(out.sequences, plain_out.sequences)),
    )
    if case["mode"] == "ours":
        rounds = out.draft_lengths.tolist()
        ideal = at.plain_ideal / ideal_ms(at.cost, at.num_layers, at.new_tokens, case["exit_layer"], rounds)
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
    lines += [f"\n{name}: {why}" for name, why in report.get("not_run", {}).items()]
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


def build_parser():
    parser = ArgumentParser(prog="ee-transformers bench-speculative", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an early-exit folder, or a plain one with --exit-layers")
    parser.add_argument(
        "--exit-layers",
        type=comma_list(int),
        default=None,
        help="convert a plain folder with these exits (e.g. 7,15,23); default: the folder's own",
    )
    add_config_arguments(parser, SpeculativeConfig, skip=PYTHON_ONLY)
    parser.add_argument("--out", default=None, help="folder for report.json and results.md")
    return parser


def main(argv=None):
    return run_command(build_parser(), lambda args: _command(args, argv), argv)


def _command(args, argv=None):
    from ee_transformers.convert import check_weights, read_config

    config = config_from_args(SpeculativeConfig, args)
    read_config(args.model, "--model")  # before anything loads: one line naming the flag
    check_weights(args.model, "--model")
    if config.threads:
        torch.set_num_threads(config.threads)
    ee_model, plain_model = load_models(args.model, exit_layers=args.exit_layers)
    num_prompts = max(8, *config.batch_sizes)
    if config.random_prompts or ee_model.tokenizer is None:
        prompts = random_prompts(ee_model.config.vocab_size, num_prompts, config.prompt_tokens)
    else:
        prompts = heldout_prompts(ee_model.tokenizer, num_prompts=num_prompts, window=config.prompt_tokens)
    start = time.perf_counter()
    report = run_speculative(ee_model, plain_model, prompts, config, log=lambda m: print(m, flush=True))
    report["command"] = "python -m ee_transformers.tools.bench.speculative " + " ".join(
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
