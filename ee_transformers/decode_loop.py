"""The generate-loop skeleton every decoding mode shares, written once: what transformers' own sampling loop does
around a model's forward. A mode's `custom_generate` (`early_exit_generate`, `speculative_generate`) checks its own
preconditions, then supplies only its step:

    require_cache(model_kwargs, mode)   the KV cache the loop decodes into (a `ValueError` naming the mode without one)
    loop = DecodeLoop(...)              EOS and pad handling as plain generate decides it: `pad_token_id`, `pad_mode`
                                        (an EOS criterion is set: a row ends at its EOS and is padded after it),
                                        `max_length` (the tightest of the config's and the stopping criteria's); the
                                        streamer gets the prompt
    loop.next_tokens(ids, logits)       one step of one token per row: the logits processors, the recorded scores and
                                        raw logits (when `output_scores` / `output_logits` ask), the draw
    loop.record_rows(...)               the same records for rows that advance by different numbers of tokens (a
                                        ragged batch: `row_scores=vocab_size`, one buffer slot per row and step)
    loop.choose(scores)                 a token per row: sampled or greedy, as plain generate draws it
    loop.stream(tokens)                 the streamer's next tokens
    loop.finish(sequences, Output, ...) the streamer's end; the sequences, or the output with the recorded scores

Part of the Hub runtime: imports only torch, transformers and its siblings.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .compat import cache_of


def require_cache(model_kwargs, mode: str):
    """The KV cache `generate` prepared (`model_kwargs[CACHE]`); a `ValueError` naming `mode` when there is none."""
    cache = cache_of(model_kwargs)
    if not model_kwargs.get("use_cache", True) or cache is None:
        raise ValueError(f"{mode} needs a KV cache: call generate with `use_cache=True`.")
    return cache


class DecodeLoop:
    """The shared part of one `custom_generate` call over `input_ids` `(B, P)`: its logits processors, stopping
    criteria and streamer as `generate` prepared them, EOS / pad handling, and the score and logit records.

    row_scores: None records one `(B, V)` entry per step (every row advances by one token); a vocabulary size
    preallocates `(B, max_length - P, V)` buffers that `record_rows` fills per row (rows advance by different numbers
    of tokens)."""

    def __init__(
        self, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None, row_scores=None
    ):
        self.logits_processor, self.stopping_criteria, self.streamer = logits_processor, stopping_criteria, streamer
        self.prompt_length, self.sample = input_ids.shape[1], generation_config.do_sample
        pad = generation_config._pad_token_tensor
        self.pad_token_id = None if pad is None else pad.to(input_ids.device)
        self.pad_mode = any(hasattr(c, "eos_token_id") for c in stopping_criteria)  # as plain generate decides it
        self.return_dict = generation_config.return_dict_in_generate
        criteria = [c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria)]
        self.max_length = min([generation_config.max_length] + criteria)  # the most tokens a row may hold
        # the stopping criteria but the max length, which a ragged batch applies per row itself
        self.row_criteria = StoppingCriteriaList([c for c in stopping_criteria if not isinstance(c, MaxLengthCriteria)])
        wanted = [self.return_dict and getattr(generation_config, n) for n in ("output_scores", "output_logits")]
        self.ragged = row_scores is not None
        if self.ragged:  # (B, steps, V) each, when asked
            shape = (input_ids.shape[0], self.max_length - self.prompt_length, row_scores)
            self.scores, self.raw_logits = (torch.zeros(shape, device=input_ids.device) if w else None for w in wanted)
        else:  # a tuple of (B, V), one per step, when asked
            self.scores, self.raw_logits = (() if w else None for w in wanted)
        if streamer is not None:  # generate streams the prompt itself only when it keeps the streamer
            streamer.put(input_ids.cpu())

    def choose(self, scores) -> torch.Tensor:
        """`(B, V)` processed scores -> a token per row `(B,)`: drawn from their softmax when sampling, else argmax."""
        if self.sample:
            return torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return torch.argmax(scores, dim=-1)

    def next_tokens(self, input_ids, logits) -> torch.Tensor:
        """The step's token per row from the logits `(B, V)` that decide it, as transformers' sampling loop makes
        it: a float32 copy, the logits processors on the sequences so far, the records, the draw."""
        raw = logits.to(copy=True, dtype=torch.float32, device=input_ids.device)
        scores = self.logits_processor(input_ids, raw)
        if self.scores is not None:
            self.scores += (scores,)
        if self.raw_logits is not None:
            self.raw_logits += (raw,)
        return self.choose(scores)

    def pad_finished(self, tokens, unfinished) -> torch.Tensor:
        """In pad mode, the pad token for rows that have finished (`unfinished` `(B,)` 0/1)."""
        if not self.pad_mode:
            return tokens
        return tokens * unfinished + self.pad_token_id * (1 - unfinished)

    def still_unfinished(self, input_ids, unfinished) -> torch.Tensor:
        """`unfinished` `(B,)` less the rows a stopping criterion stops after the sequences `input_ids`."""
        return unfinished & ~self.stopping_criteria(input_ids, self.scores)

    def record_rows(self, scores, logits, before, counts) -> None:
        """Ragged records: row r's scores / raw logits `(B, q, V)` of its committed tokens j < counts[r], at generated
        step `before[r] + j`."""
        if self.scores is None and self.raw_logits is None:
            return
        r, j = (torch.arange(scores.shape[1], device=counts.device) < counts[:, None]).nonzero(as_tuple=True)
        for buffer, values in ((self.scores, scores), (self.raw_logits, logits)):
            if buffer is not None:
                buffer[r, before[r] + j] = values[r, j]

    def stream(self, tokens) -> None:
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())

    def finish(self, sequences, output_class=None, **fields):
        """Ends the streamer; returns `sequences` `(B, P + steps)`, or with `return_dict_in_generate` an
        `output_class` of them, the recorded scores and raw logits (a tuple of `(B, V)` per step) and `fields`."""
        if self.streamer is not None:
            self.streamer.end()
        if not self.return_dict or output_class is None:
            return sequences
        scores, logits = self.scores, self.raw_logits
        if self.ragged:
            steps = range(sequences.shape[1] - self.prompt_length)
            scores, logits = (None if b is None else tuple(b[:, s] for s in steps) for b in (scores, logits))
        return output_class(sequences=sequences, scores=scores, logits=logits, **fields)


@dataclass
class GenerateEarlyExitOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `exit_layers`: `(batch, new_tokens)` decoder-layer index at which each token
    was decided (`num_hidden_layers - 1` = full depth, -1 where the row had already finished)."""

    exit_layers: torch.LongTensor | None = None
    greedy_exits: torch.BoolTensor | None = None  # (batch, new_tokens): decided at a lean model's deepest loaded layer
    deepenings: list | None = None  # lean, guard on: (decoding steps before it, old exit_max_layer, new) per deepening


def exit_layers_after_eos(new_tokens: torch.Tensor, eos_token_id, full_depth: int) -> torch.LongTensor:
    """Exit layers of a full-depth generation: `full_depth` for every token a row decided, -1 after its EOS."""
    layers = torch.full_like(new_tokens, full_depth)
    if eos_token_id is None:
        return layers
    eos = torch.as_tensor(eos_token_id, device=new_tokens.device).flatten()
    is_eos = torch.isin(new_tokens, eos).long()
    finished_before = (is_eos.cumsum(-1) - is_eos) > 0  # an EOS strictly before this position
    return layers.masked_fill(finished_before, -1)


__all__ = ["DecodeLoop", "GenerateEarlyExitOutput", "exit_layers_after_eos", "require_cache"]
