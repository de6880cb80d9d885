"""Helpers that several test modules use: plain functions, classes and settings (fixtures live in conftest.py)."""

import pytest
import torch
from conftest import LayerCalls, padded_batch
from transformers.generation.streamers import BaseStreamer

import ee_transformers as eet

NEVER = dict(exit_criterion="max_prob", exit_threshold=1.0)  # a softmax of a tiny random model never reaches 1
ALWAYS = dict(exit_criterion="max_prob", exit_threshold=0.0)  # every row exits at the first checked exit


def ee_model(base_dirs, family="llama", exit_layers=(0, 1, 2), perturb=True):
    model = eet.from_base(base_dirs[family][0], exit_layers=list(exit_layers)).eval()
    if perturb:  # heads that differ from the final norm, so a wrong head would show
        torch.manual_seed(7)
        with torch.no_grad():
            for head in model.exit_heads:
                head.norm.weight.mul_(torch.rand_like(head.norm.weight) + 0.5)
                if getattr(head.norm, "bias", None) is not None:
                    head.norm.bias.add_(torch.rand_like(head.norm.bias) - 0.5)
    return model


def model_with(base_dirs, family="llama", seed=7, **exit_defaults):
    """An early-exit model (exits after 0, 1, 2) with its own stored exit settings and heads perturbed by `seed`."""
    model = ee_model(base_dirs, family, perturb=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        for head in model.exit_heads:
            head.norm.weight.mul_(torch.rand_like(head.norm.weight) + 0.5)
    if exit_defaults:
        model.set_exit_defaults(**exit_defaults)
    return model


def scripted_heads(model, per_exit):
    """Replaces exit-head logits: per_exit[i](rows) -> logits (n, V) for exit i. Returns the patched model."""
    vocab = model.config.vocab_size

    def logits_from_hidden(index, hidden):
        return per_exit[index](hidden.shape[0], vocab, hidden)

    model.exit_logits_from_hidden = logits_from_hidden
    return model


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


def numbered_tokenizer():
    """A word-level tokenizer over the tiny models' 99 ids whose words name them: `<pad>` 0, `<s>` 1, `w2`..`w97`, `</s>` 98."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 98)}, "</s>": 98}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def served_folders(root):
    """A tiny Llama base folder and its early-exit folder, both with a tokenizer and a chat template, under `root`;
    the early-exit folder's stored exits (every token at layer 0) give text that full depth does not."""
    from conftest import make_base

    tok = numbered_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    make_base("llama").save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    model = eet.from_base(root / "base", exit_layers=[0, 1, 2]).eval()
    model.set_exit_defaults(exit_criterion="max_prob", exit_threshold=0.0, exit_check_layers=[0])
    model.generation_config.update(eos_token_id=-1, do_sample=False)
    model.save_pretrained(root / "ee")
    tok.save_pretrained(root / "ee")
    return root / "base", root / "ee"


def refused_before_decoding(model, match, **kwargs):
    """`model.generate(**kwargs)` on a padded batch of 2 raises a `ValueError` matching `match` before any decoder
    layer runs."""
    ids, mask = padded_batch(batch=2)
    counter = LayerCalls(model)
    try:
        with pytest.raises(ValueError, match=match):
            model.generate(ids, attention_mask=mask, max_new_tokens=6, **kwargs)
    finally:
        counter.remove()
    assert counter.calls == [0] * model.config.num_hidden_layers


def models_per_family(base_dirs, prepare=None):
    """`get(family)` -> (early-exit model with exits after layers 0, 1, 2, its base), each built once (for a
    module-scoped `models` fixture); `prepare(model, base)` adds what the module's tests need (a draft vocabulary, a
    table)."""
    cache = {}

    def get(family):
        if family not in cache:
            folder, base = base_dirs[family]
            model = eet.from_base(folder, exit_layers=[0, 1, 2]).eval()
            if prepare is not None:
                prepare(model, base)
            cache[family] = (model, base)
        return cache[family]

    return get


def sliding_window(base) -> bool:
    """Whether the base model's layers attend through a sliding window."""
    return bool(getattr(base.config, "sliding_window", None) and getattr(base.config, "use_sliding_window", True))
