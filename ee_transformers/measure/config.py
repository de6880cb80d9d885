"""What a benchmark measures: its settings (`BenchConfig`, from which `ee-transformers bench`'s flags are generated)
and the ways of decoding it compares with plain generate (`Variant`)."""

import dataclasses
from dataclasses import dataclass, field

from ee_transformers.measure.forced import FORCED_MODES
from ee_transformers.utils.arguments import check_fields

FORCED_MODE_NAMES = tuple("/".join(mode) for mode in FORCED_MODES)
VARIANT_KINDS = ("calibrated", "disabled", "forced", "sweep", "custom")


@dataclass
class BenchConfig:
    """Settings of one benchmark run; `__post_init__` raises `ValueError` naming a bad field.

    `BenchConfig.quick(...)` is the small CI setting (8 new tokens, 1 repeat, 4 prompts, 1 batch per size, the small
    sweep)."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 8], metadata={"help": "batch sizes measured", "min": 1})
    max_batches: list[int] = field(
        default_factory=lambda: [2],
        metadata={"help": "batches per batch size: one value, or one per batch size", "min": 1},
    )
    num_prompts: int = field(default=16, metadata={"help": "held-out prompts (windows of text)", "min": 1})
    prompt_tokens: int = field(default=64, metadata={"help": "tokens per prompt", "min": 1})
    new_tokens: int = field(default=128, metadata={"help": "greedy tokens generated per run", "min": 1})
    repeats: int = field(default=3, metadata={"help": "rounds of every comparison", "min": 1})
    main_repeats: int | None = field(
        default=None,
        metadata={
            "help": "rounds of the calibrated and exits-disabled runs, whose targets sit within a few percent of 1.0x "
            "(default: 2 x repeats)",
            "min": 1,
        },
    )
    calibrated: str = field(
        default="auto",
        metadata={
            "help": "the calibrated settings (generate() without exit arguments): 'auto' measures them when the model "
            "stores any, 'always' also when its calibration left exits off, 'off' never",
            "choices": ("auto", "always", "off"),
        },
    )
    disabled: bool = field(default=True, metadata={"help": "measure exits disabled (the class's full-depth overhead)"})
    sweep: bool = field(default=True, metadata={"help": "measure the sweep of criteria x thresholds x policies"})
    sweep_grid: str = field(
        default="full", metadata={"help": "thresholds per criterion", "choices": ("small", "medium", "full")}
    )
    sweep_repeats: int | None = field(
        default=None, metadata={"help": "rounds of the sweep (default: repeats)", "min": 1}
    )
    sweep_batch_sizes: list[int] | None = field(
        default=None, metadata={"help": "run the sweep at these batch sizes only (default: all)", "min": 1}
    )
    forced: bool = field(default=True, metadata={"help": "measure forced exit profiles (implementation efficiency)"})
    forced_grid: str = field(
        default="profiles",
        metadata={
            "help": "profiles: 25%@1/4, 50%@1/2, 75%@3/4, mixed; full: every share at every depth",
            "choices": ("profiles", "full"),
        },
    )
    forced_modes: list[str] = field(
        default_factory=lambda: list(FORCED_MODE_NAMES),
        metadata={"help": "policy/kv modes of the forced profiles", "choices": FORCED_MODE_NAMES},
    )
    profile: bool = field(default=True, metadata={"help": "profile where one decoding step's time goes"})
    cost_repeats: int = field(default=30, metadata={"help": "timed calls per piece of the cost model", "min": 1})
    warmup: bool = field(default=True, metadata={"help": "one short untimed generate per configuration first"})
    seed: int = field(default=0, metadata={"help": "seed of the prompts and the forced draws"})

    def __post_init__(self):
        check_fields(self)
        if len(self.max_batches) not in (1, len(self.batch_sizes)):
            raise ValueError(
                f"`max_batches` must hold one value or one per batch size ({len(self.batch_sizes)}), "
                f"got {self.max_batches}."
            )
        unknown = sorted(set(self.sweep_batch_sizes or ()) - set(self.batch_sizes))
        if unknown:
            raise ValueError(
                f"`sweep_batch_sizes` holds {unknown}, which are not measured: allowed values are {self.batch_sizes}."
            )

    @classmethod
    def quick(cls, **overrides) -> "BenchConfig":
        return cls(**{**QUICK, **overrides})

    def replace(self, **changes) -> "BenchConfig":
        return dataclasses.replace(self, **changes)

    def batches_per_size(self) -> list[int]:
        return self.max_batches * len(self.batch_sizes) if len(self.max_batches) == 1 else list(self.max_batches)

    def modes(self) -> list[tuple[str, str]]:
        return [tuple(mode.split("/")) for mode in self.forced_modes]


QUICK = dict(new_tokens=8, repeats=1, num_prompts=4, max_batches=[1], sweep_grid="small", cost_repeats=10)


@dataclass
class Variant:
    """One way of decoding that the benchmark compares with plain generate on the same weights.

    exit_kwargs: generate()'s exit arguments (`{}`: the calibrated settings the model stores; `{"early_exit": False}`:
        full depth through the early-exit class).
    forced: `{"profile": name or {depth fraction: share}, "seed": int}` to draw every token's exit layer from a
        profile (see `forced.py`) instead of deciding it.
    """

    name: str
    kind: str = "custom"
    exit_kwargs: dict = field(default_factory=dict)
    forced: dict | None = None

    def __post_init__(self):
        if self.kind not in VARIANT_KINDS:
            raise ValueError(f"`kind` must be one of {list(VARIANT_KINDS)}, got {self.kind!r}.")
