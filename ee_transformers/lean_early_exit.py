"""Lean early exit (HELIOS): only the decoder layers up to `exit_max_layer` are resident; a token still undecided there
exits greedily with that layer's exit head; a quality guard loads deeper layers while generating when greedy exits
pile up.

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, exit_max_layer=E)
    out = model.generate(ids, exit_breach_limit=0.2, exit_breach_window=32, return_dict_in_generate=True)
    out.exit_layers, out.greedy_exits, out.deepenings

How layers are kept off: each decoder layer above E is replaced in the family's layer list by a `ShedLayer`, a module
with no parameters and no buffers; it keeps the layer's structure on the meta device outside the module tree (so it
is neither a parameter of the model nor counted by `get_memory_footprint`). In `from_pretrained` the swap happens in
the model's `__init__`, before transformers loads the checkpoint, so the shed layers' tensors are never read from the
safetensors (their keys are unexpected, and transformers only slices a tensor it has a parameter for). The cache gets
no K/V for them because no layer above E ever runs.

How deepening brings K/V up to date: with the guard on, the residual stream leaving layer E is kept for every position,
as a deferred exit state of the cache (`EarlyExitCache.add_pending(E + 1, ...)`). Deepening reads the next layers from
the checkpoint, runs the kept states through them (full layer compute, causal, so every earlier position gets its
exact K/V there) and keeps what leaves the new deepest layer for the next deepening. Tokens that exited below E in
deferred mode are still pending lower down and are carried up by the next deep token, as deferred K/V always does.

Part of the Hub runtime: imports only torch, transformers and its siblings.
"""

import json
import os
import re

import torch
from torch import nn
from transformers.utils import cached_file

from .decode_core import _is_int, is_lean, loaded_depth, run_layers


# ---------------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------------
def allowed_max_layers(config) -> list[int]:
    """The values `exit_max_layer` may take: an exit layer, or the last layer (everything loaded)."""
    return list(config.exit_layers or []) + [config.num_hidden_layers - 1]


def check_exit_max_layer(config, value) -> None:
    """A `ValueError` naming `exit_max_layer` and the allowed values, unless `value` is one of them."""
    allowed = allowed_max_layers(config)
    if not _is_int(value) or value not in allowed:
        beyond = _is_int(value) and value >= config.num_hidden_layers
        where = (
            f" (the model has {config.num_hidden_layers} layers, 0..{config.num_hidden_layers - 1})" if beyond else ""
        )
        raise ValueError(
            f"`exit_max_layer` must be an exit layer or the last layer: allowed values are {allowed}, got "
            f"{value!r}{where}."
        )


# ---------------------------------------------------------------------------------------------------------------------
# shedding and loading layers
# ---------------------------------------------------------------------------------------------------------------------
class ShedLayer(nn.Module):
    """Stands in for decoder layer `index`, which is not loaded: no parameters, no buffers.

    The layer's structure waits on the meta device in a tuple (not a registered submodule, so it owns no parameter of
    the model) until `load_layers` materialises it from the checkpoint.
    """

    def __init__(self, index: int, blueprint: nn.Module):
        super().__init__()
        self.index = index
        self._blueprint = (blueprint,)

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"Decoder layer {self.index} is not loaded (lean model: `exit_max_layer` is below it). Use "
            "`generate`, which stops at the deepest loaded layer, or load it with "
            "`model.set_exit_max_layer(...)`."
        )

    def extra_repr(self):
        return f"index={self.index}, not loaded"


def _layers_name(model) -> str:
    """The module path of the family's decoder-layer list, e.g. "model.layers"."""
    layers = model.family.layers(model)
    return next(name for name, module in model.named_modules() if module is layers)


def shed_layers(model, exit_max_layer: int) -> None:
    """Replaces decoder layers above `exit_max_layer` by `ShedLayer`s (their tensors move to the meta device: the
    memory is freed once nothing else holds them) and records the new depth in `model.exit_max_layer`."""
    check_exit_max_layer(model.config, exit_max_layer)
    layers, last = model.family.layers(model), model.config.num_hidden_layers - 1
    for j in range(exit_max_layer + 1, last + 1):
        if not isinstance(layers[j], ShedLayer):
            layers[j] = ShedLayer(j, layers[j].to("meta"))
    model.exit_max_layer = exit_max_layer
    if exit_max_layer < last:  # from_pretrained: the checkpoint's keys of shed layers are expected to stay unused
        indices = "|".join(str(j) for j in range(exit_max_layer + 1, last + 1))
        model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | {
            rf"^(?:{re.escape(model.base_model_prefix)}\.)?layers\.(?:{indices})\.",
            rf"^{re.escape(_layers_name(model))}\.(?:{indices})\.",
        }


def _checkpoint_files(model) -> dict[str, str]:
    """{checkpoint key: safetensors file} of the folder (or Hub cache) the model was loaded from."""
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not source:
        raise ValueError(
            "This model was not loaded from a folder, so its shed layers cannot be read back; load it "
            "with `from_pretrained(folder, exit_max_layer=...)`."
        )
    index = cached_file(source, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    if index is not None:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {key: os.path.join(os.path.dirname(index), name) for key, name in weight_map.items()}
    single = cached_file(source, "model.safetensors", _raise_exceptions_for_missing_entries=False)
    if single is None:
        raise ValueError(f"No safetensors checkpoint in {source!r} to read the shed layers from.")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {key: single for key in f.keys()}


def _read_layer(model, files: dict, j: int, device) -> dict[str, torch.Tensor]:
    """Layer `j`'s tensors from the checkpoint, keyed by their names inside the layer."""
    from safetensors import safe_open

    full = f"{_layers_name(model)}.{j}."
    bare = full.removeprefix(f"{model.base_model_prefix}.")  # a checkpoint of the bare decoder
    prefix = full if any(k.startswith(full) for k in files) else bare
    wanted = {k: f for k, f in files.items() if k.startswith(prefix)}
    if not wanted:
        raise ValueError(f"The checkpoint holds no tensors for decoder layer {j} (looked for `{full}*`).")
    tensors = {}
    for file in sorted(set(wanted.values())):
        with safe_open(file, framework="pt", device=str(device)) as f:
            tensors.update({k[len(prefix) :]: f.get_tensor(k) for k, owner in wanted.items() if owner == file})
    return tensors


def load_layers(model, exit_max_layer: int) -> list[int]:
    """Materialises the shed layers up to `exit_max_layer` from the checkpoint, on the device of the layer below and
    in their own dtype. Returns the layers loaded."""
    check_exit_max_layer(model.config, exit_max_layer)
    layers = model.family.layers(model)
    todo = [j for j in range(exit_max_layer + 1) if isinstance(layers[j], ShedLayer)]
    if todo:
        if getattr(model, "hf_quantizer", None) is not None:
            raise NotImplementedError(
                "Loading shed layers into a quantized model is not supported: load it with the "
                "`exit_max_layer` it needs."
            )
        files = _checkpoint_files(model)
        for j in todo:
            device = next(layers[j - 1].parameters()).device
            layer = layers[j]._blueprint[0].to_empty(device=device)
            layer.load_state_dict(_read_layer(model, files, j, device), strict=True)  # casts to the layer's dtype
            layers[j] = layer.train(model.training)
    model.exit_max_layer = max(exit_max_layer, model.exit_max_layer)
    return todo


def set_exit_max_layer(model, exit_max_layer: int):
    """Loads (from the checkpoint) or sheds (freeing their memory) decoder layers so that exactly layers
    0..`exit_max_layer` are resident. Between generate calls only."""
    check_exit_max_layer(model.config, exit_max_layer)
    if exit_max_layer > loaded_depth(model) - 1:
        load_layers(model, exit_max_layer)
    else:
        shed_layers(model, exit_max_layer)
    return model


def next_max_layer(model) -> int:
    """The layer deepening loads up to: the next exit above the deepest loaded layer, or the last layer."""
    current = loaded_depth(model) - 1
    deeper = [e for e in model.config.exit_layers if e > current]
    return deeper[0] if deeper else model.config.num_hidden_layers - 1


# ---------------------------------------------------------------------------------------------------------------------
# the quality guard
# ---------------------------------------------------------------------------------------------------------------------
def deepen(model, cache, attention_mask) -> int:
    """Loads the layers up to the next exit (or the last layer) and brings their K/V up to date for every position
    whose state left the old deepest layer, exactly (the layers themselves run on those states). `attention_mask`:
    the 2D mask of the generation so far (kept states are a prefix of it). Returns the new `exit_max_layer`."""
    old_depth, new_max = loaded_depth(model), next_max_layer(model)
    load_layers(model, new_max)
    entry = cache.pop_pending(old_depth)
    if entry is not None:
        fam, h = model.family, entry.states  # (B, n, D)
        mask = None if attention_mask is None else attention_mask[:, : h.shape[1]]
        inputs = fam.layer_inputs(model, h, mask, cache, entry.position_ids, layer_idx=old_depth)  # an empty layer
        h = run_layers(model, h, inputs, cache, old_depth, new_max + 1).h
        if is_lean(model):  # what leaves the new deepest layer waits for the next deepening
            cache.add_pending(new_max + 1, h, entry.position_ids)
    return new_max


# ---------------------------------------------------------------------------------------------------------------------
# memory, measured
# ---------------------------------------------------------------------------------------------------------------------
def resident_parameter_bytes(*models) -> int:
    """Bytes of the parameters and buffers of `models` that hold memory (not on the meta device); tied tensors and
    modules the models share count once."""
    tensors = {id(t): t for m in models for t in (*m.parameters(), *m.buffers()) if t.device.type != "meta"}
    return sum(t.nelement() * t.element_size() for t in tensors.values())


def kv_bytes_per_token(cache) -> dict:
    """Measured from a cache after a generate: `layers` holding K/V, their K/V `bytes_per_token` (allocated bytes per
    row and position: a static cache counts its whole capacity), and `kept_bytes_per_token` of states kept for
    deepening."""
    layers, per_token = 0, 0.0
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or keys.numel() == 0:
            continue
        layers += 1
        per_token += (keys.nbytes + values.nbytes) / (keys.shape[0] * keys.shape[-2])
    kept = sum(e.states.nbytes / (e.states.shape[0] * e.states.shape[1]) for e in getattr(cache, "pending", []))
    return {"layers": layers, "bytes_per_token": per_token, "kept_bytes_per_token": kept}


def memory_report(model, cache=None) -> dict:
    """Resident parameter bytes and loaded depth of `model`; with a `cache`, its measured K/V bytes per token."""
    report = {
        "exit_max_layer": loaded_depth(model) - 1,
        "loaded_layers": loaded_depth(model),
        "resident_parameter_bytes": resident_parameter_bytes(model),
    }
    if cache is not None:
        kv = kv_bytes_per_token(cache)
        report.update(
            kv_layers=kv["layers"],
            kv_bytes_per_token=kv["bytes_per_token"],
            kept_bytes_per_token=kv["kept_bytes_per_token"],
        )
    return report


__all__ = [
    "ShedLayer",
    "allowed_max_layers",
    "check_exit_max_layer",
    "deepen",
    "is_lean",
    "kv_bytes_per_token",
    "load_layers",
    "loaded_depth",
    "memory_report",
    "next_max_layer",
    "resident_parameter_bytes",
    "set_exit_max_layer",
    "shed_layers",
]
