"""Lossless drafts verified inside transformers' continuous batching (`generate_batch`, `init_continuous_batching`,
`transformers serve --continuous-batching`): turned on by `prompt_lookup_num_tokens` (K, the most drafts a request
adds to a step) in the passed generation config or the model's stored one, `max_matching_ngram_size` as in
transformers; ours as in `generate`: `speculative_table_drafts`, `speculative_history_tokens`, `speculative_gate`.

A continuous-batching step packs every scheduled request's query tokens into one row: prefill chunks, and one token per
decoding request. Here a decoding request may carry its next input token plus k drafts (copied by the model's
`drafter`, drafts.py, from the request's own prompt and output, the history of earlier generations, the other
requests' texts so far, or the stored table), packed into the same forward as the other requests' tokens and prefill chunks:

    prepare   the scheduler has picked the step's requests and their cache blocks; each decoding request asks the
              drafter for a chain (tokens, and the estimated probability that drafts 0..i are all accepted), and
              `plan_packed` chooses k per request (below); the request's query becomes [last token, d_1 .. d_k], its
              cache grows by k slots (`can_store_request_tokens`; no room, no drafts) and transformers builds the
              packed batch as usual (positions, causal mask, read / write indices)
    forward   the model's logits at the k + 1 positions of each drafting request (one at the others), after the
              logits processors (each row gets its request's arguments)
    verify    greedy: the longest prefix of drafts equal to the argmax, plus the argmax after it; sampling (point-mass
              drafts): d_i is kept with probability p_i(d_i), at the first rejection the token is drawn from p_i with
              d_i removed, renormalised; after k kept drafts, from p_k. Both give the model's own distribution
    commit    tokens go to the request one by one through transformers' own `update_and_check_completion`, so EOS and
              `max_new_tokens` inside an accepted run stop it exactly there (nothing past is kept or streamed)
    rollback  a request that kept n < k drafts wrote K/V for k - n rejected positions: its `position_offset` (the
              length the next step writes at and reads up to) goes back by k - n and the blocks past the kept length
              return to the pool (`give_back_blocks`). A later token writes those slots before any read covers
              them, so nothing reads a rejected draft's K/V. A sliding-window layer's pages are a ring buffer
              (position p in slot p mod W): a draft's slot held K/V of position p - W, still inside the window of
              the next tokens, so those slots are saved before the forward and a rejected draft's slot is restored
              after it (`RingSlots`); drafts per request stay below W, so no draft pushes a kept token out of the
              ring

The draft budget follows the load. Each step times its forward and feeds `drafter.costs` with (packed tokens,
seconds), so `cost(T)` is the measured step time at T packed tokens on this machine. With base B tokens (prefill chunks
and decode tokens) and request r's chain probabilities P_r(1) >= P_r(2) >= ..., `plan_packed` picks

    k_r = argmax over (k_1, k_2, ...) of  (m + sum_r sum_{i <= k_r} P_r(i)) / cost(B + sum_r k_r)

for the m requests that get a token this step (every decode, with or without a chain, and each prompt that ends);
all zero unless drafting beats the plain step by `drafts.MARGIN` (then the step is exactly a plain step of
transformers). A wide step of decodes already costs close to linear in T, so a draft must be accepted with
probability near 1 to pay there: at saturation drafting shrinks toward none; a narrow step costs about the same at T
and T + k, so every likely draft goes in.

Where transformers has no public seam (the manager samples itself, one token per decoding request), three methods of
the batch processor it builds are wrapped per instance, read in transformers 5.19 to 5.24, where they are the same
(`check_batching_internals` raises, in one line, on a release that lacks them): the IO buffers'
`prepare_batch_tensors` (adds the drafts), `_generation_step` (forward, verify), `update_batch` (commit the first
token through transformers' own update, then the rest, then rollback). A step without
drafts runs transformers' own methods unchanged. With drafts on, prefix sharing of blocks, async batching, CUDA graphs
and the decode fast path are off; confident exits are not used (drafts decide at full depth).

Part of the Hub runtime: imports only torch, transformers and its siblings.
"""

import copy
import dataclasses
import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
from transformers.generation.continuous_batching.cache_allocators import (
    FullAttentionCacheAllocator,
    SlidingAttentionCacheAllocator,
)
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.utils import logging

from .compat import require_transformers
from .drafts import MAX_MATCH, SuffixIndex, peers_of, plan_packed
from .request import PagedDraftSettings

logger = logging.get_logger(__name__)

DRAFT_FIELD = "prompt_lookup_num_tokens"  # transformers' field: the most drafts per request and step


def check_paged_drafts(model, generation_config, cb_config):
    """Raises what continuous batching cannot honour with drafts on; returns the batching config to use (a copy with
    prefix sharing, async batching, CUDA graphs and the block-table decode path off)."""
    check_batching_internals()
    layers, max_layer = model.config.num_hidden_layers, getattr(model, "exit_max_layer", None)
    if max_layer is not None and max_layer < layers - 1:
        raise ValueError(
            f"`{DRAFT_FIELD}` verifies drafts with every layer, but this model holds decoder layers 0..{max_layer} "
            f"only; load them with `model.set_exit_max_layer({layers - 1})` first, or pass `{DRAFT_FIELD}=None`."
        )
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    if "sliding_attention" in group_layers_by_attn_type(model.config.get_text_config()) and (window or 0) < 2:
        raise ValueError(
            f"`{DRAFT_FIELD}` in continuous batching needs a sliding window of at least 2 positions (a request's "
            f"drafts stay below it), got `sliding_window={window}`; pass `{DRAFT_FIELD}=None`."
        )
    compiled = getattr(generation_config, "compile_config", None) is not None or any(
        getattr(cb_config, name, None) for name in ("varlen_compile_config", "decode_compile_config")
    )
    if compiled or (getattr(cb_config, "default_compile_level", 0) or 0) > 0:
        raise ValueError(
            f"Compiled continuous-batching steps cannot verify drafts (the query length of a request changes every "
            f"step); leave compile settings out, or pass `{DRAFT_FIELD}=None`."
        )
    if any(cb_config.cuda_graph_booleans):
        raise ValueError(
            f"CUDA graphs (`use_cuda_graph`) cannot capture draft verification; pass `use_cuda_graph=False`, or "
            f"`{DRAFT_FIELD}=None`."
        )
    if cb_config.use_async_batching:
        raise ValueError(
            f"Async batching (`use_async_batching=True`) schedules a step before the last one's tokens are known, "
            f"which drafts need; pass `use_async_batching=False`, or `{DRAFT_FIELD}=None`."
        )
    if cb_config.allow_block_sharing:
        logger.warning_once(
            "Drafts in continuous batching: prefix sharing of cache blocks is off (a block may hold a rejected "
            "draft's K/V until it is rolled back)."
        )
    return dataclasses.replace(
        copy.copy(cb_config),
        allow_block_sharing=False,
        max_blocks_per_request=0,  # the decode fast path takes one token per request
        use_async_batching=False,
        use_cuda_graph=False,
    )


# ---------------------------------------------------------------------------------------------------------------------
# the transformers internals this module wraps (the same in 5.19 to 5.24)
# ---------------------------------------------------------------------------------------------------------------------
def check_batching_internals() -> None:
    """Raises `ImportError` (one line) when the installed transformers does not have the continuous-batching internals
    the paged drafts wrap; `check_paged_drafts` calls it when drafts are turned on."""
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import BlockLedger
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    from transformers.generation.continuous_batching.requests import FutureRequestState, RequestState

    wanted = {
        ContinuousBatchProcessor: ("_generation_step", "update_batch", "prepare_next_batch"),
        ContinuousBatchingIOs: ("prepare_batch_tensors", "prepare_batch_update", "get_model_kwargs"),
        RequestState: ("update_and_check_completion", "to_generation_output", "generated_len"),
        BlockLedger: ("release",),
        FullAttentionCacheAllocator: ("_compute_blocks_needed", "get_write_indices", "register_cache_tensor"),
        SlidingAttentionCacheAllocator: ("_compute_blocks_needed", "get_write_indices", "register_cache_tensor"),
    }
    missing = [f"{cls.__name__}.{name}" for cls, names in wanted.items() for name in names if not hasattr(cls, name)]
    fields = {f.name for f in dataclasses.fields(RequestState)}
    missing += [f"RequestState.{n}" for n in ("position_offset", "tokens_to_process") if n not in fields]
    missing += [
        f"FutureRequestState.{n}" for n in ("query_length", "has_new_token") if n not in FutureRequestState.__slots__
    ]
    wrapped = {  # the methods replaced per instance, called with these arguments
        (ContinuousBatchingIOs, "prepare_batch_tensors"): (
            "requests_in_batch",
            "logits_processors",
            "use_decode_fast_path",
            "num_q_tokens",
            "max_kv_read",
            "use_padding",
        ),
        (ContinuousBatchProcessor, "_generation_step"): ("model",),
        (ContinuousBatchProcessor, "update_batch"): (),
    }
    for (cls, name), arguments in wrapped.items():
        method = getattr(cls, name, None)
        if method is not None and tuple(inspect.signature(method).parameters)[1:] != arguments:
            missing.append(f"{cls.__name__}.{name}({', '.join(arguments)})")
    require_transformers(f"Drafts in continuous batching (`{DRAFT_FIELD}`)", missing)


def give_back_blocks(cache, request_id: str, length: int) -> int:
    """Shrinks a request's block tables to `length` tokens and returns the blocks past it to the pool (as
    `CacheAllocator.free_blocks` does for a whole request); returns the number of blocks released."""
    released = 0
    for allocator in cache.cache_allocators.values():
        table = allocator.block_table.get(request_id)
        if table is None:
            continue
        keep = allocator._compute_blocks_needed(0, length, 0)  # the blocks `length` tokens need (a ring: <= W)
        extra, table[keep:] = table[keep:], []
        freed = [block for block in extra if allocator.ledger.release(block)]
        allocator.pool.free_blocks(allocator.index, freed)
        released += len(extra)
    return released


class RingSlots:
    """The sliding-window layers' ring slots one request's drafts write (positions `first .. first + k - 1`), saved
    before the forward: `restore(n)` writes back the slots of the drafts after the first n (the rejected ones)."""

    def __init__(self, cache, request_id: str, first: int, k: int):
        self.saved = []  # (keys view, values view, slots (k,), saved keys (k, H, D), saved values)
        for allocator in cache.cache_allocators.values():
            if isinstance(allocator, SlidingAttentionCacheAllocator):
                slots = allocator.get_write_indices(request_id, first, k)
                for layer in allocator.layer_indices:
                    keys, values = allocator._kv_token_views[layer]
                    index = torch.tensor(slots, dtype=torch.long, device=keys.device)
                    self.saved.append((keys, values, index, keys.index_select(0, index), values.index_select(0, index)))

    def restore(self, n: int) -> None:
        for keys, values, index, old_keys, old_values in self.saved:
            keys.index_copy_(0, index[n:], old_keys[n:])
            values.index_copy_(0, index[n:], old_values[n:])


# ---------------------------------------------------------------------------------------------------------------------
# verification
# ---------------------------------------------------------------------------------------------------------------------
def accept_prefix(target: list[int], drafts: list[int]) -> list[int]:
    """target: the argmax at the input token and at each of the k drafts (k + 1 entries); returns the longest prefix
    of drafts equal to the argmax, plus the argmax after it."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return drafts[:n] + [target[n]]


def accept_point_mass(probs: torch.Tensor, drafts: list[int]) -> list[int]:
    """Speculative sampling with point-mass drafts. probs `(k + 1, V)`: the model's distributions at the input token
    and each draft. d_i is kept with probability p_i(d_i); at the first rejection the token is drawn from p_i with d_i
    removed, renormalised (max(p - q, 0) for q the point mass at d_i); after k kept drafts it is drawn from p_k."""
    k = len(drafts)
    n = 0
    if k:
        d = torch.tensor(drafts, device=probs.device)
        kept = torch.rand(k, device=probs.device) < probs[:k].gather(1, d[:, None])[:, 0]
        rejected = (~kept).nonzero()
        n = int(rejected[0, 0]) if len(rejected) else k
    p = probs[n]
    if n < k:
        p = p.clone()
        p[drafts[n]] = 0.0
    return drafts[:n] + [int(torch.multinomial(p / p.sum(), 1))]


# ---------------------------------------------------------------------------------------------------------------------
# counters
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class DraftTrace:
    """What the paged drafts did while `record_paged_drafts(model)` was active: per request id `[drafted, accepted]`
    tokens, and per step with drafts `(packed tokens, drafted, accepted, seconds)`."""

    requests: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)

    @property
    def drafted(self) -> int:
        return sum(d for d, _ in self.requests.values())

    @property
    def accepted(self) -> int:
        return sum(a for _, a in self.requests.values())


@contextmanager
def record_paged_drafts(model):
    """`with record_paged_drafts(model) as trace:` counts drafted and accepted tokens per request."""
    model._paged_draft_trace = trace = DraftTrace()
    try:
        yield trace
    finally:
        model._paged_draft_trace = None


# ---------------------------------------------------------------------------------------------------------------------
# the batch processor's wrapped steps
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class _Drafted:
    """One request of the current step that carries drafts."""

    chain: object
    k: int
    ring: RingSlots | None = None
    tokens: list = field(default_factory=list)  # committed by verification: accepted drafts + the model's token
    logprobs: list = field(default_factory=list)


class PagedDrafts:
    """The drafts of one batch processor: built by `attach_paged_drafts` (`manager.batch_processor._paged_drafts`),
    it wraps three of the processor's methods. `counts`: [drafted, accepted] tokens per running request; `totals`: of
    every request so far (each finished request's counts are also logged at INFO level)."""

    def __init__(self, model, settings: PagedDraftSettings, processor):
        self.model, self.settings, self.processor = model, settings, processor
        self.drafter = drafter = model.drafter  # one per model and process: history, acceptance, step costs
        if settings.table:
            drafter.use_table(model.draft_table_keys, model.draft_table_next, model.config.vocab_size)
        if settings.history:
            drafter.history.resize(settings.history)
        self.contexts = {}  # request id -> (its RequestState, its SuffixIndex, tokens indexed)
        allocators = processor.cache.cache_allocators.values()
        windows = [a.sliding_window for a in allocators if isinstance(a, SlidingAttentionCacheAllocator)]
        self.max_drafts = min([settings.max_drafts, *(w - 1 for w in windows)])  # a query fits in the ring
        self.step = {}  # request id -> _Drafted, for the current step (empty: a plain step)
        self.packed = (0, 0, 0)  # the current step's (tokens, logits rows, keys read)
        self.counts = {}  # request id -> [drafted, accepted] tokens, while it runs
        self.totals = [0, 0]  # [drafted, accepted] tokens of every request so far
        io = processor.inputs_and_outputs
        self._prepare, self._generate, self._update = (
            io.prepare_batch_tensors,
            processor._generation_step,
            processor.update_batch,
        )
        io.prepare_batch_tensors, processor._generation_step = self.prepare_batch_tensors, self.generation_step
        processor.update_batch = self.update_batch

    def cost(self, tokens: int, rows: int, keys: int, drafted: bool) -> float:
        """Seconds of a step of `tokens` packed tokens, `rows` of them with logits, its attention reading `keys`, that
        verifies drafts or not (`drafted`)."""
        return self.drafter.packed.cost(tokens, rows, keys, drafted)

    # prepare ---------------------------------------------------------------------------------------------------------
    def _context(self, state) -> SuffixIndex:
        entry = self.contexts.get(state.request_id)
        if entry is None or entry[0] is not state:  # new, or soft-reset by the offloading manager
            entry = (state, SuffixIndex(ngram_size=self.settings.ngram_size), 0)
        state_, index, seen = entry
        prompt, generated = state.initial_tokens, state.generated_tokens
        if seen < len(prompt):
            index.extend(prompt[seen:])
        index.extend(generated[max(seen - len(prompt), 0) :])
        self.contexts[state.request_id] = (state_, index, len(prompt) + len(generated))
        return index

    def _room(self, state) -> int:
        """The most drafts worth verifying for `state`: K, and fewer than the new tokens it may still add (a step adds
        its accepted drafts plus one token)."""
        if state.max_new_tokens is None:
            return self.max_drafts
        return min(self.max_drafts, state.max_new_tokens - state.generated_len() - 1)

    def _chains(self, requests_in_batch):
        """Each request of this step that gets a new token, with its chain (None: no drafts; at most K drafts, and
        fewer than the tokens it may still add)."""
        s, rooms = self.settings, {}
        for fs in requests_in_batch:
            state = fs.state
            decoding = fs.query_length == 1 and state.generated_len() > 0 and state.status == RequestStatus.DECODING
            room = self._room(state) if fs.has_new_token and decoding else 0
            if room > 0:
                rooms[state.request_id] = room
                self._context(state)
        row = {request_id: i for i, request_id in enumerate(self.contexts)}  # every request's text so far: the peers
        texts = [entry[1] for entry in self.contexts.values()]
        out = []
        for fs in requests_in_batch:
            if not fs.has_new_token:
                continue
            chain, room = None, rooms.get(fs.state.request_id, 0)
            if room > 0:
                r = row[fs.state.request_id]
                chain = self.drafter.propose(
                    texts[r], texts[r].tail(MAX_MATCH), room, s.history > 0, s.table, peers_of(texts, r)
                )
            out.append((fs, chain if chain is not None and chain.tokens else None))
        return out

    def prepare_batch_tensors(
        self, requests_in_batch, logits_processors, use_decode_fast_path, num_q_tokens, max_kv_read, use_padding
    ):
        self._forget_gone()
        self.step = {}
        chains = self._chains(requests_in_batch)
        rows = len(chains)  # the requests that get a new token: a logits row each
        keys = max_kv_read + num_q_tokens  # what attention reads: the cache the scheduler counted, and the step
        if any(chain is not None for _, chain in chains):
            if self.settings.gate:  # every request with a new token produces one: those without a chain too

                def cost(tokens):  # each draft is a token, a logits row and a key more
                    n = tokens - num_q_tokens
                    return self.cost(tokens, rows + n, keys + n, n > 0)

                ks = plan_packed([list(c.probs) if c is not None else [] for _, c in chains], num_q_tokens, cost)
            else:
                ks = [len(c.tokens) if c is not None else 0 for _, c in chains]
            budget = self.processor.max_batch_tokens - num_q_tokens  # the static inputs hold this many tokens
            for (fs, chain), k in zip(chains, ks):
                k = min(int(k), budget, len(chain.tokens)) if chain is not None else 0
                if k <= 0 or not self.processor.cache.can_store_request_tokens(fs.state, 1 + k):
                    continue
                fs.state.tokens_to_process = fs.state.tokens_to_process + list(chain.tokens[:k])
                fs.query_length, budget = 1 + k, budget - k
                self.step[fs.state.request_id] = _Drafted(chain, k)
        added = sum(d.k for d in self.step.values())
        self.packed = (num_q_tokens + added, rows + added, keys + added)  # what the step costs are fitted on
        self._prepare(
            requests_in_batch,
            logits_processors,
            use_decode_fast_path and not added,
            num_q_tokens + added,
            max_kv_read,
            use_padding,
        )

    def _forget_gone(self):
        active = self.processor.scheduler.active_requests
        for request_id in [r for r in self.contexts if r not in active]:  # cancelled
            self.contexts.pop(request_id)
            self.counts.pop(request_id, None)

    # forward and verify ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generation_step(self, model):
        if not self.step:
            start = time.perf_counter()
            self._generate(model)
            self.drafter.packed.observe(*self.packed, time.perf_counter() - start)
            return
        processor = self.processor
        io = processor.inputs_and_outputs
        requests = [fs for fs in io.requests_in_batch if fs.has_new_token]
        counts, rows, end = [], [], 0
        for fs in io.requests_in_batch:
            end += fs.query_length
            if fs.has_new_token:
                drafted = self.step.get(fs.state.request_id)
                counts.append(1 + (drafted.k if drafted else 0))
                rows.extend(range(end - counts[-1], end))
        start = time.perf_counter()
        for fs in requests:  # the ring slots the drafts overwrite (sliding-window layers)
            drafted = self.step.get(fs.state.request_id)
            if drafted is not None:
                first = fs.state.position_offset - drafted.k  # prepare moved it past the step's tokens
                drafted.ring = RingSlots(processor.cache, fs.state.request_id, first, drafted.k)
        batch = io.get_model_kwargs(use_padding=False)
        index = torch.tensor(rows, dtype=torch.long, device=batch["input_ids"].device)
        batch["logits_indices"] = index
        if processor.model_runner.supports_logits_to_keep(model):
            batch["logits_to_keep"] = index
        logits = model(**batch).logits
        if "logits_to_keep" not in batch:
            logits = logits[:, index]
        scores = logits[0].float()  # (rows, V)
        if processor.logit_processor.do_processing:  # each row with its request's arguments
            repeats = torch.tensor(counts, device=scores.device)
            args = batch["logits_processor_args"][:, : len(counts)].repeat_interleave(repeats, dim=1)
            scores = processor.logit_processor(batch["input_ids"][0, index], scores, args)
        self._verify(requests, counts, scores)
        for drafted in self.step.values():
            drafted.ring.restore(len(drafted.tokens) - 1)
        seconds = time.perf_counter() - start
        self.drafter.packed.observe(*self.packed, seconds, drafted=True)
        trace = getattr(self.model, "_paged_draft_trace", None)
        if trace is not None:
            drafted = sum(d.k for d in self.step.values())
            accepted = sum(len(d.tokens) - 1 for d in self.step.values())
            trace.steps.append((self.packed[0], drafted, accepted, seconds))

    def _verify(self, requests, counts, scores):
        """Each request's committed tokens from its rows of `scores`; the first goes into the output ids transformers'
        own `update_batch` reads, the drafting requests keep theirs in `self.step`."""
        sampling, logprobs = self.processor.do_sample, self.processor.return_logprobs
        probs = scores.softmax(-1) if sampling or logprobs else None
        target = None if sampling else scores.argmax(-1).tolist()
        firsts, first_logprobs, row = [], [], 0
        for fs, count in zip(requests, counts):
            drafted = self.step.get(fs.state.request_id)
            drafts = list(drafted.chain.tokens[: drafted.k]) if drafted else []
            if sampling:
                tokens = accept_point_mass(probs[row : row + count], drafts)
            else:
                tokens = accept_prefix(target[row : row + count], drafts)
            lps = [float(probs[row + i, t].log()) for i, t in enumerate(tokens)] if logprobs else []
            if drafted:
                drafted.tokens, drafted.logprobs = tokens, lps
            firsts.append(tokens[0])
            first_logprobs += lps[:1]
            row += count
        output_ids = self.processor.inputs_and_outputs.output_ids
        output_ids[0, : len(firsts)] = torch.tensor(firsts, dtype=output_ids.dtype)
        if logprobs:
            output_ids[1, : len(firsts)] = torch.tensor(first_logprobs, dtype=torch.float32).view(torch.int32)

    # commit and rollback ---------------------------------------------------------------------------------------------
    def update_batch(self):
        """transformers' own update commits each request's first token (EOS, max length, streaming, forks); then the
        drafting requests commit the rest of their tokens one by one, and give back the K/V slots they rejected."""
        requests = [fs for fs in self.processor.inputs_and_outputs.requests_in_batch if fs.has_new_token]
        self._update()
        processor, pending = self.processor, []
        trace = getattr(self.model, "_paged_draft_trace", None)
        for fs in requests:
            state = fs.state
            drafted = self.step.get(state.request_id)
            if drafted is not None:
                accepted = len(drafted.tokens) - 1
                self.drafter.observe(drafted.chain, accepted, drafted=drafted.k)
                for counts in (
                    self.counts.setdefault(state.request_id, [0, 0]),
                    self.totals,
                    *([trace.requests.setdefault(state.request_id, [0, 0])] if trace is not None else []),
                ):
                    counts[0], counts[1] = counts[0] + drafted.k, counts[1] + accepted
                if state.status != RequestStatus.FINISHED:
                    finished = False
                    rest = zip(drafted.tokens[1:], drafted.logprobs[1:] or [None] * accepted)
                    for token, logprob in rest:
                        if state.update_and_check_completion(token, logprob):
                            finished = True
                            break
                    if finished:
                        processor.scheduler.finish_request(state.request_id)
                        processor.scheduler.block_new_requests = False
                    else:
                        state.position_offset -= drafted.k - accepted
                        give_back_blocks(processor.cache, state.request_id, state.position_offset)
                    if accepted and (state.streaming or finished):
                        pending.append(state.to_generation_output())
            if state.status == RequestStatus.FINISHED:
                self.contexts.pop(state.request_id, None)
                drafts, kept = self.counts.pop(state.request_id, (0, 0))
                logger.info(f"Request {state.request_id}: {drafts} drafted tokens, {kept} accepted.")
                if self.settings.history:  # its tokens enter the drafter's history
                    self.drafter.finish(state.to_generation_output().generated_tokens)
        self.step = {}
        if pending:
            processor.output_router.deliver_batch(pending)


def attach_paged_drafts(model, manager, settings: PagedDraftSettings) -> None:
    """Every batch processor `manager` builds verifies drafts (`PagedDrafts`)."""
    create = manager._create_batch_processor

    def create_with_drafts():
        processor = create()
        if getattr(processor, "_paged_drafts", None) is None:
            processor._paged_drafts = PagedDrafts(model, settings, processor)
        return processor

    manager._create_batch_processor = create_with_drafts
    manager.paged_draft_settings = settings
