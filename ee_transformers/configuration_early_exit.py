"""Configurations of the early-exit model families.

Each config is the family's own config plus the exit fields of `EarlyExitConfigMixin`, so a plain checkpoint's
`config.json` loads into it unchanged and the exit settings travel with the model folder.

This file is part of the Hub runtime: it imports only torch, transformers and its siblings.
"""

from dataclasses import dataclass

from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

EXIT_HEAD_TYPES = ("norm", "adapter")
# decoding settings the first wave kept in config.json (now generation settings)
LEGACY_DECODING_FIELDS = (
    "exit_criterion",
    "exit_threshold",
    "exit_policy",
    "exit_patience",
    "exit_kv",
    "exit_check_layers",
)


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
    """The exit fields shared by every early-exit config: the architecture of the exits.

    exit_layers: sorted 0-based decoder-layer indices after which an exit head sits. The last layer is always the final
        exit and is not listed.
    exit_head: `"norm"` (a per-exit norm feeding the shared LM head) or `"adapter"` (that norm plus a zero-initialised
        low-rank residual MLP of rank `exit_adapter_rank`).
    exit_adapter_rank: rank of the adapter when `exit_head="adapter"`.
    exit_confidence_heads: whether each exit also has a learned confidence head (the `"learned"` criterion).
    draft_vocab_size: how many token ids, most frequent first, the folder stores for exit-head drafts that score only
        those tokens (`generate(assistant_vocab_size=n)`, n up to this; the model's `draft_token_ids` buffer); None:
        none stored.
    draft_table_size: entries of the table of frequent continuations the folder stores for table drafts
        (`generate(prompt_lookup_num_tokens=N, speculative_table_drafts=True)`; the model's `draft_table_keys` /
        `draft_table_next` buffers, draft_table.py); None: none stored.

    How to decode (criterion, threshold, policy, ...) is a generation setting: it lives in `model.generation_config`
    (`generation_config.json`), where calibration writes it.
    """

    exit_layers: list[int] | None = None
    exit_head: str = "norm"
    exit_adapter_rank: int = 64
    exit_confidence_heads: bool = False
    draft_vocab_size: int | None = None
    draft_table_size: int | None = None

    def __post_init__(self, **kwargs):
        self.exit_layers = list(self.exit_layers) if self.exit_layers is not None else []
        # first-wave folders stored decoding defaults here (LEGACY_DECODING_FIELDS): they stay plain attributes until
        # the model moves them to its generation config on load (`pop_legacy_exit_settings`)
        super().__post_init__(**kwargs)
        self.validate_early_exit()

    def validate_early_exit(self):
        """Raises a `ValueError` naming the bad field and the allowed values."""
        self.exit_layers = validate_exit_layers(self.exit_layers, self.num_hidden_layers)
        if self.exit_head not in EXIT_HEAD_TYPES:
            raise ValueError(f"`exit_head` must be one of {list(EXIT_HEAD_TYPES)}, got {self.exit_head!r}.")
        rank = self.exit_adapter_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise ValueError(f"`exit_adapter_rank` must be a positive integer, got {rank!r}.")
        n = self.draft_vocab_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.vocab_size):
            raise ValueError(f"`draft_vocab_size` must be None or an integer in [1, {self.vocab_size}], got {n!r}.")
        n = self.draft_table_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"`draft_table_size` must be None or a positive integer, got {n!r}.")

    def pop_legacy_exit_settings(self) -> dict:
        """Removes and returns the decoding defaults a first-wave config.json held (now generation settings)."""
        found = {name: getattr(self, name) for name in LEGACY_DECODING_FIELDS if name in self.__dict__}
        for name in found:
            delattr(self, name)
        return found

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


class EarlyExitGemma3Config(EarlyExitConfigMixin, Gemma3TextConfig):
    """Gemma 3 text (`Gemma3ForCausalLM`, plain `model_type` "gemma3_text")."""

    model_type = "early_exit_gemma3"

    def validate_early_exit(self):
        super().validate_early_exit()
        if self.use_bidirectional_attention:
            raise ValueError(
                "`use_bidirectional_attention=True` (an embedding model, not a causal LM) is not "
                "supported by early exit: allowed value is False."
            )


class EarlyExitGemma2Config(EarlyExitConfigMixin, Gemma2Config):
    model_type = "early_exit_gemma2"


class EarlyExitPhi3Config(EarlyExitConfigMixin, Phi3Config):
    model_type = "early_exit_phi3"


class EarlyExitOlmo2Config(EarlyExitConfigMixin, Olmo2Config):
    model_type = "early_exit_olmo2"


class EarlyExitGPT2Config(EarlyExitConfigMixin, GPT2Config):
    model_type = "early_exit_gpt2"

    def validate_early_exit(self):
        super().validate_early_exit()
        if self.add_cross_attention:
            raise ValueError(
                "`add_cross_attention=True` (GPT-2 as the decoder of an encoder-decoder) is not "
                "supported by early exit: allowed value is False."
            )


__all__ = [
    "EarlyExitConfigMixin",
    "EarlyExitGemma2Config",
    "EarlyExitGemma3Config",
    "EarlyExitGPT2Config",
    "EarlyExitLlamaConfig",
    "EarlyExitMistralConfig",
    "EarlyExitOlmo2Config",
    "EarlyExitPhi3Config",
    "EarlyExitQwen2Config",
    "EarlyExitQwen3Config",
]
