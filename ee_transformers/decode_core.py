"""The layer loop of every early-exit mode, written once: `run_layers` runs decoder layers `start..stop-1` through the
family's own layer calls (`families.py`), joins the tokens of deferred K/V at their layer, and keeps the states
entering and leaving the layers its caller checks.

Its callers: `prefill` and `decode_one_token` (`generation_early_exit.py`, which also holds the exit rule on the kept
states: `exit_at`, `first_confident_exit`), continuous batching's `paged_step`, self-speculative decoding's prefill
(`prefill_full_depth`), draft and verify forwards, a lean model's `deepen` and a pool's `catch_up`. What the `generate`
loops do around their steps is shared too (`decode_loop.py`).

Part of the Hub runtime: imports only torch, transformers and its siblings.
"""

import warnings
from contextlib import nullcontext
from typing import NamedTuple

import torch
from torch.profiler import record_function

from .families import LayerInputs


class LayerRun(NamedTuple):
    """What `run_layers` returns. h: `(B, q, D)`, leaving the last layer run; inputs: the layer inputs it ended with
    (with the joined deferred tokens' when any joined); states: {kept layer: (h_out, h_in)}, the `(B, q, D)` states
    leaving and entering it."""

    h: torch.Tensor
    inputs: LayerInputs
    states: dict


def run_layers(model, h, inputs, cache, start, stop, keep=(), join=False, mask_2d=None, label=None) -> LayerRun:
    """Runs decoder layers `start..stop-1` of `model` on the residual stream h `(B, q, D)`, writing their K/V to `cache`.

    keep: the layers whose entering and leaving states are returned (`LayerRun.states`). join (deferred K/V): before
    layer j, the exit states waiting in `cache` for it (`pop_pending`) join h ahead of its tokens (they are earlier
    positions), with layer inputs built again for them from the 2D attention mask `mask_2d`. label: a profiler label
    for each layer call (the decoding steps' `"ee::layer"`, which the step profile counts); None: no label.
    """
    fam, states = model.family, {}
    for j in range(start, stop):
        if join and (entry := cache.pop_pending(j)) is not None:
            h = torch.cat([entry.states, h], dim=1)  # (B, pending + q, D)
            position_ids = torch.cat([entry.position_ids, inputs.position_ids], dim=1)
            inputs = fam.layer_inputs(model, h, mask_2d, cache, position_ids, layer_idx=j)
        h_in = h
        with record_function(label) if label else nullcontext():
            h = fam.run_layer(model, j, h, inputs, cache)
        if j in keep:
            states[j] = (h, h_in)
    return LayerRun(h, inputs, states)


def deprecated_aliases(module: str, namespace: dict, renamed: dict):
    """A module `__getattr__` that serves each old name of `renamed` ({old: new}) as `namespace[new]` with a
    `DeprecationWarning` (for one release)."""

    def __getattr__(name):
        if name in renamed:
            warnings.warn(
                f"`{module}.{name}` is deprecated: use `{renamed[name]}` (this alias goes away in the next release).",
                DeprecationWarning,
                stacklevel=2,
            )
            return namespace[renamed[name]]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


__all__ = ["LayerRun", "run_layers"]
