"""Model cards for early-exit folders, rendered from the template in `ee_transformers/tools/model_cards/`."""

import json
import os
from importlib import resources
from pathlib import Path
from string import Template

TEMPLATE_NAME = "early_exit_model_card.md"


def _template_text() -> str:
    # package data (pyproject's [tool.setuptools.package-data]), so a wheel has it as an editable install does
    return resources.files("ee_transformers.tools").joinpath("model_cards", TEMPLATE_NAME).read_text()


def render_model_card(model, extra: dict | None = None) -> str:
    """The card for `model`. `extra` may hold: base_model, training (markdown), calibration (markdown),
    evaluation (markdown), notes (markdown)."""
    config = model.config
    extra = dict(getattr(model, "card_data", None) or {}, **(extra or {}))
    base_model = extra.get("base_model") or getattr(config, "_name_or_path", "") or "unknown"
    if os.path.isdir(str(base_model)):  # a local path says nothing to a Hub reader
        base_model = extra.get("base_model_name") or os.path.basename(os.path.normpath(str(base_model)))
    exits = list(config.exit_layers)
    decoding = "Full depth (no calibrated exit settings stored)."
    stored = model.exit_defaults if hasattr(model, "exit_defaults") else {}
    if stored.get("exit_criterion") is not None or stored.get("exit_patience"):
        decoding = (f"criterion `{stored['exit_criterion']}`, threshold `{stored['exit_threshold']}`, policy "
                    f"`{stored['exit_policy'] or 'batch'}`, patience `{stored['exit_patience'] or 0}`, KV "
                    f"`{stored['exit_kv'] or 'immediate'}`, checked exits "
                    f"`{stored['exit_check_layers'] if stored['exit_check_layers'] is not None else exits}` "
                    "(stored in `generation_config.json`)")
    values = dict(
        base_model=base_model,
        base_model_yaml=json.dumps(str(base_model)),
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        exit_layers=", ".join(map(str, exits)) or "none",
        exit_layers_yaml="[" + ", ".join(str(int(e)) for e in exits) + "]",
        exit_head=config.exit_head,
        adapter_rank=config.exit_adapter_rank if config.exit_head == "adapter" else "-",
        confidence_heads="yes" if config.exit_confidence_heads else "no",
        decoding=decoding,
        training=extra.get("training", "Exit heads not fitted yet: each starts as the final norm (plus a silent "
                                       "adapter), so early exits are exactly 'final norm applied early'."),
        calibration=extra.get("calibration", "Not calibrated."),
        evaluation=extra.get("evaluation", "Not evaluated."),
        notes=extra.get("notes", ""),
    )
    return Template(_template_text()).safe_substitute(values)


def write_model_card(model, folder, extra: dict | None = None) -> Path:
    path = Path(folder) / "README.md"
    path.write_text(render_model_card(model, extra))
    return path
