"""Tiny random checkpoints with a word-level tokenizer, for tests and smoke runs of the training scripts (no hub)."""

import json
import os
import random

import torch
from transformers import PreTrainedTokenizerFast

TINY = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=98,
    max_position_embeddings=128,
    initializer_range=0.3,
)  # a large init makes the random model's distributions peaked, like a real LM's
WORDS = [f"w{i}" for i in range(95)]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `WORDS`: ids 0 pad, 1 bos, 2 unk, 3..97 words, 98 eos (vocab 99)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}, "</s>": 98}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_texts(n_docs: int = 8, words_per_doc: int = 200, seed: int = 0) -> list[str]:
    """Documents from a sparse random Markov chain over `WORDS` (each word has 3 likely successors)."""
    rng = random.Random(seed)
    successors = {w: rng.sample(WORDS, 3) for w in WORDS}
    docs = []
    for _ in range(n_docs):
        w = rng.choice(WORDS)
        out = [w]
        for _ in range(words_per_doc - 1):
            w = rng.choice(successors[w]) if rng.random() < 0.9 else rng.choice(WORDS)
            out.append(w)
        docs.append(" ".join(out))
    return docs


def save_tiny_base(folder, family: str = "llama", seed: int = 0, **overrides) -> str:
    """Saves a tiny random plain checkpoint of `family` ('llama', 'mistral', 'qwen2', 'qwen3', 'gemma3', 'gemma2',
    'phi3', 'olmo2', 'gpt2') plus the tokenizer."""
    import transformers as tf

    gemma = {"head_dim": 8, "query_pre_attn_scalar": 8}
    families = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": None}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 8}),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, gemma),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, gemma),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {}),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {}),
        "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, {"n_inner": TINY["intermediate_size"]}),
    }
    if family not in families:
        raise ValueError(f"`family` must be one of {list(families)}, got {family!r}.")
    config_cls, model_cls, extra = families[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).eval()
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def write_texts(folder, texts, kind: str = "txt") -> list[str]:
    """Writes `texts` as .txt files (one per document) or one .jsonl file; returns the paths."""
    os.makedirs(folder, exist_ok=True)
    if kind == "jsonl":
        path = os.path.join(folder, "docs.jsonl")
        with open(path, "w") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
        return [path]
    paths = []
    for i, t in enumerate(texts):
        paths.append(os.path.join(folder, f"doc{i:03d}.txt"))
        with open(paths[-1], "w") as f:
            f.write(t)
    return paths
