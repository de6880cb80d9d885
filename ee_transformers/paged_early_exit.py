"""Early exit inside transformers' continuous batching: `generate_batch`, `init_continuous_batching` and
`transformers serve --continuous-batching` decode with the stored (or given) exit settings.

Continuous batching calls `model(**batch)` once per step on a packed batch: every request's query tokens side by side
in one row `(1, T)`, `cu_seq_lens_q` marking where each request's tokens start, and a `PagedAttentionCache` whose
`write_index` names the cache slot each token writes and whose `read_index` names the slots each request reads. A
step mixes prefill chunks (prompt tokens) and decode tokens (one per generating request). `paged_step` runs such a
step layer by layer, as the first seed paper's framework does in vLLM's paged cache:

- prompt tokens run every loaded layer; the last one of a prompt picks the request's first token at the first checked
  exit whose criterion holds, as `prefill` does in `generate`;
- a decode token is checked at every exit. With `exit_policy="row"` a confident token leaves the packed batch, so
  deeper layers run only for the others; with `exit_policy="batch"` the decode tokens leave together at the first
  exit where every one of them is confident (the seed's iteration-level rule; prompt tokens go on);
- before the step ends, the skipped layers' K/V of every exited token are computed from its exit state and written
  into its paged-cache slots (the seed's fill), so the request's later tokens read a complete cache.

For greedy fp32 requests, tokens and exit layers equal `generate` with the same settings for each prompt alone
(`exit_policy="row"`; the batch policy groups whichever requests share a step). What this path cannot honour raises
when the manager is made (`check_paged_exits`): deferred K/V, the lean guard, compiled steps, CUDA graphs, flash
attention; nothing decodes at full depth silently. Prefix sharing of cache blocks is turned off with exits on (a
block written by exited tokens holds backfilled K/V, not the full-depth K/V a prompt must read).

One case is not told apart: a prompt whose last prefill chunk is a single token (the scheduler split the prompt one
token before its end) looks like a decode token in the packed batch, so that token may exit and its deeper K/V are
backfilled.

Part of the Hub runtime: imports only torch, transformers and its siblings.
"""

import copy
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.utils import logging

from .decode_core import (
    Decided,
    StepState,
    backfill_kv,
    decide_deepest,
    exit_at,
    first_confident_exit,
    loaded_depth,
    run_layers,
)
from .families import LayerInputs
from .request import keeps_exit_states

logger = logging.get_logger(__name__)


def is_paged(cache) -> bool:
    return isinstance(cache, PagedAttentionCache)


# ---------------------------------------------------------------------------------------------------------------------
# what continuous batching must not be asked with exits on
# ---------------------------------------------------------------------------------------------------------------------
def check_paged_exits(model, settings, generation_config, cb_config):
    """Raises what continuous batching cannot honour with exits on; returns the batching config to use (a copy with
    prefix sharing and the block-table decode path off)."""
    if settings.kv == "deferred":
        raise ValueError(
            "`exit_kv='deferred'` is not served by continuous batching: a paged-cache step writes every token's K/V "
            "before it ends. Use `exit_kv='immediate'`."
        )
    if keeps_exit_states(model, settings):
        raise ValueError(
            "The lean guard (`exit_breach_window`) is not served by continuous batching: deepening a running request "
            "needs its kept exit states. Leave the guard out, or decode with `generate`."
        )
    compiled = getattr(generation_config, "compile_config", None) is not None or any(
        getattr(cb_config, name, None) for name in ("varlen_compile_config", "decode_compile_config")
    )
    if compiled or (getattr(cb_config, "default_compile_level", 0) or 0) > 0:
        raise ValueError(
            "Compiled continuous-batching steps cannot follow early exit (the layer loop stops at data-dependent "
            "depths); leave compile settings out, or pass `early_exit=False`."
        )
    if any(cb_config.cuda_graph_booleans):
        raise ValueError(
            "CUDA graphs (`use_cuda_graph`) cannot capture early exit (the layer loop stops at data-dependent "
            "depths); pass `use_cuda_graph=False`, or `early_exit=False`."
        )
    if "flash" in str(model.config._attn_implementation):
        raise ValueError(
            f"Early exit in continuous batching runs with attention 'sdpa' or 'paged|eager', not "
            f"'{model.config._attn_implementation}': load the model with `attn_implementation='sdpa'`."
        )
    if cb_config.allow_block_sharing:
        logger.warning_once(
            "Early exit in continuous batching: prefix sharing of cache blocks is off (a block written by exited "
            "tokens holds backfilled K/V, not the full-depth K/V a prompt must read)."
        )
    if cb_config.auto_switch_to_flash and model.device.type != "cpu":
        logger.warning_once(
            "Early exit in continuous batching keeps the model's attention (no automatic switch to flash attention, "
            "whose block-table decode path the exits do not follow)."
        )
    return dataclasses.replace(
        copy.copy(cb_config),
        allow_block_sharing=False,  # see above
        max_blocks_per_request=0,  # no block-table decode path: the paged cache's index path
        auto_switch_to_flash=False,
        use_cuda_graph=False,  # not inferred on: a graph cannot capture data-dependent depths
    )


@contextmanager
def loaded_layers_config(model):
    """While continuous batching sizes its paged cache, `model.config.get_text_config()` names the loaded layers only
    (a lean model): the layers it does not load get no cache pages, so their bytes become blocks for more requests."""
    depth, config = loaded_depth(model), model.config
    if depth == config.num_hidden_layers:
        yield
        return
    view = copy.copy(config)
    if getattr(config, "layer_types", None) is not None:
        view.layer_types = list(config.layer_types[:depth])
    view.num_hidden_layers = depth
    config.get_text_config = lambda *args, **kwargs: view
    try:
        yield
    finally:
        del config.get_text_config


# ---------------------------------------------------------------------------------------------------------------------
# the packed batch
# ---------------------------------------------------------------------------------------------------------------------
def take_tokens(t, idx):
    """The packed tokens `idx` of `t` `(1, T, ...)`; tuples of tensors and None pass through."""
    if isinstance(t, tuple):
        return tuple(take_tokens(x, idx) for x in t)
    return t if t is None else t.index_select(1, idx)


@dataclass
class Packed:
    """One step's packed batch on the host: per request, its query tokens and (per layer type) the keys it reads.

    attention: the paged-attention kwargs each layer's attention receives (`cu_seq_lens_*`, `max_length_*`,
    `read_index`, `write_index`, ...); groups: the layer type of each cache group, in `read_index` / `write_index` order.
    """

    q_lens: list
    k_lens: dict
    attention: dict
    groups: list
    masks: object = None  # what continuous batching passed as `attention_mask`: None, one 4D tensor, or one per type
    starts: list = field(init=False)

    def __post_init__(self):
        self.starts = [0, *accumulate(self.q_lens)]

    @classmethod
    def read(cls, cache, attention_mask, attention: dict) -> "Packed":
        cu_q = attention["cu_seq_lens_q"].tolist()
        k_lens = {}
        for kind, cu_k in attention["cu_seq_lens_k"].items():
            cu_k = cu_k.tolist()
            k_lens[kind] = [b - a for a, b in zip(cu_k, cu_k[1:])]
        groups = [allocator.layer_type for allocator in cache.cache_allocators.values()]
        q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
        return cls(q_lens, k_lens, dict(attention), groups, attention_mask)

    def last_token(self, r: int) -> int:
        return self.starts[r + 1] - 1

    def past(self, r: int) -> int:
        """Keys request `r` reads besides its query tokens."""
        return max(lens[r] for lens in self.k_lens.values()) - self.q_lens[r]

    def token_index(self, requests, device) -> torch.Tensor:
        return torch.tensor(
            [t for r in requests for t in range(self.starts[r], self.starts[r + 1])], dtype=torch.long, device=device
        )

    def key_index(self, kind: str, requests, device) -> torch.Tensor:
        starts = [0, *accumulate(self.k_lens[kind])]
        return torch.tensor(
            [k for r in requests for k in range(starts[r], starts[r + 1])], dtype=torch.long, device=device
        )

    def keep(self, requests: list, device) -> "Packed":
        """The packed batch of `requests` only (indices into this one), in their order."""
        tokens = self.token_index(requests, device)
        keys = {kind: self.key_index(kind, requests, device) for kind in self.k_lens}
        q_lens = [self.q_lens[r] for r in requests]
        k_lens = {kind: [lens[r] for r in requests] for kind, lens in self.k_lens.items()}
        a = dict(self.attention)
        to_cu = lambda lens: torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=device)  # noqa: E731
        a["cu_seq_lens_q"] = to_cu(q_lens)
        a["max_length_q"] = max(q_lens)
        a["cu_seq_lens_k"] = {kind: to_cu(lens) for kind, lens in k_lens.items()}
        a["max_length_k"] = {kind: max(lens) for kind, lens in k_lens.items()}
        a["write_index"] = [w.index_select(0, tokens) for w in self.attention["write_index"]]
        a["read_index"] = [
            r if r.numel() == 0 else r.index_select(0, keys[kind])
            for r, kind in zip(self.attention["read_index"], self.groups)
        ]
        masks = self.masks
        if isinstance(masks, torch.Tensor):
            (kind,) = self.k_lens
            masks = masks.index_select(-2, tokens).index_select(-1, keys[kind])
        elif isinstance(masks, dict):
            masks = {kind: m.index_select(-2, tokens).index_select(-1, keys[kind]) for kind, m in masks.items()}
        return Packed(q_lens, k_lens, a, self.groups, masks)

    def layer_masks(self) -> dict:
        if isinstance(self.masks, dict):
            return self.masks
        return {"full_attention": self.masks, "sliding_attention": self.masks}

    def write_only(self, tokens: torch.Tensor) -> dict:
        """`cache.update` kwargs that write K/V of packed tokens `tokens` into their slots and read nothing back."""
        empty = self.attention["write_index"][0][:0]
        return {
            "cu_seq_lens_k": {kind: empty for kind in self.k_lens},
            "max_length_k": {kind: 0 for kind in self.k_lens},
            "read_index": [empty for _ in self.groups],
            "write_index": [w.index_select(0, tokens) for w in self.attention["write_index"]],
        }


# ---------------------------------------------------------------------------------------------------------------------
# one step
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class PagedTrace:
    """What continuous batching decided while `record_paged_exits(model)` was active: one record per token that got
    a new token, `(step, position, input token, exit layer)`; a prompt's last token is one too (its exit picked the
    request's first new token)."""

    records: list = field(default_factory=list)
    steps: int = 0

    def add(self, input_ids, position_ids, logits_indices, exit_layers):
        positions, tokens = position_ids[0, logits_indices].tolist(), input_ids[0, logits_indices].tolist()
        decided = zip(positions, tokens, exit_layers.tolist())
        self.records += [(self.steps, p, t, e) for p, t, e in decided if e >= 0]  # -1: a padding slot
        self.steps += 1


@contextmanager
def record_paged_exits(model):
    """`with record_paged_exits(model) as trace:` records the exit of every token continuous batching decides."""
    model._paged_trace = trace = PagedTrace()
    try:
        yield trace
    finally:
        model._paged_trace = None


class _Live:
    """The requests still in one step's packed batch: their ids (in packing order), their `Packed` batch, the packed
    positions of their tokens in the step's row, and their residual stream h `(1, T', D)`."""

    def __init__(self, model, batch, h, position_ids):
        self.requests, self.batch, self.h = list(range(len(batch.q_lens))), batch, h
        self.tokens = torch.arange(h.shape[1], device=h.device)
        self.positions, self.position_ids = model.family.positions(model, h, position_ids), position_ids

    def inputs(self) -> LayerInputs:
        return LayerInputs(
            self.batch.layer_masks(),
            {k: take_tokens(v, self.tokens) for k, v in self.positions.items()},
            self.position_ids.index_select(1, self.tokens),
            attention=self.batch.attention,
        )

    def last_tokens(self, requests) -> torch.Tensor:
        """The positions in h of the last token of each of `requests`."""
        local = {r: k for k, r in enumerate(self.requests)}
        return torch.tensor([self.batch.last_token(local[r]) for r in requests], device=self.h.device)

    def drop(self, gone: set) -> bool:
        """The requests `gone` leave the packed batch; returns whether any request is left."""
        stay = [k for k, r in enumerate(self.requests) if r not in gone]
        self.requests = [self.requests[k] for k in stay]
        if self.requests:
            index = self.batch.token_index(stay, self.h.device)
            self.h, self.tokens = self.h.index_select(1, index), self.tokens.index_select(0, index)
            self.batch = self.batch.keep(stay, self.h.device)
        return bool(self.requests)


def paged_step(model, settings, input_ids, position_ids, attention_mask, cache, logits_indices, attention):
    """One continuous-batching step with exits: logits `(1, n, V)` at `logits_indices` (the last token of each request
    that gets a new token), each from the head that decided it. The packed batch runs from one checked exit to the next
    (`run_layers`); at each, the decode tokens are checked (`exit_at`) and those that exit fill their skipped layers'
    K/V and leave the batch, while the prompts' last tokens keep their states, decided after the last layer."""
    if attention.get("block_table") is not None:
        raise ValueError("Early exit in continuous batching needs the paged cache's index path, not a block table.")
    depth, device = loaded_depth(model), input_ids.device
    batch = Packed.read(cache, attention_mask, attention)
    slot, wanted = _slots(batch, logits_indices.tolist())
    decoding = [s is not None and batch.q_lens[r] == 1 and batch.past(r) > 0 for r, s in enumerate(slot)]
    prompt_ends = [r for r, s in enumerate(slot) if s is not None and not decoding[r]]
    live = _Live(model, batch, model.family.embed(model, input_ids, position_ids), position_ids)  # h: (1, T, D)
    running = [r for r in live.requests if decoding[r]]  # decode requests not decided yet
    row_of = {r: i for i, r in enumerate(running)}  # decode request -> its row in the step state
    state, decided = StepState(settings, len(running), device, None), Decided(wanted)
    at_exit = {}  # exit layer -> (states leaving it, states entering it) of the prompts' last tokens
    left, start, inputs = (None, None), 0, live.inputs()
    for j in [c for c in settings.check_layers if c < depth]:
        live.h, _, states = run_layers(model, live.h, inputs, cache, start, j + 1, keep=(j,), label="ee::layer")
        start, h_in = j + 1, states[j][1]
        if prompt_ends:
            ends = live.last_tokens(prompt_ends)
            at_exit[j] = (live.h[0].index_select(0, ends), h_in[0].index_select(0, ends))
        if not running:
            continue
        at, rows = live.last_tokens(running), torch.tensor([row_of[r] for r in running], device=device)
        slots = torch.tensor([slot[r] for r in running], device=device)
        h_out = live.h[0].index_select(0, at)
        exited, kept, left = exit_at(
            model, settings, j, h_out, h_in[0].index_select(0, at), rows, state, depth, decided, slots
        )
        if kept is None:
            continue
        _fill_skipped(
            model, live.batch, cache, j + 1, depth, h_out.index_select(0, exited), at.index_select(0, exited), inputs
        )
        gone, running = {running[i] for i in exited.tolist()}, [running[i] for i in kept.tolist()]
        if not live.drop(gone):
            break
        inputs = live.inputs()
    if live.requests:
        live.h = run_layers(model, live.h, inputs, cache, start, depth, label="ee::layer").h
    if running:
        slots = torch.tensor([slot[r] for r in running], device=device)
        decide_deepest(model, decided, depth, live.h[0].index_select(0, live.last_tokens(running)), slots, left)
    if prompt_ends:
        last = live.h[0].index_select(0, live.last_tokens(prompt_ends))
        _decide_prompt_ends(model, settings, decided, at_exit, last, [slot[r] for r in prompt_ends], depth)
    if not decided.groups:  # prompt chunks only: no token gets a new token this step
        return live.h.new_zeros(1, wanted, model.config.vocab_size), torch.zeros(0, dtype=torch.long, device=device)
    logits, exit_layers, _ = decided.finish(model)
    return logits.unsqueeze(0), exit_layers


def _slots(batch, logits_indices):
    """Each request's slot in `logits_indices` (None: no new token this step), and the number of slots. Continuous
    batching lists the last token of each request that gets a new token, in packing order, then pads with zeros."""
    slot, k = [None] * len(batch.q_lens), 0
    for r in range(len(batch.q_lens)):
        if k < len(logits_indices) and logits_indices[k] == batch.last_token(r):
            slot[r], k = k, k + 1
    return slot, len(logits_indices)


def _fill_skipped(model, batch, cache, first, depth, states, at, inputs):
    """The seed's fill: K/V of layers `first..depth-1` for exited tokens (packed positions `at` in the live batch),
    from their exit states `(n, D)`, written into their paged-cache slots."""
    if first >= depth:
        return
    sub = dataclasses.replace(
        inputs, positions={k: take_tokens(v, at) for k, v in inputs.positions.items()}, position_ids=None, attention={}
    )
    slots = batch.write_only(at)  # the same cache slots at every skipped layer
    for layer_idx in range(first, depth):
        key, value = backfill_kv(model, layer_idx, states.unsqueeze(0), sub)
        cache.update(key, value, layer_idx, kwargs=dict(slots))  # update rewrites its kwargs: a copy per layer


def _decide_prompt_ends(model, settings, decided, at_exit, last, slots, depth):
    """The first token of each request whose prompt ended this step: the first checked exit whose criterion holds at
    the prompt's last token, else the deepest loaded layer (`first_confident_exit`, as `prefill` does, one request at
    a time)."""
    row_settings = dataclasses.replace(settings, policy="row")
    state = StepState(row_settings, len(slots), last.device, None)
    slots = torch.tensor(slots, device=last.device)
    first_confident_exit(model, row_settings, at_exit, state, depth, decided, last, slots)
