"""ee-transformers: early-exit LLMs that really skip layers, native to Hugging Face transformers."""

__version__ = "0.2.0"

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache_early_exit import EarlyExitCache
from .configuration_early_exit import (
    EarlyExitLlamaConfig,
    EarlyExitMistralConfig,
    EarlyExitQwen2Config,
    EarlyExitQwen3Config,
)
from .convert import SUPPORTED_FAMILIES, from_base, model_class_for
from .generation_early_exit import (
    EXIT_CRITERIA,
    Check,
    ExitCriterion,
    ExitSettings,
    ExitStats,
    GenerateEarlyExitOutput,
    register_exit_criterion,
)
from .modeling_early_exit import (
    FAMILIES,
    EarlyExitCausalLMOutput,
    EarlyExitLlamaForCausalLM,
    EarlyExitLlamaModel,
    EarlyExitMistralForCausalLM,
    EarlyExitMistralModel,
    EarlyExitMixin,
    EarlyExitModelOutput,
    EarlyExitQwen2ForCausalLM,
    EarlyExitQwen2Model,
    EarlyExitQwen3ForCausalLM,
    EarlyExitQwen3Model,
)
from .tools.model_card import write_model_card


for _cls in FAMILIES.values():
    AutoConfig.register(_cls.config_class.model_type, _cls.config_class, exist_ok=True)
    AutoModelForCausalLM.register(_cls.config_class, _cls, exist_ok=True)
    AutoModel.register(_cls.config_class, _cls.base_model_class, exist_ok=True)

# with the package installed, save_pretrained also writes the model card
EarlyExitMixin.model_card_writer = staticmethod(write_model_card)

__all__ = [
    "Check",
    "EXIT_CRITERIA",
    "ExitCriterion",
    "FAMILIES",
    "EarlyExitLlamaModel",
    "EarlyExitMistralModel",
    "EarlyExitModelOutput",
    "EarlyExitQwen2Model",
    "EarlyExitQwen3Model",
    "register_exit_criterion",
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
