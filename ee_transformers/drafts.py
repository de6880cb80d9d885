"""Which drafts a row gets, and whether a round pays: the one heart of every lossless mode that copies drafts.

    drafter = model.drafter                          # one per model and process
    row = SuffixIndex(ngram_size=3); row.extend(prompt_ids)
    chain = drafter.propose(row, row.tail(), max_drafts=8)   # Chain | None: tokens, probs, source
    w = plan_padded([chain.probs], [True], cost)     # generate's rounds: one width for the batch (0: decode plainly)
    ks = plan_packed([chain.probs], base_tokens, cost)       # a packed continuous-batching step: drafts per request
    drafter.observe(chain, accepted, drafted=w)      # after verification
    drafter.finish(generated_ids)                    # a generation ended: its tokens enter the history index

Draft sources, each a `Chain` of copied tokens (drafts are guesses: verification at full depth keeps the output the
full model's, so a source only decides how often a round is worth more than one token):

- **context**: the row's own prompt and output (`SuffixIndex` of the row), as prompt lookup does;
- **history**: earlier generations of this process (`drafter.history`, bounded by a token budget, oldest evicted;
  saved and loaded only through `SuffixIndex.save` / `load`, so a folder never ships user text), as SuffixDecoding's
  global tree does;
- **peer**: the texts (prompt and output so far) of the other rows decoded at the same time: a batch's other rows in
  `generate`, the other requests of a continuous-batching step; where several requests work on one document, a row
  behind copies what a row ahead has already written (before it enters the history). On wherever the history is;
- **table**: the model's stored table of frequent continuations (`draft_table.py`), the seed where neither matches.

`SuffixIndex.chain` finds the occurrences of the row's last g tokens (g <= `ngram_size`, largest first), keeps those
whose match extends furthest back (the longest suffix that matches, up to `MAX_MATCH` tokens), and follows the most
frequent continuation among them token by token; each draft carries the share of those occurrences that continue
that way. `Drafter.propose` turns shares into acceptance probabilities: the verified acceptance so far of drafts like
it (by source, match length, share and support; a Beta estimate learned over the process) times the row's own
acceptance so far relative to what was predicted for it; of the sources' chains it returns the one that expects the
most accepted tokens. `probs[i]` is the probability that drafts 0..i are all accepted (non-increasing).

The gate (never slower): a round that verifies w drafts per row costs `cost(w + 1)`, measured on the running machine
(`StepCosts`: the median of the latest timings of each width, interpolated between measured widths; unmeasured
widths follow a prior of +10% per position relative to the nearest measured one; a width timed fewer than 3 times
costs at most that estimate, so one slow timing does not shut it out). It produces, for a row,
`1 + sum(probs[:w])` tokens in expectation. `plan_padded` picks the w with the most expected tokens per second for
the rows that set the pace (at batch > 1 the batch waits for its slowest rows) and 0, a plain one-token step, unless
drafting beats it by `MARGIN`; `plan_packed` does the same for a packed step, adding the drafts with the highest
probability first; its cost (`PackedCosts`) is fitted on the latest steps from their tokens, logits rows and keys read.

Part of the Hub runtime: imports only torch.
"""

import bisect
import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

DEFAULT_HISTORY_TOKENS = 1 << 16  # the history index's default budget (tokens; a few MB of Python objects)
MAX_MATCH = 16  # how far back a match is extended when ranking occurrences
MAX_OCCURRENCES = 64  # the latest occurrences of an n-gram that are ranked
MAX_PEERS = 7  # peer drafts only where at most this many other rows run beside a row (each costs a lookup)
MARGIN = 1.03  # drafting must beat a plain step's expected tokens per second by this factor
PRIOR_SLOPE = 0.1  # unmeasured widths: +10% cost per extra position
SAMPLES = 9  # timings kept per width (the median is used)
TRUSTED = 3  # timings after which a width's median alone is its cost
PACKED_STEPS = 256  # the latest packed steps `PackedCosts` fits
PACKED_FIT_AFTER = 8  # packed steps timed before the fit replaces the width table
PLAIN_REFRESH = 16  # a plain width's timing older than this many timed rounds is stale ...
REFRESH_BAND = 1.25  # ... and a round drafting for less than this gain over it decodes plainly to time it afresh
BEYOND_SLOWEST = 0.5  # the gate's weight of a pace row's drafts beyond what the slowest row keeps (plan_padded)


@dataclass
class Chain:
    """Drafts of one row. tokens: the copied tokens; shares: per token, the share of the matched occurrences that
    continue this way (cumulative); match: the length of the matched suffix; support: how many occurrences matched;
    source: "context", "history", "peer" or "table"; probs: per token, the estimated probability that it and every draft
    before it are accepted (set by `Drafter.propose`); row: the row's own index (its acceptance so far)."""

    tokens: list[int]
    shares: list[float]
    match: int
    support: int
    source: str
    probs: list[float] = field(default_factory=list)
    cells: list[tuple] = field(default_factory=list)
    conditional: list[float] = field(default_factory=list)  # per token, before the row's factor
    row: "SuffixIndex | None" = None

    def expected(self, k: int | None = None) -> float:
        """Expected accepted drafts when the first `k` (all: None) are verified."""
        return sum(self.probs[:k])


class SuffixIndex:
    """Token documents indexed by their n-grams (n = 1..`ngram_size`), bounded by `max_tokens` (None: unbounded;
    the oldest documents are evicted first). A row's own text is one open document (`extend`); the history index
    holds one closed document per generation (`add_document`). n-grams never span documents.

    Also the row's acceptance so far (`accepted`, `predicted`: drafts it kept, and what was predicted for them)."""

    def __init__(self, ngram_size: int = 3, max_tokens: int | None = None):
        if isinstance(ngram_size, bool) or not isinstance(ngram_size, int) or ngram_size < 1:
            raise ValueError(f"`ngram_size` must be an integer >= 1, got {ngram_size!r}.")
        self.ngram_size = ngram_size
        self.max_tokens = _check_budget(max_tokens)
        self.tokens: list[int] = []  # the store; -1 between documents
        self.base = 0  # global position of tokens[0] (evicted tokens are gone from the front)
        self.where: dict[tuple, list[int]] = {}  # n-gram -> global positions right after it, increasing
        self.documents: deque = deque()  # (global start, global end) of closed documents
        self.start = 0  # global start of the open document
        self.evicted = 0  # tokens evicted since the last re-index
        self.accepted = 0.0
        self.predicted = 0.0

    # ----------------------------------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens held (closed documents and the open one)."""
        return self.base + len(self.tokens) - self.documents[0][0] if self.documents else self._open_length()

    def _open_length(self) -> int:
        return self.base + len(self.tokens) - self.start

    @property
    def nbytes(self) -> int:
        """An estimate of the bytes the index holds in Python objects (a list slot and an int per token, a tuple key
        and a list entry per n-gram occurrence)."""
        occurrences = sum(len(v) for v in self.where.values())
        return 36 * len(self.tokens) + 72 * len(self.where) + 36 * occurrences

    def tail(self, n: int = MAX_MATCH) -> list[int]:
        """The open document's last `n` tokens."""
        return self.tokens[max(len(self.tokens) - n, self.start - self.base) :]

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends `tokens` to the open document and indexes the n-grams they end."""
        store, where, n, start = self.tokens, self.where, self.ngram_size, self.start - self.base
        for t in tokens:
            store.append(int(t))
            end = len(store)  # local position right after the n-grams that end here
            for g in range(1, min(n, end - start) + 1):
                where.setdefault(tuple(store[end - g : end]), []).append(self.base + end)

    def close(self) -> None:
        """Ends the open document (a separator follows it) and evicts the oldest documents beyond the budget."""
        end = self.base + len(self.tokens)
        if end > self.start:
            self.documents.append((self.start, end))
            self.tokens.append(-1)
        self.start = self.base + len(self.tokens)
        self._evict()

    def add_document(self, tokens: Sequence[int]) -> None:
        """One closed document (its last `max_tokens` tokens when longer)."""
        if self.max_tokens == 0:
            return
        tokens = list(tokens)
        if self.max_tokens is not None:
            tokens = tokens[-self.max_tokens :]
        self.extend(tokens)
        self.close()

    def resize(self, max_tokens: int | None) -> None:
        self.max_tokens = _check_budget(max_tokens)
        self._evict()

    def clear(self) -> None:
        self.__init__(self.ngram_size, self.max_tokens)

    def _evict(self):
        if self.max_tokens is None:
            return
        while self.documents and self.num_tokens > self.max_tokens:
            start, end = self.documents.popleft()
            cut = end + 1 - self.base  # the document and its separator
            del self.tokens[:cut]
            self.base += cut
            self.evicted += cut
        if self.evicted > max(self.max_tokens, 1024):  # dead n-grams pile up: index the survivors again
            self._reindex()

    def _reindex(self):
        documents, base = list(self.documents), self.base
        store = self.tokens
        self.where, self.tokens, self.documents, self.evicted = {}, [], deque(), 0
        self.start = self.base = base
        for start, end in documents:
            self.extend(store[start - base : end - base])
            self.close()

    # ----------------------------------------------------------------------------------------------------------------
    def chain(self, suffix: Sequence[int], max_drafts: int, source: str = "context") -> Chain | None:
        """The most frequent continuation of the longest indexed match of `suffix` (the row's latest tokens), at most
        `max_drafts` tokens; None when nothing matches or no occurrence is followed by a token."""
        if max_drafts <= 0 or not suffix:
            return None
        store, base = self.tokens, self.base
        for g in range(min(self.ngram_size, len(suffix)), 0, -1):
            found = self.where.get(tuple(suffix[len(suffix) - g :]))
            if not found:
                continue
            if found[0] <= base:  # the oldest positions were evicted (positions increase)
                del found[: bisect.bisect_right(found, base)]
                if not found:
                    continue
            # continued by a token of the same document (the row's own tail is not a match of itself)
            after = [p - base for p in found[-MAX_OCCURRENCES:] if p - base < len(store) and store[p - base] >= 0]
            if not after:
                continue
            lengths = [_match_length(store, p, suffix, g) for p in after]
            longest = max(lengths)
            after = [p for p, m in zip(after, lengths) if m == longest]
            tokens, shares = _follow(store, after, max_drafts)
            return Chain(tokens, shares, longest, len(after), source)
        return None

    # ----------------------------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Writes the closed documents (token ids) and the settings to `path` (`torch.save` of plain tensors)."""
        docs = [torch.tensor(self.tokens[s - self.base : e - self.base], dtype=torch.long) for s, e in self.documents]
        lengths = torch.tensor([len(d) for d in docs], dtype=torch.long)
        tokens = torch.cat(docs) if docs else torch.zeros(0, dtype=torch.long)
        budget = -1 if self.max_tokens is None else self.max_tokens
        torch.save({"tokens": tokens, "lengths": lengths, "ngram_size": self.ngram_size, "max_tokens": budget}, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SuffixIndex":
        state = torch.load(path, weights_only=True)
        budget = None if state["max_tokens"] < 0 else int(state["max_tokens"])
        index = cls(int(state["ngram_size"]), budget)
        for doc in state["tokens"].split(state["lengths"].tolist()):
            index.add_document(doc.tolist())
        return index


def peers_of(texts: Sequence[SuffixIndex], row: int) -> list[SuffixIndex]:
    """The texts `row` looks its peer drafts up in: every other one, or none when more than `MAX_PEERS` others run
    beside it (a wide batch or step rarely pays for drafts, and each peer costs a lookup per row, about 30 us)."""
    return [] if len(texts) > MAX_PEERS + 1 else [t for i, t in enumerate(texts) if i != row]


def _check_budget(max_tokens):
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
        raise ValueError(f"`max_tokens` must be an integer >= 0 or None, got {max_tokens!r}.")
    return max_tokens


def _match_length(store, p, suffix, g):
    """How many of `suffix`'s last tokens equal the tokens before local position `p` (at least g, at most
    `MAX_MATCH`)."""
    m, n = g, len(suffix)
    while m < min(n, MAX_MATCH) and p - m - 1 >= 0 and store[p - m - 1] == suffix[n - m - 1]:
        m += 1
    return m


def _follow(store, after, max_drafts):
    """From the occurrences ending before local positions `after`, the most frequent next token (ties: the latest
    occurrence's), step by step; returns (tokens, cumulative shares)."""
    tokens, shares, total, end = [], [], len(after), len(store)
    for d in range(max_drafts):
        counts: dict[int, int] = {}
        for p in reversed(after):  # latest first: the tie-break
            if p + d < end and store[p + d] >= 0:
                counts[store[p + d]] = counts.get(store[p + d], 0) + 1
        if not counts:
            break
        best = max(counts, key=counts.get)  # the first maximum in insertion order: the latest occurrence's
        after = [p for p in after if p + d < end and store[p + d] == best]
        tokens.append(best)
        shares.append(len(after) / total)
    return tokens, shares


# ---------------------------------------------------------------------------------------------------------------------
# acceptance and costs
# ---------------------------------------------------------------------------------------------------------------------
def _bucket(value, edges):
    return sum(value >= e for e in edges)


def _cell(source, match, share, support):
    """A draft's kind: its source, match length, conditional share and support, bucketed."""
    return (source, _bucket(match, (2, 3, 4, 8)), _bucket(share, (0.5, 0.8, 1.0)), _bucket(support, (2, 4)))


class Drafter:
    """The process-wide draft state of one model: the history index of earlier generations, the acceptance
    statistics of the drafts verified so far, the measured step costs, and the stored table (when given)."""

    def __init__(self, history_tokens: int | None = DEFAULT_HISTORY_TOKENS, ngram_size: int = 4):
        self.history = SuffixIndex(ngram_size, history_tokens)
        self.costs = StepCosts()
        self.packed = PackedCosts(self.costs)
        self.stats: dict[tuple, list[float]] = {}  # cell -> [accepted, reached]
        self.table: dict[tuple[int, int] | int, int] | None = None
        self._table_key = None

    def use_table(self, keys: torch.Tensor, following: torch.Tensor, vocab_size: int) -> None:
        """The stored table (`draft_table.build_draft_table`'s buffers), as a dict built once per table."""
        key = (keys.data_ptr(), keys.numel(), keys._version)
        if key == self._table_key:
            return
        # keys: a pair (a, b) is a * V + b, a single token b is V * V + b
        self.table, self._table_key, self._vocab = dict(zip(keys.tolist(), following.tolist())), key, vocab_size

    def table_chain(self, suffix: Sequence[int], max_drafts: int) -> Chain | None:
        if not self.table or max_drafts <= 0 or not suffix:
            return None
        v, table = self._vocab, self.table
        a, b = (suffix[-2] if len(suffix) > 1 else -1), suffix[-1]
        tokens = []
        while len(tokens) < max_drafts:
            nxt = table.get(a * v + b, -1) if a >= 0 else -1
            nxt = table.get(v * v + b, -1) if nxt < 0 else nxt
            if nxt < 0:
                break
            tokens.append(nxt)
            a, b = b, nxt
        return Chain(tokens, [1.0] * len(tokens), 2, 4, "table") if tokens else None

    # ----------------------------------------------------------------------------------------------------------------
    def propose(
        self,
        context: SuffixIndex | None,
        suffix: Sequence[int],
        max_drafts: int,
        history: bool = True,
        table=False,
        peers: Sequence[SuffixIndex] = (),
    ) -> Chain | None:
        """The chain of the row's sources (its own text `context`, the history index, the texts of the rows decoded
        beside it, `peers`, and the stored table) that expects the most accepted drafts, with its `probs` set; None
        when no source offers one."""
        chains = [
            context.chain(suffix, max_drafts, "context") if context is not None else None,
            self.history.chain(suffix, max_drafts, "history") if history and self.history.tokens else None,
            self.table_chain(suffix, max_drafts) if table else None,
            *(peer.chain(suffix, max_drafts, "peer") for peer in (peers if history else ())),
        ]
        best = None
        for chain in chains:
            if chain is not None:
                self._estimate(chain, context)
                best = chain if best is None or chain.expected() > best.expected() else best
        return best

    def _estimate(self, chain: Chain, row: SuffixIndex | None) -> None:
        factor = 1.0 if row is None else min(max((row.accepted + 2.0) / (row.predicted + 2.0), 0.25), 2.0)
        probs, cells, conditional, p, before = [], [], [], 1.0, 1.0
        for share in chain.shares:
            cell = _cell(chain.source, chain.match, share / before, chain.support)
            accepted, reached = self.stats.get(cell, (0.0, 0.0))
            prior = (0.6 if chain.source != "table" else 0.3) * share / before
            conditional.append((accepted + 2.0 * prior) / (reached + 2.0))
            p *= min(conditional[-1] * factor, 0.98)
            probs.append(p)
            cells.append(cell)
            before = share
        chain.probs, chain.cells, chain.conditional, chain.row = probs, cells, conditional, row

    def observe(self, chain: Chain, accepted: int, drafted: int | None = None) -> None:
        """`accepted` of the first `drafted` (default: all) of `chain.tokens` were accepted: each draft that was
        reached (every one before it accepted) updates its kind's statistics and the row's."""
        drafted = len(chain.tokens) if drafted is None else min(drafted, len(chain.tokens))
        reached = min(accepted + 1, drafted)
        for i in range(reached):
            counts = self.stats.setdefault(chain.cells[i], [0.0, 0.0])
            counts[0] += float(i < accepted)
            counts[1] += 1.0
        if chain.row is not None:
            chain.row.accepted += min(accepted, drafted)
            chain.row.predicted += sum(chain.conditional[:reached])

    def finish(self, tokens: Sequence[int]) -> None:
        """A generation ended: its tokens become a document of the history index."""
        self.history.add_document(tokens)


class StepCosts:
    """Seconds of a step by kind and width, measured on the running machine: `observe(key, seconds)`, `cost(key)`.
    A key is a tuple whose last element is the width (positions per row, or packed tokens) and whose other
    elements name a group (e.g. ("padded", rows, width), ("packed", tokens)); a width is compared only with widths
    of its group."""

    def __init__(self):
        self.samples: dict[tuple, dict[int, deque]] = {}
        self.clock, self.latest = 0, {}  # timings so far; the clock at each key's latest

    def observe(self, key: tuple, seconds: float) -> None:
        group, width = key[:-1], int(key[-1])
        self.samples.setdefault(group, {}).setdefault(width, deque(maxlen=SAMPLES)).append(float(seconds))
        self.clock += 1
        self.latest[(*group, width)] = self.clock

    def measured(self, key: tuple) -> bool:
        return int(key[-1]) in self.samples.get(key[:-1], {})

    def trusted(self, key: tuple) -> bool:
        """Whether `key` has been timed `TRUSTED` times (its median alone is then its cost)."""
        return len(self.samples.get(key[:-1], {}).get(int(key[-1]), ())) >= TRUSTED

    def cheapest(self, group: tuple, least: int, most: int = 0) -> int:
        """`cheapest_width` of `group`'s widths `least..most`, a wider one competing once it is `trusted`."""
        return cheapest_width(lambda w: self.cost((*group, w)), least, most, lambda w: self.trusted((*group, w)))

    def age(self, key: tuple) -> int | None:
        """Timings (of any key) since `key`'s latest; None when it was never timed."""
        latest = self.latest.get((*key[:-1], int(key[-1])))
        return None if latest is None else self.clock - latest

    def cost(self, key: tuple) -> float:
        """The median measured seconds of `key`; between measured widths linearly interpolated; beyond them (or with
        none measured in the group, in prior units) scaled by the prior `1 + PRIOR_SLOPE * (width - 1)`."""
        group, x = key[:-1], int(key[-1])
        widths = self.samples.get(group, {})
        if x in widths and len(widths[x]) >= TRUSTED:
            return _median(widths[x])
        others = {w: v for w, v in widths.items() if w != x}
        estimate = _between(others, x) if others else _prior(x)
        # a width timed fewer than TRUSTED times: one slow sample must not shut it out for good
        return min(_median(widths[x]), estimate) if x in widths else estimate


class PackedCosts:
    """Seconds of a packed continuous-batching step from what it computes, fitted on the running machine's latest
    steps: `a + b * tokens + c * rows + d * tokens * keys / 1024 + e * drafted`, where `tokens` are the step's packed
    tokens (the decoder layers' work), `rows` those that get logits (the LM head's: a draft is a row, a prefill token
    is not), `keys` the K/V its attention reads (the step's tokens included: packed attention computes tokens x
    keys) and `drafted` 1 for a step that verifies drafts (its verification and rollback). A draft adds one to each of
    the first three. Weighted least squares on relative error with non-negative coefficients over the latest
    `PACKED_STEPS` steps; until `PACKED_FIT_AFTER` steps are timed, the width table `costs` keyed by tokens.

    Keyed by tokens alone, a step of 32 decode tokens and 26 drafts looks like one of 32 and a 26-token prefill
    chunk, though the drafted one also runs 26 more rows through the LM head (Gemma-3-270M's has 262k words) and 26
    more queries over every key: the width table undercounted what drafts cost under load (BENCHMARKS.md 6e)."""

    def __init__(self, costs: StepCosts):
        self.table, self.samples, self._fit = costs, deque(maxlen=PACKED_STEPS), None

    @staticmethod
    def _features(tokens, rows, keys, drafted):
        return (1.0, float(tokens), float(rows), tokens * keys / 1024.0, float(drafted))

    def observe(self, tokens: int, rows: int, keys: int, seconds: float, drafted: bool = False) -> None:
        self.table.observe(("packed", tokens), seconds)
        self.samples.append((self._features(tokens, rows, keys, drafted), float(seconds)))
        self._fit = None

    def coefficients(self) -> list[float] | None:
        """(a, b, c, d, e) of the fit, None before `PACKED_FIT_AFTER` steps."""
        if self._fit is None and len(self.samples) >= PACKED_FIT_AFTER:
            x = torch.tensor([f for f, _ in self.samples], dtype=torch.float64)
            y = torch.tensor([s for _, s in self.samples], dtype=torch.float64)
            x, keep = x / y[:, None], list(range(x.shape[1]))  # relative error: each row divided by its seconds
            while True:  # least squares; a negative coefficient leaves the fit (an active set, non-negative)
                beta = torch.linalg.lstsq(x[:, keep], torch.ones_like(y)[:, None]).solution[:, 0]
                if bool((beta >= 0).all()) or len(keep) == 1:
                    break
                keep.pop(int(beta.argmin()))
            fit = [0.0] * x.shape[1]
            for i, b in zip(keep, beta.clamp(min=0).tolist()):
                fit[i] = b
            self._fit = fit
        return self._fit

    def cost(self, tokens: int, rows: int, keys: int, drafted: bool = False) -> float:
        fit = self.coefficients()
        if fit is None or not any(fit):
            return self.table.cost(("packed", tokens))
        return sum(b * f for b, f in zip(fit, self._features(tokens, rows, keys, drafted)))


def _between(widths, x):
    """Seconds at width x from the measured `widths` {width: samples} (x not among them): interpolated between the
    nearest measured widths, or scaled by the prior from the nearest one."""
    lower = max((w for w in widths if w < x), default=None)
    upper = min((w for w in widths if w > x), default=None)
    if lower is not None and upper is not None:
        a, b = _median(widths[lower]), _median(widths[upper])
        return a + (b - a) * (x - lower) / (upper - lower)
    near = lower if lower is not None else upper
    return _median(widths[near]) * _prior(x) / _prior(near)


def _prior(width):
    return 1.0 + PRIOR_SLOPE * (max(width, 1) - 1)


def _median(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


# ---------------------------------------------------------------------------------------------------------------------
# the gate
# ---------------------------------------------------------------------------------------------------------------------
def cheapest_width(
    cost: Callable[[int], float], least: int, most: int = 0, known: Callable[[int], bool] | None = None
) -> int:
    """The fed width (positions per row) in `least..most` of the lowest `cost`, the narrowest among equals; a width
    beyond `least` competes only where `known(width)` (default: every one). Where the machine's kernels are faster at
    a wider round, its extra positions are fillers, never accepted (on the 2-core CPU of BENCHMARKS.md 5g,
    SmolLM2-135M at batch 1 verified 5 positions in 69 ms and 2 in 87)."""
    wider = [width for width in range(least + 1, most + 1) if known is None or known(width)]
    return min([least, *wider], key=lambda width: (cost(width), width))


def plan_padded(
    probs: Sequence[Sequence[float]],
    pace: Sequence[bool],
    cost: Callable[[int], float],
    beyond: float = 1.0,
    fed: Callable[[int], int] | None = None,
) -> int:
    """Drafts per row, w, of a round that feeds every row w + 1 positions (`cost(w + 1)` seconds): the w whose
    expected advance per second is highest; 0 (a plain step) unless drafting beats it by `MARGIN`. `probs[r][j]`:
    the chance that row r keeps its drafts 0..j. The advance counts the rows that set the pace (`pace`): the drafts
    all of them keep (the slowest row's, the rows taken as independent: the batch moves with it) in full, and each
    row's drafts beyond those weighted by `beyond` (1: the rows' mean; 0: the slowest row's alone). A row that gets
    ahead of the slowest moves the batch only later, when it drops out of the pace or finishes early. A round of w
    drafts is fed `fed(w + 1)` positions (fillers after the drafts; default w + 1) and costs that width's time."""
    rows = [p for p, lead in zip(probs, pace) if lead]
    widest = max((len(p) for p in rows), default=0)
    if not widest:
        return 0
    plain, best, best_w, slowest, total = 1.0 / cost(1), 0.0, 0, 0.0, 0.0
    for w in range(1, widest + 1):
        kept = [p[w - 1] if w <= len(p) else 0.0 for p in rows]
        slowest, total = slowest + math.prod(kept), total + sum(kept)
        mean = total / len(rows)
        rate = (1.0 + slowest + beyond * (mean - slowest)) / cost(w + 1 if fed is None else fed(w + 1))
        if rate > best:
            best, best_w = rate, w
    return best_w if best > MARGIN * plain else 0


def plan_packed(probs: Sequence[Sequence[float]], base_tokens: int, cost: Callable[[int], float]) -> list[int]:
    """Drafts per decode request of a packed step of `base_tokens` tokens without drafts (`cost(tokens)` seconds):
    the drafts with the highest probability first (a request's in order), as many as maximise the step's expected
    tokens per second; none unless drafting beats the plain step by `MARGIN`."""
    items = sorted(((p, r) for r, ps in enumerate(probs) for p in ps), key=lambda x: -x[0])  # stable: in order
    produced = float(len(probs))
    plain = produced / cost(base_tokens)
    best, best_n, gained = plain * MARGIN, 0, 0.0
    for n, (p, _) in enumerate(items, start=1):
        gained += p
        rate = (produced + gained) / cost(base_tokens + n)
        if rate > best:
            best, best_n = rate, n
    ks = [0] * len(probs)
    for _, r in items[:best_n]:
        ks[r] += 1
    return ks


def plan_padded_fresh(
    probs: Sequence[Sequence[float]], pace: Sequence[bool], costs: StepCosts, group: tuple, most_fed: int = 0
) -> int:
    """`plan_padded` (drafts beyond the slowest row's weighted by `BEYOND_SLOWEST`) on `costs`' widths of `group` (keys
    `(*group, width)`), with the plain width kept fresh: a round decodes plainly (0), and so times the plain width,
    when that width was never timed in the group (its estimate would come from wider rounds by the prior's slope), or
    when its timing is `PLAIN_REFRESH` timings old and drafting wins by less than `REFRESH_BAND`: a drift of the
    machine since then, or a batch of another speed, could have turned that gain into a loss, and once drafting wins
    nothing else would time plain again. A round is fed at `costs.cheapest` width up to `most_fed` (a wider width
    competes once it is trusted: a single fast timing, or a guess, does not draw every round to it)."""
    cost = lambda width: costs.cost((*group, width))  # noqa: E731
    fed = lambda least: costs.cheapest(group, least, most_fed)  # noqa: E731
    w = plan_padded(probs, pace, cost, BEYOND_SLOWEST, fed)
    age = costs.age((*group, 1))
    if w and age is None:
        return 0
    banded = lambda x: cost(x) * (REFRESH_BAND if x > 1 else 1)  # noqa: E731
    if w and age >= PLAIN_REFRESH and not plan_padded(probs, pace, banded, BEYOND_SLOWEST, fed):
        return 0
    return w


def pace_setters(lengths: Sequence[int], active: Sequence[bool], slack: int = 1) -> list[bool]:
    """The active rows that set a batch's pace: those at most `slack` tokens ahead of the shortest active row (the
    batch ends when its slowest row does)."""
    live = [n for n, a in zip(lengths, active) if a]
    if not live:
        return [False] * len(lengths)
    slowest = min(live)
    return [bool(a) and n <= slowest + slack for n, a in zip(lengths, active)]


__all__ = [
    "DEFAULT_HISTORY_TOKENS",
    "Chain",
    "Drafter",
    "StepCosts",
    "SuffixIndex",
    "cheapest_width",
    "pace_setters",
    "peers_of",
    "plan_packed",
    "plan_padded",
    "plan_padded_fresh",
]
