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

import math
import os
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ee_transformers.training.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_state,
    save_checkpoint,
)
from ee_transformers.training.distill import (  # noqa: F401 (also importable from here, as before)
    BlockStream,
    DistillationStep,
    LayerDrop,
    _ee,
    evaluate_exits,
    exit_weights,
    fit_confidence_heads,
    lr_lambda_for,
    sample_positions,
)
from ee_transformers.training.fit_config import (  # noqa: F401 (also importable from here, as before)
    LORA_TARGETS,
    FitConfig,
    FitResult,
)
from ee_transformers.training.model_folder import (  # noqa: F401 (also importable from here, as before)
    agreement_table,
    check_checkpoint_dir,
    save_model_folder,
    training_card,
    write_model_folder,
)


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
