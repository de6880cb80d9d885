"""The start-up check of an early-exit architecture: vLLM calls it while it builds its config, in the process that
parses the server's arguments, before any model or worker exists (`verify_and_update_config`, the per-architecture
hook of `vllm.model_executor.models.config`). A bad exit setting stops the server here with one line naming it."""

from vllm.logger import init_logger

from .config import plugin_settings, requested_values
from .models import refusal

logger = init_logger(__name__)
PROPOSER = "ee_transformers.vllm.proposer.EarlyExitProposer"


class EarlyExitStartup:
    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        reason = refusal(vllm_config.model_config.architecture)
        if reason is not None:
            raise ValueError(reason)
        settings = plugin_settings(vllm_config)  # raises ValueError naming the field
        exits = settings.exits
        spec = vllm_config.speculative_config
        if spec is not None:
            logger.info(
                "ee-transformers: exits off under speculative decoding (%s): drafts are verified at full depth.",
                spec.method,
            )
            return
        lookup = requested_values(vllm_config.model_config, ("prompt_lookup_num_tokens",))["prompt_lookup_num_tokens"]
        if lookup:
            logger.info(
                "ee-transformers: the folder stores a lossless mode (prompt_lookup_num_tokens=%s); serve it with "
                '--speculative-config \'{"method": "custom_class", "model": "%s", "num_speculative_tokens": %s}\'.',
                lookup,
                PROPOSER,
                lookup,
            )
        if exits is None:
            logger.info("ee-transformers: exits off; the folder is served at full depth by vLLM's own forward.")
            return
        logger.info(
            "ee-transformers: iteration-level exits on (criterion %s, thresholds %s): an all-decode step stops at "
            "the first checked exit where every sequence is confident, and the skipped layers' K/V are written into "
            "the paged cache from the exit state.",
            exits.criterion.name,
            exits.thresholds,
        )


def register_startup_checks(architectures) -> None:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for arch in architectures:
        MODELS_CONFIG_MAP.setdefault(arch, EarlyExitStartup)


__all__ = ["EarlyExitStartup", "register_startup_checks"]
