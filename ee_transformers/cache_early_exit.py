"""The early-exit KV cache.

Transformers builds the causal mask once per forward from layer 0's length, so every layer must hold every earlier
position before its attention runs. Tokens that exit at layer e skip the layers above it; their K/V there come from:

* ``exit_kv="immediate"``: the exit state (the residual stream leaving layer e) run through each skipped layer's input
  norm and K/V projections before the step ends (done by the model; this cache just stores them);
* ``exit_kv="deferred"``: this cache keeps the exit states as *pending* and the next token that runs a skipped layer
  takes them along through it, so the deep K/V become exactly what a full-depth model would have stored.

`EarlyExitCache` wraps the layer objects of any dynamic or static cache, so `generate`'s cache choice is kept.

Part of the Hub runtime: imports only torch and transformers.
"""

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache


@dataclass
class PendingStates:
    """Tokens whose K/V are missing from layer `depth` upward (deferred mode).

    states: `(batch, n, hidden)`, the residual stream entering layer `depth`; position_ids: `(batch, n)`.
    """

    depth: int
    states: torch.Tensor
    position_ids: torch.Tensor


class EarlyExitCache(Cache):
    """A `Cache` over given layer objects that also holds deferred exit states."""

    def __init__(self, layers):
        super().__init__(layers=layers)
        self.pending: list[PendingStates] = []  # sorted by depth, deepest (= earliest positions) first

    @classmethod
    def from_cache(cls, cache: Cache) -> "EarlyExitCache":
        """Shares `cache`'s layer objects (dynamic or static), so nothing is copied."""
        if isinstance(cache, cls):
            return cache
        if not cache.layers:
            raise ValueError("EarlyExitCache needs a cache whose layers are created up front (pass `config=`).")
        return cls(layers=cache.layers)

    # deferred exit states ------------------------------------------------------------------------------------------
    def add_pending(self, depth: int, states: torch.Tensor, position_ids: torch.Tensor) -> None:
        for entry in self.pending:
            if entry.depth == depth:  # the new states are later positions: append after the older ones
                entry.states = torch.cat([entry.states, states], dim=1)
                entry.position_ids = torch.cat([entry.position_ids, position_ids], dim=1)
                return
        self.pending.append(PendingStates(depth, states, position_ids))
        self.pending.sort(key=lambda entry: -entry.depth)

    def pop_pending(self, depth: int) -> PendingStates | None:
        for i, entry in enumerate(self.pending):
            if entry.depth == depth:
                return self.pending.pop(i)
        return None

    @property
    def num_pending(self) -> int:
        return sum(entry.states.shape[1] for entry in self.pending)

    # batch bookkeeping: keep pending states aligned with the layers' batch dimension ------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self._map_pending(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self._map_pending(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._map_pending(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_pending(self, fn):
        for entry in self.pending:
            entry.states, entry.position_ids = fn(entry.states), fn(entry.position_ids)

    def crop(self, tokens_to_remove: int) -> None:
        if self.pending:
            raise ValueError("Cannot crop an EarlyExitCache that holds deferred exit states; use exit_kv='immediate'.")
        super().crop(tokens_to_remove)

    def reset(self):
        super().reset()
        self.pending = []


class RowSubsetCache:
    """A one-step view of `cache` for a decoder layer that runs on a subset `rows` of the batch (row policy).

    The real cache always receives one update per layer for the whole batch: the running rows' K/V from the layer
    itself, the exited rows' K/V from `fill(layer_idx)` (their backfill). The layer sees only its rows.
    """

    def __init__(self, cache: Cache, rows: torch.Tensor, fill):
        self.cache, self.rows, self.fill = cache, rows, fill

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.fill(layer_idx)  # (batch, heads, q, head_dim), exited rows filled
        keys = keys.index_copy(0, self.rows, key_states)
        values = values.index_copy(0, self.rows, value_states)
        keys, values = self.cache.update(keys, values, layer_idx, *args, **kwargs)
        return keys.index_select(0, self.rows), values.index_select(0, self.rows)


__all__ = ["EarlyExitCache", "PendingStates", "RowSubsetCache"]
