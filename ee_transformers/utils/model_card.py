"""Model cards for early-exit folders, rendered from the template in `ee_transformers/tools/model_cards/`.

The card's `base_model` and `license` describe the model the folder was built from, and come only from what that
model says about itself (`source_card_data`): the record `ee-transformers fetch-assets` writes next to a fetched model
(`ASSET.json`), the card of a folder built earlier, the Hub cache layout of a downloaded snapshot. A local folder's
name is not a Hub name: with nothing recorded, `base_model` is left out (with a comment saying why) and the license
is `other`, with a sentence asking the reader to check the base model's terms.
"""

import json
import os
import re
from importlib import resources
from pathlib import Path
from string import Template

import yaml

TEMPLATE_NAME = "early_exit_model_card.md"
ASSET_RECORD = "ASSET.json"  # written by `ee-transformers fetch-assets` (ee_transformers.tools.assets.cache.MARKER)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")  # Hub license identifiers: apache-2.0, mit, llama3.1, other...
_HUB_SNAPSHOT = re.compile(r"models--([\w.-]+)--([\w.-]+)[/\\]snapshots[/\\][0-9a-f]+[/\\]?$")


def _template_text() -> str:
    # the repository's root `model_cards/`: read in place in a checkout, shipped in a wheel as the package data of
    # `ee_transformers.model_cards` (pyproject)
    checkout = Path(__file__).resolve().parents[2] / "model_cards" / TEMPLATE_NAME
    if checkout.is_file():
        return checkout.read_text()
    return resources.files("ee_transformers.model_cards").joinpath(TEMPLATE_NAME).read_text()


def hub_id(name) -> str | None:
    """`name` when it can be a Hub model id (`org/name`, or a legacy `name`) and is not a path on this machine."""
    name = str(name or "").strip()
    if not _HUB_ID.fullmatch(name) or os.path.exists(name):
        return None
    return name


def front_matter(text: str) -> dict:
    """The YAML metadata block at the top of a model card (`{}` when there is none or it does not parse)."""
    match = re.match(r"---\s*\n(.*?)\n---\s*(\n|$)", text, flags=re.S)
    if not match:
        return {}
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def source_card_data(folder) -> dict:
    """`base_model` and `license` of the model in `folder`, from what it records about itself; keys it does not
    record are absent. Sources, first found wins per key: `ASSET.json` (fetch-assets), an early-exit card in the
    folder (built by this package: its own base model), the Hub cache path `models--ORG--NAME/snapshots/<hash>`,
    and the license line of any other card in the folder (a Hub checkout's own card; its `base_model` is its parent,
    not itself, so it is not used)."""
    folder = Path(folder)
    found = {}
    try:
        record = json.loads((folder / ASSET_RECORD).read_text())
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict):
        found.update({k: record[k] for k in ("base_model", "license") if isinstance(record.get(k), str)})
    try:
        card = front_matter((folder / "README.md").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        card = {}
    ours = "early-exit" in (card.get("tags") or [])
    if ours and isinstance(card.get("base_model"), str):
        found.setdefault("base_model", card["base_model"])
    snapshot = _HUB_SNAPSHOT.search(str(folder.resolve()))
    if snapshot:
        found.setdefault("base_model", f"{snapshot.group(1)}/{snapshot.group(2)}")
    if isinstance(card.get("license"), str) and card["license"] != "other":
        found.setdefault("license", card["license"])
    if "base_model" in found and not hub_id(found["base_model"]):
        del found["base_model"]
    return found


def render_model_card(model, extra: dict | None = None) -> str:
    """The card for `model`. `extra` (over `model.card_data`, which `from_base` fills from the source folder) may
    hold: base_model (a Hub id), license (a Hub license id), training, calibration, lossless calibration, evaluation,
    notes (markdown)."""
    config = model.config
    extra = dict(getattr(model, "card_data", None) or {}, **(extra or {}))
    base_model = hub_id(extra.get("base_model"))
    license_ = str(extra.get("license") or "other").lower()
    if not _LICENSE_ID.fullmatch(license_):
        license_ = "other"
    exits = list(config.exit_layers)
    decoding, generate_snippet, snippet_note = _decoding(model, exits, calibrated=bool(extra.get("calibration")))
    values = dict(
        generate_snippet=generate_snippet,
        snippet_note=snippet_note,
        base_model_line=(
            f"base_model: {json.dumps(base_model)}"
            if base_model
            else "# base_model: not recorded (built from a local folder that does not name its Hub model)"
        ),
        license_id=license_,
        license_text=_license_text(license_, base_model),
        title=base_model or f"{config.model_type.removeprefix('early_exit_').capitalize()} model",
        source=f"`{base_model}`" if base_model else "The base model",
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        exit_layers=", ".join(map(str, exits)) or "none",
        exit_layers_yaml="[" + ", ".join(str(int(e)) for e in exits) + "]",
        exit_head=config.exit_head,
        adapter_rank=config.exit_adapter_rank if config.exit_head == "adapter" else "-",
        confidence_heads="yes" if config.exit_confidence_heads else "no",
        decoding=decoding,
        training=extra.get(
            "training",
            "Exit heads not fitted yet: each starts as the final norm (plus a silent "
            "adapter), so early exits are exactly 'final norm applied early'.",
        ),
        calibration="\n\n".join(
            t for t in (extra.get("calibration", "Not calibrated."), extra.get("lossless calibration")) if t
        ),
        evaluation=extra.get("evaluation", "Not evaluated."),
        notes=extra.get("notes", ""),
    )
    return Template(_template_text()).safe_substitute(values)


def _license_text(license_: str, base_model: str | None) -> str:
    if license_ == "other":
        return (
            "The license of the base model was not recorded where this folder was built. The weights "
            "here are the base model's, under its terms: check them before using or sharing this folder."
        )
    return (
        f"`{license_}`, the license of the base model{f' `{base_model}`' if base_model else ''}, "
        "whose weights this folder holds."
    )


def _decoding(model, exits, calibrated: bool) -> tuple[str, str, str]:
    """(how the folder decodes, the card's generate() snippet, the note under it), from what the folder stores: a
    lossless setting, calibrated exit settings, or nothing (`calibrated`: a calibration ran and kept none)."""
    stored = model.exit_defaults if hasattr(model, "exit_defaults") else {}
    exits_stored = stored.get("exit_criterion") is not None or stored.get("exit_patience")
    decoding = "Full depth (no calibrated exit settings stored)."
    if exits_stored:
        decoding = (
            f"criterion `{stored['exit_criterion']}`, threshold `{stored['exit_threshold']}`, policy "
            f"`{stored['exit_policy'] or 'batch'}`, patience `{stored['exit_patience'] or 0}`, KV "
            f"`{stored['exit_kv'] or 'immediate'}`, checked exits "
            f"`{stored['exit_check_layers'] if stored['exit_check_layers'] is not None else exits}` "
            "(stored in `generation_config.json`)"
        )
    lossless = {
        name: getattr(model.generation_config, name, None)
        for name in (
            "prompt_lookup_num_tokens",
            "max_matching_ngram_size",
            "assistant_early_exit",
            "assistant_vocab_size",
            "speculative_verify_width",
            "speculative_table_drafts",
        )
    }
    lossless = {k: v for k, v in lossless.items() if v is not None}
    if lossless:
        decoding = (
            "lossless speculative decoding, "
            + ", ".join(f"`{k}={v}`" for k, v in lossless.items())
            + " (stored in `generation_config.json`; the text is token for token full depth's)"
        )
        snippet = (
            "# the stored lossless setting applies (generation_config.json): the same text as full depth, faster\n"
            "out = model.generate(**inputs, max_new_tokens=32, return_dict_in_generate=True)"
        )
        return (
            decoding,
            snippet,
            "The call above uses the setting stored in `generation_config.json` (" + decoding + ").",
        )
    if exits_stored:
        snippet = (
            "# the stored (calibrated) exit settings apply: generation_config.json holds them\n"
            "out = model.generate(**inputs, max_new_tokens=32, return_dict_in_generate=True)"
        )
        note = "The call above uses the exit settings stored in `generation_config.json` (" + decoding + ")."
        return decoding, snippet, note
    snippet = (
        "# no exit settings are stored (full depth by default): pass them to try early exit\n"
        'out = model.generate(**inputs, max_new_tokens=32, exit_criterion="max_prob", '
        "exit_threshold=0.9,\n                     return_dict_in_generate=True)"
    )
    note = (
        "No exit settings are stored: calibration kept none (the Calibration section says why), so `generate()` "
        "decodes at full depth and the snippet passes settings by hand to try early exit anyway."
        if calibrated
        else "No exit settings are stored, so the snippet passes some by hand; calibrate the folder "
        "(`ee-transformers calibrate`) to store settings chosen for a quality target."
    )
    return decoding, snippet, note


def write_model_card(model, folder, extra: dict | None = None) -> Path:
    path = Path(folder) / "README.md"
    path.write_text(render_model_card(model, extra))
    return path
