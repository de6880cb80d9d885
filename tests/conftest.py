"""Tiny random models of every supported family, built in fixtures (no hub)."""

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)


torch.set_num_threads(1)

TINY = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=98, max_position_embeddings=256)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
}


def make_base(family: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **extra, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial norms, so tests can tell a copied norm from a fresh one
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="session")
def base_dirs(tmp_path_factory):
    """A saved plain checkpoint per family: {family: (folder, base model)}."""
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(f"base-{family}")
        model = make_base(family)
        model.save_pretrained(folder)
        out[family] = (folder, model)
    return out


@pytest.fixture(params=list(FAMILIES))
def family(request):
    return request.param


def padded_batch(batch=3, length=7, seed=1):
    """A left-padded batch: row 0 has two pads, row 1 one, the rest none."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 97, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    if batch > 1:
        mask[1, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask
