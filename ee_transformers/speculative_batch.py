"""The ragged batch of self-speculative decoding (`speculative_early_exit.py`): rows that advance by different numbers
of tokens over one shared cache (`RaggedBatch`, the slot layout of that module's docstring, and `_capacity`, the most
slots a cache holds in order), each row's own text for copied drafts (`RowTexts`, `copied_drafts`, `_chain_tensors`),
and the per-row tallies and draft budgets of the rounds (`_RoundStats`). Only the speculative mode imports it; its
names stay importable from `speculative_early_exit`.

Part of the Hub runtime: imports only torch and its siblings.
"""

from collections import defaultdict

import torch

from .drafts import MAX_MATCH, SuffixIndex, peers_of


# ---------------------------------------------------------------------------------------------------------------------
# the ragged batch
# ---------------------------------------------------------------------------------------------------------------------
def _groups(rows, lengths):
    """[(length, row indices)] for rows of equal length: each group's prefixes are exactly what plain generate shows
    processors and stopping criteria, which are then called on the whole batch (some hold per-row state, such as the
    repetition penalty's padding lengths) with the group's rows read back."""
    by_length = defaultdict(list)
    for row, length in zip(rows, lengths):
        by_length[length].append(row)
    return list(by_length.items())


class RaggedBatch:
    """Rows that advance by different numbers of tokens, over one shared cache (see the module docstring).

    tokens: `(B, width)`, row r's sequence is `tokens[r, :length[r]]` (drafts sit after it while a round runs);
    slots: `(B, N)` bool, which of the cache's N slots hold row r's tokens; positions: `(B,)` each row's next position
    id (its number of kept slots); stopped / stop_at: a stopping criterion fired for the row / its length then.
    pad_mode: rows stop at their own end and get `pad_token_id` after it (generate does this when an EOS criterion is
    set); otherwise every row runs on to the longest row's end, as plain generate's rows do.
    """

    def __init__(self, input_ids, attention_mask, max_length, pad_mode, pad_token_id):
        batch, prompt = input_ids.shape
        device = input_ids.device
        self.prompt_length, self.max_length, self.pad_mode, self.pad = prompt, max_length, pad_mode, pad_token_id
        self.tokens = input_ids.new_full((batch, 2 * max_length - prompt + 1), pad_token_id)
        self.tokens[:, :prompt] = input_ids
        self.length = torch.full((batch,), prompt, dtype=torch.long, device=device)
        self.slots = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        self.positions = self.slots.sum(-1)
        self.first = prompt - self.positions  # each row's first real token (rows are left-padded)
        self.live = torch.arange(batch, device=device)  # the rows the cache (and every forward) still holds
        self.selectable = None  # whether every cache layer can drop rows (`retire`)
        self.gapless = bool(self.slots.all())
        self.stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        self.stop_at = torch.full((batch,), max_length, dtype=torch.long, device=device)

    @property
    def batch_size(self):
        return self.tokens.shape[0]

    @property
    def active(self) -> torch.Tensor:
        """`(B,)` rows that still take tokens."""
        if self.pad_mode:
            return ~self.stopped
        end = int(self.stop_at.max()) if bool(self.stopped.all()) else self.max_length
        return self.length < end

    def last_tokens(self) -> torch.Tensor:
        return self.tokens.gather(1, (self.length - 1)[:, None]).squeeze(1)

    # what the next forward sees --------------------------------------------------------------------------------------
    def position_ids(self, offset, q) -> torch.Tensor:
        """`(R, q)` position ids of the live rows' fed tokens `offset .. offset + q - 1` of the round."""
        return self.positions[self.live, None] + offset + torch.arange(q, device=self.positions.device)

    def to_live(self, t):
        """The live rows of a per-row tensor `(B, ...)`."""
        return t if self.live.numel() == self.batch_size else t.index_select(0, self.live)

    def to_all(self, t):
        """A live rows' tensor `(R, ...)` as `(B, ...)`, zeros in the retired rows (processors see the whole batch)."""
        if self.live.numel() == self.batch_size:
            return t
        return t.new_zeros(self.batch_size, *t.shape[1:]).index_copy_(0, self.live, t)

    def attention_mask(self, q):
        """2D mask over the cache's slots plus `q` new ones, `(B, N + q)`; None without gaps (as generate drops an
        all-ones mask)."""
        if self.gapless:
            return None
        return torch.cat([self.slots, self.slots.new_ones(self.slots.shape[0], q)], dim=1)

    def process(self, logits_processor, logits, offset):
        """Scores of `logits` `(B, q, V)` at fed positions `offset ..`: each row's processors see its own prefix (its
        tokens and the drafts before the position), grouped by length, exactly as plain generate shows them."""
        if not logits_processor:
            return logits
        out = torch.empty_like(logits)
        lengths = self.length.tolist()
        for j in range(logits.shape[1]):
            for length, rows in _groups(range(self.batch_size), [n + offset + j for n in lengths]):
                idx = torch.tensor(rows, device=logits.device)
                scores = logits_processor(self.tokens[:, :length], logits[:, j].clone())  # clone: processors may write
                out[idx, j] = scores.index_select(0, idx)
        return out

    def write_draft(self, i, tokens):
        """Draft i (0-based) of every row, `(B,)`, or drafts i.. `(B, k)`, after its sequence, where processors of later
        positions see them."""
        tokens = tokens[:, None] if tokens.ndim == 1 else tokens
        index = self.length[:, None] + i + torch.arange(tokens.shape[1], device=tokens.device)
        self.tokens.scatter_(1, index, tokens)

    # committing a round ----------------------------------------------------------------------------------------------
    def commit(self, new, counts, stopping_criteria) -> torch.Tensor:
        """Appends `new[r, :counts[r]]` to every active row, applies the stopping criteria per row and token, and
        returns the numbers of tokens appended `(B,)`."""
        counts = torch.minimum(counts, self.max_length - self.length) * self.active
        index = self.length[:, None] + torch.arange(new.shape[1], device=new.device)
        self.tokens.scatter_(1, index, new)
        if stopping_criteria:
            counts = self._stop(counts, stopping_criteria)
        reached = ~self.stopped & (self.length + counts >= self.max_length)
        self.stop_at = torch.where(reached, self.max_length, self.stop_at)
        self.stopped |= reached
        self.length += counts
        return counts

    def _stop(self, counts, criteria):
        """Each row's criteria after each of its new tokens, on its own prefix; a row stops at the first that fires."""
        n, stopped, length = counts.tolist(), self.stopped.tolist(), self.length.tolist()
        stop_at = self.stop_at.tolist()
        for j in range(max(n, default=0)):
            rows = [r for r in range(self.batch_size) if j < n[r] and not stopped[r]]
            for ell, group in _groups(rows, [length[r] + j + 1 for r in rows]):
                fired = criteria(self.tokens[:, :ell], None).tolist()
                for r in group:
                    if fired[r]:
                        stopped[r], stop_at[r] = True, ell
                        if self.pad_mode:
                            n[r] = j + 1
        device = counts.device
        self.stopped = torch.tensor(stopped, device=device)
        self.stop_at = torch.tensor(stop_at, device=device)
        return torch.tensor(n, device=device)

    def keep(self, cache, counts, fed):
        """After a round that fed `fed` tokens to every row, row r keeps the first `counts[r]` of their slots; slots no
        row kept are cropped off every layer, the others are gaps in the rows that did not keep them."""
        live_counts = self.to_live(counts)
        width = int(live_counts.max())
        if fed > width:
            cache.crop(width - fed)
        kept = torch.arange(width, device=counts.device) < live_counts[:, None]
        self.slots = torch.cat([self.slots, kept], dim=1)
        self.positions = self.positions + counts
        self.gapless = self.gapless and bool(kept.all())

    def _needed(self, active):
        """Slots each row still needs: all it kept while it takes tokens, one once it has ended (so that its query,
        fed along with the batch's, still attends to something)."""
        return int(torch.where(self.to_live(active), self.to_live(self.positions), 1).max())

    def wants_compaction(self, capacity, fed, active):
        """Whether the dead columns are worth removing (over a quarter of the cache) or must go (a static cache of
        `capacity` slots would not hold `fed` more)."""
        n = self.slots.shape[1]
        dead = n - self._needed(active)
        return dead > 0 and (4 * dead > n or 0 < capacity < n + fed)

    def retire(self, cache, active):
        """Drops the rows that have ended from the cache and from every later forward (they only cost compute), when
        at least a quarter of the live rows have ended and every cache layer can select rows (dynamic layers)."""
        if self.selectable is None:  # static layers cannot drop rows; decided once
            self.selectable = all(hasattr(layer, "batch_select_indices") for layer in cache.layers)
        done = ~self.to_live(active)
        if not self.selectable or 4 * int(done.sum()) < max(self.live.numel(), 4):
            return
        keep = (~done).nonzero().squeeze(1)
        cache.batch_select_indices(keep)
        self.live, self.slots = self.live[keep], self.slots[keep]
        self.gapless = bool(self.slots.all())

    def compact(self, cache, active):
        """Moves every row's kept slots to the right end, in order, in every layer, and drops the dead columns (an
        ended row keeps only its latest slots)."""
        n, width = self.slots.shape[1], self._needed(active)
        order = torch.sort(self.slots.to(torch.uint8), dim=1, stable=True).indices[:, n - width :]  # (B, width)
        for layer in cache.layers:
            keys, values = layer.keys[:, :, :n], layer.values[:, :, :n]
            index = order[:, None, :, None]
            keys = keys.gather(2, index.expand(-1, keys.shape[1], -1, keys.shape[3]))
            values = values.gather(2, index.expand(-1, values.shape[1], -1, values.shape[3]))
            layer.crop(-n)
            layer.update(keys, values)  # the layer's own write: dynamic layers concatenate, static ones copy in place
        self.slots = self.slots.gather(1, order)
        self.gapless = bool(self.slots.all())

    def sequences(self):
        """`(B, P + steps)`, as plain generate returns them: in pad mode each row ends at its own end and is padded
        after it; otherwise every row runs to the longest row's end."""
        width = int(self.length.max()) if self.pad_mode else int(self.stop_at.max())
        out = self.tokens[:, :width]
        if self.pad_mode:
            out = out.masked_fill(torch.arange(width, device=out.device) >= self.length[:, None], self.pad)
        return out


# ---------------------------------------------------------------------------------------------------------------------
# copied drafts (the row's text, the history of earlier generations, the stored table: drafts.py)
# ---------------------------------------------------------------------------------------------------------------------
class RowTexts:
    """Each row's own text as a `drafts.SuffixIndex`: its prompt (without left padding), then what it commits."""

    def __init__(self, batch, ngram_size):
        first, prompt = batch.first.tolist(), batch.tokens[:, : batch.prompt_length].tolist()
        self.rows = [SuffixIndex(ngram_size) for _ in first]
        for row, tokens, start in zip(self.rows, prompt, first):
            row.extend(tokens[start:])
        self.seen = [batch.prompt_length] * len(first)

    def sync(self, batch) -> None:
        """Indexes the tokens each row committed since the last call (one host transfer)."""
        length = batch.length.tolist()
        lo, hi = min(self.seen), max(length)
        if hi <= lo:
            return
        new = batch.tokens[:, lo:hi].tolist()
        for r, (row, seen, n) in enumerate(zip(self.rows, self.seen, length)):
            if n > seen:
                row.extend(new[r][seen - lo : n - lo])
        self.seen = length

    def generated(self, batch) -> list[list[int]]:
        """Each row's generated tokens (the history's documents)."""
        tokens, start = batch.tokens.tolist(), batch.prompt_length
        return [t[start:n] for t, n in zip(tokens, batch.length.tolist())]


def copied_drafts(model, settings, texts, budget):
    """Each row's best chain of copied drafts (`Drafter.propose`: its own text, the history, the other rows' texts,
    the stored table), at most `budget[r]` tokens; None where no source offers one or the budget is 0."""
    drafter, rows, history = model.drafter, texts.rows, settings.history > 0
    return [
        drafter.propose(row, row.tail(MAX_MATCH), n, history, settings.table, peers_of(rows, r)) if n else None
        for r, (row, n) in enumerate(zip(rows, budget.tolist()))
    ]


def _chain_tensors(chains, k, like):
    """(drafts `(B, k)`, counts `(B,)`, from the table `(B,)`, from other generations `(B,)`: the history or the rows
    beside it) of the chains cut at k."""
    tokens = [(c.tokens[:k] if c is not None else []) for c in chains]
    drafts = torch.tensor([t + [0] * (k - len(t)) for t in tokens], dtype=like.dtype).reshape(len(chains), k)
    counts = torch.tensor([len(t) for t in tokens], dtype=torch.long, device=like.device)
    source = [None if c is None or not t else c.source for c, t in zip(chains, tokens)]
    table = torch.tensor([s == "table" for s in source], device=like.device)
    history = torch.tensor([s in ("history", "peer") for s in source], device=like.device)  # other generations
    return drafts.to(like.device), counts, table, history


# ---------------------------------------------------------------------------------------------------------------------
# the cache's capacity and the rounds' tallies
# ---------------------------------------------------------------------------------------------------------------------
def _capacity(cache) -> int:
    """The most slots every layer holds, and attends to, in order (-1: no limit): a static layer's size; a dynamic
    sliding layer's window - 1 (beyond it, it would drop slots, and its mask hide them)."""
    sizes = [
        layer.sliding_window - 1 if hasattr(layer, "sliding_window") else layer.get_max_length()
        for layer in cache.layers
    ]
    return min([n for n in sizes if n > 0], default=-1)


def _grow(budget, accepted, drafted, rows, steps):
    """transformers' heuristic schedule, per row: all drafts kept -> budget + 2, else budget - 1 (at least 1)."""
    grown = torch.where(accepted >= drafted, budget + 2, (budget - 1).clamp_min(1)).clamp_max(steps)
    return torch.where(rows, grown, budget)


class _RoundStats:
    """Per row `(B,)`: drafts verified, drafts kept, rounds taken part in, and the context drafts among both; and the
    positions drafted per round. `budgets`: each row's most drafts of each source (the heuristic schedule's)."""

    def __init__(self, settings, size, steps, device):
        self.settings, self.steps, self.draft_lengths = settings, steps, []
        self.totals = {
            n: torch.zeros(size, dtype=torch.long, device=device)
            for n in ("drafted", "accepted", "rounds", "cd", "ca", "td", "ta", "hd", "ha")
        }
        self.budgets = {
            "exit": torch.full((size,), settings.num_tokens, dtype=torch.long, device=device),
            "context": torch.full((size,), settings.lookup_tokens, dtype=torch.long, device=device),
        }

    def add(self, r, active, accepted, counts):
        k = r.drafts.shape[1]
        drafted = (k if r.valid is None else r.valid.sum(-1)) * active
        kept = torch.minimum(accepted, counts) * active
        self.totals["drafted"] += drafted
        self.totals["accepted"] += kept
        self.totals["rounds"] += active.long()
        self.totals["cd"] += r.context * active
        self.totals["ca"] += torch.minimum(kept, r.context)
        self.totals["td"] += r.context * (active & r.table)
        self.totals["ta"] += torch.minimum(kept, r.context) * r.table
        self.totals["hd"] += r.context * (active & r.history)
        self.totals["ha"] += torch.minimum(kept, r.context) * r.history
        self.draft_lengths.append(k)
        if self.settings.schedule == "heuristic":
            copied, budgets = active & (r.context > 0), self.budgets
            budgets["context"] = _grow(budgets["context"], accepted, r.context, copied, self.steps)
            budgets["exit"] = _grow(budgets["exit"], accepted, drafted, active & ~copied, self.steps)

    def fields(self) -> dict:
        t = self.totals
        return dict(
            draft_tokens=t["drafted"],
            accepted_tokens=t["accepted"],
            verify_rounds=t["rounds"],
            draft_lengths=torch.tensor(self.draft_lengths, dtype=torch.long),
            context_draft_tokens=t["cd"],
            context_accepted_tokens=t["ca"],
            table_draft_tokens=t["td"],
            table_accepted_tokens=t["ta"],
            history_draft_tokens=t["hd"],
            history_accepted_tokens=t["ha"],
        )
