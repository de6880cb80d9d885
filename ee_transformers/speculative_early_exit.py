"""Lossless self-speculative decoding from an exit head, at any batch size.

    out = model.generate(ids, attention_mask=mask, max_new_tokens=128,
                         assistant_early_exit=16,             # the first 16 decoder layers draft (exit after layer 15)
                         num_assistant_tokens=4,              # at most 4 drafts per round
                         assistant_confidence_threshold=0.4,  # stop drafting once no row's draft head is sure
                         return_dict_in_generate=True)
    out.sequences          # greedy: token for token the full model's own greedy generation
    out.acceptance_rate    # (batch,) share of each row's drafts that the full model accepted

Context drafts (prompt lookup), alone or with the exit head's, in the same engine:

    out = model.generate(ids, attention_mask=mask, max_new_tokens=128,
                         prompt_lookup_num_tokens=2,          # at most 2 drafts copied from the row's own text
                         max_matching_ngram_size=3)           # the n-gram matched (largest first)

Two settings of ours (`OUR_FIELDS`, generate arguments or stored in `generation_config.json`): `assistant_vocab_size=n`,
the exit head drafts from the n most frequent tokens the model stores (`set_draft_vocab`; `draft_vocab_head`, about
n / V of the full head's cost); `speculative_verify_width=w`, a context round that verifies drafts feeds at least w
positions per row (fillers after the drafts, never accepted), for CPUs whose kernels are slower at 2-3 rows than at 8.
A third, `speculative_table_drafts=True`: a row whose own text offers no match drafts from the table of frequent
continuations the model stores (`set_draft_table`, draft_table.py), verified like every copied draft. Copied drafts
also come from the history of earlier generations and the other rows' texts so far (`speculative_history_tokens`, the
history's budget; 0: both off), and a gate decodes plainly where a wider round would not pay (`speculative_gate`;
drafts.py: which drafts a row gets and whether a round pays, the same heart continuous batching calls).

`assistant_early_exit`, `num_assistant_tokens`, `num_assistant_tokens_schedule` and `assistant_confidence_threshold` are
transformers' GenerationConfig fields, with transformers' meaning and defaults (20 drafts, "constant", 0.4); stored in
`model.generation_config` they are the model's defaults. `EarlyExitMixin.generate` hands `speculative_generate` to
transformers' `generate` as `custom_generate`; it runs on the generate-loop skeleton every mode shares
(`decode_loop.DecodeLoop`: EOS / pad handling, the max length, the draw, per-row score records, the streamer, the
output), its own step being a prefill at full depth (`prefill_full_depth`), then rounds. Below, E is the 0-based
exit layer (`assistant_early_exit - 1`, one of `config.exit_layers`), L the number of decoder layers, k the number of
drafts of a round.

One round, all rows at once (context drafts: `copied_drafts` copies each row's drafts from the tokens that followed
an earlier occurrence of its last tokens, in its own text, earlier generations or the stored table, and the gate
decides how many positions the round verifies, 0 drafts being a plain step; when no active row needs the exit head,
the round feeds every row's last token and drafts, fillers after a row's own, through ALL layers in one forward, and
`verify` starts at layer 0):

    draft_step  the row's last token, then each draft, runs layers 0..E once: its K/V there are written for good and
                the residual leaving E is kept; exit head E proposes the next token (`draft_head`). Drafting stops
                after k <= K drafts: when no row is still confident (max_prob of its draft, or the learned confidence
                head when the model has one, below the threshold) or the token budget is spent
    verify      ONE forward of the k+1 fed tokens through layers E+1..L-1 only, from the kept states (layers <= E
                never run twice for a token), then the final head: the full model's logits at every fed position
    accept_*    greedy: the longest prefix of drafts equal to the full model's argmax, plus the full model's own token
                after it; sampling: speculative sampling (a draft d is kept with probability min(1, p(d) / q(d)); at
                the first rejection the token is drawn from max(p - q, 0), normalised), so the tokens are distributed
                exactly as the full model's
    RaggedBatch each row commits its own number of tokens (1..k+1); stopping criteria and logits processors see each
                row's own prefix, exactly as in plain generate; the cache keeps the accepted slots only

Ragged rows and rejected K/V. Every row writes a fed token to the same cache slot (transformers' cache layers have one
write pointer), so a round appends k+1 slots to every layer. Row r keeps the first n_r of them: its last token and its
accepted drafts. Slots that no row kept are cropped off every layer (`Cache.crop`: at batch 1 that is all of them, and
the cache is exactly plain generate's). Slots that some rows kept are gaps in the other rows: `RaggedBatch.slots`, a
per-row mask over the cache slots, is the 2D attention mask of every later forward, and each row's position ids count
its own kept slots only, so a gap is invisible to attention and to RoPE. Gaps cost attention width only; when the
removable columns exceed a quarter of the cache, or a static cache would overflow, `RaggedBatch.compact` moves each
row's kept slots to the right end in order (the usual left-padded layout) and drops the dead columns. A sliding-window
layer counts its window in slots, so it is treated like a static cache of `window - 1` slots (compaction keeps every
slot inside the window; generations longer than the window are refused). The ragged batch, the rows' texts and the
rounds' tallies live in `speculative_batch.py` (importable from here as before).

Part of the Hub runtime: imports only torch, transformers and its siblings.
"""

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function
from transformers.utils import logging

from .compat import CACHE, crop_hint
from .decode_core import deprecated_aliases, run_layers
from .decode_loop import DecodeLoop, GenerateEarlyExitOutput, require_cache
from .drafts import pace_setters, plan_padded_fresh
from .request import (  # the settings of this mode live in the resolver; importable from here as before
    DRAFT_SOURCES,
    GATE_FIELD,
    HISTORY_FIELD,
    MAX_BATCH_FIELD,
    OUR_FIELDS,
    SCHEDULES,
    TABLE_FIELD,
    VOCAB_FIELD,
    WIDTH_FIELD,
    SpeculativeSettings,
    our_speculative_arguments,
    resolve_speculative_settings,
    speculation_requested,
    stored_draft_settings,
)
from .speculative_batch import (  # the ragged batch, the rows' texts, the rounds' tallies; importable from here
    RaggedBatch,
    RowTexts,
    _capacity,
    _chain_tensors,
    _RoundStats,
    copied_drafts,
)

logger = logging.get_logger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# the steps
# ---------------------------------------------------------------------------------------------------------------------
def prefill_full_depth(model, input_ids, attention_mask, position_ids, cache):
    """Every layer runs for every prompt position (the prompt's K/V complete in every layer); returns the final head's
    logits at the last position, `(B, V)` in float32."""
    fam = model.family
    h = fam.embed(model, input_ids, position_ids)  # (B, P, D)
    inputs = fam.layer_inputs(model, h, attention_mask, cache, position_ids)
    with record_function("ee::prefill"):
        h = run_layers(model, h, inputs, cache, 0, model.config.num_hidden_layers).h
    with record_function("ee::final_head"):
        return fam.head_logits(model, fam.final_norm(model)(h[:, -1])).float()


def draft_step(model, exit_layer, tokens, batch, cache, i):
    """Feeds `tokens` `(B,)`, fed token i of the round, through layers 0..E only: their K/V land in the round's slot
    i of those layers, for good. Returns the residual stream leaving E, `(B, 1, D)`."""
    fam = model.family
    position_ids = batch.position_ids(i, 1)
    h = fam.embed(model, tokens[:, None], position_ids)
    inputs = fam.layer_inputs(model, h, batch.attention_mask(i + 1), cache, position_ids)
    with record_function("ee::draft_step"):  # one label per step, not per layer: a label costs ~10-25 us on a CPU
        return run_layers(model, h, inputs, cache, 0, exit_layer + 1).h


def draft_vocab_head(model, n) -> nn.Linear:
    """The LM head restricted to the model's n most frequent stored tokens (`draft_token_ids[:n]`): a linear layer
    whose rows are copied once from the output embeddings (about n / V of the full head's cost, 4 * n * D bytes
    resident in float32) and kept on the model until those weights change."""
    full = model.get_output_embeddings()
    weight = getattr(full, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not weight.is_floating_point():
        raise ValueError(
            f"`{VOCAB_FIELD}` copies rows of the output embeddings, but {type(full).__name__} has no plain floating "
            "weight (a quantized head?): draft with the full vocabulary (`assistant_vocab_size=None`)."
        )
    key = (n, weight.data_ptr(), weight._version, weight.dtype, weight.device)
    cached = getattr(model, "_draft_vocab_head", None)
    if cached is None or cached[0] != key:
        ids = model.draft_token_ids[:n].to(weight.device)
        head = nn.Linear(weight.shape[1], n, bias=getattr(full, "bias", None) is not None)
        head = head.to(device=weight.device, dtype=weight.dtype).requires_grad_(False)
        with torch.no_grad():
            head.weight.copy_(weight[ids])
            if head.bias is not None:
                head.bias.copy_(full.bias[ids])
        cached = (key, head, ids)
        model.__dict__["_draft_vocab_head"] = cached  # a plain attribute: not a submodule, never saved
    return cached[1]


def draft_head(model, settings, h):
    """Exit head E on `h` `(B, D)`: its logits `(B, V)` (float32) and the learned confidence `(B,)` when the model has
    confidence heads (else None). With a draft vocabulary (`settings.vocab_size`) only those tokens are scored, the
    others get -inf (probability 0: never drafted, and q = 0 for speculative sampling)."""
    with record_function("ee::draft_head"):
        head_out = model.exit_heads[settings.exit_index](h)
        if settings.vocab_size:
            head = draft_vocab_head(model, settings.vocab_size)
            some = model.family.head_logits(model, head_out, head).float()  # (B, n)
            ids = model._draft_vocab_head[2].expand(some.shape[0], -1)
            full = model.get_output_embeddings().weight.shape[0]
            logits = some.new_full((some.shape[0], full), float("-inf")).scatter_(1, ids, some)
        else:
            logits = model.family.head_logits(model, head_out).float()
        heads = getattr(model, "confidence_heads", None)
        return logits, None if heads is None else heads[settings.exit_index](head_out)


def verify(model, exit_layer, states, batch, cache):
    """ONE forward of the round's fed tokens through layers E+1..L-1, from `states` `(B, q, D)` (the residual leaving E
    for each), against those layers' cache (the kept past); returns the final head's logits `(B, q, V)` (float32)."""
    fam = model.family
    position_ids = batch.position_ids(0, states.shape[1])
    inputs = fam.layer_inputs(
        model, states, batch.attention_mask(states.shape[1]), cache, position_ids, layer_idx=exit_layer + 1
    )  # masks sized from layer E+1's cache, which lacks the round
    with record_function("ee::verify"):
        h = run_layers(model, states, inputs, cache, exit_layer + 1, model.config.num_hidden_layers).h
    with record_function("ee::final_head"):
        return fam.head_logits(model, fam.final_norm(model)(h)).float()


def accept_greedy(scores, drafts, valid=None):
    """`scores` `(B, k+1, V)`: the full model's at the fed positions; `drafts` `(B, k)`; `valid` `(B, k)`: which are
    drafts (None: all; the others are fillers, never accepted). Returns (accepted `(B,)`, next `(B,)`): the longest
    prefix of drafts equal to the full model's argmax, and its own token after it."""
    target = scores.argmax(-1)  # (B, k+1)
    same = drafts == target[:, :-1]
    accepted = (same if valid is None else same & valid).long().cumprod(-1).sum(-1)
    return accepted, target.gather(1, accepted[:, None]).squeeze(1)


def accept_sampled(p, q, drafts, valid=None):
    """Speculative sampling. `p` `(B, k+1, V)`: the full model's probabilities at the fed positions; `q` `(B, k, V)`:
    the draft head's, from which `drafts` `(B, k)` were drawn. Draft i is kept with probability min(1, p_i(d) /
    q_i(d)) while all before it were; at the first rejection the token is drawn from max(p - q, 0) normalised, after
    k kept drafts from p. The tokens are then distributed exactly as under p. A context draft is a point mass (q
    one-hot: kept with probability p(d), else the token comes from p without d); `valid` `(B, k)` marks fillers
    (False), which are never kept and must have q = 0. Returns (accepted `(B,)`, next `(B,)`)."""
    k = drafts.shape[1]
    index = drafts[..., None]
    p_draft, q_draft = p[:, :k].gather(-1, index).squeeze(-1), q.gather(-1, index).squeeze(-1)
    kept = torch.rand_like(q_draft) * q_draft <= p_draft  # u <= p / q without dividing; q(d) > 0 as d was drawn
    if valid is not None:
        kept &= valid
    accepted = kept.long().cumprod(-1).sum(-1)
    rows = torch.arange(p.shape[0], device=p.device)
    p_next = p[rows, accepted]
    q_next = nn.functional.pad(q, (0, 0, 0, 1))[rows, accepted]  # zeros after the last draft: the bonus comes from p
    residual = (p_next - q_next).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p_next)  # p == q cannot reject; guarded
    return accepted, torch.multinomial(residual, 1).squeeze(1)


# ---------------------------------------------------------------------------------------------------------------------
# the generate loop
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class GenerateSpeculativeOutput(GenerateEarlyExitOutput):
    """`GenerateEarlyExitOutput` of self-speculative decoding (every token is decided by the final head, so
    `exit_layers` is `num_hidden_layers - 1` for every token, -1 after a row's end), plus per row `(batch,)`:
    `draft_tokens` (drafts verified for the row), `accepted_tokens` (those it kept), `verify_rounds` (rounds it took
    part in), `context_draft_tokens` / `context_accepted_tokens` (the share of those two copied, from the row's text
    the history or the table), `table_draft_tokens` / `table_accepted_tokens` and `history_draft_tokens` /
    `history_accepted_tokens` (the shares of those from the table and from earlier generations); and
    `draft_lengths` `(rounds,)`: the positions drafted in each round (batch-wide; 0: a plain step, where the gate
    found that no draft would pay). A round gives a row its accepted
    drafts plus one token of the full model, unless a stop comes first.

    `scores` / `logits`: per generated token, the full model's processed / raw scores (zeros after a row's end, where
    plain generate scores its pad tokens). `cache`: each row's tokens in the slot layout of the module docstring (at
    batch > 1 with gaps between them, and without rows that ended early: `RaggedBatch.retire`); it is not meant for
    continuing a generation."""

    draft_tokens: torch.LongTensor | None = None
    accepted_tokens: torch.LongTensor | None = None
    verify_rounds: torch.LongTensor | None = None
    draft_lengths: torch.LongTensor | None = None
    context_draft_tokens: torch.LongTensor | None = None
    context_accepted_tokens: torch.LongTensor | None = None
    table_draft_tokens: torch.LongTensor | None = None
    table_accepted_tokens: torch.LongTensor | None = None
    history_draft_tokens: torch.LongTensor | None = None
    history_accepted_tokens: torch.LongTensor | None = None

    @property
    def acceptance_rate(self) -> torch.Tensor:
        """`(batch,)` share of each row's drafts the full model accepted."""
        return self.accepted_tokens.double() / self.draft_tokens.clamp_min(1).double()

    @property
    def mean_accepted_length(self) -> torch.Tensor:
        """`(batch,)` accepted drafts per verification round (tokens per round: one more)."""
        return self.accepted_tokens.double() / self.verify_rounds.clamp_min(1).double()


@dataclass
class _Round:
    """What one round fed and drafted. states: `(R, k+1, D)` the live rows' residual entering verification (leaving
    layer `start`; -1: the embeddings); drafts / valid: `(B, k)` the drafted tokens and which of them are drafts (not
    fillers); q: `(B, k, V)` the draft distributions (sampling only); context: `(B,)` leading copied drafts (from
    the row's text, the history or the table); table / history: `(B,)` whether a row's copied drafts came from the
    table / the history index; chains: each row's `drafts.Chain` (None: no copied drafts)."""

    start: int
    states: torch.Tensor
    drafts: torch.Tensor
    valid: torch.Tensor | None
    q: torch.Tensor | None
    context: torch.Tensor
    table: torch.Tensor | None = None
    history: torch.Tensor | None = None
    chains: list | None = None


def _point_mass(drafts, valid, vocab_size):
    """`(B, k, V)` one-hot draft distributions of copied drafts, zero at fillers."""
    q = nn.functional.one_hot(drafts, vocab_size).float()
    return q if valid is None else q * valid[..., None]


def _context_round(model, batch, drafts, counts, k, sample):
    """Every row's last token and its k context drafts (fillers after its own) run through no layer here: their
    embeddings are verified from layer 0, all k+1 positions in one forward."""
    fed = batch.to_live(torch.cat([batch.last_tokens()[:, None], drafts[:, :k]], dim=1))
    states = model.family.embed(model, fed, batch.position_ids(0, k + 1))
    valid = torch.arange(k, device=counts.device) < counts[:, None]
    batch.write_draft(0, drafts[:, :k])
    q = _point_mass(drafts[:, :k], valid, model.config.vocab_size) if sample else None
    return _Round(-1, states, drafts[:, :k], valid, q, counts)


def _exit_round(model, settings, batch, cache, k, drafting, context, counts, logits_processor, sample, budget):
    """Each fed token runs layers 0..E once (its K/V kept, its state leaving E kept for verification); a row drafts
    its context tokens first, then exit head E's. Drafting stops after k drafts, or once no row is still drafting
    (confidence below the threshold, or its budget spent)."""
    token, states, drafts, q = batch.last_tokens(), [], [], []
    adaptive = settings.threshold > 0 or settings.schedule != "constant"
    copying = int(counts.max())  # steps in which some row still copies from the context (one host sync, not k)
    for i in range(k + 1):
        states.append(draft_step(model, settings.exit_layer, batch.to_live(token), batch, cache, i))
        if i == k:
            break  # the last draft only needed its state for verification
        draft_logits, learned = draft_head(model, settings, states[-1][:, -1])
        draft_logits, learned = batch.to_all(draft_logits), None if learned is None else batch.to_all(learned)
        draft_scores = batch.process(logits_processor, draft_logits[:, None], i)[:, 0]
        probs = draft_scores.softmax(-1) if sample or (adaptive and learned is None) else None
        token = torch.multinomial(probs, 1).squeeze(1) if sample else draft_scores.argmax(-1)
        if i < copying:
            copied = i < counts
            token = torch.where(copied, context[:, i], token)
            probs = (
                None
                if probs is None
                else torch.where(copied[:, None], _point_mass(token, None, probs.shape[-1]), probs)
            )
        drafts.append(token)
        if sample:
            q.append(probs)
        batch.write_draft(i, token)
        if adaptive:
            confidence = learned if learned is not None else probs.max(-1).values
            drafting &= (budget > i + 1) & (confidence >= settings.threshold) | (i + 1 < counts)
            if not bool(drafting.any()):
                k = i + 1
    drafts = torch.stack(drafts, 1) if drafts else batch.tokens.new_zeros(batch.batch_size, 0)
    q = (torch.stack(q, 1) if q else None) if sample else None
    return _Round(settings.exit_layer, torch.cat(states, dim=1), drafts, None, q, counts.clamp(max=k))


def _plan(model, settings, batch, texts, active, budgets, capacity, cache):
    """This round's drafts: (context drafts, their counts, k, whether the exit head drafts, from the table, from the
    history, the chains) for the active rows. Without exit drafts the gate picks k (`drafts.plan_padded_fresh`: 0 decodes
    this round plainly); with one live row the round is fed at the cheapest trusted width that holds k drafts: the
    row's further drafts, then fillers."""
    room = (batch.max_length - batch.length - 1).clamp_min(0) * active  # drafts beyond it could never be committed
    chains = [None] * batch.batch_size
    if settings.lookup_tokens:
        chains = copied_drafts(model, settings, texts, torch.minimum(budgets["context"], room))
    widest = max((len(c.tokens) for c in chains if c is not None), default=0)
    running = active.tolist()
    use_exit = settings.exit_layer is not None and any(c is None for c, a in zip(chains, running) if a)
    k = widest
    if settings.gate and not use_exit and widest:
        rows = batch.live.numel()
        pace = pace_setters(batch.length.tolist(), running)
        probs = [c.probs if c is not None else [] for c in chains]
        costs, group = model.drafter.costs, ("context", rows)
        # the widest fed round; wider than the drafts at one live row only (BENCHMARKS.md 5g: at batch 8 it lost)
        most = max(widest, min(settings.lookup_tokens, int(room.max()))) + 1 if rows == 1 else 0
        k = plan_padded_fresh(probs, pace, costs, group, most)
        if k:  # fed at its cheapest width: the rows' further drafts, then fillers
            k = costs.cheapest(group, k + 1, most) - 1
    context, counts, table, history = _chain_tensors(chains, k, batch.tokens)
    if use_exit:
        k = max(k, min(int(budgets["exit"][active].max()), int(room.max())))
    elif k and settings.verify_width > k + 1:  # fillers after the drafts, never accepted: a wider, cheaper forward
        k = max(k, min(settings.verify_width - 1, int(room.max())))
    context = nn.functional.pad(context, (0, max(k - context.shape[1], 0)))
    batch.retire(cache, active)
    if batch.wants_compaction(capacity, k + 1, active):
        batch.compact(cache, active)
    if capacity > 0:
        k = max(min(k, capacity - batch.slots.shape[1] - 1), 0)
    return context, counts.clamp(max=k), k, use_exit, table, history, chains


def _draft(model, settings, batch, texts, cache, active, budgets, capacity, logits_processor, sample):
    context, counts, k, use_exit, table, history, chains = _plan(
        model, settings, batch, texts, active, budgets, capacity, cache
    )
    if not use_exit:
        r = _context_round(model, batch, context, counts, k, sample)
    else:
        r = _exit_round(
            model, settings, batch, cache, k, active.clone(), context, counts, logits_processor, sample, budgets["exit"]
        )
    r.table, r.history, r.chains = table, history, chains
    return r


def _check_call(mode, input_ids, synced_gpus, model_kwargs, streamer):
    """What a speculative call needs beyond its settings: no synced GPUs, an empty croppable cache (returned), a
    streamer only at batch size 1."""
    if synced_gpus:
        raise ValueError(
            f"{mode} does not support `synced_gpus`: rows finish after different numbers of rounds, which peers "
            "would have to match."
        )
    cache = require_cache(model_kwargs, mode)
    if cache.get_seq_length() > 0:
        raise ValueError(f"{mode} starts from an empty cache; pass no `cache` holding a prefix.")
    if not cache.is_croppable:
        raise ValueError(
            f"{mode} needs a cache whose rejected slots can be cropped; {type(cache).__name__} cannot be"
            f"{crop_hint(cache)}."
        )
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(
            f"A streamer takes one row's tokens; with {mode} rows of a batch advance by different amounts, so "
            "stream at batch size 1."
        )
    return cache


def _first_token(model, loop, batch, cache, input_ids, model_kwargs):
    """The prefill at full depth and every row's first token from the full model's logits."""
    position_ids = model_kwargs.get("position_ids")
    if position_ids is None:  # as generate builds them
        position_ids = (batch.slots.long().cumsum(-1) - 1).masked_fill(~batch.slots, 0)
    mask = model_kwargs.get("attention_mask")
    logits = prefill_full_depth(model, input_ids, mask, position_ids, cache)[:, None]  # (B, 1, V)
    scores = batch.process(loop.logits_processor, logits, 0)
    before = batch.length - batch.prompt_length
    counts = batch.commit(loop.choose(scores[:, 0])[:, None], torch.ones_like(batch.length), loop.row_criteria)
    loop.record_rows(scores, logits, before, counts)
    loop.stream(batch.last_tokens())


def _verify_and_commit(model, loop, batch, cache, r):
    """Verifies round `r`'s drafts, accepts them (greedy or speculative sampling) and commits each row's tokens.
    Returns (accepted drafts `(B,)`, committed tokens `(B,)`)."""
    k = r.drafts.shape[1]
    logits = batch.to_all(verify(model, r.start, r.states, batch, cache))  # (B, k+1, V)
    with record_function("ee::accept"):
        scores = batch.process(loop.logits_processor, logits, 0)
        if loop.sample:
            q = r.q if r.q is not None else scores.new_zeros(batch.batch_size, 0, scores.shape[-1])
            accepted, following = accept_sampled(scores.softmax(-1), q, r.drafts, r.valid)
        else:
            accepted, following = accept_greedy(scores, r.drafts, r.valid)
        new = torch.cat([r.drafts, following[:, None]], dim=1).scatter(1, accepted[:, None], following[:, None])
        before = batch.length - batch.prompt_length
        counts = batch.commit(new, accepted + 1, loop.row_criteria)
        batch.keep(cache, counts, k + 1)
    loop.record_rows(scores, logits, before, counts)
    if loop.streamer is not None and int(counts[0]):
        loop.stream(new[:, : int(counts[0])])
    return accepted, counts


def _finish(model, loop, batch, cache, stats):
    """The sequences, or the output: every token decided at full depth (exit layer -1 after a row's end)."""
    sequences = batch.sequences()
    if not loop.return_dict:
        return loop.finish(sequences)
    size, new_steps, device = batch.batch_size, sequences.shape[1] - batch.prompt_length, sequences.device
    exit_layers = torch.full((size, new_steps), model.config.num_hidden_layers - 1, dtype=torch.long, device=device)
    if loop.pad_mode:
        ended = torch.arange(new_steps, device=device) >= (batch.length - batch.prompt_length)[:, None]
        exit_layers = exit_layers.masked_fill(ended, -1)
    return loop.finish(
        sequences, GenerateSpeculativeOutput, **{CACHE: cache}, exit_layers=exit_layers, **stats.fields()
    )


def speculative_generate(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    spec_streamer=None,
    assistant_vocab_size=None,
    speculative_verify_width=None,
    speculative_table_drafts=None,
    speculative_history_tokens=None,
    speculative_gate=None,
    **model_kwargs,
):
    """The decoding loop of `generate(assistant_early_exit=... and / or prompt_lookup_num_tokens=...)` (passed as
    `custom_generate`), on the shared skeleton (`decode_loop.DecodeLoop`): prefill at full depth, then rounds of
    draft, verify, accept, commit until every row has stopped."""
    settings = resolve_speculative_settings(
        model,
        generation_config,
        assistant_vocab_size,
        speculative_verify_width,
        speculative_table_drafts,
        speculative_history_tokens,
        speculative_gate,
    )
    cache = _check_call(settings.mode, input_ids, synced_gpus, model_kwargs, spec_streamer)
    vocab = model.config.vocab_size
    loop = DecodeLoop(input_ids, logits_processor, stopping_criteria, generation_config, spec_streamer, vocab)
    pad = 0 if loop.pad_token_id is None else int(loop.pad_token_id)
    mask = model_kwargs.get("attention_mask")
    batch = RaggedBatch(input_ids, mask, loop.max_length, loop.pad_mode, pad)
    _first_token(model, loop, batch, cache, input_ids, model_kwargs)
    stats = _RoundStats(settings, input_ids.shape[0], loop.max_length - input_ids.shape[1], input_ids.device)
    capacity = _capacity(cache)
    texts = RowTexts(batch, settings.ngram_size) if settings.lookup_tokens else None
    if settings.table:  # once per call: the table as the drafter's dict, the history at this call's budget
        model.drafter.use_table(model.draft_table_keys, model.draft_table_next, model.config.vocab_size)
    if settings.history:
        model.drafter.history.resize(settings.history)
    while bool((active := batch.active).any()):
        start = time.perf_counter()
        if texts is not None:
            texts.sync(batch)
        r = _draft(model, settings, batch, texts, cache, active, stats.budgets, capacity, logits_processor, loop.sample)
        live = batch.live.numel()
        accepted, counts = _verify_and_commit(model, loop, batch, cache, r)
        stats.add(r, active, accepted, counts)
        if texts is not None:
            _learn(model, r, accepted, live, time.perf_counter() - start)
    if settings.history:
        for tokens in texts.generated(batch):
            model.drafter.finish(tokens)
    return _finish(model, loop, batch, cache, stats)


def _learn(model, r, accepted, rows, seconds):
    """After a round: each row's chain learns how many of its verified drafts were kept; a context round (no exit
    head) times its width for the gate."""
    drafter, k = model.drafter, r.drafts.shape[1]
    if r.start < 0:
        drafter.costs.observe(("context", rows, k + 1), seconds)
    counts = torch.stack([r.context, accepted]).tolist()  # one transfer
    for chain, n, kept in zip(r.chains, *counts):
        if chain is not None and n:
            drafter.observe(chain, kept, drafted=n)


# deprecated names, kept importable for one release: {old: new}
_RENAMED = {"prefill": "prefill_full_depth"}  # `prefill` is also confident exits' (`generation_early_exit.prefill`)


__getattr__ = deprecated_aliases(__name__, globals(), _RENAMED)


__all__ = [
    "DRAFT_SOURCES",
    "MAX_BATCH_FIELD",
    "VOCAB_FIELD",
    "WIDTH_FIELD",
    "TABLE_FIELD",
    "HISTORY_FIELD",
    "GATE_FIELD",
    "OUR_FIELDS",
    "SCHEDULES",
    "GenerateSpeculativeOutput",
    "RaggedBatch",
    "SpeculativeSettings",
    "accept_greedy",
    "accept_sampled",
    "RowTexts",
    "copied_drafts",
    "draft_head",
    "draft_vocab_head",
    "our_speculative_arguments",
    "draft_step",
    "prefill_full_depth",
    "resolve_speculative_settings",
    "speculation_requested",
    "speculative_generate",
    "stored_draft_settings",
    "verify",
]
