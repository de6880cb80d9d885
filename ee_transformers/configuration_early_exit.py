"""Configurations of the early-exit model families.

Each config is the family's own config plus the exit fields of `EarlyExitConfigMixin`, so a plain checkpoint's
`config.json` loads into it unchanged and the exit settings travel with the model folder.

This file is part of the Hub runtime: it imports only torch, transformers and its siblings.
"""

from dataclasses import dataclass

from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config


EXIT_HEAD_TYPES = ("norm", "adapter")
EXIT_CRITERIA = ("max_prob", "margin", "entropy", "cosine", "learned")
EXIT_POLICIES = ("batch", "row")
EXIT_KV_MODES = ("immediate", "deferred")


def validate_exit_layers(exit_layers, num_hidden_layers: int) -> list[int]:
    """Checks `exit_layers` against a decoder of `num_hidden_layers` layers and returns it as a list of ints."""
    if exit_layers is None:
        return []
    if isinstance(exit_layers, (str, bytes)) or not hasattr(exit_layers, "__iter__"):
        raise ValueError(f"`exit_layers` must be a list of layer indices, got {exit_layers!r}.")
    layers = list(exit_layers)
    last = num_hidden_layers - 1
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"`exit_layers` must hold integers, got {layer!r} in {layers}.")
        if not 0 <= layer < last:
            raise ValueError(
                f"`exit_layers` holds {layer}, out of range: allowed values are 0..{last - 1} for a model with "
                f"{num_hidden_layers} layers (the last layer, {last}, is always the final exit and is not listed)."
            )
    if len(set(layers)) != len(layers):
        raise ValueError(f"`exit_layers` holds duplicates: {layers}.")
    if layers != sorted(layers):
        raise ValueError(f"`exit_layers` must be sorted in increasing order, got {layers}.")
    return layers


@dataclass(repr=False, eq=False)
class EarlyExitConfigMixin:
    """The exit fields shared by every early-exit config.

    Architecture:
        exit_layers: sorted 0-based decoder-layer indices after which an exit head sits. The last layer is always the
            final exit and is not listed.
        exit_head: `"norm"` (a per-exit norm feeding the shared LM head) or `"adapter"` (that norm plus a zero-initialised
            low-rank residual MLP of rank `exit_adapter_rank`).
        exit_adapter_rank: rank of the adapter when `exit_head="adapter"`.
        exit_confidence_heads: whether each exit also has a learned confidence head (the `"learned"` criterion).

    Decoding defaults (written by calibration; used by `generate()` when it gets no exit arguments):
        exit_criterion: one of `EXIT_CRITERIA`, or None to decode at full depth.
        exit_threshold: a float, or one float per checked exit.
        exit_policy: `"batch"` or `"row"`.
        exit_patience: 0 (off) or k >= 2 for the stable-token exit.
        exit_kv: `"immediate"` or `"deferred"`.
        exit_check_layers: the subset of `exit_layers` checked at decode time (None = all of them).
    """

    exit_layers: list[int] | None = None
    exit_head: str = "norm"
    exit_adapter_rank: int = 64
    exit_confidence_heads: bool = False
    exit_criterion: str | None = None
    exit_threshold: float | list[float] | None = None
    exit_policy: str = "batch"
    exit_patience: int = 0
    exit_kv: str = "immediate"
    exit_check_layers: list[int] | None = None

    def __post_init__(self, **kwargs):
        self.exit_layers = list(self.exit_layers) if self.exit_layers is not None else []
        super().__post_init__(**kwargs)
        self.validate_early_exit()

    def validate_early_exit(self):
        """Raises a `ValueError` naming the bad field and the allowed values."""
        self.exit_layers = validate_exit_layers(self.exit_layers, self.num_hidden_layers)
        if self.exit_head not in EXIT_HEAD_TYPES:
            raise ValueError(f"`exit_head` must be one of {list(EXIT_HEAD_TYPES)}, got {self.exit_head!r}.")
        if isinstance(self.exit_adapter_rank, bool) or not isinstance(self.exit_adapter_rank, int) or self.exit_adapter_rank <= 0:
            raise ValueError(f"`exit_adapter_rank` must be a positive integer, got {self.exit_adapter_rank!r}.")
        if self.exit_criterion is not None and self.exit_criterion not in EXIT_CRITERIA:
            raise ValueError(f"`exit_criterion` must be one of {list(EXIT_CRITERIA)} or None, got {self.exit_criterion!r}.")
        if self.exit_policy not in EXIT_POLICIES:
            raise ValueError(f"`exit_policy` must be one of {list(EXIT_POLICIES)}, got {self.exit_policy!r}.")
        if self.exit_kv not in EXIT_KV_MODES:
            raise ValueError(f"`exit_kv` must be one of {list(EXIT_KV_MODES)}, got {self.exit_kv!r}.")
        if self.exit_check_layers is not None:
            unknown = [layer for layer in self.exit_check_layers if layer not in self.exit_layers]
            if unknown:
                raise ValueError(
                    f"`exit_check_layers` holds {unknown}, which are not exits: allowed values are {self.exit_layers}."
                )

    @property
    def num_exits(self) -> int:
        return len(self.exit_layers)


class EarlyExitLlamaConfig(EarlyExitConfigMixin, LlamaConfig):
    model_type = "early_exit_llama"


class EarlyExitMistralConfig(EarlyExitConfigMixin, MistralConfig):
    model_type = "early_exit_mistral"


class EarlyExitQwen2Config(EarlyExitConfigMixin, Qwen2Config):
    model_type = "early_exit_qwen2"


class EarlyExitQwen3Config(EarlyExitConfigMixin, Qwen3Config):
    model_type = "early_exit_qwen3"


__all__ = [
    "EarlyExitConfigMixin",
    "EarlyExitLlamaConfig",
    "EarlyExitMistralConfig",
    "EarlyExitQwen2Config",
    "EarlyExitQwen3Config",
]
