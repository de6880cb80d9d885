"""The settings of a calibration (`CalibrationConfig`, from which `ee-transformers calibrate`'s flags are generated);
`ee_transformers.training.calibrate` calibrates with them."""

import dataclasses
from dataclasses import dataclass, field

from ee_transformers.training.simulation import (
    CRITERIA,
)
from ee_transformers.utils.arguments import check_fields


# ------------------------------------------------------------------------------------------------------------ config
@dataclass
class CalibrationConfig:
    """Settings of one calibration; `__post_init__` raises `ValueError` naming a bad field. Limits that depend on the
    model (`block_size`, `verify_prompt_length`, `verify_new_tokens`) default to what fits it: see `for_model`."""

    criterion: str = field(
        default="max_prob", metadata={"help": "the exit criterion calibrated", "choices": tuple(CRITERIA)}
    )
    target_agreement: float = field(
        default=0.95, metadata={"help": "greedy agreement with full depth to reach", "above": 0, "max": 1}
    )
    policy: str = field(
        default="batch", metadata={"help": "exit policy decoding will use", "choices": ("batch", "row")}
    )
    patience: int = field(
        default=0, metadata={"help": "stable-token exits over k checked exits (0 = off, else >= 2)", "min": 0}
    )
    kv: str = field(
        default="immediate", metadata={"help": "K/V of skipped layers", "choices": ("immediate", "deferred")}
    )
    block_size: int | None = field(
        default=None,
        metadata={
            "help": "tokens per held-out block when calibrating on text (default: min(256, the model's positions))",
            "min": 2,
        },
    )
    max_blocks: int = field(default=64, metadata={"help": "use at most this many held-out blocks", "min": 2})
    batch_size: int = field(default=4, metadata={"help": "blocks per forward pass while collecting scores", "min": 1})
    decode_batch_size: int = field(
        default=1,
        metadata={
            "help": "batch size decoding will run at: costs are measured there, and with policy batch rows are simulated "
            "exiting together",
            "min": 1,
        },
    )
    verify_prompts: int = field(
        default=0,
        metadata={
            "help": "really decode this many held-out prompts to check the choice on-policy (0 = skip)",
            "min": 0,
        },
    )
    verify_prompt_length: int | None = field(
        default=None,
        metadata={"help": "tokens of each verification prompt (default: min(32, block_size // 2))", "min": 1},
    )
    verify_new_tokens: int | None = field(
        default=None,
        metadata={
            "help": "tokens decoded per verification prompt (default: min(32, the positions left after the prompt))",
            "min": 1,
        },
    )
    verify_rounds: int = field(
        default=3, metadata={"help": "searches rerun with a raised target while verification misses", "min": 1}
    )
    seed: int = field(default=0, metadata={"help": "seed of the A/B split"})
    guarantee: float | None = field(
        default=None,
        metadata={
            "help": "choose thresholds by Learn then Test so that, with probability 1 - confidence over the calibration "
            "sample, the per-token disagreement rate with full depth is at most this (instead of "
            "target_agreement)",
            "above": 0,
            "below": 1,
        },
    )
    confidence: float = field(
        default=0.1,
        metadata={"help": "delta of the guarantee: the probability the promise may fail", "above": 0, "below": 1},
    )
    measure_speed: bool = field(
        default=False,
        metadata={
            "help": "decode held-out prompts with the choice and full depth, interleaved, and keep exits on only when "
            "the measured speed-up's lower quartile clears 1.0"
        },
    )
    speed_prompts: int = field(default=4, metadata={"help": "held-out prompts per speed measurement", "min": 1})
    speed_new_tokens: int = field(default=32, metadata={"help": "tokens decoded per speed run", "min": 2})
    speed_repeats: int = field(default=3, metadata={"help": "interleaved rounds per speed measurement", "min": 1})
    speed_batch_sizes: list[int] | None = field(
        default=None,
        metadata={
            "help": "batch sizes the speed promise must hold at, each measured (default: decode_batch_size)",
            "min": 1,
        },
    )
    progress: bool = field(default=False, metadata={"help": "show progress bars while collecting exit scores"})
    speed_candidates: int = field(
        default=3,
        metadata={"help": "settings measured at most, fastest predicted first, until one clears 1.0", "min": 1},
    )

    def __post_init__(self):
        check_fields(self)
        if self.patience == 1:
            raise ValueError("`patience` must be 0 (off) or an integer >= 2, got 1.")
        if self.kv == "deferred" and self.policy == "row":
            raise ValueError("`kv`='deferred' works with `policy`='batch' only.")

    def for_model(self, max_position_embeddings: int | None, block_size: int | None = None) -> "CalibrationConfig":
        """This config with the model-dependent limits filled in and checked against the model's positions:
        `block_size` (given here when the blocks are already cut) defaults to min(256, max_position_embeddings), the
        verification prompt to min(32, block_size // 2) tokens and its decoding to min(32, the positions left)."""
        limit = max_position_embeddings
        block_size = block_size or self.block_size or (min(256, limit) if limit else 256)
        if limit is not None and block_size > limit:
            raise ValueError(
                f"`block_size`={block_size} is beyond the model's positions (`max_position_embeddings`="
                f"{limit}); use at most {limit}."
            )
        prompt = self.verify_prompt_length or max(1, min(32, block_size // 2))
        if self.verify_prompts and prompt >= block_size:
            raise ValueError(
                f"`verify_prompt_length`={prompt} needs blocks longer than that (`block_size`={block_size})."
            )
        new = self.verify_new_tokens or max(1, min(32, (limit or prompt + 32) - prompt))
        if self.verify_prompts and limit is not None and prompt + new > limit:
            raise ValueError(
                f"`verify_new_tokens`={new} after a {prompt}-token prompt goes beyond the model's "
                f"positions (`max_position_embeddings`={limit}); use at most {limit - prompt}."
            )
        return dataclasses.replace(self, block_size=block_size, verify_prompt_length=prompt, verify_new_tokens=new)
