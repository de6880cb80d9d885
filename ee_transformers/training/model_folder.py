"""A fitted model's folder: checkpoint folders checked, the Hub-ready folder written atomically
(`save_model_folder`), and the training section of its model card (`training_card`)."""

import json
import os

from ee_transformers.training.fit_config import (
    LORA_TARGETS,
    FitConfig,
    FitResult,
)
from ee_transformers.utils.arguments import InputError
from ee_transformers.utils.outputs import OutputFolder


# ------------------------------------------------------------------------------------------------- output folders
def check_checkpoint_dir(path, argument: str = "--checkpoint-dir") -> None:
    """Raises `InputError` unless checkpoints can be written at `path` (checked before any training)."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"`{argument}` {path!r} is a file: checkpoints need a folder.")
    ancestor = path
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
        raise InputError(f"`{argument}`: checkpoints cannot be written in {ancestor!r}.")


def write_model_folder(model, folder, tokenizer=None, card_data: dict | None = None, reports: dict | None = None):
    """Writes a Hub-ready early-exit folder into `folder` (as it is: give it the temporary folder of an
    `OutputFolder`, or use `save_model_folder`): weights, config, runtime code, tokenizer, card, and `reports`
    ({file name: JSON-able}, e.g. fit_report.json) next to them."""
    if tokenizer is not None:
        model.tokenizer = tokenizer
    if card_data is not None:  # over what from_base read from the source (base model, license)
        model.card_data = {**(getattr(model, "card_data", None) or {}), **card_data}
    model.save_pretrained(folder)
    for name, payload in (reports or {}).items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(payload, f, indent=1)


def save_model_folder(
    model,
    out,
    tokenizer=None,
    card_data: dict | None = None,
    reports: dict | None = None,
    carry_from=None,
    overwrite: bool = False,
    command: str | None = None,
) -> str:
    """Writes a Hub-ready early-exit folder atomically (`ee_transformers.utils.outputs.OutputFolder`): `out` is
    either its previous self or the complete new folder, never half written. A non-empty `out` needs `overwrite`
    (and then must be a folder an ee-transformers command wrote); `carry_from`: a folder whose other entries
    (reports, adapters) are kept when not written anew (`carry_from=out` updates `out` in place)."""
    output = out if isinstance(out, OutputFolder) else OutputFolder(out, overwrite=overwrite, carry_from=carry_from)
    with output.writing(command) as folder:
        write_model_folder(model, folder, tokenizer, card_data, reports)
    return str(output.path)


def agreement_table(exits, before, after, final_before=None, final_after=None) -> str:
    """A markdown table of per-exit held-out agreement before/after fitting."""
    head = "| | " + " | ".join(f"exit {e}" for e in exits) + (" | final layer |" if final_after is not None else " |")
    rule = "|---" * (len(exits) + 1 + (final_after is not None)) + "|"
    rows = [head, rule]
    for label, values, final in (("before fitting", before, final_before), ("after fitting", after, final_after)):
        if values is None:
            continue
        cells = " | ".join(f"{v:.3f}" for v in values)
        extra = (
            f" | {final:.3f}"
            if final_after is not None and final is not None
            else (" | -" if final_after is not None else "")
        )
        rows.append(f"| {label} | {cells}{extra} |")
    return "\n".join(rows)


def training_card(
    result: FitResult,
    config: FitConfig,
    base_model: str | None,
    data_desc: str,
    n_train: int,
    n_heldout: int,
    block_size: int,
    world: int = 1,
    quantized: str | None = None,
) -> str:
    tokens = config.steps * config.grad_accum * config.batch_size * world * block_size
    lines = [
        f"Exit heads fitted by self-distillation from {f'`{base_model}`' if base_model else 'the base model'}'s own "
        "final layer "
        f"(KL at temperature {config.temperature}"
        + (f", plus next-token cross-entropy weight {config.ce_weight}" if config.ce_weight else "")
        + ").",
        "",
        f"- data: {data_desc}; {n_train} training blocks and {n_heldout} held-out blocks of {block_size} tokens",
        f"- steps: {config.steps} x {config.grad_accum * config.batch_size * world} blocks "
        f"(about {tokens} context tokens, {config.positions_per_block or block_size - 1} distilled positions per block), "
        f"lr {config.lr}, warm-up {config.warmup_steps}, cosine to {config.min_lr_ratio} x lr, "
        f"mixed precision `{config.mixed_precision}`, seed {config.seed}",
    ]
    if config.lora_rank:
        lines.append(
            f"- backbone: LoRA rank {config.lora_rank} (alpha {config.lora_alpha or 2 * config.lora_rank}) on "
            f"{', '.join(LORA_TARGETS)}, lr {config.lora_lr}, final-layer KL weight {config.final_kl_weight}, "
            f"layer dropout {config.layer_dropout}; adapters "
            + ("merged into the weights" if config.merge_lora else "kept separately (see `lora_adapter/`)")
        )
        if result.final_agreement is not None:
            lines.append(
                f"- **the final layer moved**: its argmax agrees with the original model's on "
                f"{result.final_agreement:.3f} of held-out positions (KL {result.final_kl:.4f}); this is a "
                "slightly different model from the base"
            )
    else:
        lines.append("- backbone: frozen (bit-identical to the base model); only the exit heads were trained")
    if quantized:
        lines.append(
            f"- the frozen backbone was loaded in {quantized} (bitsandbytes) while fitting, and the agreements "
            "below were measured on it; this folder holds the original full-precision weights"
        )
    if result.confidence:
        lines.append(
            f"- learned confidence heads: {result.confidence['steps']} steps; held-out accuracy "
            f"{result.confidence['accuracy']}"
        )
    if result.agreement_before is not None:
        lines += [
            "",
            "Argmax agreement of each exit with the original model's final layer (held-out blocks, every position):",
            "",
            agreement_table(
                result.exit_layers,
                result.agreement_before,
                result.agreement_after,
                1.0 if config.lora_rank else None,
                result.final_agreement,
            ),
        ]
        if result.kl_before is not None and result.kl_after is not None:
            lines += [
                "",
                "Mean KL(original final || exit): "
                + ", ".join(
                    f"exit {e} {b:.3f} -> {a:.3f}"
                    for e, b, a in zip(result.exit_layers, result.kl_before, result.kl_after)
                )
                + ".",
            ]
    return "\n".join(lines)
