"""Per-family adapters: everything the early-exit core needs to know about a model family, in one small place.

The core runs the family's own decoder layers; it only needs to (1) build the attention masks the family's decoder
builds, per layer, and (2) compute one layer's key/value projections of a hidden state, for backfilling the layers a
token skipped. Families differ there only: Qwen3 normalises keys (`k_norm`), Mistral and Qwen2 may use sliding-window
masks, Qwen2 has projection biases (inside `k_proj`, so nothing to do). Every projection is a module call, so LoRA and
quantized layers keep working.

Part of the Hub runtime: imports only torch and transformers.
"""

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.llama.modeling_llama import rotate_half


class FamilyAdapter:
    """Llama's behaviour; other families override what differs."""

    name = "llama"

    def layer_type(self, config, layer_idx: int) -> str:
        return "full_attention"

    def build_masks(self, config, inputs_embeds, attention_mask, cache, position_ids, layer_idx=None) -> dict:
        """Masks keyed by layer type, as the family's decoder builds them. `layer_idx` sizes the mask from that layer's
        cache (used when a layer receives more queries than the others, in deferred KV mode)."""
        if isinstance(attention_mask, dict):  # already prepared by generate (compileable caches)
            return attention_mask
        if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 4:
            return {"full_attention": attention_mask, "sliding_attention": attention_mask}
        kwargs = dict(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
                      position_ids=position_ids, layer_idx=layer_idx)
        return self._masks(config, kwargs)

    def _masks(self, config, kwargs) -> dict:
        return {"full_attention": create_causal_mask(**kwargs)}

    def project_key(self, attn, x: torch.Tensor, hidden_shape) -> torch.Tensor:
        return attn.k_proj(x).view(hidden_shape)

    def key_value(self, attn, x: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values one attention module stores for input-normed hidden states `x`: `(B, q, D)` ->
        two `(B, kv_heads, q, head_dim)` tensors, rotary applied to the keys, exactly as the module's forward does."""
        hidden_shape = (*x.shape[:-1], -1, attn.head_dim)
        key = self.project_key(attn, x, hidden_shape).transpose(1, 2)
        value = attn.v_proj(x).view(hidden_shape).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        key = (key * cos) + (rotate_half(key) * sin)  # the keys' half of the family's apply_rotary_pos_emb
        return key, value


class MistralAdapter(FamilyAdapter):
    name = "mistral"

    def layer_type(self, config, layer_idx: int) -> str:
        return "full_attention" if config.sliding_window is None else "sliding_attention"

    def _masks(self, config, kwargs) -> dict:
        if config.sliding_window is None:
            return {"full_attention": create_causal_mask(**kwargs)}
        return {"sliding_attention": create_sliding_window_causal_mask(**kwargs)}


class Qwen2Adapter(FamilyAdapter):
    name = "qwen2"

    def layer_type(self, config, layer_idx: int) -> str:
        return config.layer_types[layer_idx]

    def _masks(self, config, kwargs) -> dict:
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in config.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks


class Qwen3Adapter(Qwen2Adapter):
    name = "qwen3"

    def project_key(self, attn, x, hidden_shape):
        return attn.k_norm(attn.k_proj(x).view(hidden_shape))


__all__ = ["FamilyAdapter", "MistralAdapter", "Qwen2Adapter", "Qwen3Adapter"]
