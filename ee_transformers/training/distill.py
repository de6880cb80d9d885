"""The pieces of self-distillation a fit is made of: the exit weights and learning-rate schedule, sampled positions,
the block stream, the distillation step (KL to the final layer, optionally next-token cross-entropy and LayerDrop),
the held-out evaluation of the exits, and the learned confidence heads (`fit_confidence_heads`).
`ee_transformers.training.fit_exit_heads` runs the fit loop on them."""

import math
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn import functional as F

from ee_transformers.training.fit_config import (
    FitConfig,
)


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
