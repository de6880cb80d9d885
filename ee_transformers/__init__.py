"""ee-transformers: early-exit LLMs that really skip layers, native to Hugging Face transformers."""

__version__ = "0.2.0"

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import configuration_early_exit, modeling_early_exit
from .cache_early_exit import EarlyExitCache
from .configuration_early_exit import *  # noqa: F403  (EarlyExit<Family>Config for every family)
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
from .lean_early_exit import ShedLayer, memory_report
from .measure.profile import ExitProfile, profile_exits
from .modeling_early_exit import *  # noqa: F403  (EarlyExit<Family>ForCausalLM / EarlyExit<Family>Model)
from .modeling_early_exit import FAMILIES, EarlyExitMixin
from .paged_early_exit import PagedTrace, record_paged_exits
from .paged_speculative import DraftTrace, record_paged_drafts
from .pool_early_exit import EarlyExitPool, GenerateEarlyExitPoolOutput
from .speculative_early_exit import GenerateSpeculativeOutput
from .utils.model_card import write_model_card

for _cls in FAMILIES.values():
    AutoConfig.register(_cls.config_class.model_type, _cls.config_class, exist_ok=True)
    AutoModelForCausalLM.register(_cls.config_class, _cls, exist_ok=True)
    AutoModel.register(_cls.config_class, _cls.base_model_class, exist_ok=True)

# with the package installed, save_pretrained also writes the model card
EarlyExitMixin.model_card_writer = staticmethod(write_model_card)

__all__ = [
    *configuration_early_exit.__all__,
    *modeling_early_exit.__all__,
    "Check",
    "EXIT_CRITERIA",
    "EarlyExitCache",
    "EarlyExitPool",
    "DraftTrace",
    "ExitCriterion",
    "ExitProfile",
    "ExitSettings",
    "ExitStats",
    "GenerateEarlyExitOutput",
    "GenerateEarlyExitPoolOutput",
    "GenerateSpeculativeOutput",
    "PagedTrace",
    "SUPPORTED_FAMILIES",
    "ShedLayer",
    "from_base",
    "memory_report",
    "model_class_for",
    "profile_exits",
    "record_paged_drafts",
    "record_paged_exits",
    "register_exit_criterion",
    "write_model_card",
]
