"""`ee-transformers bench --memory-budget BYTES --context N`: HELIOS's headline measured side by side.

The fully loaded early-exit model ("full": every layer resident, the same exit settings) against the lean model at
the profiled depth ("lean": layers 0..E resident, greedy exits at E). For each, in one process:

1. memory, measured: resident parameter bytes (`resident_parameter_bytes`), K/V bytes per token from a real cache,
   and the peak of every tensor a whole generate allocates (K/V, activations, logits; a dispatch-mode tracker of
   live storages) at batch 1 and 2, which gives bytes per row and a fixed part;
2. the largest batch whose weights + that peak fit the budget, then the peak measured again at that batch;
3. throughput: each model at its own largest batch, runs interleaved (full, lean, lean, full, ...; a warm-up at
   batch 2 first), and lean at full's batch (what depth alone gives), generated
   tokens per second end to end (prefill included: both run their own prompts' prefill);
4. quality against full depth (the plain full-depth greedy tokens of held-out prompts): agreement and tokens until
   the first divergence, for full, lean, and lean with the quality guard on, whose deepening events are counted.

    ee-transformers bench-lean --model FOLDER --memory-budget 1.2G --context 128

Python API: `LeanConfig` (the settings; the CLI's flags are generated from it), `PeakMemory`, `measure_memory`,
`fit_batch`, `interleaved_throughput`, `measure_quality`, `measure_budget`, `format_table`, `parse_bytes`, `main`.
"""

import json
import math
import statistics
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ee_transformers.compat import cache_of
from ee_transformers.generation_early_exit import ExitStats
from ee_transformers.lean_early_exit import kv_bytes_per_token, resident_parameter_bytes
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
    "LeanConfig",
    "PeakMemory",
    "build_parser",
    "fit_batch",
    "format_table",
    "interleaved_throughput",
    "main",
    "measure_budget",
    "measure_memory",
    "measure_quality",
    "parse_bytes",
]


def parse_bytes(text) -> int:
    """ "1.5G", "900M", "64K", "123456" -> bytes (powers of 1024)."""
    units = {"K": 1024, "M": 1024**2, "G": 1024**3}
    text = str(text).strip().upper().removesuffix("B").removesuffix("I")
    scale = units.get(text[-1:], 1)
    value = float(text[:-1] if text[-1:] in units else text) * scale
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"`--memory-budget` must be a positive size (e.g. 1.5G, 900M, 123456), got {text!r}.")
    return int(value)


@dataclass
class LeanConfig:
    """Settings of one `bench-lean` run; `__post_init__` raises `ValueError` naming a bad field. `memory_budget`
    (bytes, one or more budgets) and `context` have no default; `--memory-budget` takes sizes (1.5G, 900M, ...)."""

    memory_budget: list[int] = field(
        metadata={"help": "bytes for weights + K/V + activations; repeat for several budgets", "min": 1}
    )
    context: int = field(metadata={"help": "tokens per sequence: prompt + new tokens", "min": 1})
    prompt_tokens: int = field(default=64, metadata={"help": "tokens per prompt", "min": 1})
    exit_criterion: str | None = field(default=None, metadata={"help": "default: the folder's stored setting"})
    exit_threshold: list[float] | None = field(
        default=None, metadata={"help": "one threshold, or one per checked exit (default: the folder's)"}
    )
    exit_policy: str | None = field(
        default=None, metadata={"help": "default: the folder's stored setting", "choices": ("batch", "row")}
    )
    exit_check_layers: list[int] | None = field(
        default=None, metadata={"help": "checked exits (default: the folder's)", "min": 0, "empty": True}
    )
    coverage: float = field(
        default=0.95, metadata={"help": "profile coverage that picks exit_max_layer", "above": 0, "max": 1}
    )
    exit_max_layer: int | None = field(default=None, metadata={"help": "skip the profile's choice", "min": 0})
    profile_tokens: int = field(default=4096, metadata={"help": "teacher-forced tokens to profile", "min": 1})
    breach_limit: float = field(
        default=0.2, metadata={"help": "the quality guard's exit_breach_limit", "min": 0, "max": 1}
    )
    breach_window: int = field(default=32, metadata={"help": "the quality guard's exit_breach_window", "min": 1})
    quality_prompts: int = field(default=8, metadata={"help": "prompts whose quality is measured", "min": 1})
    quality_batch: int = field(default=8, metadata={"help": "batch size of the quality runs", "min": 1})
    repeats: int = field(default=2, metadata={"help": "interleaved throughput repeats", "min": 1})
    max_batch: int = field(default=256, metadata={"help": "the largest batch tried", "min": 1})
    threads: int | None = field(default=None, metadata={"help": "torch threads (default: torch's choice)", "min": 1})

    def __post_init__(self):
        check_fields(self)
        if self.context - self.prompt_tokens < 2:
            raise ValueError(
                f"`context` must exceed `prompt_tokens` by at least 2, got {self.context} and {self.prompt_tokens}."
            )

    @property
    def new_tokens(self) -> int:
        return self.context - self.prompt_tokens

    def exit_kwargs(self) -> dict:
        """generate()'s exit arguments that were given (one threshold as a number)."""
        threshold = self.exit_threshold
        if threshold is not None and len(threshold) == 1:
            threshold = threshold[0]
        given = dict(
            exit_criterion=self.exit_criterion,
            exit_threshold=threshold,
            exit_policy=self.exit_policy,
            exit_check_layers=self.exit_check_layers or None,
        )
        return {k: v for k, v in given.items() if v is not None}

    def guard(self) -> dict:
        return dict(exit_breach_limit=self.breach_limit, exit_breach_window=self.breach_window)


class PeakMemory(TorchDispatchMode):
    """The peak of live tensor storage allocated while it is active. Each new storage is counted once; an op's result
    that shares an input's storage (a view, an in-place op: e.g. a transposed weight) is not new memory, so tensors
    that existed before, like the weights, are not counted. A storage's bytes are released when torch frees it."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self._seen and key not in inputs:  # views and in-place results: no new memory
                    self._seen.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key, size):
        self._seen.discard(key)
        self.live -= size


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generation_config(model, new_tokens):
    """Greedy, exactly `new_tokens` tokens (EOS does not stop a row, so every run decodes the same steps)."""
    from ee_transformers.measure.timing import greedy_generation_config

    return greedy_generation_config(model, new_tokens)


def _batch(prompts, batch_size, offset=0):
    """`batch_size` prompts (recycled), left-padded: (ids, mask)."""
    rows = [prompts[(offset + i) % len(prompts)] for i in range(batch_size)]
    length = max(map(len, rows))
    ids = torch.zeros(batch_size, length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, length - len(r) :], mask[i, length - len(r) :] = torch.tensor(r), 1
    return ids, mask


@torch.no_grad()
def _generate(model, prompts, batch_size, new_tokens, exit_kwargs, offset=0):
    ids, mask = _batch(prompts, batch_size, offset)
    ids, mask = ids.to(model.device), mask.to(model.device)
    return model.generate(
        ids, attention_mask=mask, **generate_kwargs(model, _generation_config(model, new_tokens), **exit_kwargs)
    )


def measure_memory(model, prompts, new_tokens, exit_kwargs, batch_sizes=(1, 2)) -> dict:
    """Resident parameter bytes, K/V bytes per token (from the cache of a real generate) and the peak bytes a whole
    generate allocates at each of `batch_sizes`, with the per-row slope and fixed part of that peak."""
    peaks = {}
    for b in batch_sizes:
        with PeakMemory() as meter:
            out = _generate(model, prompts, b, new_tokens, exit_kwargs)
            kv = kv_bytes_per_token(cache_of(out))
            del out
        peaks[b] = meter.peak
    (b1, p1), (b2, p2) = sorted(peaks.items())[:2]
    per_row = (p2 - p1) / (b2 - b1)
    return {
        "weights": resident_parameter_bytes(model),
        "kv_bytes_per_token": kv["bytes_per_token"],
        "kv_layers": kv["layers"],
        "peak": peaks,
        "per_row": per_row,
        "fixed": p1 - per_row * b1,
    }


def fit_batch(memory: dict, budget: int, max_batch: int = 4096) -> int:
    """The largest batch b with weights + fixed + b * per_row <= budget (0 when not even one row fits)."""
    room = budget - memory["weights"] - memory["fixed"]
    return max(0, min(max_batch, int(room // memory["per_row"]))) if memory["per_row"] > 0 else max_batch


def _quality(model, reference, prompts, new_tokens, exit_kwargs, batch_size, reset_to=None):
    """Agreement of `model`'s greedy tokens with `reference` (plain full depth), batch by batch; with `reset_to`,
    the lean model goes back to that depth before every batch (the guard may have deepened it)."""
    from ee_transformers.measure.timing import agreement

    rows, exits, greedy, deepenings, tokens = [], [], [], 0, 0
    for start in range(0, len(prompts), batch_size):
        if reset_to is not None:
            model.set_exit_max_layer(reset_to)
        n = min(batch_size, len(prompts) - start)
        out = _generate(model, prompts, n, new_tokens, exit_kwargs, offset=start)
        new = out.sequences[:, -new_tokens:].cpu()
        rows += agreement(reference[start : start + n], new)
        exits.append(out.exit_layers.flatten())
        greedy.append((out.greedy_exits if out.greedy_exits is not None else out.exit_layers < -1).flatten())
        deepenings += len(out.deepenings or [])
        tokens += new.numel()
    stats = ExitStats.from_exit_layers(torch.cat(exits), model.config.num_hidden_layers, torch.cat(greedy))
    return {
        "agreement": sum(r["matches"] for r in rows) / max(sum(r["compared"] for r in rows), 1),
        "first_divergence": statistics.mean(r["first_divergence"] for r in rows),
        "mean_exit_layer": stats.mean_exit_layer,
        "histogram": stats.histogram,
        "greedy_rate": stats.greedy_rate,
        "deepenings": deepenings,
        "deepenings_per_1k_tokens": 1000 * deepenings / tokens,
        "tokens": tokens,
    }


def interleaved_throughput(models, prompts, new_tokens, repeats, log=print):
    """`models`: {name: (model, batch size, exit kwargs)}. Runs them interleaved, each at its own batch, the order
    flipping every repeat: {name: [generated tokens / s per run]}, end to end (prefill included)."""
    names, out = list(models), {name: [] for name in models}
    for name in names:  # warm-up at batch 2, not counted
        model, _, exit_kwargs = models[name]
        _generate(model, prompts, 2, new_tokens, exit_kwargs)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            model, batch_size, exit_kwargs = models[name]
            _sync(model.device)
            start = time.perf_counter()
            _generate(model, prompts, batch_size, new_tokens, exit_kwargs, offset=r)
            _sync(model.device)
            seconds = time.perf_counter() - start
            out[name].append(batch_size * new_tokens / seconds)
            log(f"[bench-lean] repeat {r + 1} {name} batch {batch_size}: {out[name][-1]:.1f} tok/s ({seconds:.1f} s)")
    return out


def _calibration_texts(max_chars):
    """The front of the held-out novel and of the Python manual: text the benchmark's prompts (their tails) do not
    use."""
    from ee_transformers.tools import assets

    text = assets.fetch_text()
    novel = next(p for p in text["austen"] if Path(p).stem == assets.AUSTEN_HELDOUT)
    out = []
    for path, (lo, hi) in ((novel, (0.0, 0.5)), (text["python"][0], (0.0, 0.8))):
        body = Path(path).read_text(encoding="utf-8", errors="replace")
        part = body[int(lo * len(body)) : int(hi * len(body))]
        out.append(part[len(part) // 3 : len(part) // 3 + max_chars])  # away from the front matter
    return out


def _log(message):
    print(message, flush=True)


def _exit_max_layer(full, config: LeanConfig, exit_kwargs):
    """(the exit profile or None, the lean depth): `config.exit_max_layer`, or the profile's depth for
    `config.coverage`."""
    from ee_transformers.tools.profile import profile_exits

    if config.exit_max_layer is not None:
        return None, config.exit_max_layer
    profile = profile_exits(
        full,
        full.tokenizer,
        _calibration_texts(40 * config.profile_tokens),
        window=256,
        max_tokens=config.profile_tokens,
        write=False,
        **exit_kwargs,
    )
    _log(f"[bench-lean] profile: {profile}")
    return profile, profile.recommend(config.coverage)


def _measure_memories(models, prompts, config: LeanConfig, exit_kwargs):
    """`measure_memory` of each of `models` ({name: model}), logged."""
    memory = {}
    for name, model in models.items():
        m = memory[name] = measure_memory(model, prompts, config.new_tokens, exit_kwargs)
        _log(
            f"[bench-lean] {name}: weights {m['weights'] / 2**20:.1f} MiB, K/V {m['kv_bytes_per_token'] / 1024:.1f} "
            f"KiB/token ({m['kv_layers']} layers), {m['per_row'] / 2**20:.2f} MiB per row at context {config.context} "
            f"(K/V {m['kv_bytes_per_token'] * config.context / 2**20:.2f}), fixed {m['fixed'] / 2**20:.1f} MiB"
        )
    return memory


def measure_quality(full, lean, prompts, depth, config: LeanConfig, exit_kwargs) -> dict:
    """Agreement with plain full depth of full, lean, and lean with the quality guard on, on the first
    `config.quality_prompts` of `prompts`, once (it does not depend on the budget); the lean model ends at `depth`."""
    new_tokens, size = config.new_tokens, config.quality_batch
    with torch.no_grad():
        reference = torch.cat(
            [
                _generate(
                    full, prompts, min(size, config.quality_prompts - s), new_tokens, {"early_exit": False}, offset=s
                ).sequences[:, -new_tokens:]
                for s in range(0, config.quality_prompts, size)
            ]
        ).cpu()
    held = prompts[: config.quality_prompts]
    guarded = {**exit_kwargs, **config.guard()}
    quality = {
        "full": _quality(full, reference, held, new_tokens, exit_kwargs, size),
        "lean": _quality(lean, reference, held, new_tokens, exit_kwargs, size),
        "lean + guard": _quality(lean, reference, held, new_tokens, guarded, size, reset_to=depth),
    }
    lean.set_exit_max_layer(depth)
    for name, q in quality.items():
        _log(
            f"[bench-lean] quality {name}: agreement {q['agreement']:.3f}, first divergence "
            f"{q['first_divergence']:.1f}, greedy {q['greedy_rate']:.3f}, deepenings {q['deepenings']}"
        )
    return quality


def measure_budget(full, lean, memory, prompts, budget, config: LeanConfig, exit_kwargs) -> dict:
    """One budget's row: the largest batch of each model within `budget`, the memory measured at it, and the
    interleaved throughput of full, lean, and lean at full's batch (what depth alone gives)."""
    models = {"full": full, "lean": lean}
    batch = {name: fit_batch(memory[name], budget, config.max_batch) for name in memory}
    row = {"budget": budget, "batch": batch}
    if min(batch.values()) == 0:
        row["note"] = "one row does not fit: " + ", ".join(n for n, b in batch.items() if b == 0)
        _log(f"[bench-lean] budget {budget / 2**20:.0f} MiB: {row['note']}")
        return row
    measured = {}
    for name, model in models.items():
        with PeakMemory() as meter:
            _generate(model, prompts, batch[name], config.new_tokens, exit_kwargs)
        measured[name] = memory[name]["weights"] + meter.peak
    _log(
        f"[bench-lean] budget {budget / 2**20:.0f} MiB: batch full {batch['full']}, lean {batch['lean']}; "
        f"measured totals {measured['full'] / 2**20:.0f} / {measured['lean'] / 2**20:.0f} MiB"
    )
    # lean at full's batch too: its ratio to full is what depth alone gives, the rest is the larger batch
    runs = {
        "full": (full, batch["full"], exit_kwargs),
        "lean": (lean, batch["lean"], exit_kwargs),
        "lean at full's batch": (lean, batch["full"], exit_kwargs),
    }
    speed = interleaved_throughput(runs, prompts, config.new_tokens, config.repeats, _log)
    ratios = [lv / fv for lv, fv in zip(speed["lean"], speed["full"])]
    same_batch = [lv / fv for lv, fv in zip(speed["lean at full's batch"], speed["full"])]
    row.update(
        measured_total=measured,
        tokens_per_s={n: statistics.median(v) for n, v in speed.items()},
        tokens_per_s_runs=speed,
        batch_ratio=batch["lean"] / batch["full"],
        throughput_ratio=statistics.median(ratios),
        throughput_ratio_runs=ratios,
        same_batch_ratio=statistics.median(same_batch),
    )
    return row


def build_parser():
    p = ArgumentParser(prog="ee-transformers bench-lean", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="early-exit folder, or a plain one with --exit-layers")
    p.add_argument(
        "--exit-layers", type=comma_list(int), default=None, help="comma-separated exits, to convert a plain folder"
    )
    p.add_argument(
        "--memory-budget",
        required=True,
        action="append",
        type=parse_bytes,
        help="bytes for weights + K/V + activations (1.5G, 900M, ...); repeat for several budgets",
    )
    add_config_arguments(p, LeanConfig, skip=("memory_budget",))
    p.add_argument("--out", default=None, help="write report.json and results.md here")
    return p


def main(argv=None):
    return run_command(build_parser(), lambda args: _run(args, argv), argv)


def _run(args, argv=None):
    from ee_transformers.convert import from_base
    from ee_transformers.tools.bench.loading import heldout_prompts
    from ee_transformers.tools.bench.run import machine_info

    config = config_from_args(LeanConfig, args)
    if config.threads:
        torch.set_num_threads(config.threads)
    started = time.perf_counter()
    exit_kwargs, exit_layers = config.exit_kwargs(), args.exit_layers or None
    full = from_base(args.model, exit_layers=exit_layers, dtype=torch.float32).eval()
    last = full.config.num_hidden_layers - 1
    profile, depth = _exit_max_layer(full, config, exit_kwargs)
    if depth == last:
        _log(
            f"[bench-lean] the profile needs every layer for {100 * config.coverage:g}% coverage (exit_max_layer "
            f"{last}): the lean model is the full model, nothing to compare. Lower --coverage or pass --exit-max-layer."
        )
        return 0
    lean = from_base(args.model, exit_layers=exit_layers, dtype=torch.float32, exit_max_layer=depth).eval()
    _log(f"[bench-lean] lean model: layers 0..{depth} of 0..{last} resident")

    num_prompts = max(config.quality_prompts, 8)
    prompts = [p["ids"] for p in heldout_prompts(full.tokenizer, num_prompts=num_prompts, window=config.prompt_tokens)]
    memory = _measure_memories({"full": full, "lean": lean}, prompts, config, exit_kwargs)
    quality = measure_quality(full, lean, prompts, depth, config, exit_kwargs)
    budgets = [
        measure_budget(full, lean, memory, prompts, budget, config, exit_kwargs) for budget in config.memory_budget
    ]
    report = {
        "command": "python -m ee_transformers.tools.bench.lean " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine_info(),
        "model": str(args.model),
        "num_layers": last + 1,
        "exit_layers": list(full.config.exit_layers),
        "exit_settings": {k: str(v) for k, v in exit_kwargs.items()},
        "context": config.context,
        "prompt_tokens": config.prompt_tokens,
        "new_tokens": config.new_tokens,
        "exit_max_layer": depth,
        "coverage": config.coverage,
        "profile": profile.to_dict() if profile is not None else None,
        "memory": memory,
        "quality": quality,
        "guard": config.guard(),
        "budgets": budgets,
        "wall_seconds": time.perf_counter() - started,
    }
    table = format_table(report)
    print(table)
    if args.out:
        _write(report, table, profile, Path(args.out))
    return 0


def _write(report, table, profile, out: Path):
    """report.json and results.md into `out`, and the exit profile (exit_profile.json / .png) when one was made."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "results.md").write_text(table)
    if profile is not None:
        from ee_transformers.tools.profile import write_profile

        write_profile(profile, out)


def format_table(report) -> str:
    mib = 2**20
    m, q = report["memory"], report["quality"]
    lines = [
        f"**Lean at exit_max_layer {report['exit_max_layer']}** (layers 0..{report['exit_max_layer']} of "
        f"0..{report['num_layers'] - 1}), context {report['context']} ({report['prompt_tokens']} prompt + "
        f"{report['new_tokens']} new tokens)",
        "",
        "| model | weights MiB | K/V KiB / token | MiB per row | agreement | tokens to 1st divergence | "
        "greedy exits | deepenings / 1k tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("full", "lean", "lean + guard"):
        mem = m["lean" if name.startswith("lean") else "full"]
        lines.append(
            f"| {name} | {mem['weights'] / mib:.1f} | {mem['kv_bytes_per_token'] / 1024:.1f} | "
            f"{mem['per_row'] / mib:.2f} | {q[name]['agreement']:.3f} | {q[name]['first_divergence']:.1f} | "
            f"{q[name]['greedy_rate']:.3f} | {q[name]['deepenings_per_1k_tokens']:.1f} |"
        )
    if report.get("profile") and report["profile"].get("agreement"):
        agreement, e = report["profile"]["agreement"], str(report["exit_max_layer"])
        lines += [
            "",
            f"Teacher-forced on the profile's text: the early-exit model agrees with full depth on "
            f"{agreement[str(report['num_layers'] - 1)]:.3f} of tokens, a lean one at {e} on "
            f"{agreement[e]:.3f} (its greedy exits); the profile covers "
            f"{report['profile']['coverage'][e]:.3f} of decisions at {e}.",
        ]
    lines += [
        "",
        "| budget MiB | batch full | batch lean | batch ratio | tok/s full | tok/s lean | throughput ratio "
        "[runs] | lean at full's batch / full | measured MiB full / lean |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b in report["budgets"]:
        if "note" in b:
            lines.append(
                f"| {b['budget'] / mib:.0f} | {b['batch']['full']} | {b['batch']['lean']} | - | - | - | - | "
                f"- | {b['note']} |"
            )
            continue
        runs = ", ".join(f"{r:.2f}" for r in b["throughput_ratio_runs"])
        lines.append(
            f"| {b['budget'] / mib:.0f} | {b['batch']['full']} | {b['batch']['lean']} | "
            f"{b['batch_ratio']:.2f}x | {b['tokens_per_s']['full']:.1f} | {b['tokens_per_s']['lean']:.1f} | "
            f"{b['throughput_ratio']:.2f}x [{runs}] | {b['same_batch_ratio']:.2f}x | "
            f"{b['measured_total']['full'] / mib:.0f} / "
            f"{b['measured_total']['lean'] / mib:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
