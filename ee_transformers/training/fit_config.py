"""The settings of a fit (`FitConfig`, from which `ee-transformers fit`'s flags are generated) and its result
(`FitResult`); `ee_transformers.training.fit_exit_heads` fits with them."""

from dataclasses import dataclass, field, fields

from torch import nn

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ------------------------------------------------------------------------------------------------------------ config
@dataclass
class FitConfig:
    """Settings of one fitting run; `__post_init__` raises `ValueError` naming a bad field."""

    steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=4, metadata={"help": "blocks per micro-batch (per process)"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float = field(default=5e-4, metadata={"help": "peak learning rate of the exit heads"})
    weight_decay: float = 0.0
    warmup_steps: int = field(default=20, metadata={"help": "linear warm-up, then cosine decay"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "the cosine decays to lr * min_lr_ratio"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping (0 = off)"})
    temperature: float = field(default=1.0, metadata={"help": "distillation temperature T"})
    ce_weight: float = field(default=0.0, metadata={"help": "weight of next-token cross-entropy per exit"})
    exit_weighting: str = field(default="depth", metadata={"help": "'uniform' or 'depth' (w_i ~ layer+1), sum 1"})
    positions_per_block: int = field(default=64, metadata={"help": "random positions distilled per block (0 = all)"})
    mixed_precision: str = field(default="no", metadata={"help": "'no', 'bf16' or 'fp16' (accelerate)"})
    eval_every: int = field(default=0, metadata={"help": "evaluate on held-out blocks every N steps (0 = end only)"})
    eval_blocks: int = field(default=16, metadata={"help": "held-out blocks used by evaluation"})
    checkpoint_every: int = field(default=0, metadata={"help": "checkpoint every N steps (0 = never)"})
    keep_checkpoints: int = 2
    seed: int = 0
    lora_rank: int = field(default=0, metadata={"help": "LoRA rank on the backbone (0 = frozen backbone)"})
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA alpha (default 2 * rank)"})
    lora_dropout: float = 0.0
    lora_lr: float = field(default=2e-4, metadata={"help": "peak learning rate of the LoRA adapters"})
    final_kl_weight: float = field(
        default=2.0, metadata={"help": "LoRA: weight of KL(original final || adapted final)"}
    )
    layer_dropout: float = field(default=0.0, metadata={"help": "LoRA: max layer-drop probability, rising with depth"})
    merge_lora: bool = field(default=True, metadata={"help": "LoRA: merge adapters into the weights at the end"})
    confidence_steps: int = field(default=0, metadata={"help": "steps of the learned-confidence stage (0 = skip)"})
    confidence_lr: float = 1e-2
    draft_vocab_size: int = field(
        default=16384,
        metadata={"help": "store the N most frequent tokens of the fitting data for cheap exit-head drafts (0 = none)"},
    )
    draft_table: bool = field(
        default=True,
        metadata={"help": "store the fitting data's table of frequent continuations for table drafts"},
    )
    progress: bool = True

    def __post_init__(self):
        positive = ("steps", "batch_size", "grad_accum", "eval_blocks", "keep_checkpoints")
        non_negative = (
            "warmup_steps",
            "positions_per_block",
            "eval_every",
            "checkpoint_every",
            "lora_rank",
            "confidence_steps",
            "draft_vocab_size",
        )
        for name in positive + non_negative:
            value = getattr(self, name)
            low = 1 if name in positive else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}.")
        for name in ("lr", "lora_lr", "temperature", "confidence_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be > 0, got {getattr(self, name)!r}.")
        for name in ("ce_weight", "final_kl_weight", "weight_decay", "max_grad_norm"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)!r}.")
        if not 0 < self.min_lr_ratio <= 1:
            raise ValueError(f"`min_lr_ratio` must be in (0, 1], got {self.min_lr_ratio!r}.")
        if not 0 <= self.layer_dropout < 1 or not 0 <= self.lora_dropout < 1:
            raise ValueError("`layer_dropout` and `lora_dropout` must be in [0, 1).")
        if self.layer_dropout and not self.lora_rank:
            raise ValueError("`layer_dropout` needs `lora_rank` > 0: a frozen backbone is not trained.")
        if self.exit_weighting not in ("uniform", "depth"):
            raise ValueError(f"`exit_weighting` must be 'uniform' or 'depth', got {self.exit_weighting!r}.")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"`mixed_precision` must be 'no', 'bf16' or 'fp16', got {self.mixed_precision!r}.")


@dataclass
class FitResult:
    """What a run did. Agreements are per exit (aligned with `exit_layers`), argmax agreement with the original final
    layer on held-out blocks; `final_agreement` (LoRA only) is the adapted final layer's agreement with the original."""

    model: nn.Module
    exit_layers: list
    steps: int
    agreement_before: list | None = None
    agreement_after: list | None = None
    kl_before: list | None = None
    kl_after: list | None = None
    final_agreement: float | None = None
    final_kl: float | None = None
    confidence: dict | None = None
    history: list = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}
