"""Fit exit heads by self-distillation on a frozen (or LoRA-adapted) backbone.

    ee-transformers fit --model path/to/plain-or-ee --exit-layers 7,15,22 --data books/*.txt --out my-ee-model
    accelerate launch -m ee_transformers.tools.fit ...     # several GPUs (DDP; FSDP best-effort)

(the command line: `ee_transformers.tools.fit`)

Per step the backbone runs once per block under no_grad with `output_hidden_states`; the final layer's distribution
at temperature T is computed once on a random subset of positions and every exit head learns it (KL, optionally plus
next-token cross-entropy). Only heads get gradients, so the backbone stays bit-identical. With `--lora-rank r` the
backbone also gets LoRA adapters (peft): the teacher is then the same model with its adapters disabled, and the
adapted final layer is held to the teacher by a KL term of weight `--final-kl-weight`.

Python use (demo, benchmark):

    result = fit_exit_heads(model, train_blocks, heldout_blocks, FitConfig(steps=200))
    result.agreement_before, result.agreement_after   # per-exit argmax agreement with the final layer, held out
"""

import json
import math
import os
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields

import torch
from torch import nn
from torch.nn import functional as F

from ee_transformers.training.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_state,
    save_checkpoint,
)
from ee_transformers.utils.arguments import InputError
from ee_transformers.utils.outputs import OutputFolder

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


# ----------------------------------------------------------------------------------------------------------- helpers
def _ee(model):
    """The early-exit model under a (possibly) peft-wrapped one."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def exit_weights(exit_layers, how: str) -> list[float]:
    raw = [1.0] * len(exit_layers) if how == "uniform" else [layer + 1.0 for layer in exit_layers]
    return [w / sum(raw) for w in raw]


def lr_lambda_for(config: FitConfig):
    """Linear warm-up to 1, then cosine decay to `min_lr_ratio` at `steps` (a picklable-free closure; the scheduler's
    state is only its step count)."""

    def factor(step):
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        span = max(1, config.steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / span)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def sample_positions(block_size: int, count: int, seed: int, sample_index: int) -> torch.LongTensor:
    """Sorted random positions of one block with a next token (< block_size - 1); a pure function of the seed and
    the global sample index, so a resumed run draws exactly what an uninterrupted one would."""
    usable = block_size - 1
    if count == 0 or count >= usable:
        return torch.arange(usable)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + sample_index)
    return torch.randperm(usable, generator=generator)[:count].sort().values


class BlockStream:
    """Deterministic order of training blocks: epoch k is a permutation seeded by (seed, k); sample g of the global
    stream is block `perm_{g // n}[g % n]`. The data position is just the number of samples consumed."""

    def __init__(self, blocks: torch.LongTensor, seed: int):
        self.blocks, self.seed, self._perms = blocks, seed, {}

    def block_index(self, g: int) -> int:
        n = self.blocks.shape[0]
        epoch = g // n
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + 7919 * epoch))}
        return int(self._perms[epoch][g % n])


def _gather(h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """h: (B, T, D), positions: (B, P) -> (B, P, D)."""
    return h.gather(1, positions[..., None].expand(-1, -1, h.shape[-1]))


def _kl(teacher_logp: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) at temperature T, times T^2. Shapes (N, V)."""
    student_logp = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return F.kl_div(student_logp, teacher_logp, log_target=True, reduction="batchmean") * temperature**2


class LayerDrop:
    """LoRA training only: skips decoder layer l (its output = its input) with probability p * l / (L - 1), one draw
    per layer per micro-batch from a seeded generator. Off while the teacher runs.

    It replaces the layers' `forward` on the instance rather than adding a forward hook: transformers captures hidden
    states with forward hooks installed lazily at the first `output_hidden_states` call, so a hook's effect on the
    captured states would depend on which was registered first (and a resumed run would differ from an uninterrupted
    one). A skipped layer also costs nothing."""

    def __init__(self, layers, p_max: float):
        self.active, self.drop = False, set()
        n = len(layers)
        self.p = [p_max * i / max(1, n - 1) for i in range(n)]
        self.layers = list(layers)
        for i, layer in enumerate(self.layers):
            layer.forward = self._wrap(i, layer, layer.forward)

    def _wrap(self, index, layer, forward):
        def maybe_skip(*args, **kwargs):
            if self.active and layer.training and index in self.drop:
                return args[0] if args else kwargs["hidden_states"]
            return forward(*args, **kwargs)

        return maybe_skip

    def draw(self, seed: int):
        generator = torch.Generator().manual_seed(seed)
        u = torch.rand(len(self.p), generator=generator)
        self.drop = {i for i, p in enumerate(self.p) if u[i] < p}

    def remove(self):
        for layer in self.layers:
            if "forward" in vars(layer):
                del layer.forward  # back to the class's forward


class DistillationStep(nn.Module):
    """The loss of one micro-batch, as a module so that `accelerate` can wrap it (DDP syncs the heads' gradients)."""

    def __init__(self, model, config: FitConfig, lora: bool):
        super().__init__()
        self.model = model  # the (peft-wrapped) early-exit model
        self.config, self.lora = config, lora
        ee = _ee(model)
        self.exit_layers = list(ee.config.exit_layers)
        self.weights = exit_weights(self.exit_layers, config.exit_weighting)
        self.layer_drop = (
            LayerDrop(ee.family.layers(ee), config.layer_dropout) if lora and config.layer_dropout else None
        )

    def teacher_context(self):
        return self.model.disable_adapter() if self.lora else nullcontext()

    def forward(self, input_ids: torch.LongTensor, positions: torch.LongTensor):
        """input_ids: (B, T) packed blocks; positions: (B, P) positions distilled. Returns (loss, per-exit agreement
        (E,), final-layer agreement or nan)."""
        ee, cfg, T = _ee(self.model), self.config, self.config.temperature
        with torch.no_grad(), self.teacher_context():
            if self.layer_drop is not None:
                self.layer_drop.active = False
            out = ee.family.decoder(ee)(input_ids=input_ids, output_hidden_states=True, use_cache=False)
            teacher_logits = (
                ee.family.head_logits(ee, _gather(out.hidden_states[-1], positions)).float().flatten(0, 1)
            )  # (N, V)
            teacher_logp = F.log_softmax(teacher_logits / T, dim=-1)
            teacher_argmax = teacher_logits.argmax(-1)
        hidden = out.hidden_states
        loss = teacher_logits.new_zeros(())
        final_agree = torch.tensor(float("nan"))
        if self.lora:  # the student backbone, with gradients into the adapters
            if self.layer_drop is not None:
                self.layer_drop.active = True
            hidden = ee.family.decoder(ee)(
                input_ids=input_ids, output_hidden_states=True, use_cache=False
            ).hidden_states
            if self.layer_drop is not None:
                self.layer_drop.active = False
            final_logits = ee.family.head_logits(ee, _gather(hidden[-1], positions)).flatten(0, 1)
            loss = loss + cfg.final_kl_weight * _kl(teacher_logp, final_logits, T)
            final_agree = (final_logits.argmax(-1) == teacher_argmax).float().mean().detach()
        agree = []
        labels = None
        if cfg.ce_weight:
            labels = input_ids.gather(1, positions + 1).flatten()  # next tokens: positions < T - 1
        for i, layer in enumerate(self.exit_layers):
            logits = ee.exit_logits_from_hidden(i, _gather(hidden[layer + 1], positions)).flatten(0, 1)
            term = _kl(teacher_logp, logits, T)
            if labels is not None:
                term = term + cfg.ce_weight * F.cross_entropy(logits.float(), labels)
            loss = loss + self.weights[i] * term
            agree.append((logits.argmax(-1) == teacher_argmax).float().mean().detach())
        return loss, torch.stack(agree), final_agree


# -------------------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate_exits(model, blocks: torch.LongTensor, batch_size: int = 4, lora: bool | None = None) -> dict:
    """Per-exit argmax agreement and mean KL(original final || exit) over every position of `blocks` (B, T).

    With a peft-wrapped model the reference is the original model (adapters disabled) and the result also holds the
    adapted final layer's agreement / KL with it. Returns {"agreement": [...], "kl": [...], "final_agreement",
    "final_kl", "positions"}.
    """
    ee = _ee(model)
    lora = hasattr(model, "disable_adapter") if lora is None else lora
    modes = [(m, m.training) for m in ee.modules()]  # restored exactly: the trainer's modes differ per module
    ee.eval()
    exits = list(ee.config.exit_layers)
    agree = torch.zeros(len(exits), dtype=torch.float64)
    kl = torch.zeros(len(exits), dtype=torch.float64)
    final_agree = final_kl = 0.0
    count = 0
    device = ee.device
    for start in range(0, blocks.shape[0], batch_size):
        ids = blocks[start : start + batch_size].to(device)
        with model.disable_adapter() if lora else nullcontext():
            ref = ee.family.decoder(ee)(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            ref_logits = ee.family.head_logits(ee, ref[-1]).float().flatten(0, 1)
        ref_logp, ref_argmax = ref_logits.log_softmax(-1), ref_logits.argmax(-1)
        hidden = ref
        if lora:
            hidden = ee.family.decoder(ee)(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            student = ee.family.head_logits(ee, hidden[-1]).float().flatten(0, 1)
            final_agree += float((student.argmax(-1) == ref_argmax).sum())
            final_kl += float(_kl(ref_logp, student, 1.0)) * ref_argmax.numel()
        for i, layer in enumerate(exits):
            logits = ee.exit_logits_from_hidden(i, hidden[layer + 1]).float().flatten(0, 1)
            agree[i] += float((logits.argmax(-1) == ref_argmax).sum())
            kl[i] += float(_kl(ref_logp, logits, 1.0)) * ref_argmax.numel()
        count += ref_argmax.numel()
    for m, mode in modes:
        m.training = mode
    count = max(count, 1)
    result = {
        "agreement": [round(float(a) / count, 4) for a in agree],
        "kl": [round(float(k) / count, 4) for k in kl],
        "positions": count,
        "final_agreement": None,
        "final_kl": None,
    }
    if lora:
        result["final_agreement"], result["final_kl"] = round(final_agree / count, 4), round(final_kl / count, 4)
    return result


# --------------------------------------------------------------------------------------------------------- the fitter
def attach_lora(model, config: FitConfig):
    """Wraps the early-exit model in peft LoRA on the backbone's projections; the exit heads stay trainable."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError("`lora_rank` > 0 needs peft: pip install 'ee-transformers[train]'.") from None
    lora_config = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha or 2 * config.lora_rank,
        lora_dropout=config.lora_dropout,
        target_modules=LORA_TARGETS,
        bias="none",
    )
    # names match the decoder layers' projections only (the exit adapters' modules are `down` / `up`)
    return get_peft_model(model, lora_config)


def trainable_state(model) -> dict:
    """{name: tensor} of every parameter that trains (exit heads, confidence heads, LoRA), names relative to the
    early-exit model so a state moves between a peft-wrapped and a plain model."""
    return {name: p for name, p in _ee(model).named_parameters() if p.requires_grad}


def _freeze_for_fitting(model, lora: bool):
    ee = _ee(model)
    for name, p in ee.named_parameters():
        p.requires_grad_(name.startswith("exit_heads.") or (lora and "lora_" in name))
    decoder = ee.family.decoder(ee)
    decoder.eval()  # the backbone's own dropout (GPT-2 has some) stays off: it is the teacher
    if lora:  # only the LoRA layers train (their dropout included)
        for name, module in decoder.named_modules():
            if "lora_" in name:
                module.train()
    ee.exit_heads.train()


def _check_resume(state: dict, model, config: FitConfig):
    ee = _ee(model)
    want = {
        "exit_layers": list(ee.config.exit_layers),
        "exit_head": ee.config.exit_head,
        "exit_adapter_rank": ee.config.exit_adapter_rank,
        "lora_rank": config.lora_rank,
    }
    for key, value in want.items():
        if key in state.get("meta", {}) and state["meta"][key] != value:
            raise ValueError(
                f"Cannot resume: the checkpoint was made with `{key}`={state['meta'][key]!r}, this run "
                f"has {value!r}. Use the same settings or start a new run."
            )
    if state["step"] > config.steps:
        raise ValueError(f"Cannot resume: the checkpoint is at step {state['step']}, beyond `steps`={config.steps}.")


def resolve_resume(resume, checkpoint_dir):
    """`resume`: None, a checkpoint folder, or "auto" (the newest in `checkpoint_dir`, None if there is none)."""
    if resume in (None, False, ""):
        return None
    if resume in ("auto", True):
        return latest_checkpoint(checkpoint_dir)
    if not os.path.isdir(resume):
        raise ValueError(f"`resume`: no checkpoint folder {resume!r}.")
    found = latest_checkpoint(resume)  # a checkpoint *directory* resumes from its newest step
    return found or resume


def fit_exit_heads(
    model,
    train_blocks: torch.LongTensor,
    heldout_blocks: torch.LongTensor | None = None,
    config: FitConfig | None = None,
    checkpoint_dir=None,
    resume=None,
    accelerator=None,
    on_step=None,
) -> FitResult:
    """Fits the exit heads of an early-exit `model` (from `ee_transformers.from_base`) on packed `train_blocks`
    `(n, block_size)`; evaluates on `heldout_blocks` before and after.

    checkpoint_dir / resume: checkpoints every `config.checkpoint_every` steps go to `checkpoint_dir`; `resume` is a
        checkpoint folder or "auto" (newest in `checkpoint_dir`). A resumed run ends equal to an uninterrupted one.
    accelerator: an `accelerate.Accelerator` (`make_accelerator(config.mixed_precision, ...)` when None).
    on_step: optional `on_step(step, metrics)` called after every optimizer step (from the main process).
    Returns a `FitResult`; `result.model` is the early-exit model (LoRA merged when `config.merge_lora`, else the
    peft-wrapped model).
    """
    config = config or FitConfig()
    _check_fit_inputs(model, train_blocks)
    resume_path = resolve_resume(resume, checkpoint_dir)
    resume_state = read_checkpoint_state(resume_path) if resume_path else None
    lora = config.lora_rank > 0
    if resume_state is not None:
        _check_resume(resume_state, model, config)

    accelerator = accelerator or make_accelerator(config.mixed_precision, bool(config.layer_dropout))
    started = time.time()
    if lora and not hasattr(model, "disable_adapter"):
        model = attach_lora(model, config)
    _freeze_for_fitting(model, lora)
    heldout = heldout_blocks[: config.eval_blocks] if heldout_blocks is not None and len(heldout_blocks) else None

    before = resume_state.get("before") if resume_state else None
    if before is None and heldout is not None:
        before = evaluate_exits(model, heldout.to(accelerator.device), config.batch_size, lora=lora)
        if lora:  # before any LoRA step the adapted model IS the original: report what heads alone achieve
            before["final_agreement"], before["final_kl"] = 1.0, 0.0

    fit = _Fit.prepare(model, train_blocks, heldout, config, accelerator, lora)
    fit.before = before
    fit.history = list(resume_state.get("history", [])) if resume_state else []
    start_step = fit.restore(resume_path) if resume_path else 0
    fit.train(start_step, checkpoint_dir, on_step)
    accelerator.wait_for_everyone()
    _ee(model).eval()
    after = (
        evaluate_exits(model, heldout.to(accelerator.device), config.batch_size, lora=lora)
        if heldout is not None
        else None
    )

    exits = list(_ee(model).config.exit_layers)
    result = FitResult(model=model, exit_layers=exits, steps=config.steps, history=fit.history)
    if before:
        result.agreement_before, result.kl_before = before["agreement"], before["kl"]
    if after:
        result.agreement_after, result.kl_after = after["agreement"], after["kl"]
        result.final_agreement, result.final_kl = after["final_agreement"], after["final_kl"]
    if lora and config.merge_lora:
        result.model = merge_lora(model)
    if config.confidence_steps:
        result.confidence = fit_confidence_heads(result.model, train_blocks, heldout, config, accelerator)
    for p in _ee(result.model).parameters():
        p.requires_grad_(False)
    if config.draft_vocab_size:  # `generate(assistant_vocab_size=n)` drafts from the first n of them
        from ee_transformers.training.data import frequent_tokens

        vocab = _ee(result.model).config.vocab_size
        _ee(result.model).set_draft_vocab(frequent_tokens(train_blocks, min(config.draft_vocab_size, vocab), vocab))
    if config.draft_table:  # `generate(prompt_lookup_num_tokens=N, speculative_table_drafts=True)`
        try:
            _ee(result.model).set_draft_table(train_blocks)
        except ValueError:  # too little text for any continuation to repeat: no table, said so
            warnings.warn("The fitting data holds no continuation seen twice: no draft table stored.", stacklevel=2)
    result.seconds = round(time.time() - started, 2)
    return result


def _check_fit_inputs(model, train_blocks):
    """`ValueError` unless the model has exits and `train_blocks` is a non-empty (n, block_size) tensor whose blocks
    fit the model's positions."""
    from ee_transformers.training.data import check_block_size

    ee = _ee(model)
    if not list(ee.config.exit_layers):
        raise ValueError(
            "The model has no exit heads (`config.exit_layers` is empty): load it with "
            "`ee_transformers.from_base(path, exit_layers=[...])`."
        )
    if train_blocks.ndim != 2 or train_blocks.shape[0] == 0:
        raise ValueError(
            f"`train_blocks` must be a non-empty (n, block_size) tensor, got shape {tuple(train_blocks.shape)}."
        )
    check_block_size(int(train_blocks.shape[1]), ee.config)


@dataclass
class _Fit:
    """The moving parts of one fit's training loop: the loss module (as accelerate prepared it), the optimizer and
    scheduler, the order of the training blocks, and what the loop records (`history`, and `before` for
    checkpoints)."""

    model: nn.Module
    config: FitConfig
    accelerator: object
    train_blocks: torch.LongTensor
    heldout: torch.LongTensor | None
    lora: bool
    step_module: DistillationStep
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer
    prepared_optimizer: object
    scheduler: object
    groups: list
    stream: BlockStream
    before: dict | None = None
    history: list = field(default_factory=list)

    @classmethod
    def prepare(cls, model, train_blocks, heldout, config: FitConfig, accelerator, lora: bool) -> "_Fit":
        """AdamW over the heads (and LoRA adapters, at `lora_lr`), the cosine schedule, the loss module, all through
        `accelerator.prepare`."""
        ee = _ee(model)
        head_params = [p for n, p in ee.named_parameters() if p.requires_grad and n.startswith("exit_heads.")]
        lora_params = [p for n, p in ee.named_parameters() if p.requires_grad and "lora_" in n]
        groups = [{"params": head_params, "lr": config.lr}]
        if lora_params:
            groups.append({"params": lora_params, "lr": config.lora_lr})
        optimizer = torch.optim.AdamW(groups, weight_decay=config.weight_decay, foreach=False)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_for(config))
        step_module = DistillationStep(model, config, lora)
        wrapped, prepared_optimizer = accelerator.prepare(step_module, optimizer)
        # the scheduler is stepped by hand once per optimizer step (accelerate would step it once per process)
        return cls(
            model=model,
            config=config,
            accelerator=accelerator,
            train_blocks=train_blocks,
            heldout=heldout,
            lora=lora,
            step_module=step_module,
            wrapped=wrapped,
            optimizer=optimizer,
            prepared_optimizer=prepared_optimizer,
            scheduler=scheduler,
            groups=groups,
            stream=BlockStream(train_blocks, config.seed),
        )

    def restore(self, resume_path) -> int:
        """Loads the trainable weights, optimizer and scheduler of a checkpoint; returns its step."""
        trainable, state = load_checkpoint(resume_path, self.optimizer, self.scheduler)
        params = trainable_state(self.model)
        missing = sorted(set(params) - set(trainable))
        if missing:
            raise ValueError(f"Cannot resume from {resume_path}: it lacks {missing[:3]}...")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(trainable[name].to(p.device, p.dtype))
        self.accelerator.print(f"Resumed from {resume_path} at step {state['step']}.")
        return state["step"]

    def train(self, start_step: int, checkpoint_dir, on_step):
        """Optimizer steps `start_step`..`config.steps`, with progress, evaluation, checkpoints and `on_step`; a
        killed or failed run leaves the model as it found it (layer dropout removed)."""
        config, accelerator = self.config, self.accelerator
        progress = None
        if config.progress and accelerator.is_main_process:
            from tqdm.auto import tqdm

            progress = tqdm(total=config.steps, initial=start_step, desc="fit exit heads", dynamic_ncols=True)
        try:
            running_agree = None
            for step in range(start_step, config.steps):
                step_loss, step_agree, step_final = self._accumulate(step)
                if config.max_grad_norm:
                    accelerator.clip_grad_norm_([p for g in self.groups for p in g["params"]], config.max_grad_norm)
                self.prepared_optimizer.step()
                self.scheduler.step()
                self.prepared_optimizer.zero_grad(set_to_none=True)
                done = step + 1
                running_agree = step_agree if running_agree is None else 0.9 * running_agree + 0.1 * step_agree
                metrics = self._metrics(done, step_loss, step_agree, step_final)
                self.history.append(metrics)
                if progress is not None:
                    postfix = {"loss": f"{step_loss:.3f}", "agree": "/".join(f"{a:.2f}" for a in running_agree)}
                    if step_final:
                        postfix["final"] = f"{metrics['final_agreement']:.2f}"
                    progress.set_postfix(postfix)
                    progress.update(1)
                if checkpoint_dir and config.checkpoint_every and done % config.checkpoint_every == 0:
                    self._checkpoint(checkpoint_dir, done)
                if on_step is not None and accelerator.is_main_process:
                    on_step(done, metrics)
        finally:
            if self.step_module.layer_drop is not None:
                self.step_module.layer_drop.remove()
            if progress is not None:
                progress.close()

    def _accumulate(self, step: int):
        """Forward and backward over the `grad_accum` micro-batches of optimizer step `step`; returns (mean loss,
        mean per-exit agreement, final-layer agreements of the micro-batches that have one)."""
        config, accelerator = self.config, self.accelerator
        world, rank = accelerator.num_processes, accelerator.process_index
        block_size = self.train_blocks.shape[1]
        step_loss, step_agree, step_final = 0.0, torch.zeros(len(self.step_module.exit_layers)), []
        for micro in range(config.grad_accum):
            m = step * config.grad_accum + micro  # global micro-batch index
            first = (m * world + rank) * config.batch_size
            samples = range(first, first + config.batch_size)
            ids = torch.stack([self.train_blocks[self.stream.block_index(g)] for g in samples]).to(accelerator.device)
            pos = torch.stack(
                [sample_positions(block_size, config.positions_per_block, config.seed, g) for g in samples]
            ).to(accelerator.device)
            if self.step_module.layer_drop is not None:
                self.step_module.layer_drop.draw(config.seed * 1_000_003 + 500_009 * (m + 1))
            sync = micro == config.grad_accum - 1
            with nullcontext() if sync else accelerator.no_sync(self.wrapped), accelerator.autocast():
                loss, agree, final_agree = self.wrapped(ids, pos)
                accelerator.backward(loss / config.grad_accum)
            step_loss += float(loss.detach()) / config.grad_accum
            step_agree += agree.float().cpu() / config.grad_accum
            if not math.isnan(float(final_agree)):
                step_final.append(float(final_agree))
        return step_loss, step_agree, step_final

    def _metrics(self, done: int, step_loss, step_agree, step_final) -> dict:
        """The history entry of optimizer step `done`, with a held-out evaluation every `eval_every` steps."""
        config = self.config
        metrics = {
            "step": done,
            "loss": round(step_loss, 5),
            "agreement": [round(float(a), 4) for a in step_agree],
            "lr": self.scheduler.get_last_lr()[0],
        }
        if step_final:
            metrics["final_agreement"] = round(sum(step_final) / len(step_final), 4)
        if config.eval_every and done % config.eval_every == 0 and done < config.steps and self.heldout is not None:
            heldout = self.heldout.to(self.accelerator.device)
            metrics["eval"] = evaluate_exits(self.model, heldout, config.batch_size, lora=self.lora)
            self.accelerator.print(f"step {done}: held-out agreement {metrics['eval']['agreement']}")
        return metrics

    def _checkpoint(self, checkpoint_dir, done: int):
        config, accelerator = self.config, self.accelerator
        accelerator.wait_for_everyone()
        if not accelerator.is_main_process:
            return
        ee = _ee(self.model)
        meta = {
            "exit_layers": list(ee.config.exit_layers),
            "exit_head": ee.config.exit_head,
            "exit_adapter_rank": ee.config.exit_adapter_rank,
            "lora_rank": config.lora_rank,
            "config": asdict(config),
        }
        save_checkpoint(
            checkpoint_dir,
            done,
            trainable_state(self.model),
            self.optimizer,
            self.scheduler,
            {
                "meta": meta,
                "before": self.before,
                "history": self.history,
                "data_position": (done * config.grad_accum) * accelerator.num_processes * config.batch_size,
            },
            keep=config.keep_checkpoints,
        )


def make_accelerator(mixed_precision: str = "no", find_unused_parameters: bool = False):
    """An `accelerate.Accelerator` (CPU when there is no GPU). accelerate keeps one global state per process; a later
    run asking for another mixed precision (tests, notebooks) resets that state rather than failing.
    `find_unused_parameters`: DDP must tolerate parameters without gradients (layer dropout skips layers' adapters)."""
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.state import AcceleratorState

    kwargs = dict(
        mixed_precision=mixed_precision,
        cpu=not torch.cuda.is_available(),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters)],
    )
    try:
        return Accelerator(**kwargs)
    except ValueError:
        AcceleratorState._reset_state()  # keeps the process group (PartialState) of a distributed launch
        return Accelerator(**kwargs)


def merge_lora(model):
    """Folds LoRA adapters into the backbone weights; returns the plain early-exit model."""
    if not hasattr(model, "merge_and_unload"):
        return model
    return model.merge_and_unload()


# --------------------------------------------------------------------------------------------- learned confidence
def fit_confidence_heads(model, train_blocks, heldout_blocks, config: FitConfig, accelerator=None) -> dict:
    """CALM's meta classifier: per exit, a linear probe on the exit head's output predicting "this exit's argmax equals
    the final argmax" (binary cross-entropy). Backbone and exit heads stay fixed. Returns held-out accuracy and the
    positive rate per exit. Deterministic in `config.seed` (re-run, not checkpointed: it is short)."""
    ee = _ee(model)
    device = ee.device
    fresh = ee.confidence_heads is None
    heads = ee.add_confidence_heads()
    if fresh:  # start silent (p = 0.5) and deterministic, whatever the runtime's initialiser did
        with torch.no_grad():
            for head in heads:
                head.proj.weight.zero_()
                head.proj.bias.zero_()
    for p in ee.parameters():
        p.requires_grad_(False)
    for p in heads.parameters():
        p.requires_grad_(True)
    heads.train()
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.confidence_lr, foreach=False)
    stream = BlockStream(train_blocks, config.seed + 1)
    block_size = train_blocks.shape[1]
    exits = list(ee.config.exit_layers)

    def features(ids, positions):
        with torch.no_grad():
            hidden = ee.family.decoder(ee)(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            final = ee.family.head_logits(ee, _gather(hidden[-1], positions)).argmax(-1)
            feats, labels = [], []
            for i, layer in enumerate(exits):
                x = ee.exit_heads[i](_gather(hidden[layer + 1], positions))
                feats.append(x)
                labels.append((ee.family.head_logits(ee, x).argmax(-1) == final).float())
        return feats, labels

    for step in range(config.confidence_steps):
        samples = range(step * config.batch_size, (step + 1) * config.batch_size)
        ids = torch.stack([train_blocks[stream.block_index(g)] for g in samples]).to(device)
        pos = torch.stack(
            [sample_positions(block_size, config.positions_per_block, config.seed + 1, g) for g in samples]
        ).to(device)
        feats, labels = features(ids, pos)
        loss = sum(
            F.binary_cross_entropy_with_logits(heads[i].proj(x).squeeze(-1).float(), y)
            for i, (x, y) in enumerate(zip(feats, labels))
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    heads.eval()
    for p in heads.parameters():
        p.requires_grad_(False)
    report = {"steps": config.confidence_steps, "accuracy": None, "positive_rate": None}
    if heldout_blocks is not None and len(heldout_blocks):
        correct, positive, total = torch.zeros(len(exits)), torch.zeros(len(exits)), 0
        for start in range(0, heldout_blocks.shape[0], config.batch_size):
            ids = heldout_blocks[start : start + config.batch_size].to(device)
            pos = torch.arange(block_size, device=device).expand(ids.shape[0], -1)
            feats, labels = features(ids, pos)
            with torch.no_grad():
                for i, (x, y) in enumerate(zip(feats, labels)):
                    correct[i] += float(((heads[i](x) >= 0.5).float() == y).sum())
                    positive[i] += float(y.sum())
            total += pos.numel()
        report["accuracy"] = [round(float(c) / total, 4) for c in correct]
        report["positive_rate"] = [round(float(p) / total, 4) for p in positive]
    return report


# ------------------------------------------------------------------------------------------------- output folders
def check_checkpoint_dir(path, argument: str = "--checkpoint-dir") -> None:
    """Raises `InputError` unless checkpoints can be written at `path` (checked before any training)."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"`{argument}` {path!r} is a file: checkpoints need a folder.")
    ancestor = path
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
        raise InputError(f"`{argument}`: checkpoints cannot be written in {ancestor!r}.")


def write_model_folder(model, folder, tokenizer=None, card_data: dict | None = None, reports: dict | None = None):
    """Writes a Hub-ready early-exit folder into `folder` (as it is: give it the temporary folder of an
    `OutputFolder`, or use `save_model_folder`): weights, config, runtime code, tokenizer, card, and `reports`
    ({file name: JSON-able}, e.g. fit_report.json) next to them."""
    if tokenizer is not None:
        model.tokenizer = tokenizer
    if card_data is not None:  # over what from_base read from the source (base model, license)
        model.card_data = {**(getattr(model, "card_data", None) or {}), **card_data}
    model.save_pretrained(folder)
    for name, payload in (reports or {}).items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(payload, f, indent=1)


def save_model_folder(
    model,
    out,
    tokenizer=None,
    card_data: dict | None = None,
    reports: dict | None = None,
    carry_from=None,
    overwrite: bool = False,
    command: str | None = None,
) -> str:
    """Writes a Hub-ready early-exit folder atomically (`ee_transformers.utils.outputs.OutputFolder`): `out` is
    either its previous self or the complete new folder, never half written. A non-empty `out` needs `overwrite`
    (and then must be a folder an ee-transformers command wrote); `carry_from`: a folder whose other entries
    (reports, adapters) are kept when not written anew (`carry_from=out` updates `out` in place)."""
    output = out if isinstance(out, OutputFolder) else OutputFolder(out, overwrite=overwrite, carry_from=carry_from)
    with output.writing(command) as folder:
        write_model_folder(model, folder, tokenizer, card_data, reports)
    return str(output.path)


def agreement_table(exits, before, after, final_before=None, final_after=None) -> str:
    """A markdown table of per-exit held-out agreement before/after fitting."""
    head = "| | " + " | ".join(f"exit {e}" for e in exits) + (" | final layer |" if final_after is not None else " |")
    rule = "|---" * (len(exits) + 1 + (final_after is not None)) + "|"
    rows = [head, rule]
    for label, values, final in (("before fitting", before, final_before), ("after fitting", after, final_after)):
        if values is None:
            continue
        cells = " | ".join(f"{v:.3f}" for v in values)
        extra = (
            f" | {final:.3f}"
            if final_after is not None and final is not None
            else (" | -" if final_after is not None else "")
        )
        rows.append(f"| {label} | {cells}{extra} |")
    return "\n".join(rows)


def training_card(
    result: FitResult,
    config: FitConfig,
    base_model: str | None,
    data_desc: str,
    n_train: int,
    n_heldout: int,
    block_size: int,
    world: int = 1,
    quantized: str | None = None,
) -> str:
    tokens = config.steps * config.grad_accum * config.batch_size * world * block_size
    lines = [
        f"Exit heads fitted by self-distillation from {f'`{base_model}`' if base_model else 'the base model'}'s own "
        "final layer "
        f"(KL at temperature {config.temperature}"
        + (f", plus next-token cross-entropy weight {config.ce_weight}" if config.ce_weight else "")
        + ").",
        "",
        f"- data: {data_desc}; {n_train} training blocks and {n_heldout} held-out blocks of {block_size} tokens",
        f"- steps: {config.steps} x {config.grad_accum * config.batch_size * world} blocks "
        f"(about {tokens} context tokens, {config.positions_per_block or block_size - 1} distilled positions per block), "
        f"lr {config.lr}, warm-up {config.warmup_steps}, cosine to {config.min_lr_ratio} x lr, "
        f"mixed precision `{config.mixed_precision}`, seed {config.seed}",
    ]
    if config.lora_rank:
        lines.append(
            f"- backbone: LoRA rank {config.lora_rank} (alpha {config.lora_alpha or 2 * config.lora_rank}) on "
            f"{', '.join(LORA_TARGETS)}, lr {config.lora_lr}, final-layer KL weight {config.final_kl_weight}, "
            f"layer dropout {config.layer_dropout}; adapters "
            + ("merged into the weights" if config.merge_lora else "kept separately (see `lora_adapter/`)")
        )
        if result.final_agreement is not None:
            lines.append(
                f"- **the final layer moved**: its argmax agrees with the original model's on "
                f"{result.final_agreement:.3f} of held-out positions (KL {result.final_kl:.4f}); this is a "
                "slightly different model from the base"
            )
    else:
        lines.append("- backbone: frozen (bit-identical to the base model); only the exit heads were trained")
    if quantized:
        lines.append(
            f"- the frozen backbone was loaded in {quantized} (bitsandbytes) while fitting, and the agreements "
            "below were measured on it; this folder holds the original full-precision weights"
        )
    if result.confidence:
        lines.append(
            f"- learned confidence heads: {result.confidence['steps']} steps; held-out accuracy "
            f"{result.confidence['accuracy']}"
        )
    if result.agreement_before is not None:
        lines += [
            "",
            "Argmax agreement of each exit with the original model's final layer (held-out blocks, every position):",
            "",
            agreement_table(
                result.exit_layers,
                result.agreement_before,
                result.agreement_after,
                1.0 if config.lora_rank else None,
                result.final_agreement,
            ),
        ]
        if result.kl_before is not None and result.kl_after is not None:
            lines += [
                "",
                "Mean KL(original final || exit): "
                + ", ".join(
                    f"exit {e} {b:.3f} -> {a:.3f}"
                    for e, b, a in zip(result.exit_layers, result.kl_before, result.kl_after)
                )
                + ".",
            ]
    return "\n".join(lines)
