"""Building early-exit models from plain checkpoints (`from_base`, `ee-transformers convert`)."""

import json
import logging
import os

from .modeling_early_exit import (
    EarlyExitLlamaForCausalLM,
    EarlyExitMistralForCausalLM,
    EarlyExitQwen2ForCausalLM,
    EarlyExitQwen3ForCausalLM,
)
from .tools.model_card import source_card_data

logger = logging.getLogger(__name__)

# plain model_type (and our own) -> early-exit class
SUPPORTED_FAMILIES = {
    "llama": EarlyExitLlamaForCausalLM,
    "mistral": EarlyExitMistralForCausalLM,
    "qwen2": EarlyExitQwen2ForCausalLM,
    "qwen3": EarlyExitQwen3ForCausalLM,
}
_BY_EE_TYPE = {cls.config_class.model_type: cls for cls in SUPPORTED_FAMILIES.values()}


def model_class_for(model_type: str):
    """The early-exit class for a plain (`"llama"`) or early-exit (`"early_exit_llama"`) model type."""
    cls = SUPPORTED_FAMILIES.get(model_type) or _BY_EE_TYPE.get(model_type)
    if cls is None:
        raise ValueError(f"Unsupported model family {model_type!r}: supported families are "
                         f"{sorted(SUPPORTED_FAMILIES)}.")
    return cls


def read_config(path, argument: str = "path") -> dict:
    """The raw `config.json` of a model folder; a `ValueError` naming `argument` when there is none."""
    config_file = os.path.join(str(path), "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"`{argument}` {str(path)!r} is not a model folder: no config.json in it.")
    with open(config_file) as f:
        return json.load(f)


def from_base(path, exit_layers=None, exit_head=None, exit_adapter_rank=None, **kwargs):
    """Loads a plain (or early-exit) checkpoint folder into the early-exit class of its family.

    `exit_layers` (and `exit_head`, `exit_adapter_rank`) override what the checkpoint's config holds; everything is
    validated before any weight is read. Extra keyword arguments go to `from_pretrained` (e.g. `dtype`).
    """
    config = read_config(path)
    cls = model_class_for(config.get("model_type"))
    overrides = {k: v for k, v in dict(exit_layers=exit_layers, exit_head=exit_head,
                                       exit_adapter_rank=exit_adapter_rank).items() if v is not None}
    # validate on a config object first: bad exit arguments fail here, before weights are touched
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "auto_map")}
    fields.update(overrides)
    config_obj = cls.config_class(**fields)  # validates
    model = cls.from_pretrained(path, config=config_obj, **kwargs)
    # what the source says about itself (its Hub name, its license), for the model cards of folders saved from it
    model.card_data = source_card_data(path)
    return model
