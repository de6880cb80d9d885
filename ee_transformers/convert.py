"""Building early-exit models from plain checkpoints (`from_base`, `ee-transformers convert`)."""

import json
import logging
import os

from transformers import PreTrainedModel

from .generation_early_exit import EXIT_ARGUMENTS, check_exit_argument
from .modeling_early_exit import FAMILIES
from .utils.arguments import InputError
from .utils.model_card import source_card_data

logger = logging.getLogger(__name__)

# plain model_type -> early-exit class (the family table of modeling_early_exit.py)
SUPPORTED_FAMILIES = FAMILIES
_BY_EE_TYPE = {cls.config_class.model_type: cls for cls in SUPPORTED_FAMILIES.values()}


def model_class_for(model_type: str) -> type:
    """The early-exit class for a plain (`"llama"`) or early-exit (`"early_exit_llama"`) model type."""
    cls = SUPPORTED_FAMILIES.get(model_type) or _BY_EE_TYPE.get(model_type)
    if cls is None:
        raise ValueError(
            f"Unsupported model family {model_type!r}: supported families are {sorted(SUPPORTED_FAMILIES)}."
        )
    return cls


def read_config(path: str | os.PathLike, argument: str = "path") -> dict:
    """The raw `config.json` of a model folder, a JSON object; an `InputError` (a `ValueError`) naming `argument` or
    the file when the folder is missing, holds no config.json, or it is not a JSON object."""
    folder = str(path)
    if not os.path.isdir(folder):
        raise InputError(
            f"`{argument}` {folder!r} "
            + ("is a file, not a model folder." if os.path.exists(folder) else "does not exist.")
        )
    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise InputError(f"`{argument}` {folder!r} is not a model folder: no config.json in it.")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"{config_file} cannot be read ({error}).") from None
    except json.JSONDecodeError as error:
        raise InputError(
            f"{config_file} is not valid JSON ({error.msg} at line {error.lineno} column {error.colno})."
        ) from None
    if not isinstance(config, dict):
        raise InputError(f"{config_file} must hold a JSON object, not a JSON {type(config).__name__}.")
    return config


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_weights(path, argument: str = "path") -> None:
    """Raises `InputError` naming `argument` unless the folder holds weights whose safetensors headers are sound (a
    header read, not the tensors: cheap even for a large model)."""
    from safetensors import SafetensorError, safe_open

    folder = str(path)
    present = [name for name in WEIGHT_FILES if os.path.isfile(os.path.join(folder, name))]
    if not present:
        raise InputError(f"`{argument}` {folder!r} holds no weights (none of {', '.join(WEIGHT_FILES)}).")
    files = []
    if "model.safetensors" in present:
        files = ["model.safetensors"]
    elif "model.safetensors.index.json" in present:
        index_file = os.path.join(folder, "model.safetensors.index.json")
        try:
            with open(index_file, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise InputError(f"{index_file} is not a safetensors index ({type(error).__name__}: {error}).") from None
    for name in files:
        file = os.path.join(folder, str(name))
        try:
            with safe_open(file, "pt"):
                pass
        except (OSError, SafetensorError) as error:
            raise InputError(f"`{argument}` {folder!r}: the weights {name} cannot be read ({error}).") from None


def from_base(
    path: str | os.PathLike,
    exit_layers: list[int] | None = None,
    exit_head: str | None = None,
    exit_adapter_rank: int | None = None,
    **kwargs,
) -> PreTrainedModel:
    """Loads a plain (or early-exit) checkpoint folder into the early-exit class of its family.

    `exit_layers` (and `exit_head`, `exit_adapter_rank`) override what the checkpoint's config holds; exit settings
    (`exit_criterion=...`, `exit_threshold=...`, ...) become the model's generation defaults. Everything is validated
    before any weight is read. Other keyword arguments go to `from_pretrained` (e.g. `dtype`).
    """
    for name in EXIT_ARGUMENTS:
        check_exit_argument(name, kwargs.get(name))
    config = read_config(path)
    cls = model_class_for(config.get("model_type"))
    overrides = {
        k: v
        for k, v in dict(exit_layers=exit_layers, exit_head=exit_head, exit_adapter_rank=exit_adapter_rank).items()
        if v is not None
    }
    # validate on a config object first: bad exit arguments fail here, before weights are touched
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "auto_map")}
    fields.update(overrides)
    config_obj = cls.config_class(**fields)  # validates
    if "gguf_file" not in kwargs:
        check_weights(path)  # then the weights: present, with sound headers
    model = cls.from_pretrained(path, config=config_obj, **kwargs)
    # what the source says about itself (its Hub name, its license), for the model cards of folders saved from it
    model.card_data = source_card_data(path)
    return model
