"""The package's drafter as vLLM's proposer: lossless copied drafts for every running request of a vLLM step.

    --speculative-config '{"method": "custom_class", "model": "ee_transformers.vllm.proposer.EarlyExitProposer",
                           "num_speculative_tokens": 4}'

vLLM builds the class with its `VllmConfig` and, after each step's sampling, calls `propose` with every row's sampled
tokens, token count and the CPU token table; it returns each row's drafts, which vLLM verifies at full depth in the
next step with its own rejection sampler (greedy: a draft is kept where it equals the target's argmax, so the text
is the model's own). What a row drafts is `drafts.Drafter.propose`, the code `generate` and transformers' continuous
batching call: the request's own prompt and output, the history index of earlier generations of this process, the
other running requests' texts (peers, up to `drafts.MAX_PEERS`), and the folder's stored table. How many drafts each
row gets is `drafts.plan_packed` on the step cost `drafts.PackedCosts` fits from the steps vLLM ran here (the
seconds between two calls of a step that only continued its requests, against its scheduled tokens, logits rows and
keys read), so drafting shrinks toward none as the batch fills.

The settings are the folder's stored lossless mode (`prompt_lookup_num_tokens`, `max_matching_ngram_size`,
`speculative_table_drafts`, `speculative_history_tokens`: the history budget, `speculative_gate`) under vLLM's
precedence (`--override-generation-config`), validated by the same resolver as continuous batching's;
`num_speculative_tokens` caps the drafts per row. vLLM does not tell a proposer which request a row holds, so a
request's text is followed by its content: its first tokens and the last ones indexed (`_Rows`).
"""

import json
import os
import time

import numpy as np
import torch

from ..drafts import MAX_MATCH, Drafter, SuffixIndex, peers_of, plan_packed
from .config import requested_values

STATS_EVERY = 2000  # steps between two INFO lines of the proposer's counts
KEY_TOKENS = 16  # a request's first tokens: the key its text is found under
TAIL_TOKENS = 8  # the last tokens indexed, which a row must still hold to continue a text


class _Text:
    """One request's text as the proposer follows it: its index, how many tokens it holds, the prompt length (the
    tokens held when first seen, less the sampled ones), the chain drafted for it at the last step, and when it was
    last seen."""

    __slots__ = ("index", "seen", "prompt", "chain", "k", "step")

    def __init__(self, ngram_size, prompt):
        self.index, self.seen, self.prompt, self.chain, self.k, self.step = (
            SuffixIndex(ngram_size),
            0,
            prompt,
            None,
            0,
            0,
        )

    def tail(self):
        return self.index.tokens[-TAIL_TOKENS:]


class _Rows:
    """Requests' texts found by content: their first `KEY_TOKENS` tokens (all of them, for a text first seen
    shorter) -> texts."""

    def __init__(self):
        self.by_key: dict[bytes, list[_Text]] = {}
        self.lengths = {KEY_TOKENS}  # the key lengths in use

    def find(self, tokens: np.ndarray, taken: set) -> "_Text | None":
        """The text `tokens` continues: same first tokens, fewer tokens held, and its last indexed tokens in place."""
        best = None
        for length in self.lengths:
            for text in self.by_key.get(tokens[:length].tobytes(), ()):
                if id(text) in taken or text.seen > len(tokens):
                    continue
                tail = text.tail()
                if tokens[text.seen - len(tail) : text.seen].tolist() == tail and (
                    best is None or text.seen > best.seen
                ):
                    best = text
        return best

    def add(self, tokens: np.ndarray, text: _Text) -> None:
        self.lengths.add(min(len(tokens), KEY_TOKENS))
        self.by_key.setdefault(tokens[:KEY_TOKENS].tobytes(), []).append(text)

    def gone(self, step: int):
        """Texts not seen at `step` or the one before: removed and returned (their requests finished or left)."""
        out = []
        for key in list(self.by_key):
            texts = self.by_key[key]
            out += [t for t in texts if t.step < step - 1]
            texts[:] = [t for t in texts if t.step >= step - 1]
            if not texts:
                del self.by_key[key]
        return out

    def __len__(self):
        return sum(len(v) for v in self.by_key.values())


def _stored_table(folder):
    """(keys, next tokens) of the folder's stored draft table, None without one."""
    from safetensors import safe_open

    names = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    for name in names:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            if "draft_table_keys" in f.keys():
                return f.get_tensor("draft_table_keys"), f.get_tensor("draft_table_next")
    return None


class EarlyExitProposer:
    """vLLM's `custom_class` proposer on the package's `Drafter` (see the module's docstring)."""

    def __init__(self, vllm_config):
        from transformers import GenerationConfig

        from ..request import DRAFT_FIELDS, paged_draft_settings

        model_config = vllm_config.model_config
        self.max_drafts = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = model_config.max_model_len
        asked = requested_values(model_config, DRAFT_FIELDS)
        values = {name: value for name, value in asked.items() if value is not None}
        values.setdefault("prompt_lookup_num_tokens", self.max_drafts)
        hf_config = model_config.hf_config

        class _Folder:  # what the resolver reads off a model
            config = hf_config
            generation_config = GenerationConfig(**values)

        self.settings = paged_draft_settings(_Folder)
        self.drafter = Drafter(history_tokens=self.settings.history or None)
        self.table = False
        if self.settings.table:
            keys, following = _stored_table(model_config.model)
            self.drafter.use_table(keys, following, hf_config.vocab_size)
            self.table = True
        self.rows = _Rows()
        self.steps = 0
        self.totals = {"drafted": 0, "accepted": 0, "requests": 0, "seconds": 0.0}
        self._last = None  # (perf_counter at the end of the last call, the step's (tokens, rows, keys, drafted))
        from vllm.logger import init_logger

        self.logger = init_logger(__name__)
        self.logger.info(
            "ee-transformers proposer: up to %d drafts per request from %s; gate %s; history budget %d tokens",
            self.max_drafts,
            ", ".join(["context", "peers"] + (["history"] if self.settings.history else []) + (["table"] * self.table)),
            "on" if self.settings.gate else "off",
            self.settings.history,
        )

    @torch.no_grad()
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_):
        start = time.perf_counter()
        self.steps += 1
        step, taken = self.steps, set()
        texts: list[_Text | None] = []
        continued = True  # every row continues a text seen at the last call (no prompt in the step): the step is timed
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not sampled or n >= self.max_model_len - 1:
                texts.append(None)
                continued = continued and not sampled
                continue
            tokens = token_ids_cpu[i, :n]
            text = self.rows.find(tokens, taken)
            if text is None:
                text, continued = _Text(self.settings.ngram_size, n - len(sampled)), False
                self.rows.add(tokens, text)
            elif text.step == step - 1:  # a decode step of this text; with drafts, verified: those kept, plus one
                if text.chain is not None:
                    accepted = min(len(sampled) - 1, text.k)
                    self.drafter.observe(text.chain, accepted, drafted=text.k)
                    self.totals["accepted"] += accepted
            else:
                continued = False
            text.index.extend(tokens[text.seen : n].tolist())
            text.seen, text.step, text.chain, text.k = n, step, None, 0
            taken.add(id(text))
            texts.append(text)
        if self._last is not None and continued and any(t is not None for t in texts):
            tokens, rows, keys, drafted = self._last[1]
            self.drafter.packed.observe(tokens, rows, keys, start - self._last[0], drafted=drafted)
        for text in self.rows.gone(step):
            self.drafter.finish(text.index.tokens[text.prompt :])
            self.totals["requests"] += 1
        drafts = self._draft(texts, num_tokens_no_spec)
        end = time.perf_counter()
        self.totals["seconds"] += end - start
        if step % STATS_EVERY == 0:
            self.logger.info("ee-transformers proposer: %s", json.dumps(self.stats()))
        return drafts

    def _draft(self, texts, num_tokens_no_spec):
        s = self.settings
        live = [t for t in texts if t is not None]
        indexes = [t.index for t in live]
        chains, r = [], -1
        for text in texts:
            chain, room = None, 0
            if text is not None:
                r, room = r + 1, min(self.max_drafts, self.max_model_len - text.seen - 1)
            if room > 0:
                peers = peers_of(indexes, r)
                chain = self.drafter.propose(
                    text.index, text.index.tail(MAX_MATCH), room, s.history > 0, s.table, peers
                )
            chains.append(chain if chain is not None and chain.tokens else None)
        decoding = len(live)
        keys = sum(t.seen + 1 for t in live)
        if s.gate and any(c is not None for c in chains):

            def cost(tokens):  # each draft is a token, a logits row and a key more
                n = tokens - decoding
                return self.drafter.packed.cost(tokens, decoding + n, keys + n, n > 0)

            ks = plan_packed([list(c.probs) if c is not None else [] for c in chains], decoding, cost)
        else:
            ks = [len(c.tokens) if c is not None else 0 for c in chains]
        out = []
        for text, chain, k in zip(texts, chains, ks):
            k = min(int(k), len(chain.tokens)) if chain is not None else 0
            if k > 0:
                text.chain, text.k = chain, k
                self.totals["drafted"] += k
            out.append(list(chain.tokens[:k]) if k > 0 else [])
        added = sum(len(d) for d in out)
        self._last = (time.perf_counter(), (decoding + added, decoding + added, keys + added, added > 0))
        return out

    def stats(self) -> dict:
        """Counts so far: drafted and accepted tokens, finished requests, the proposer's own seconds, the requests
        followed, and the history index's tokens and bytes."""
        history = self.drafter.history
        return {
            **self.totals,
            "steps": self.steps,
            "following": len(self.rows),
            "history_tokens": history.num_tokens,
            "history_bytes": history.nbytes,
        }

    # vLLM calls these on some proposers; copied drafts need nothing loaded
    def load_model(self, *args, **kwargs) -> None:
        return None


__all__ = ["EarlyExitProposer"]
