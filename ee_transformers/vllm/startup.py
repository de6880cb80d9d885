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
        if spec is None:
            spec = stored_lossless_mode(vllm_config)
        if spec is not None:
            logger.info(
                "ee-transformers: exits off under speculative decoding (%s): drafts are verified at full depth.",
                spec.method,
            )
            return
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


def stored_lossless_mode(vllm_config):
    """The folder's stored lossless mode (`prompt_lookup_num_tokens` > 0 in its generation settings, as calibration
    writes it) turns on the package's proposer with that many drafts per request, where the user passed no
    `--speculative-config` of their own (theirs wins); `--override-generation-config '{"prompt_lookup_num_tokens": 0}'`
    or `--generation-config vllm` keeps it off. Returns the speculative config set, or None."""
    from vllm.config import SpeculativeConfig

    lookup = requested_values(vllm_config.model_config, ("prompt_lookup_num_tokens",))["prompt_lookup_num_tokens"]
    if lookup is None or lookup == 0:
        return None
    if isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 0:
        raise ValueError(f"`prompt_lookup_num_tokens` must be a non-negative integer, got {lookup!r}.")
    vllm_config.speculative_config = SpeculativeConfig(
        method="custom_class",
        model=PROPOSER,
        num_speculative_tokens=lookup,
        target_model_config=vllm_config.model_config,
        target_parallel_config=vllm_config.parallel_config,
    )
    logger.info(
        "ee-transformers: the folder stores a lossless mode (prompt_lookup_num_tokens=%s): serving with the "
        "package's proposer (speculative_config %s); pass --speculative-config to choose another, or "
        "--override-generation-config '{\"prompt_lookup_num_tokens\": 0}' to serve without drafts.",
        lookup,
        {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": lookup},
    )
    return vllm_config.speculative_config


def register_startup_checks(architectures) -> None:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for arch in architectures:
        MODELS_CONFIG_MAP.setdefault(arch, EarlyExitStartup)


__all__ = ["EarlyExitStartup", "register_startup_checks", "stored_lossless_mode"]
