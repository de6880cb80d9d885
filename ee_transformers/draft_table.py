"""Table drafts: a row whose own text offers no n-gram match drafts from the most frequent continuations of a corpus.

    model.set_draft_table(blocks)          # (n, T) token ids of text like the user's (`fit` stores its data's)
    model.generate(ids, prompt_lookup_num_tokens=2, max_matching_ngram_size=3, speculative_table_drafts=True)

The table maps each token pair (a, b) seen at least `min_count` times to the token that most often followed it, and
each single token b likewise (the fallback when the pair is missing). A draft chain follows it from the row's last two
tokens. Drafts are guesses verified at full depth like every copied draft, so the output is the full model's; a table
only decides how often a round is worth more than one token (REST, He et al. 2024, drafts from a datastore likewise).

Stored as two sorted buffers of the model, `draft_table_keys` / `draft_table_next` (`config.draft_table_size`
entries): a pair (a, b) has key `a * V + b`, a single token b key `V * V + b`.

Part of the Hub runtime: imports only torch.
"""

import torch


def build_draft_table(blocks, vocab_size: int, min_count: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, next) of the table of `blocks` (a `(n, T)` tensor or a list of 1-D token sequences): sorted int64 keys
    and, for each, its most frequent following token (ties: the lower id), over continuations seen >= `min_count`
    times."""
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        raise ValueError(f"`min_count` must be an integer >= 1, got {min_count!r}.")
    rows = [torch.as_tensor(b, dtype=torch.long).flatten().cpu() for b in blocks]
    v = vocab_size
    pairs, singles = [], []
    for s in rows:
        if s.numel() and (int(s.min()) < 0 or int(s.max()) >= v):
            raise ValueError(f"`blocks` must hold token ids in [0, {v}).")
        pairs.append((s[:-2] * v + s[1:-1]) * v + s[2:])
        singles.append(v * v * v + s[:-1] * v + s[1:])  # after every pair key: sorts into its own range
    keys, counts = torch.cat(pairs + singles).unique(return_counts=True)
    keep = counts >= min_count
    keys, counts = keys[keep], counts[keep]
    context, following = keys // v, keys % v  # context: a * V + b, or V * V + b for a single token
    # per context the most frequent follower: sort by count (descending, stable keeps the lower id first), then by
    # context (stable), and take each context's first entry
    order = torch.sort(counts, descending=True, stable=True).indices
    order = order[torch.sort(context[order], stable=True).indices]
    context, following = context[order], following[order]
    first = torch.ones_like(context, dtype=torch.bool)
    first[1:] = context[1:] != context[:-1]
    return context[first], following[first]


def table_drafts(keys, following, tokens, length, budget, vocab_size: int):
    """Up to `budget[r]` `(B,)` drafts per row chained through the table from the row's last two tokens
    (`tokens[r, :length[r]]`). Returns (drafts `(B, max budget)`, counts `(B,)`: the chain stops at the first token
    the table does not continue)."""
    size, v = int(budget.max()) if keys.numel() else 0, vocab_size  # the round's one host sync
    last = tokens.gather(1, (length[:, None] - 2 + torch.arange(2, device=length.device)).clamp_min(0))  # (B, 2)
    a, b = last[:, 0], last[:, 1]
    drafts = tokens.new_zeros(tokens.shape[0], size)
    going, counts = budget > 0, torch.zeros_like(length)
    for i in range(size):  # a chain step for every row at once: the pair's key, then the single token's
        query = torch.stack([a * v + b, v * v + b], dim=1)  # (B, 2)
        at = torch.searchsorted(keys, query).clamp_max(keys.numel() - 1)
        found = keys[at] == query
        nxt = torch.where(found[:, 0], following[at[:, 0]], torch.where(found[:, 1], following[at[:, 1]], -1))
        going = going & (nxt >= 0) & (i < budget)  # a chain that stopped stays stopped
        drafts[:, i] = torch.where(going, nxt, 0)
        counts += going.long()
        a, b = b, nxt.clamp_min(0)
    return drafts, counts
