"""A calibration's result in a model: stored in its generation config (`apply_calibration`) and shown on its card
(`calibration_card`, with the measured speeds: `speed_table`)."""

from ee_transformers.generation_early_exit import LOGIT_CRITERIA


def apply_calibration(model, report: dict) -> None:
    """Stores the report's choice as the model's generation defaults (`model.generation_config`, saved to
    `generation_config.json`; generate() then uses it with no exit arguments); with no choice, exits are turned off
    (full depth)."""
    chosen = report.get("chosen")
    if chosen:
        thresholds = chosen["thresholds"]
        model.set_exit_defaults(
            exit_criterion=report["criterion"],
            exit_threshold=thresholds[0] if len(set(thresholds)) == 1 else list(thresholds),
            exit_check_layers=list(chosen["check_layers"]),
            exit_policy=report["policy"],
            exit_patience=report["patience"],
            exit_kv=report.get("kv", "immediate"),
        )
    else:
        model.set_exit_defaults(
            exit_criterion=None,
            exit_threshold=None,
            exit_check_layers=None,
            exit_patience=None,
            exit_policy=None,
            exit_kv=None,
        )


def speed_table(report: dict) -> list[str]:
    """The settings whose speed calibration measured: predicted (teacher-forced on split B) next to measured (really
    decoded against full depth, interleaved pairs), both quality measures; markdown lines."""
    lines = [
        "Settings measured against full depth on this machine, fastest predicted first (the speed promise: exits stay "
        "on only if the lower quartile of the measured speed-up clears 1.0 at every batch size):",
        "",
        "| check exits | thresholds | predicted speed-up | predicted per-token agreement (teacher-forced, B) | batch "
        "| measured speed-up: median (lower quartile) | per-token agreement, really decoded | identical-token share "
        "| kept |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    kept = report["speed"].get("kept")
    for k, t in enumerate(report["speed"]["tried"]):
        p = t.get("predicted_B") or {"speedup": t["predicted_speedup"], "agreement": float("nan")}
        last = kept and k == len(report["speed"]["tried"]) - 1
        for b, m in t["by_batch_size"].items():
            agreement = m.get("per_token_agreement")
            lines.append(
                f"| {t['check_layers']} | {', '.join(f'{x:.4g}' for x in t['thresholds'])} | {p['speedup']:.2f}x | "
                f"{p['agreement']:.3f} | {b} | {m['median']:.2f}x ({m['lower_quartile']:.2f}x) | "
                + (f"{agreement:.3f}" if agreement is not None else "-")
                + f" | {m['identical_token_share']:.3f} | {'yes' if last else 'no'} |"
            )
    return lines


def calibration_card(report: dict) -> str:
    """The card's calibration section (markdown). Quality figures are named by the measure they are (see
    `ee_transformers.measure.quality`)."""
    c = report["costs"]
    if report.get("guarantee"):
        g = report["guarantee"]
        goal = (
            f"Thresholds chosen by Learn then Test: with probability >= {1 - g['delta']:.2f} over the calibration "
            f"sample, the per-token disagreement rate with full depth is <= {g['epsilon']} (assumption: "
            f"{g['assumption']}; {g['positions']} positions, {g['tested_exit_sets']} exit sets tested, "
            f"{g['certified']} settings certified)."
        )
    else:
        goal = f"Target per-token agreement with full depth (teacher-forced) >= {report['target_agreement']}."
    lines = [
        f"Criterion `{report['criterion']}`, policy `{report['policy']}`, patience {report['patience']}. {goal}",
        "",
        f"Measured costs on `{c.get('device', '?')}` ({c.get('dtype', '?')}, batch {c.get('batch_size', '?')}), in "
        f"decoder-layer steps: LM head through an exit head {c['head_cost']:.2f}"
        + ("" if report["criterion"] in LOGIT_CRITERIA else f", `{report['criterion']}` check {c['check_cost']:.2f}")
        + f", K/V backfill per skipped layer {c['backfill_cost']:.2f}.",
        "",
    ]
    speed = report.get("speed")
    if report.get("chosen"):
        a, b = report["selection_A"], report["heldout_B"]
        thresholds = ", ".join(
            f"{layer}: {t:.4g}" for layer, t in zip(report["chosen"]["check_layers"], report["chosen"]["thresholds"])
        )
        measured = speed["tried"][-1]["measured"] if speed and speed.get("kept") else None
        lines += [
            f"Chosen: check exits {report['chosen']['check_layers']} with thresholds {{{thresholds}}} "
            "(stored in `generation_config.json`; `generate()` uses them when called without exit arguments).",
            "",
            "| split | positions | per-token agreement | mean exit layer | exit rate | predicted speed-up | measured "
            "speed-up |",
            "|---|---|---|---|---|---|---|",
            f"| A (chosen on), teacher-forced | {report['positions']['A']} | {a['agreement']:.3f} | "
            f"{a['mean_exit_layer']:.2f} | {a['exit_rate']:.3f} | {a['speedup']:.2f}x | - |",
            f"| B (reported), teacher-forced | {report['positions']['B']} | {b['agreement']:.3f} | "
            f"{b['mean_exit_layer']:.2f} | {b['exit_rate']:.3f} | {b['speedup']:.2f}x | "
            + (
                f"{measured['median']:.2f}x (lower quartile {measured['lower_quartile']:.2f}x) |"
                if measured
                else "not measured |"
            ),
        ]
        if report.get("on_policy_B"):
            v = report["on_policy_B"]
            lines.append(
                f"| B, really decoded (own prefix) | {v['tokens']} tokens | {v['agreement']:.3f} | "
                f"{v['mean_exit_layer']:.2f} | {v['exit_rate']:.3f} | - | - |"
            )
    else:
        lines.append(
            f"**Early exit is off by default** ({report['message']}). Pass exit arguments to `generate()` "
            "to try it anyway."
        )
    if speed and speed.get("tried"):
        lines += ["", *speed_table(report)]
    b = report.get("decode_batch_size", 1)
    grouped = " (batch policy: rows of a batch exit together)" if b > 1 and report["policy"] == "batch" else ""
    lines += [
        "",
        f"Predicted speed-ups are teacher-forced simulations at decode batch size {b}{grouped} with the "
        "measured costs"
        + (
            "; measured speed-ups are interleaved pairs of real decoding against full depth on the same weights"
            if speed
            else "; the benchmark measures real decoding"
        )
        + ". Per-token agreement: the share of "
        "early-exit tokens the full model would also choose at that position. Full report: `calibration.json`.",
    ]
    return "\n".join(lines)
