"""`ee-transformers bench-pool`: the HELIOS model pool on SmolLM2-135M, side by side with each of its models alone and
with full depth, in one process.

1. Two early-exit models on the one frozen backbone, exit heads (norm + low-rank adapter) fitted on different text:
   `novels` on Austen's five training novels, `python` on the first half of the Python manual (cached in --out;
   `--reuse` skips the fits). The two models share the backbone modules (it is frozen: the same weights either way).
2. Complementarity, teacher-forced on held-out text of each domain: per model, how many tokens exit early under the
   criterion and how often they agree with full depth, and the predicted cost per token (the pool's analytic units).
3. A workload mixing both domains (the benchmark's held-out prompts, alternating novels / Python): greedy, batch 1,
   `--new-tokens` tokens each (EOS does not stop a row), every configuration on every prompt, interleaved, in
   `--repeats` rounds: full depth (the plain twin), `novels` alone, `python` alone, the pool of both.
4. Report: tokens/s (total new tokens over total seconds, and per domain), the quality measures of
   `tools/quality.py` against full depth (identical-token share scored
   up to full depth's first EOS), mean exit layer, and where the pool switched.

    ee-transformers bench-pool --out runs/pool-bench --steps 300
    ee-transformers bench-pool --reuse --out runs/pool-bench --threshold 0.8

Python API: `PoolConfig` (the settings; the CLI's flags are generated from it), `domain_texts`, `fit_domain_model`,
`share_backbone`, `complementarity`, `configurations`, `run_workload`, `format_report`, `main`.
"""

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ee_transformers.tools.assets.text import CALIBRATION_REGIONS, FIT_REGIONS, text_slice
from ee_transformers.utils.arguments import (
    ArgumentParser,
    add_config_arguments,
    check_fields,
    config_from_args,
    run_command,
)
from ee_transformers.utils.generation import generate_kwargs

__all__ = [
    "HELIOS_CLAIM",
    "QUICK",
    "CatchUpTimer",
    "PoolConfig",
    "build_parser",
    "complementarity",
    "configurations",
    "domain_texts",
    "fit_domain_model",
    "fit_model",
    "format_report",
    "main",
    "run_workload",
    "share_backbone",
]

HELIOS_CLAIM = (
    "HELIOS (arXiv abstract) reports 1.48x throughput and 15.14x batch size over existing early-exit "
    "frameworks, for model switching and lean loading together; the abstract gives no figure for the pool "
    "alone."
)
# the demo's regions: fits on the first half of the manual (and the five training novels, whole); profiles on the
# calibration regions, held out from fits and from the prompts
PROFILE_REGIONS = CALIBRATION_REGIONS


@dataclass
class PoolConfig:
    """Settings of one `bench-pool` run; `__post_init__` raises `ValueError` naming a bad field."""

    exit_layers: list[int] = field(
        default_factory=lambda: [23, 26], metadata={"help": "exit layers (of 0..29)", "min": 0}
    )
    adapter_rank: int = field(default=64, metadata={"help": "rank of the exit heads' adapters", "min": 1})
    steps: int = field(default=100, metadata={"help": "fitting steps per model (2 blocks each)", "min": 1})
    block_size: int = field(default=128, metadata={"help": "tokens per block (fits and profiles)", "min": 1})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate of the exit heads", "above": 0})
    positions: int = field(default=32, metadata={"help": "distilled positions per block (0 = all)", "min": 0})
    max_chars: int = field(default=400_000, metadata={"help": "characters of training text per domain", "min": 1})
    criterion: str = field(
        default="max_prob", metadata={"help": "exit criterion", "choices": ("max_prob", "margin", "entropy")}
    )
    threshold: float = field(default=0.9, metadata={"help": "exit threshold of the criterion"})
    check_layers: list[int] | None = field(
        default=None, metadata={"help": "exits to check (default: all)", "min": 0, "empty": True}
    )
    policy: str = field(default="batch", metadata={"help": "exit policy", "choices": ("batch", "row")})
    interval: int = field(default=16, metadata={"help": "pool_interval", "min": 1})
    profile_every: int = field(default=1, metadata={"help": "pool_profile_every", "min": 1})
    new_tokens: int = field(default=64, metadata={"help": "greedy tokens generated per prompt", "min": 1})
    prompts: int = field(default=8, metadata={"help": "held-out prompts, alternating the two domains", "min": 1})
    repeats: int = field(default=2, metadata={"help": "interleaved rounds over the prompts", "min": 1})
    threads: int = field(default=2, metadata={"help": "torch threads", "min": 1})

    def __post_init__(self):
        check_fields(self)

    def exit_kwargs(self) -> dict:
        """generate()'s exit arguments of every early-exit configuration."""
        kwargs = {"exit_criterion": self.criterion, "exit_threshold": self.threshold, "exit_policy": self.policy}
        if self.check_layers:
            kwargs["exit_check_layers"] = list(self.check_layers)
        return kwargs

    def pool_kwargs(self) -> dict:
        return {"pool_interval": self.interval, "pool_profile_every": self.profile_every}


QUICK = dict(steps=4, prompts=2, new_tokens=8, repeats=1, max_chars=40_000)  # --quick: over the flags given


def build_parser():
    parser = ArgumentParser(
        prog="ee-transformers bench-pool", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/pool-bench", help="fitted folders and results go here")
    parser.add_argument("--reuse", action="store_true", help="reuse fitted folders in --out")
    add_config_arguments(parser, PoolConfig)
    parser.add_argument("--quick", action="store_true", help="tiny settings, to check the pipeline end to end")
    return parser


def domain_texts(novels, manual, max_chars):
    """{model name: training texts}, {domain: held-out profiling text}, equal characters per domain; `novels`: {slug:
    path}, `manual`: the Python manual's path."""
    from ee_transformers.tools import assets

    per_novel = max_chars // len(assets.AUSTEN_TRAIN)
    train = {
        "novels": [text_slice(novels[name], (0.0, 1.0), per_novel) for name in assets.AUSTEN_TRAIN],
        "python": [text_slice(manual, FIT_REGIONS["python"], max_chars)],
    }
    heldout = {
        "austen": text_slice(novels[assets.AUSTEN_HELDOUT], PROFILE_REGIONS["austen"], 60_000),
        "python": text_slice(manual, PROFILE_REGIONS["python"], 60_000),
    }
    return train, heldout


def _domain_texts(assets, max_chars):
    text = assets.fetch_text()
    return domain_texts({Path(p).stem: p for p in text["austen"]}, text["python"][0], max_chars)


def fit_domain_model(texts, model_dir, exit_layers, steps, adapter_rank=64, block_size=128, lr=2e-3, positions=32):
    """An early-exit model with exit heads (norm + low-rank adapter) fitted on `texts` for `steps` steps, frozen
    backbone. Returns (model, fit result)."""
    from ee_transformers.convert import from_base
    from ee_transformers.training.data import tokenize_blocks
    from ee_transformers.training.fit_exit_heads import FitConfig, fit_exit_heads

    model = from_base(
        model_dir,
        exit_layers=list(exit_layers),
        exit_head="adapter",
        exit_adapter_rank=adapter_rank,
        dtype=torch.float32,
    )
    blocks = tokenize_blocks(texts, model.tokenizer, block_size)
    order = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(0))
    heldout, train = blocks[order[:8]], blocks[order[8:]]
    config = FitConfig(
        steps=steps,
        batch_size=2,
        lr=lr,
        warmup_steps=min(20, steps // 5),
        positions_per_block=positions,
        eval_blocks=8,
    )
    return model, fit_exit_heads(model, train, heldout, config)


def fit_model(name, texts, model_dir, folder, config: PoolConfig):
    """Fits exit heads on `texts` (frozen backbone) and saves the folder."""
    from ee_transformers.training.fit_exit_heads import save_model_folder

    started = time.perf_counter()
    model, result = fit_domain_model(
        texts,
        model_dir,
        config.exit_layers,
        config.steps,
        config.adapter_rank,
        config.block_size,
        config.lr,
        config.positions,
    )
    print(
        f"   {name}: {config.steps} steps in {(time.perf_counter() - started) / 60:.1f} min; held-out agreement with "
        f"the final layer per exit {[round(a, 3) for a in result.agreement_before]} -> "
        f"{[round(a, 3) for a in result.agreement_after]}"
    )
    save_model_folder(model, folder, tokenizer=model.tokenizer, reports={"fit_report.json": result.summary()})
    return folder


def share_backbone(models) -> None:
    """Points every model of `models` at the first one's backbone and LM head (the same frozen weights): the pool
    then holds them once."""
    first, *others = models
    prefix = first.base_model_prefix
    for model in others:
        setattr(model, prefix, getattr(first, prefix))
        model.set_output_embeddings(first.get_output_embeddings())


@torch.no_grad()
def complementarity(models, tokenizer, heldout, exit_kwargs, block_size):
    """Teacher-forced on each domain's held-out text: per model, the exit each position takes under the criterion
    (first checked exit whose score holds), its agreement with full depth, and the predicted cost per token."""
    from ee_transformers.generation_early_exit import logit_score, merged_exit_values, resolve_exit_settings
    from ee_transformers.pool_early_exit import analytic_costs
    from ee_transformers.training.data import tokenize_blocks

    rows = []
    for domain, text in heldout.items():
        blocks = tokenize_blocks([text], tokenizer, block_size)[:8]
        for name, model in models.items():
            settings = resolve_exit_settings(model.config, merged_exit_values(model, None, dict(exit_kwargs)))
            out = model(blocks, output_exit_logits=True)
            final = out.logits.argmax(-1)
            last = model.config.num_hidden_layers - 1
            exits, tokens = torch.full_like(final, last), final.clone()
            undecided = torch.ones_like(final, dtype=torch.bool)
            for index, layer in enumerate(model.config.exit_layers):
                if layer not in settings.thresholds:
                    continue
                logits = out.exit_logits[index]
                fire = undecided & (logit_score(logits, settings.criterion.name) >= settings.thresholds[layer])
                exits[fire], tokens[fire] = layer, logits.argmax(-1)[fire]
                undecided &= ~fire
            counts = exits.flatten().bincount(minlength=last + 1)
            histogram = {layer: int(c) for layer, c in enumerate(counts.tolist()) if c}
            rows.append(
                {
                    "model": name,
                    "domain": domain,
                    "tokens": int(final.numel()),
                    "exit_rate": float((exits < last).float().mean()),
                    "agreement": float((tokens == final).float().mean()),
                    "mean_exit_layer": float(exits.float().mean()),
                    "cost_per_token": analytic_costs(model, settings).per_token(histogram),
                    "histogram": histogram,
                }
            )
    return rows


class CatchUpTimer:
    """Seconds a pool spends catching its inactive models up and profiling them: wraps the two functions of
    `pool_early_exit` for the duration of a `with` block (a measuring device for this benchmark only)."""

    def __init__(self):
        self.seconds = 0.0

    def _timed(self, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return run

    def __enter__(self):
        from ee_transformers import pool_early_exit

        self.module, self.saved = pool_early_exit, (pool_early_exit.catch_up, pool_early_exit.pool_profile_exits)
        pool_early_exit.catch_up, pool_early_exit.pool_profile_exits = (self._timed(fn) for fn in self.saved)
        return self

    def __exit__(self, *exc):
        self.module.catch_up, self.module.pool_profile_exits = self.saved


def configurations(models, plain, pool, exit_kwargs, pool_kwargs):
    """name -> generate(ids) returning (new tokens (1, T), exit layers (1, T) or None, pool output or None, seconds
    spent in catch-up)."""

    def ee(model):
        def run(ids, config):
            out = model.generate(ids, **generate_kwargs(model, config, **exit_kwargs))
            return out.sequences[:, ids.shape[1] :], out.exit_layers, None, 0.0

        return run

    def full(ids, config):
        out = plain.generate(ids, generation_config=config)
        return out.sequences[:, ids.shape[1] :], None, None, 0.0

    def pooled(ids, config):
        with CatchUpTimer() as timer:
            out = pool.generate(ids, generation_config=config, **exit_kwargs, **pool_kwargs)
        return out.sequences[:, ids.shape[1] :], out.exit_layers, out, timer.seconds

    names = list(models)
    return {
        "full depth": full,
        f"{names[0]} alone": ee(models[names[0]]),
        f"{names[1]} alone": ee(models[names[1]]),
        f"pool [{', '.join(names)}]": pooled,
    }


def run_workload(configs, prompts, config, repeats, eos_ids, num_layers, plain=None):
    """Every configuration on every prompt, interleaved (the order rotates per prompt and repeat). Returns per
    configuration: seconds and tokens per domain, identical-token share with full depth and tokens to the first
    divergence, exit layers, pool switches; with `plain` (the full-depth model) also per-token agreement and the full
    model's perplexity of the continuation (`ee_transformers.measure.quality`)."""
    from ee_transformers.measure.quality import full_model_view, summarise_views
    from ee_transformers.measure.timing import agreement

    names = list(configs)
    results = {
        name: {"seconds": {}, "tokens": {}, "catch_up_seconds": 0.0, "exits": [], "switches": []} for name in names
    }
    reference = {}
    for repeat in range(repeats):
        for k, prompt in enumerate(prompts):
            ids = torch.tensor([prompt["ids"]])
            shift = (repeat * len(prompts) + k) % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                new, exits, pool_out, catch_up_seconds = configs[name](ids, config)
                seconds = time.perf_counter() - start
                r, domain = results[name], prompt["domain"]
                r["catch_up_seconds"] += catch_up_seconds
                r["seconds"][domain] = r["seconds"].get(domain, 0.0) + seconds
                r["tokens"][domain] = r["tokens"].get(domain, 0) + new.numel()
                if repeat == 0:  # greedy: every repeat decodes the same tokens
                    if name == "full depth":
                        reference[k] = new
                    r["exits"].append(exits if exits is not None else torch.full_like(new, num_layers - 1))
                    if pool_out is not None:
                        r["switches"].append(
                            {
                                "prompt": k,
                                "domain": domain,
                                "switches": [(s.token, s.source, s.target) for s in pool_out.switches],
                                "profiles": pool_out.profiles,
                                "caught_up": pool_out.caught_up,
                            }
                        )
                    r.setdefault("new", {})[k] = new
                    if plain is not None:
                        sequences = torch.cat([ids, new], dim=1)
                        r.setdefault("views", []).append(full_model_view(plain, sequences, ids.shape[1], None, eos_ids))
        print(f"   round {repeat + 1}/{repeats} done")
    for name in names:
        r = results[name]
        rows = [agreement(reference[k], r["new"][k], eos_ids)[0] for k in range(len(prompts))]
        r["identical_share"] = sum(x["matches"] for x in rows) / max(sum(x["compared"] for x in rows), 1)
        r["first_divergence"] = statistics.mean(x["first_divergence"] for x in rows)
        exits = torch.cat([e.flatten() for e in r["exits"]])
        r["mean_exit_layer"] = float(exits[exits >= 0].float().mean())
        r["tok_s"] = sum(r["tokens"].values()) / sum(r["seconds"].values())
        r["catch_up_share"] = r["catch_up_seconds"] / sum(r["seconds"].values())
        r["tok_s_by_domain"] = {d: r["tokens"][d] / r["seconds"][d] for d in r["tokens"]}
        if plain is not None:
            r["quality"] = summarise_views(r["views"], results["full depth"]["views"])
    for name in names:
        results[name].pop("views", None)
        del results[name]["new"], results[name]["exits"]
    return results


def _comma(values) -> str:
    return ",".join(map(str, values))


def format_report(complement, results, config: PoolConfig, names, machine):
    """The markdown report of a run: complementarity, generation, where the pool switched, catch-up."""
    lines = [
        f"Criterion `{config.criterion}` >= {config.threshold}, checked exits "
        f"{_comma(config.check_layers or config.exit_layers)}, {config.policy} policy; pool_interval "
        f"{config.interval}, pool_profile_every {config.profile_every}; {machine}.",
        "",
        f"Teacher-forced on held-out text (8 blocks of {config.block_size} tokens per domain):",
        "",
        "| model | domain | exit rate | per-token agreement (teacher-forced) | mean exit layer | predicted cost / token "
        "(M params read) |",
        "|---|---|---|---|---|---|",
    ]
    for row in complement:
        lines.append(
            f"| {row['model']} | {row['domain']} | {row['exit_rate']:.3f} | {row['agreement']:.3f} | "
            f"{row['mean_exit_layer']:.1f} | {row['cost_per_token'] / 1e6:.1f} |"
        )
    full = results["full depth"]["tok_s"]
    domains = list(results["full depth"]["tok_s_by_domain"])
    lines += [
        "",
        f"Generation, batch 1, {config.prompts} prompts x {config.new_tokens} new tokens, {config.repeats} "
        "interleaved rounds (tok/s = new tokens / seconds over all rounds):",
        "",
        "| configuration | tok/s | vs full depth | "
        + " | ".join(f"tok/s {d}" for d in domains)
        + " | per-token agreement | identical-token share | tokens to 1st divergence | perplexity (full model's) "
        "| mean exit layer |",
        "|---|---|---|" + "---|" * len(domains) + "---|---|---|---|---|",
    ]
    for name, r in results.items():
        by_domain = " | ".join(f"{r['tok_s_by_domain'][d]:.2f}" for d in domains)
        lines.append(
            f"| {name} | {r['tok_s']:.2f} | {r['tok_s'] / full:.3f}x | {by_domain} | "
            f"{r['quality']['per_token_agreement']:.3f} | {r['identical_share']:.3f} | {r['first_divergence']:.1f} | "
            f"{r['quality']['continuation_ppl']:.2f} | {r['mean_exit_layer']:.1f} |"
        )
    pool_name = next(n for n in results if n.startswith("pool"))
    records = results[pool_name]["switches"]
    lines += ["", f"Where the pool switched ({len(records)} prompts; model 0 = {names[0]}, 1 = {names[1]}):", ""]
    for domain in domains:
        mine = [r for r in records if r["domain"] == domain]
        switched = [r for r in mine if r["switches"]]
        where = ", ".join(
            f"prompt {r['prompt']}: " + "; ".join(f"token {t}: {s}->{d}" for t, s, d in r["switches"]) for r in switched
        )
        lines.append(
            f"- {domain}: {len(switched)} of {len(mine)} requests switched{' (' + where + ')' if where else ''}"
        )
    best = max((n for n in results if n.endswith("alone")), key=lambda n: results[n]["tok_s"])
    pooled = results[pool_name]
    ratio = pooled["tok_s"] / results[best]["tok_s"]
    free = pooled["tok_s"] / (1 - pooled["catch_up_share"])  # the same run, its catch-up seconds taken out
    lines += [
        "",
        f"Catch-up and profiling took {100 * pooled['catch_up_share']:.1f}% of the pool's time "
        f"({pooled['catch_up_seconds']:.1f} s); without it the pool would run at {free:.2f} tok/s "
        f"({free / results[best]['tok_s']:.3f}x the best single model).",
        "",
        f"Pool vs the best single model ({best}): {ratio:.3f}x tokens/s, per-token agreement "
        f"{pooled['quality']['per_token_agreement']:.3f} vs {results[best]['quality']['per_token_agreement']:.3f}. "
        f"{HELIOS_CLAIM}",
    ]
    return "\n".join(lines)


def main(argv=None):
    return run_command(build_parser(), _run, argv)


def _run(args):
    config = config_from_args(PoolConfig, args)  # the flags given are checked before --quick overrides them
    if args.quick:
        config = dataclasses.replace(config, **QUICK)
    torch.set_num_threads(config.threads)
    from ee_transformers.tools.bench.report import jsonable

    started = time.perf_counter()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print("== 1. assets and the two models")
    models, heldout = _domain_models(out, args.reuse, config)
    tokenizer = next(iter(models.values())).tokenizer
    exit_kwargs = config.exit_kwargs()
    print("== 2. complementarity (teacher-forced, held-out text)")
    complement = complementarity(models, tokenizer, heldout, exit_kwargs, config.block_size)
    for row in complement:
        print(
            f"   {row['model']:>7} on {row['domain']:<7} exit rate {row['exit_rate']:.3f}, agreement "
            f"{row['agreement']:.3f}, mean exit layer {row['mean_exit_layer']:.1f}"
        )
    print("== 3. the mixed workload")
    results = _mixed_workload(models, config)
    machine = f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.device('cpu')}"
    report = format_report(complement, results, config, list(models), machine)
    print("== 4. report\n" + report)
    summary = {
        "args": {"out": args.out, "reuse": args.reuse, **dataclasses.asdict(config), "quick": args.quick},
        "complementarity": complement,
        "results": results,
        "minutes": round((time.perf_counter() - started) / 60, 1),
    }
    (out / "bench_pool.json").write_text(json.dumps(jsonable(summary), indent=1))
    (out / "bench_pool.md").write_text(report + "\n")
    print(f"== done in {summary['minutes']} min; {out / 'bench_pool.md'}")
    return 0


def _domain_models(out, reuse, config: PoolConfig):
    """({name: early-exit model fitted on one domain (or reused from `out`)}, {domain: held-out text}); the models
    share one backbone."""
    from ee_transformers.convert import from_base
    from ee_transformers.tools import assets

    model_dir = assets.fetch_model()
    train, heldout = _domain_texts(assets, config.max_chars)
    models = {}
    for name, texts in train.items():
        folder = out / name
        if not (reuse and (folder / "config.json").exists()):
            fit_model(name, texts, model_dir, folder, config)
        models[name] = from_base(folder, dtype=torch.float32).eval()
    share_backbone(list(models.values()))  # one frozen backbone: share it, do not hold it twice
    return models, heldout


def _mixed_workload(models, config: PoolConfig):
    """`run_workload` of full depth, each model alone and their pool on the mixed held-out prompts, after a
    warm-up."""
    from ee_transformers.measure.quality import eos_token_ids
    from ee_transformers.measure.timing import greedy_generation_config, without_eos
    from ee_transformers.pool_early_exit import EarlyExitPool
    from ee_transformers.tools.bench.loading import heldout_prompts, plain_twin

    first = next(iter(models.values()))
    plain = plain_twin(first)
    pool = EarlyExitPool(list(models.values()))
    prompts = heldout_prompts(first.tokenizer, num_prompts=config.prompts)
    generation_config = greedy_generation_config(first, config.new_tokens, clear_exit_settings=True)
    configs = configurations(models, plain, pool, config.exit_kwargs(), config.pool_kwargs())
    warm = torch.tensor([prompts[0]["ids"]])
    for run in configs.values():  # warm-up: first calls pay allocations and lazy inits
        run(warm, greedy_generation_config(first, 4, clear_exit_settings=True))
    eos_ids = eos_token_ids(first)  # before `without_eos`: agreement is scored up to full depth's EOS
    with without_eos(plain, *models.values()):
        return run_workload(
            configs, prompts, generation_config, config.repeats, eos_ids, first.config.num_hidden_layers, plain
        )


if __name__ == "__main__":
    raise SystemExit(main())
