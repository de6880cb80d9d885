"""Resumable training checkpoints without pickle: tensors in safetensors, counters and settings in JSON.

A checkpoint folder `step-000123/` holds
    trainable.safetensors   the trained parameters (exit heads, LoRA adapters), by name
    optimizer.safetensors   the optimizer's per-parameter state, keyed `state.<param index>.<name>`
    rng.safetensors         torch CPU (and CUDA) generator states, numpy's Mersenne state
    state.json              step, data position, optimizer param groups, scheduler state, python's RNG state, meta
It is written to a temporary folder and renamed into place, so a folder named `step-*` is always complete.
"""

import json
import os
import random
import shutil

import torch
from safetensors.torch import load_file, save_file

STATE_FILE = "state.json"


# ------------------------------------------------------------------------------------------------------- optimizer
def optimizer_to_flat(optimizer) -> tuple[dict, list]:
    """Optimizer state dict -> ({name: tensor}, JSON-able param groups)."""
    state = optimizer.state_dict()
    tensors = {}
    for index, values in state["state"].items():
        for name, value in values.items():
            tensors[f"state.{index}.{name}"] = torch.as_tensor(value).contiguous()
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()} for group in state["param_groups"]
    ]
    return tensors, groups


def optimizer_from_flat(optimizer, tensors: dict, groups: list) -> None:
    state = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in group.items()} for group in groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ------------------------------------------------------------------------------------------------------------- rng
def rng_state() -> tuple[dict, dict]:
    """Current RNG states: ({name: tensor}, JSON-able extras)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    version, internal, gauss = random.getstate()
    extras = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        tensors["numpy.keys"] = torch.from_numpy(keys.astype("int64"))
        extras["numpy"] = [kind, int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return tensors, extras


def set_rng_state(tensors: dict, extras: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = extras["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in extras and "numpy.keys" in tensors:
        import numpy as np

        kind, pos, has_gauss, cached = extras["numpy"]
        np.random.set_state((kind, tensors["numpy.keys"].numpy().astype("uint32"), pos, has_gauss, cached))


# ----------------------------------------------------------------------------------------------------- save / load
def _json_safe(value):
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return None  # callables (LR lambdas) and the like are rebuilt by the trainer, not stored


def save_checkpoint(folder, step: int, trainable: dict, optimizer, scheduler, state: dict, keep: int = 2) -> str:
    """Writes `folder/step-<step>` atomically and keeps only the `keep` newest checkpoints. Returns its path."""
    os.makedirs(folder, exist_ok=True)
    final = os.path.join(folder, f"step-{step:07d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in trainable.items()}, os.path.join(tmp, "trainable.safetensors")
    )
    opt_tensors, groups = optimizer_to_flat(optimizer)
    save_file({k: v.cpu() for k, v in opt_tensors.items()}, os.path.join(tmp, "optimizer.safetensors"))
    rng_tensors, rng_extras = rng_state()
    save_file({k: v.cpu().contiguous() for k, v in rng_tensors.items()}, os.path.join(tmp, "rng.safetensors"))
    payload = dict(
        state,
        step=step,
        optimizer_param_groups=groups,
        rng=rng_extras,
        scheduler=_json_safe(scheduler.state_dict()) if scheduler is not None else None,
    )
    with open(os.path.join(tmp, STATE_FILE), "w") as f:
        json.dump(_json_safe(payload), f, indent=1)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_checkpoints(folder)[:-keep] if keep else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(folder) -> list[str]:
    """Complete checkpoints in `folder`, oldest first."""
    if not folder or not os.path.isdir(folder):
        return []
    names = sorted(
        n
        for n in os.listdir(folder)
        if n.startswith("step-") and not n.endswith(".tmp") and os.path.isfile(os.path.join(folder, n, STATE_FILE))
    )
    return [os.path.join(folder, n) for n in names]


def latest_checkpoint(folder) -> str | None:
    found = list_checkpoints(folder)
    return found[-1] if found else None


TENSOR_FILES = ("trainable.safetensors", "optimizer.safetensors", "rng.safetensors")


def read_checkpoint_state(path) -> dict:
    """The JSON part of a checkpoint, after checking the checkpoint is whole: its state is a JSON object with a step
    and its tensor files have sound safetensors headers (cheap: used to validate a resume before any work). A
    `ValueError` names the file at fault."""
    from safetensors import SafetensorError, safe_open

    file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"`{path}` is not a training checkpoint: no {STATE_FILE} in it.")
    try:
        with open(file, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{file}: not a readable checkpoint state ({error}); the checkpoint is damaged, resume from "
            "an earlier one or start again."
        ) from None
    if not isinstance(state, dict) or isinstance(state.get("step"), bool) or not isinstance(state.get("step"), int):
        raise ValueError(f"{file}: not a checkpoint state (a JSON object with an integer `step`).")
    for name in TENSOR_FILES:
        try:
            with safe_open(os.path.join(path, name), "pt"):
                pass
        except (OSError, SafetensorError) as error:
            raise ValueError(
                f"{os.path.join(path, name)}: the checkpoint is damaged ({error}); resume from an "
                "earlier one or start again."
            ) from None
    return state


def load_checkpoint(path, optimizer, scheduler) -> tuple[dict, dict]:
    """Restores optimizer, scheduler and RNG states; returns (trainable tensors, state dict)."""
    state = read_checkpoint_state(path)
    trainable = load_file(os.path.join(path, "trainable.safetensors"))
    optimizer_from_flat(
        optimizer, load_file(os.path.join(path, "optimizer.safetensors")), state["optimizer_param_groups"]
    )
    if scheduler is not None and state.get("scheduler") is not None:
        sched = {k: v for k, v in state["scheduler"].items() if k != "lr_lambdas"}
        scheduler.load_state_dict({**scheduler.state_dict(), **sched})
    set_rng_state(load_file(os.path.join(path, "rng.safetensors")), state["rng"])
    return trainable, state


__all__ = ["latest_checkpoint", "list_checkpoints", "load_checkpoint", "read_checkpoint_state", "save_checkpoint"]
