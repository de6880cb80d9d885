"""vLLM plugin: `vllm serve FOLDER` and `vllm.LLM(FOLDER)` of an early-exit folder of this package.

Installed as the entry point `ee_transformers` of the group `vllm.general_plugins`, which vLLM calls in each of its
processes before it builds a model: `register` registers the folders' configs with transformers' Auto classes (no
`trust_remote_code` needed), each family's early-exit architecture with vLLM's `ModelRegistry` (`models.py`), and a
start-up check per architecture that validates the exit settings and says what the plugin turns on for them.

This is library code: it imports vLLM and the package's runtime, and the runtime never imports it.
"""


def register() -> None:
    """vLLM's plugin entry point; safe to call more than once (vLLM loads plugins in every process)."""
    from vllm import ModelRegistry

    from ..modeling_early_exit import FAMILIES
    from .startup import register_startup_checks

    for ours in FAMILIES.values():
        if ours.__name__ not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(ours.__name__, f"{__name__}.models:{ours.__name__}")
    register_startup_checks([ours.__name__ for ours in FAMILIES.values()])


__all__ = ["register"]
