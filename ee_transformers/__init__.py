"""ee-transformers: early-exit LLMs that really skip layers, native to Hugging Face transformers."""

__version__ = "0.1.0"

from transformers import AutoConfig, AutoModelForCausalLM

from .cache_early_exit import EarlyExitCache
from .configuration_early_exit import (
    EarlyExitLlamaConfig,
    EarlyExitMistralConfig,
    EarlyExitQwen2Config,
    EarlyExitQwen3Config,
)
from .convert import SUPPORTED_FAMILIES, from_base, model_class_for
from .generation_early_exit import ExitSettings, ExitStats, GenerateEarlyExitOutput
from .modeling_early_exit import (
    EarlyExitCausalLMOutput,
    EarlyExitLlamaForCausalLM,
    EarlyExitMistralForCausalLM,
    EarlyExitMixin,
    EarlyExitQwen2ForCausalLM,
    EarlyExitQwen3ForCausalLM,
)
from .tools.model_card import write_model_card


for _cls in (EarlyExitLlamaForCausalLM, EarlyExitMistralForCausalLM, EarlyExitQwen2ForCausalLM,
             EarlyExitQwen3ForCausalLM):
    AutoConfig.register(_cls.config_class.model_type, _cls.config_class, exist_ok=True)
    AutoModelForCausalLM.register(_cls.config_class, _cls, exist_ok=True)

# with the package installed, save_pretrained also writes the model card
EarlyExitMixin.model_card_writer = staticmethod(write_model_card)

__all__ = [
    "EarlyExitCache",
    "EarlyExitCausalLMOutput",
    "EarlyExitLlamaConfig",
    "EarlyExitLlamaForCausalLM",
    "EarlyExitMistralConfig",
    "EarlyExitMistralForCausalLM",
    "EarlyExitQwen2Config",
    "EarlyExitQwen2ForCausalLM",
    "EarlyExitQwen3Config",
    "EarlyExitQwen3ForCausalLM",
    "ExitSettings",
    "ExitStats",
    "GenerateEarlyExitOutput",
    "SUPPORTED_FAMILIES",
    "from_base",
    "model_class_for",
    "write_model_card",
]
