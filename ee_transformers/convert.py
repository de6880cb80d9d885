"""Building early-exit models from plain checkpoints (`from_base`, `ee-transformers convert`)."""

import json
import logging
import os

from transformers import PreTrainedModel

from .generation_early_exit import EXIT_ARGUMENTS, check_exit_argument
from .modeling_early_exit import FAMILIES
from .tools.model_card import source_card_data

logger = logging.getLogger(__name__)

# plain model_type -> early-exit class (the family table of modeling_early_exit.py)
SUPPORTED_FAMILIES = FAMILIES
_BY_EE_TYPE = {cls.config_class.model_type: cls for cls in SUPPORTED_FAMILIES.values()}


def model_class_for(model_type: str) -> type:
    """The early-exit class for a plain (`"llama"`) or early-exit (`"early_exit_llama"`) model type."""
    cls = SUPPORTED_FAMILIES.get(model_type) or _BY_EE_TYPE.get(model_type)
    if cls is None:
        raise ValueError(f"Unsupported model family {model_type!r}: supported families are "
                         f"{sorted(SUPPORTED_FAMILIES)}.")
    return cls


def read_config(path: str | os.PathLike, argument: str = "path") -> dict:
    """The raw `config.json` of a model folder; a `ValueError` naming `argument` when there is none."""
    config_file = os.path.join(str(path), "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"`{argument}` {str(path)!r} is not a model folder: no config.json in it.")
    with open(config_file) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"`{argument}`: {config_file} must hold a JSON object, got {type(config).__name__}.")
    return config


def from_base(path: str | os.PathLike, exit_layers: list[int] | None = None, exit_head: str | None = None,
              exit_adapter_rank: int | None = None, **kwargs) -> PreTrainedModel:
    """Loads a plain (or early-exit) checkpoint folder into the early-exit class of its family.

    `exit_layers` (and `exit_head`, `exit_adapter_rank`) override what the checkpoint's config holds; exit settings
    (`exit_criterion=...`, `exit_threshold=...`, ...) become the model's generation defaults. Everything is validated
    before any weight is read. Other keyword arguments go to `from_pretrained` (e.g. `dtype`).
    """
    for name in EXIT_ARGUMENTS:
        check_exit_argument(name, kwargs.get(name))
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
