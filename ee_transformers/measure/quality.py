"""The quality measures of early exit: one name and one definition each, used alike by `calibrate`, `bench`, the demo
and the model cards.

- **per-token agreement**: share of early-exit tokens the full model also chooses at that position, given the
  early-exit text so far (its own prefix; CALM's per-token consistency). Calibration targets it (teacher-forced on
  held-out text, or really decoded).
- **identical-token share**: share of positions where the early-exit text equals full-depth greedy text. One early
  difference changes the rest of a text, so this is far below per-token agreement.
- **tokens to first divergence**: generated tokens before the first position that differs from full-depth greedy text.
- **continuation perplexity**: the full model's perplexity of the early-exit continuation, next to its perplexity of
  its own continuation: a task-level measure that does not punish a different but equally likely text.
"""

import math

import torch

QUALITY_MEASURES = {
    "per_token_agreement": "per-token agreement (full model's choice given the early-exit prefix)",
    "identical_share": "identical-token share (vs full-depth greedy text)",
    "first_divergence": "tokens to first divergence (vs full-depth greedy text)",
    "continuation_ppl": "full model's perplexity of the continuation",
}

EXPLAINER = (
    "Per-token agreement asks, at each generated position, whether the full model would have chosen the same "
    "token given the text so far (what calibration targets); identical-token share compares whole texts "
    "with full-depth output, where one early difference changes everything after it."
)


def _valid_mask(new_tokens: torch.Tensor, eos_ids=()) -> torch.Tensor:
    """`(B, n)` True up to and including each row's first EOS."""
    if not eos_ids:
        return torch.ones_like(new_tokens, dtype=torch.bool)
    is_eos = torch.isin(new_tokens, torch.as_tensor(list(eos_ids), device=new_tokens.device)).long()
    return (is_eos.cumsum(-1) - is_eos) == 0


@torch.no_grad()
def full_model_view(full_model, sequences: torch.Tensor, prompt_length: int, attention_mask=None, eos_ids=()) -> dict:
    """One teacher-forced full-depth forward over `sequences` `(B, prompt + n)`: per generated position, whether the
    full model's argmax equals the token, and the token's log-probability under it. Returns sums and counts."""
    new = sequences[:, prompt_length:]
    if attention_mask is not None:
        pad = torch.ones(new.shape, dtype=attention_mask.dtype, device=attention_mask.device)
        attention_mask = torch.cat([attention_mask, pad], dim=1)
    logits = full_model(input_ids=sequences, attention_mask=attention_mask).logits[:, prompt_length - 1 : -1].float()
    valid = _valid_mask(new, eos_ids)
    agree = (logits.argmax(-1) == new) & valid
    logp = logits.log_softmax(-1).gather(-1, new[..., None]).squeeze(-1)
    return {"agree": int(agree.sum()), "tokens": int(valid.sum()), "nll": float(-(logp * valid).sum())}


def identical_share(full_new: torch.Tensor, ee_new: torch.Tensor, eos_ids=()) -> list[dict]:
    """Per row: matches, compared positions (up to the full-depth row's first EOS) and tokens to first divergence."""
    rows = []
    for p, e in zip(full_new.tolist(), ee_new.tolist()):
        length = next((i + 1 for i, token in enumerate(p) if token in eos_ids), len(p))
        length = min(length, len(e))
        same = [p[i] == e[i] for i in range(length)]
        first = next((i for i, s in enumerate(same) if not s), length)
        rows.append({"matches": sum(same), "compared": length, "first_divergence": first})
    return rows


def perplexity(nll: float, tokens: int) -> float:
    return math.exp(nll / tokens) if tokens else math.nan


def summarise_views(views: list[dict], full_views: list[dict]) -> dict:
    """Per-token agreement and continuation perplexity from `full_model_view` results of the early-exit texts
    (`views`), next to the full model's perplexity of its own texts (`full_views`)."""
    tokens, full_tokens = sum(v["tokens"] for v in views), sum(v["tokens"] for v in full_views)
    return {
        "per_token_agreement": sum(v["agree"] for v in views) / max(tokens, 1),
        "continuation_ppl": perplexity(sum(v["nll"] for v in views), tokens),
        "full_depth_ppl": perplexity(sum(v["nll"] for v in full_views), full_tokens),
    }


def eos_token_ids(model) -> list[int]:
    """The EOS ids of `model.generation_config` as a list (empty when it has none)."""
    eos = model.generation_config.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


__all__ = [
    "EXPLAINER",
    "QUALITY_MEASURES",
    "eos_token_ids",
    "full_model_view",
    "identical_share",
    "perplexity",
    "summarise_views",
]
