"""Per-family adapters: everything the early-exit core needs to know about a model family, in one small place.

The core (`generation_early_exit.py`) runs the family's own decoder layers one by one, so it can stop a row early.
It asks the family's adapter for exactly these things, and nothing else:

| method | what it returns |
|---|---|
| `layers(model)` | the `nn.ModuleList` of decoder layers |
| `embed(model, input_ids, position_ids)` | the residual stream entering layer 0, `(B, q, D)` |
| `final_norm(model)` | the final norm module (the last layer's exit head) |
| `layer_inputs(model, h, attention_mask, cache, position_ids)` | a `LayerInputs`: masks and position embeddings per layer type |
| `run_layer(model, j, h, inputs, cache)` | the residual stream leaving layer `j`, `(B, q, D)` |
| `key_value(model, j, states, inputs)` | layer `j`'s keys and values of residual states, as its attention stores them |
| `new_exit_norm(model)` | a fresh norm for an exit head, of the final norm's type |
| `head_logits(model, x)` | LM-head logits of head input `x` (plus any final soft-cap the family applies) |

Llama's behaviour is the default; a family overrides only what differs (Qwen3 normalises keys, Mistral and Qwen2 may
use sliding-window masks). Every projection is a module call, so LoRA and quantized layers keep working. Adding a
family is one adapter here plus one line in `FAMILIES` (`modeling_early_exit.py`) and its config class.

Part of the Hub runtime: imports only torch and transformers.
"""

from dataclasses import dataclass, field

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.llama.modeling_llama import rotate_half


# layer type -> the mask function transformers' decoders use for it
MASK_FUNCTIONS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def select_rows(t, rows, batch_size):
    """`t[rows]` for a per-row tensor; broadcast (batch 1) tensors, tuples of them and None pass through."""
    if isinstance(t, tuple):
        return tuple(select_rows(x, rows, batch_size) for x in t)
    if t is None or not isinstance(t, torch.Tensor) or t.ndim == 0 or t.shape[0] != batch_size or batch_size == 1:
        return t
    return t.index_select(0, rows)


@dataclass
class LayerInputs:
    """What every decoder layer of one forward needs besides the hidden states.

    masks: layer type -> attention mask (4D, or None when attention needs none); positions: layer type -> rotary
    `(cos, sin)`, each `(B, q, head_dim)` (empty for families with absolute positions); position_ids: `(B, q)`.
    """

    masks: dict
    positions: dict = field(default_factory=dict)
    position_ids: torch.Tensor | None = None

    def select(self, rows: torch.Tensor, batch_size: int) -> "LayerInputs":
        """The inputs of the running rows `rows` (row policy)."""
        return LayerInputs(
            masks={k: select_rows(v, rows, batch_size) for k, v in self.masks.items()},
            positions={k: select_rows(v, rows, batch_size) for k, v in self.positions.items()},
            position_ids=select_rows(self.position_ids, rows, batch_size),
        )


class FamilyAdapter:
    """Llama's behaviour; other families override what differs."""

    name = "llama"

    # modules ------------------------------------------------------------------------------------------------------
    def decoder(self, model):
        return model.model

    def layers(self, model):
        return self.decoder(model).layers

    def final_norm(self, model):
        return self.decoder(model).norm

    def new_exit_norm(self, model):
        norm = self.final_norm(model)
        return type(norm)(model.config.hidden_size, eps=model.config.rms_norm_eps)

    def embed(self, model, input_ids, position_ids=None):
        return self.decoder(model).embed_tokens(input_ids)

    def head_logits(self, model, head_input):
        return model.lm_head(head_input)

    # one forward's inputs -----------------------------------------------------------------------------------------
    def layer_type(self, config, layer_idx: int) -> str:
        return "full_attention"

    def layer_inputs(self, model, h, attention_mask, cache, position_ids, layer_idx=None) -> LayerInputs:
        """Masks and position embeddings as the family's decoder builds them. `layer_idx` sizes the masks from that
        layer's cache (deferred K/V: a layer may receive more queries than the others)."""
        return LayerInputs(self.build_masks(model.config, h, attention_mask, cache, position_ids, layer_idx),
                           self.positions(model, h, position_ids), position_ids)

    def positions(self, model, h, position_ids) -> dict:
        rotary = self.decoder(model).rotary_emb(h, position_ids)
        return {"full_attention": rotary, "sliding_attention": rotary}

    def build_masks(self, config, inputs_embeds, attention_mask, cache, position_ids, layer_idx=None) -> dict:
        """One mask per layer type met from `layer_idx` on, built as the family's decoder builds it. With `layer_idx`
        (deferred K/V: a flush at that layer), each type's mask is sized from the first layer of that type at or after
        it: the layers from there on hold the same tokens, but a sliding layer's cache holds fewer than a full one."""
        if isinstance(attention_mask, dict):  # already prepared by generate (compileable caches)
            return attention_mask
        if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 4:
            return {"full_attention": attention_mask, "sliding_attention": attention_mask}
        masks = {}
        for j in range(layer_idx or 0, config.num_hidden_layers):
            kind = self.layer_type(config, j)
            if kind not in masks:
                masks[kind] = MASK_FUNCTIONS[kind](
                    config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
                    position_ids=position_ids, layer_idx=None if layer_idx is None else j,
                )
        return masks

    # one layer ----------------------------------------------------------------------------------------------------
    def run_layer(self, model, j, h, inputs: LayerInputs, cache):
        kind = self.layer_type(model.config, j)
        return self.layers(model)[j](h, attention_mask=inputs.masks[kind], position_embeddings=inputs.positions[kind],
                                     position_ids=inputs.position_ids, cache=cache, use_cache=cache is not None)

    def key_value(self, model, j, states, inputs: LayerInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values layer `j` stores for residual states `(B, q, D)` entering it: two `(B, kv_heads, q,
        head_dim)` tensors, through the layer's input norm and projections and rotary, exactly as its forward does."""
        layer = self.layers(model)[j]
        attn, x = layer.self_attn, layer.input_layernorm(states)
        hidden_shape = (*x.shape[:-1], -1, attn.head_dim)
        key = self.project_key(attn, x, hidden_shape).transpose(1, 2)
        value = attn.v_proj(x).view(hidden_shape).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in inputs.positions[self.layer_type(model.config, j)])
        key = (key * cos) + (rotate_half(key) * sin)  # the keys' half of the family's apply_rotary_pos_emb
        return key, value

    def project_key(self, attn, x: torch.Tensor, hidden_shape) -> torch.Tensor:
        return attn.k_proj(x).view(hidden_shape)


class MistralAdapter(FamilyAdapter):
    name = "mistral"

    def layer_type(self, config, layer_idx: int) -> str:
        return "full_attention" if config.sliding_window is None else "sliding_attention"


class Qwen2Adapter(FamilyAdapter):
    name = "qwen2"

    def layer_type(self, config, layer_idx: int) -> str:
        return config.layer_types[layer_idx]


class Qwen3Adapter(Qwen2Adapter):
    name = "qwen3"

    def project_key(self, attn, x, hidden_shape):
        return attn.k_norm(attn.k_proj(x).view(hidden_shape))


__all__ = ["FamilyAdapter", "LayerInputs", "MistralAdapter", "Qwen2Adapter", "Qwen3Adapter", "select_rows"]
