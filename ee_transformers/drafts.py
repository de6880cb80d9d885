"""STAND-IN for the shared draft heart the lead is writing on main (same API); replaced by main's file on merge.

Only what `paged_speculative.py` calls: `SuffixIndex`, `Drafter` (`propose`, `observe`, `finish`, `history`,
`costs`), `StepCosts`, `Chain`, `plan_packed`.

Part of the Hub runtime: imports only torch, transformers and its siblings.
"""

from collections.abc import Callable
from dataclasses import dataclass, field


class SuffixIndex:
    """Tokens of one document (a request's prompt and output so far); `continuation` finds the most recent earlier
    occurrence of the longest suffix (up to `ngram_size` tokens) and returns what followed it."""

    def __init__(self, ngram_size: int = 3, max_tokens: int | None = None):
        self.ngram_size, self.max_tokens, self.tokens = ngram_size, max_tokens, []

    def extend(self, tokens: list[int]) -> None:
        self.tokens += list(tokens)
        if self.max_tokens is not None and len(self.tokens) > self.max_tokens:
            del self.tokens[: len(self.tokens) - self.max_tokens]

    def close(self) -> None:
        self.tokens.append(-1)  # a separator no n-gram matches across

    def continuation(self, suffix: list[int], limit: int) -> list[int]:
        t, best = self.tokens, []
        for n in range(min(self.ngram_size, len(suffix)), 0, -1):
            gram = list(suffix[-n:])
            for start in range(len(t) - n - 1, -1, -1):  # the most recent match with `limit` tokens after it
                if t[start : start + n] == gram:
                    out = t[start + n : start + n + limit]
                    out = out[: out.index(-1)] if -1 in out else out
                    if len(out) == limit:
                        return out
                    best = out if len(out) > len(best) else best
            if best:
                return best
        return best


@dataclass
class Chain:
    tokens: list[int]
    probs: list[float]
    source: str


@dataclass
class StepCosts:
    samples: dict = field(default_factory=dict)

    def observe(self, key, seconds: float) -> None:
        n, total = self.samples.get(key, (0, 0.0))
        self.samples[key] = (n + 1, total + seconds)

    def cost(self, key) -> float:
        if key in self.samples:
            n, total = self.samples[key]
            return total / n
        return 1.0


class Drafter:
    def __init__(self, ngram_size: int = 3):
        self.history, self.costs = SuffixIndex(ngram_size), StepCosts()
        self.drafted = self.accepted = 0

    def propose(self, context: SuffixIndex, suffix: list[int], max_drafts: int) -> Chain | None:
        if max_drafts <= 0:
            return None
        rate = (self.accepted + 1) / (self.drafted + 2)
        for source, index in (("context", context), ("history", self.history)):
            tokens = index.continuation(suffix, max_drafts)
            if tokens:
                return Chain(tokens, [rate ** (i + 1) for i in range(len(tokens))], source)
        return None

    def observe(self, chain: Chain, accepted: int) -> None:
        self.drafted += len(chain.tokens)
        self.accepted += accepted

    def finish(self, tokens: list[int]) -> None:
        self.history.extend(tokens)
        self.history.close()


def plan_packed(chains_probs: list[list[float]], base_tokens: int, cost: Callable[[int], float]) -> list[int]:
    ks = [0] * len(chains_probs)
    best = (len(chains_probs) + 0.0) / cost(base_tokens)
    produced, total = float(len(chains_probs)), base_tokens
    while True:
        options = [(probs[k], i) for i, (probs, k) in enumerate(zip(chains_probs, ks)) if k < len(probs)]
        if not options:
            return ks
        p, i = max(options)
        ratio = (produced + p) / cost(total + 1)
        if ratio <= best:
            return ks
        ks[i], produced, total, best = ks[i] + 1, produced + p, total + 1, ratio
