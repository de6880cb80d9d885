"""Fit exit heads by self-distillation on a frozen (or LoRA-adapted) backbone.

    ee-transformers fit --model path/to/plain-or-ee --exit-layers 7,15,22 --data books/*.txt \\
        --block-size 512 --steps 2000 --out my-ee-model
    python -m ee_transformers.tools.fit ...                 # the same entry point
    accelerate launch -m ee_transformers.tools.fit ...      # several GPUs (DDP; FSDP best-effort)

The command line of `ee_transformers.training.fit_exit_heads` (argument parsing, checks that need no weights, then
`fit_exit_heads` and the output folder); what fitting does is described there.
"""

import os
import sys
from dataclasses import asdict

import torch

from ee_transformers.convert import check_weights, read_config
from ee_transformers.training.checkpoint import read_checkpoint_state
from ee_transformers.training.fit_exit_heads import (
    FitConfig,
    FitResult,
    _ee,
    attach_lora,
    check_checkpoint_dir,
    fit_exit_heads,
    make_accelerator,
    merge_lora,
    resolve_resume,
    training_card,
    write_model_folder,
)
from ee_transformers.utils.arguments import ArgumentParser, add_config_arguments, config_from_args, run_command
from ee_transformers.utils.outputs import OutputFolder


def build_parser():
    p = ArgumentParser(prog="ee-transformers fit", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="plain Llama/Mistral/Qwen2/Qwen3 folder, or an early-exit folder")
    p.add_argument("--exit-layers", help="comma-separated 0-based layers, e.g. 7,15,22 (default: the folder's)")
    p.add_argument("--exit-head", choices=["norm", "adapter"], help="default: adapter for a plain folder")
    p.add_argument("--exit-adapter-rank", type=int, help="default: 64 for a plain folder")
    p.add_argument("--data", nargs="+", required=True, help="text / JSON lines / parquet / csv files or globs")
    p.add_argument("--text-field", default="text", help="field holding the text in JSON lines / datasets files")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--heldout-fraction", type=float, default=0.1)
    p.add_argument("--out", required=True, help="output model folder (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--checkpoint-dir", help="default: <out>.checkpoints")
    p.add_argument("--resume", help="a checkpoint folder, or 'auto' for the newest in --checkpoint-dir")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype of the backbone"
    )
    q = p.add_mutually_exclusive_group()
    q.add_argument("--load-in-4bit", action="store_true", help="frozen backbone through bitsandbytes 4-bit")
    q.add_argument("--load-in-8bit", action="store_true", help="frozen backbone through bitsandbytes 8-bit")
    add_config_arguments(p, FitConfig, skip=("progress", "merge_lora"))  # --no-progress / --keep-adapters below
    p.add_argument("--keep-adapters", action="store_true", help="LoRA: save adapters unmerged in <out>/lora_adapter")
    p.add_argument("--no-progress", action="store_true")
    return p


def _quantization_config(args):
    if not (args.load_in_4bit or args.load_in_8bit):
        return None
    flag = "--load-in-4bit" if args.load_in_4bit else "--load-in-8bit"
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except Exception as error:  # noqa: BLE001 - any import failure means "not supported here"
        raise ValueError(
            f"`{flag}` needs bitsandbytes, which cannot be imported on this platform ({error}); drop the "
            "flag to fit on the full-precision backbone."
        ) from None
    # the skip list replaces transformers' defaults: keep the LM head and every head we train in full precision
    skip = ["lm_head", "exit_heads", "confidence_heads"]
    if args.load_in_4bit:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)


def _load(args, exit_layers, head, rank, quantization=None):
    import ee_transformers as eet

    kwargs = {"dtype": getattr(torch, args.dtype)}
    if quantization is not None:
        kwargs["quantization_config"] = quantization
        if torch.cuda.is_available():  # quantized weights are placed at load time, on this process's GPU
            kwargs["device_map"] = {"": torch.cuda.current_device()}
    try:
        return eet.from_base(args.model, exit_layers=exit_layers, exit_head=head, exit_adapter_rank=rank, **kwargs)
    except (ImportError, RuntimeError, NotImplementedError) as error:
        if quantization is None:
            raise
        flag = "--load-in-4bit" if args.load_in_4bit else "--load-in-8bit"
        raise ValueError(f"`{flag}`: bitsandbytes could not load the backbone on this platform ({error}).") from None


def _full_precision_copy(args, result, exit_layers, head, rank, config):
    """After fitting on a quantized backbone: the same trained heads (and LoRA, merged) on the original full-precision
    weights, so the saved folder does not need bitsandbytes."""
    state = {
        n: t.detach().cpu()
        for n, t in result.model.state_dict().items()
        if n.startswith(("exit_heads.", "confidence_heads.")) or "lora_" in n
    }
    model = _load(args, exit_layers, head, rank)
    if result.confidence:
        model.add_confidence_heads()
    if config.lora_rank:
        model = attach_lora(model, config)
    target = {n: p for n, p in _ee(model).named_parameters()}
    for name, tensor in state.items():
        name = name.replace("base_model.model.", "")
        if name in target:
            with torch.no_grad():
                target[name].copy_(tensor.to(target[name].dtype))
    return merge_lora(model) if config.lora_rank and config.merge_lora else model


def main(argv=None):
    return run_command(build_parser(), _run, argv)


def _run(args):
    from transformers import AutoTokenizer

    from ee_transformers.training.data import load_blocks

    config = config_from_args(FitConfig, args, progress=not args.no_progress, merge_lora=not args.keep_adapters)
    # ---- everything that can be checked before loading weights --------------------------------------------------
    output = OutputFolder(args.out, overwrite=args.overwrite)
    exit_layers, head, rank, checkpoint_dir = _check_model_arguments(args, config)
    quantization = _quantization_config(args)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"`--model` {args.model!r}: no usable tokenizer in the folder ({error}).") from None
    splits = load_blocks(
        args.data,
        tokenizer,
        args.block_size,
        text_field=args.text_field,
        heldout_fraction=args.heldout_fraction,
        seed=config.seed,
    )

    # ---- the work --------------------------------------------------------------------------------------------------
    accelerator = make_accelerator(config.mixed_precision, bool(config.layer_dropout))
    torch.manual_seed(config.seed)  # the exit adapters' initial down-projections (DDP then broadcasts rank 0's)
    model = (
        _load(args, exit_layers, head, rank, quantization).to(accelerator.device)
        if quantization is None
        else _load(args, exit_layers, head, rank, quantization)
    )
    exit_layers = list(model.config.exit_layers)
    accelerator.print(
        f"{type(model).__name__}: exits after layers {exit_layers} of {model.config.num_hidden_layers}; "
        f"{splits.train.shape[0]} training / {splits.heldout.shape[0]} held-out blocks of {args.block_size}; "
        f"{accelerator.num_processes} process(es) on {accelerator.device}"
    )
    result = fit_exit_heads(
        model,
        splits.train,
        splits.heldout,
        config,
        checkpoint_dir=checkpoint_dir,
        resume=args.resume,
        accelerator=accelerator,
    )
    if not accelerator.is_main_process:
        return 0
    final = result.model
    if quantization is not None:
        final = _full_precision_copy(
            args, result, exit_layers, model.config.exit_head, model.config.exit_adapter_rank, config
        )
    _write_fitted(args, output, final, result, config, tokenizer, splits, accelerator.num_processes)
    return 0


def _check_model_arguments(args, config: FitConfig):
    """`--model`, `--exit-layers`, `--block-size`, `--checkpoint-dir` and `--resume` checked before any weights load.
    Returns (exit layers or None for the folder's, exit head, adapter rank, checkpoint folder)."""
    from ee_transformers import model_class_for
    from ee_transformers.configuration_early_exit import validate_exit_layers
    from ee_transformers.training.data import check_block_size

    folder_config = read_config(args.model, "--model")
    check_weights(args.model, "--model")
    exit_layers = None
    if args.exit_layers:
        try:
            exit_layers = [int(x) for x in args.exit_layers.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"`--exit-layers` must be comma-separated integers, got {args.exit_layers!r}.") from None
    elif not folder_config.get("exit_layers"):
        raise ValueError("`--exit-layers` is required for a plain checkpoint (e.g. --exit-layers 7,15,22).")
    is_plain = not str(folder_config.get("model_type", "")).startswith("early_exit_")
    head = args.exit_head or ("adapter" if is_plain else None)
    rank = args.exit_adapter_rank or (64 if is_plain else None)
    model_class_for(folder_config.get("model_type"))
    validate_exit_layers(exit_layers or folder_config.get("exit_layers"), folder_config["num_hidden_layers"])

    class _Limits:  # block size against the model's positions, before tokenising anything
        max_position_embeddings = folder_config.get("max_position_embeddings")

    check_block_size(args.block_size, _Limits)
    checkpoint_dir = args.checkpoint_dir or os.path.abspath(args.out).rstrip(os.sep) + ".checkpoints"
    check_checkpoint_dir(checkpoint_dir, "--checkpoint-dir" if args.checkpoint_dir else "--out")
    _check_resume_argument(args.resume, checkpoint_dir, exit_layers or folder_config.get("exit_layers"), config)
    return exit_layers, head, rank, checkpoint_dir


def _check_resume_argument(resume, checkpoint_dir, exit_layers, config: FitConfig):
    """`--resume` names a checkpoint made with these exit layers and this LoRA rank (when it names any)."""
    resume_path = resolve_resume(resume, checkpoint_dir)
    if resume and resume != "auto" and resume_path is None:
        raise ValueError(f"`--resume` {resume!r}: no checkpoint there.")
    if not resume_path:
        return
    meta = read_checkpoint_state(resume_path).get("meta", {})
    if meta.get("exit_layers") is not None and meta["exit_layers"] != exit_layers:
        raise ValueError(
            f"`--exit-layers` {exit_layers} disagree with the checkpoint being resumed "
            f"({resume_path}: {meta['exit_layers']})."
        )
    if meta.get("lora_rank", 0) != config.lora_rank:
        raise ValueError(
            f"`--lora-rank` {config.lora_rank} disagrees with the checkpoint being resumed ({meta.get('lora_rank')})."
        )


def _write_fitted(args, output, final, result: FitResult, config: FitConfig, tokenizer, splits, world: int):
    """The fitted folder: weights (and `lora_adapter/` when adapters are kept), card and fit_report.json. Stored exit
    settings are cleared: they were calibrated for the previous heads."""
    ee = _ee(final)
    if any(value is not None for value in ee.exit_defaults.values()):
        # decoding settings calibrated for the old heads no longer hold: back to full depth until recalibrated
        print("Cleared the stored exit settings (calibrated for the previous heads); run `ee-transformers calibrate`.")
        ee.set_exit_defaults(**{name: None for name in ee.exit_defaults})
    kept_adapters = hasattr(final, "save_pretrained") and final is not ee  # LoRA unmerged: base + adapter folder
    base_model = (getattr(ee, "card_data", None) or {}).get("base_model")  # from_base read it from the source
    card = {"training": _training_card_of_run(args, result, config, base_model, splits, world)}
    if kept_adapters:
        card["notes"] = (
            "## LoRA adapters\n\nThe weights here are the ORIGINAL backbone; the fitted LoRA adapters are in "
            "`lora_adapter/`. Load with `peft.PeftModel.from_pretrained(model, 'path/lora_adapter')`."
        )
    report = {
        "base_model": base_model,
        "exit_layers": list(result.exit_layers),
        "data": list(args.data),
        "train_blocks": int(splits.train.shape[0]),
        "heldout_blocks": int(splits.heldout.shape[0]),
        "block_size": args.block_size,
        "config": asdict(config),
        "card": card,
        **{k: v for k, v in result.summary().items() if k != "history"},
        "history_tail": result.history[-5:],
    }
    with output.writing("fit") as folder:
        if kept_adapters:
            final.save_pretrained(os.path.join(folder, "lora_adapter"))
            ee = final.unload()  # the original backbone weights, adapter modules removed (not merged)
        write_model_folder(ee, folder, tokenizer, card, {"fit_report.json": report})
    print(
        f"Wrote {args.out}: held-out agreement per exit {result.agreement_before} -> {result.agreement_after}"
        + (f"; final layer vs original {result.final_agreement}" if result.final_agreement is not None else "")
    )


def _training_card_of_run(args, result: FitResult, config: FitConfig, base_model, splits, world: int) -> str:
    """`training_card` of a command-line run: its data files named (the first eight), blocks and quantization."""
    from ee_transformers.training.data import expand_paths

    data_files = expand_paths(args.data)
    data_desc = ", ".join(sorted({os.path.basename(p) for p in data_files})[:8]) + (
        f" and {len(data_files) - 8} more files" if len(data_files) > 8 else ""
    )
    return training_card(
        result,
        config,
        base_model,
        data_desc,
        splits.train.shape[0],
        splits.heldout.shape[0],
        args.block_size,
        world,
        quantized="4-bit" if args.load_in_4bit else "8-bit" if args.load_in_8bit else None,
    )


if __name__ == "__main__":
    sys.exit(main())
