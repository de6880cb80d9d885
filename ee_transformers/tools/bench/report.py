"""The report: targets met or missed, the markdown table, the frontier and exit-histogram plots, the output files."""

import json
import math
from pathlib import Path

import torch

from ee_transformers.generation_early_exit import ExitCriterion
from ee_transformers.measure.quality import EXPLAINER
from ee_transformers.utils.plotting import pyplot, pyplot_or_skip

TARGETS = {
    "calibrated_min_speedup": 0.98,
    "frontier": ((0.95, 1.0), (0.90, 1.05)),
    "forced_realised_over_ideal": 0.9,
    "disabled_max_overhead": 0.02,
}


def frontier_points(results, batch_size):
    """Sweep (and calibrated) results at `batch_size` and the Pareto frontier (agreement up, speed-up up). A
    calibrated run with exits off is full depth, not a point of the early-exit frontier, and is left out."""
    points = [
        r
        for r in results
        if r["batch_size"] == batch_size
        and (r["kind"] == "sweep" or (r["kind"] == "calibrated" and r["criterion"] is not None))
    ]
    frontier, best = [], -math.inf
    for r in sorted(points, key=lambda r: (-r["agreement"]["share"], -r["speedup"]["median"])):
        if r["speedup"]["median"] > best:
            frontier.append(r)
            best = r["speedup"]["median"]
    return points, frontier


def evaluate_targets(report):
    """Each target of the issue, met or missed, with the numbers behind it (None where it was not measured)."""
    results = report["results"]
    out = []
    for batch_size in report["settings"]["batch_sizes"]:
        at = [r for r in results if r["batch_size"] == batch_size]
        cal = [r for r in at if r["kind"] == "calibrated"]
        out.append(
            {
                "target": f"calibrated >= {TARGETS['calibrated_min_speedup']}x",
                "batch_size": batch_size,
                "value": cal[0]["speedup"]["median"] if cal else None,
                "met": (cal[0]["speedup"]["median"] >= TARGETS["calibrated_min_speedup"]) if cal else None,
            }
        )
        points, _ = frontier_points(results, batch_size)
        for min_agree, min_speed in TARGETS["frontier"]:
            ok = [r["speedup"]["median"] for r in points if r["agreement"]["share"] >= min_agree]
            out.append(
                {
                    "target": f"frontier >= {min_speed}x at >= {int(min_agree * 100)}% agreement",
                    "batch_size": batch_size,
                    "value": max(ok) if ok else None,
                    "met": (max(ok) >= min_speed) if ok else (False if points else None),
                }
            )
        forced = [r for r in at if r["kind"] == "forced"]
        for r in forced:
            value = r["realised_over_ideal"]["median"]
            out.append(
                {
                    "target": f"{r['name']}: realised/ideal >= {TARGETS['forced_realised_over_ideal']}",
                    "batch_size": batch_size,
                    "value": value,
                    "met": None if math.isnan(value) else value >= TARGETS["forced_realised_over_ideal"],
                }
            )
        dis = [r for r in at if r["kind"] == "disabled"]
        if dis:
            overhead = 1.0 / dis[0]["speedup"]["median"] - 1.0
            out.append(
                {
                    "target": f"exits disabled: overhead <= {int(TARGETS['disabled_max_overhead'] * 100)}%",
                    "batch_size": batch_size,
                    "value": overhead,
                    "met": overhead <= TARGETS["disabled_max_overhead"],
                }
            )
    return out


def _fmt(x, spec=".2f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(report, include_sweep=True):
    """Markdown: cost model, results, step profiles, targets."""
    lines = []
    lines.append("**Cost model** (direct timed calls at decode shape, median; layer-equivalents in brackets)\n")
    lines.append(
        "| batch | layer step ms | head check | exit head | final head | backfill / layer | deferred extra "
        "/ layer | prefill ms |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for b, c in report["costs"].items():
        ms, le = {k: v[b] for k, v in c["ms"].items()}, c["layer_equivalents"]

        def cell(k, ms=ms, le=le):
            return f"{ms[k]:.3f} ({le[k]:.2f})"

        lines.append(
            f"| {b} | {ms['layer']:.3f} | {cell('head_check')} | {cell('head')} | {cell('final_head')} | "
            f"{cell('backfill')} | {cell('deferred_extra')} | {ms['prefill']:.1f} |"
        )
    lines.append("")
    lines.append(
        "**Results** (speed-up = plain ms/step over early-exit ms/step, median [min, max] of the paired "
        "ratios; " + EXPLAINER + " Perplexity: the full model's, of the early-exit continuation)\n"
    )
    lines.append(
        "| configuration | batch | speed-up | per-token agreement | identical-token share | tokens to 1st "
        "divergence | perplexity | mean exit layer | ideal | realised / ideal |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in report["results"]:
        if r["kind"] == "sweep" and not include_sweep:
            continue
        s, a, q = r["speedup"], r["agreement"], r.get("quality") or {}
        lines.append(
            f"| {r['name']} | {r['batch_size']} | {_fmt(s['median'])}x [{_fmt(s['min'])}, {_fmt(s['max'])}]"
            f" | {_fmt(q.get('per_token_agreement', math.nan), '.3f')} | {_fmt(a['share'], '.3f')} | "
            f"{_fmt(a['first_divergence'], '.1f')} | {_fmt(q.get('continuation_ppl', math.nan), '.2f')} "
            f"({_fmt(q.get('full_depth_ppl', math.nan), '.2f')} full) | "
            f"{_fmt(r['exits']['mean_exit_layer'], '.1f')} | {_fmt(r['ideal_speedup']['median'])}x | "
            f"{_fmt(r['realised_over_ideal']['median'])} |"
        )
    if report.get("profiles"):
        lines.append("")
        lines.append("**Where one decoding step's time goes** (ms per step, profiler labels; prefill excluded)\n")
        lines.append(
            "| run | batch | step ms | layers | head checks | exit heads | backfill | final head | other (Python) |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for p in report["profiles"]:
            q = p["parts_ms"]
            lines.append(
                f"| {p['name']} | {p['batch_size']} | {p['ms_per_step']:.2f} | {q['layers']:.2f} | "
                f"{q['head_checks']:.2f} | {q['exit_heads']:.2f} | {q['backfill']:.2f} | "
                f"{q['final_head']:.2f} | {q['other']:.2f} ({100 * p['shares']['other']:.0f}%) |"
            )
    if report.get("targets"):
        lines.append("")
        lines.append("**Targets**\n")
        lines.append("| target | batch | value | met |")
        lines.append("|---|---|---|---|")
        for t in report["targets"]:
            met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
            lines.append(f"| {t['target']} | {t['batch_size']} | {_fmt(t['value'], '.3f')} | {met} |")
    return "\n".join(lines) + "\n"


def plot_frontier(results, path):
    """Speed-up (median, min-max bars) versus agreement of the sweep, one panel per batch size, frontier drawn."""
    plt = pyplot()
    results = results["results"] if isinstance(results, dict) else results
    sizes = sorted({r["batch_size"] for r in results if frontier_points(results, r["batch_size"])[0]}) or [None]
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
    colors = {"max_prob": "C0", "margin": "C1", "entropy": "C2", "cosine": "C3", "learned": "C4", "stable": "C5"}
    for ax, batch_size in zip(axes[0], sizes):
        points, frontier = frontier_points(results, batch_size) if batch_size else ([], [])
        seen = set()
        for r in points:
            crit = r.get("exit_kwargs", {}).get("exit_patience") and "stable" or r["criterion"] or "calibrated"
            label = "calibrated" if r["kind"] == "calibrated" else f"{crit} ({r['policy']})"
            marker = "*" if r["kind"] == "calibrated" else ("o" if r["policy"] == "batch" else "s")
            s = r["speedup"]
            ax.errorbar(
                r["agreement"]["share"],
                s["median"],
                yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]],
                fmt=marker,
                color="k" if r["kind"] == "calibrated" else colors.get(crit, "C7"),
                markersize=11 if r["kind"] == "calibrated" else 5,
                alpha=0.8,
                capsize=2,
                label=None if label in seen else label,
            )
            seen.add(label)
        if frontier:
            ax.plot(
                [r["agreement"]["share"] for r in frontier],
                [r["speedup"]["median"] for r in frontier],
                "k--",
                lw=1,
                label="frontier",
            )
        ax.axhline(1.0, color="gray", lw=0.8)
        for i, (agree, speed) in enumerate(TARGETS["frontier"]):
            ax.plot(
                [agree],
                [speed],
                marker="x",
                color="red",
                markersize=9,
                linestyle="none",
                label="targets" if i == 0 else None,
            )
        ax.set_xlabel("identical-token share with full-depth greedy text")
        ax.set_ylabel("speed-up vs plain generate")
        ax.set_title(f"batch {batch_size}" if batch_size else "no sweep results")
        ax.grid(alpha=0.3)
        if points:
            ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_histogram(results, path, names=None):
    """Exit-layer histograms (share of tokens per deciding layer) of the chosen results, one panel per batch size.

    names: result names to draw; default the calibrated result, else the sweep result with the best speed-up at
    >= 90% agreement, plus the forced "mixed" profile (batch/immediate)."""
    plt = pyplot()
    results = results["results"] if isinstance(results, dict) else results
    sizes = sorted({r["batch_size"] for r in results})
    chosen = {}
    for b in sizes:
        at = [r for r in results if r["batch_size"] == b]
        if names is not None:
            picks = [r for r in at if r["name"] in names]
        else:
            picks = [r for r in at if r["kind"] == "calibrated"]
            if not picks:
                good = [r for r in at if r["kind"] == "sweep" and r["agreement"]["share"] >= 0.9]
                picks = sorted(good, key=lambda r: -r["speedup"]["median"])[:1]
            picks += [r for r in at if r["kind"] == "forced" and r["name"].startswith("forced mixed batch/immediate")]
        chosen[b] = [r for r in picks if r["exits"]["histogram"]]
    fig, axes = plt.subplots(1, max(len(sizes), 1), figsize=(5.5 * max(len(sizes), 1), 3.6), squeeze=False)
    for ax, b in zip(axes[0], sizes):
        picks = chosen[b]
        width = 0.8 / max(len(picks), 1)
        for i, r in enumerate(picks):
            hist = {int(k): v for k, v in r["exits"]["histogram"].items()}
            total = sum(hist.values())
            xs = sorted(hist)
            ax.bar(
                [x + (i - (len(picks) - 1) / 2) * width for x in xs],
                [hist[x] / total for x in xs],
                width=width,
                label=f"{r['name']} (mean {r['exits']['mean_exit_layer']:.1f})",
            )
        ax.set_xlabel("deciding decoder layer (last = full depth)")
        ax.set_ylabel("share of tokens")
        ax.set_title(f"batch {b}")
        ax.grid(alpha=0.3, axis="y")
        if picks:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, (torch.Tensor,)):
        return x.tolist()
    if callable(x) or isinstance(x, ExitCriterion):
        return getattr(x, "name", repr(x))
    return x


def write_outputs(report, out_dir):
    """report.json, results.md, frontier.png, exit_histogram.png under `out_dir`; returns the paths written (no plots,
    and one warning, without matplotlib)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "report.json",
        "table": out_dir / "results.md",
        "frontier": out_dir / "frontier.png",
        "histogram": out_dir / "exit_histogram.png",
    }
    paths["json"].write_text(json.dumps(jsonable(report), indent=1) + "\n")
    paths["table"].write_text(format_table(report))
    if pyplot_or_skip(paths["frontier"].name, paths["histogram"].name) is None:
        return {k: paths[k] for k in ("json", "table")}
    plot_frontier(report, paths["frontier"])
    plot_histogram(report, paths["histogram"])
    return paths
