"""Per-family adapters: everything the early-exit core needs to know about a model family, in one small place.

The core (`decode_core.run_layers`, the layer loop of every mode) runs the family's own decoder layers one by one,
so a row can stop early. It asks the family's adapter for exactly these things, and nothing else:

| method | what it returns |
|---|---|
| `layers(model)` | the `nn.ModuleList` of decoder layers |
| `embed(model, input_ids, position_ids)` | the residual stream entering layer 0, `(B, q, D)` |
| `final_norm(model)` | the final norm module (the last layer's exit head) |
| `new_exit_norm(model)` | a fresh norm for an exit head, of the final norm's type (initialised as a copy of it) |
| `layer_inputs(model, h, mask, cache, position_ids)` | a `LayerInputs`: masks and rotary per layer type |
| `run_layer(model, j, h, inputs, cache)` | the residual stream leaving layer `j`, `(B, q, D)` |
| `key_value(model, j, states, inputs)` | layer `j`'s keys and values of residual states, as its attention stores them |
| `head_logits(model, x)` | LM-head logits of head input `x` (plus any final soft-cap the family applies) |

`key_value` (the backfill of skipped layers) is built from four smaller hooks, so a family overrides only its
difference: `attention_input` (the norm before attention), `project_key_value` (fused projections),
`project_key` (key norms), `rotate_key` (partial rotary). Llama's behaviour is the default:

| family (plain `model_type`) | adapter | what it overrides |
|---|---|---|
| Llama (`llama`) | `FamilyAdapter` | nothing |
| Mistral (`mistral`) | `MistralAdapter` | `layer_type`: every layer slides when `sliding_window` is set |
| Qwen2 (`qwen2`) | `Qwen2Adapter` | `layer_type` from `config.layer_types` (full / sliding) |
| Qwen3 (`qwen3`) | `Qwen3Adapter` | Qwen2 + `project_key`: per-head `k_norm` |
| Gemma 2 (`gemma2`) | `Gemma2Adapter` | Qwen2's layer types + `head_logits`: the final logit soft-cap |
| Gemma 3 text (`gemma3_text`) | `Gemma3Adapter` | Gemma 2 + `positions`: one rotary per layer type; per-head `k_norm` |
| Phi-3 (`phi3`) | `Phi3Adapter` | Mistral's layer type + fused `qkv_proj` sliced after the call; partial rotary |
| OLMo 2 (`olmo2`) | `Olmo2Adapter` | no norm before attention; `k_norm` over the whole projection |
| GPT-2 (`gpt2`) | `GPT2Adapter` | `transformer.h`, `ln_f`, LayerNorm exits; positions in `embed`; fused `c_attn` |

What a family does inside its layers (Gemma's post-norms and attention soft-cap, OLMo 2's norms after attention)
needs no adapter code: the core calls the layer itself. Every projection is a module call, so LoRA and quantized
layers keep working (a fused projection is called whole and its K/V part sliced). Deferred K/V works for every
family: masks are built per layer type from the layer being flushed (`build_masks`).

Adding a family: an adapter here (override what differs), its config in `configuration_early_exit.py`, its two classes
and one line in `FAMILIES` (`modeling_early_exit.py`), and a row in the tests' family matrix (`tests/conftest.py`).

Part of the Hub runtime: imports only torch and transformers.
"""

from dataclasses import dataclass, field

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.llama.modeling_llama import rotate_half

from .compat import CACHE, cache_kwargs

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
    `(cos, sin)`, each `(B, q, head_dim)` (empty for families with absolute positions); position_ids: `(B, q)`;
    attention: further keyword arguments for the attention (continuous batching's paged-cache indices).
    """

    masks: dict
    positions: dict = field(default_factory=dict)
    position_ids: torch.Tensor | None = None
    attention: dict = field(default_factory=dict)

    def select(self, rows: torch.Tensor, batch_size: int) -> "LayerInputs":
        """The inputs of the running rows `rows` (row policy)."""
        return LayerInputs(
            masks={k: select_rows(v, rows, batch_size) for k, v in self.masks.items()},
            positions={k: select_rows(v, rows, batch_size) for k, v in self.positions.items()},
            position_ids=select_rows(self.position_ids, rows, batch_size),
            attention=self.attention,
        )


class FamilyAdapter:
    """Llama's behaviour; other families override what differs.

    bare: the adapter of a bare decoder (`AutoModel`, `EarlyExit<Family>Model`), which is its own decoder.
    """

    name = "llama"
    decoder_name = "model"  # the decoder's attribute in the causal LM (GPT-2: "transformer")

    def __init__(self, bare: bool = False):
        self.bare = bare

    # modules ------------------------------------------------------------------------------------------------------
    def decoder(self, model):
        return model if self.bare else getattr(model, self.decoder_name)

    def layers(self, model):
        return self.decoder(model).layers

    def final_norm(self, model):
        return self.decoder(model).norm

    def new_exit_norm(self, model):
        norm = self.final_norm(model)
        return type(norm)(model.config.hidden_size, eps=model.config.rms_norm_eps)

    def embed(self, model, input_ids, position_ids):
        return self.decoder(model).embed_tokens(input_ids)

    def head_logits(self, model, head_input, head=None):
        """The LM head's logits of `head_input` (or `head`'s: the LM head restricted to a draft vocabulary)."""
        return (model.lm_head if head is None else head)(head_input)

    # one forward's inputs -----------------------------------------------------------------------------------------
    def layer_type(self, config, layer_idx: int) -> str:
        return "full_attention"

    def layer_inputs(self, model, h, attention_mask, cache, position_ids, layer_idx=None) -> LayerInputs:
        """Masks and position embeddings as the family's decoder builds them. `layer_idx` sizes the masks from that
        layer's cache (deferred K/V: a layer may receive more queries than the others)."""
        return LayerInputs(
            self.build_masks(model.config, h, attention_mask, cache, position_ids, layer_idx),
            self.positions(model, h, position_ids),
            position_ids,
        )

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
                    config=config,
                    inputs_embeds=inputs_embeds,
                    attention_mask=attention_mask,
                    **{CACHE: cache},
                    position_ids=position_ids,
                    layer_idx=None if layer_idx is None else j,
                )
        return masks

    # one layer ----------------------------------------------------------------------------------------------------
    def run_layer(self, model, j, h, inputs: LayerInputs, cache):
        kind = self.layer_type(model.config, j)
        return self.layers(model)[j](
            h,
            attention_mask=inputs.masks[kind],
            position_embeddings=inputs.positions[kind],
            position_ids=inputs.position_ids,
            **cache_kwargs(cache),
            use_cache=cache is not None,
            **inputs.attention,
        )

    def key_value(self, model, j, states, inputs: LayerInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values layer `j` stores for residual states `(B, q, D)` entering it: two `(B, kv_heads, q,
        head_dim)` tensors, through the layer's own modules (input norm, projections, key norm, rotary), exactly as
        its forward computes them."""
        layer = self.layers(model)[j]
        key, value = self.project_key_value(layer, self.attention_input(layer, states))  # (B, q, kv_heads, head_dim)
        key, value = key.transpose(1, 2), value.transpose(1, 2)
        rotary = inputs.positions.get(self.layer_type(model.config, j))
        if rotary is not None:
            key = self.rotate_key(key, *(t.unsqueeze(1) for t in rotary))
        return key, value

    def attention_input(self, layer, states):
        """What the layer's attention sees of the residual stream."""
        return layer.input_layernorm(states)

    def kv_modules(self, layer) -> list:
        """The modules `key_value` calls in `layer`: what backfilling one skipped layer reads (the pool's cost model
        counts their parameters)."""
        attn = layer.self_attn
        return [layer.input_layernorm, attn.k_proj, attn.v_proj, *filter(None, [getattr(attn, "k_norm", None)])]

    def project_key_value(self, layer, x):
        attn = layer.self_attn
        hidden_shape = (*x.shape[:-1], -1, attn.head_dim)
        return self.project_key(attn, x, hidden_shape), attn.v_proj(x).view(hidden_shape)

    def project_key(self, attn, x, hidden_shape):
        return attn.k_proj(x).view(hidden_shape)

    def rotate_key(self, key, cos, sin):
        """The keys' half of the family's `apply_rotary_pos_emb`; cos / sin `(B, 1, q, rotary_dim)`. Cast back to the
        keys' dtype, as families whose rotary runs in float32 (OLMo 2) do; a no-op for the others."""
        return ((key * cos) + (rotate_half(key) * sin)).to(key.dtype)


class MistralAdapter(FamilyAdapter):
    """Every layer slides when `config.sliding_window` is set."""

    name = "mistral"

    def layer_type(self, config, layer_idx: int) -> str:
        return "full_attention" if config.sliding_window is None else "sliding_attention"


class Qwen2Adapter(FamilyAdapter):
    """Per-layer types (`config.layer_types`: full or sliding attention)."""

    name = "qwen2"

    def layer_type(self, config, layer_idx: int) -> str:
        return config.layer_types[layer_idx]


class Qwen3Adapter(Qwen2Adapter):
    """Qwen2 plus a per-head RMS norm on the keys."""

    name = "qwen3"

    def project_key(self, attn, x, hidden_shape):
        return attn.k_norm(attn.k_proj(x).view(hidden_shape))


class Gemma2Adapter(Qwen2Adapter):
    """Alternating sliding / global layers (`config.layer_types`), the embeddings scaled by sqrt(hidden) (inside
    `embed_tokens`), norms before and after attention and MLP (inside the layer; the keys see `input_layernorm`), and
    the final logit soft-cap `cap * tanh(logits / cap)`, which every exit applies as the final head does."""

    name = "gemma2"

    def head_logits(self, model, head_input, head=None):
        logits = (model.lm_head if head is None else head)(head_input)
        cap = model.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3Adapter(Gemma2Adapter):
    """Gemma 2 plus a rotary embedding per layer type (local and global bases) and a per-head RMS norm on the keys."""

    name = "gemma3"

    def positions(self, model, h, position_ids) -> dict:
        rotary = self.decoder(model).rotary_emb
        return {kind: rotary(h, position_ids, kind) for kind in set(model.config.layer_types)}

    def project_key(self, attn, x, hidden_shape):
        return attn.k_norm(attn.k_proj(x).view(hidden_shape))


class Phi3Adapter(MistralAdapter):
    """One fused `qkv_proj` (its K/V part is sliced from the module's output, so LoRA / quantized layers still see a
    module call) and partial rotary (`partial_rotary_factor`: only the first `rotary_dim` channels rotate)."""

    name = "phi3"

    def project_key_value(self, layer, x):
        attn = layer.self_attn
        hidden_shape = (*x.shape[:-1], -1, attn.head_dim)
        q_size, kv_size = attn.config.num_attention_heads * attn.head_dim, attn.num_key_value_heads * attn.head_dim
        qkv = attn.qkv_proj(x)
        key, value = qkv[..., q_size : q_size + kv_size], qkv[..., q_size + kv_size :]
        return key.view(hidden_shape), value.view(hidden_shape)

    def kv_modules(self, layer) -> list:
        return [layer.input_layernorm, layer.self_attn.qkv_proj]  # the fused projection is read whole

    def rotate_key(self, key, cos, sin):
        rotary_dim = cos.shape[-1]
        rotated, kept = key[..., :rotary_dim], key[..., rotary_dim:]
        return torch.cat([super().rotate_key(rotated, cos, sin), kept], dim=-1)


class Olmo2Adapter(FamilyAdapter):
    """No norm before attention or MLP (they are normed after, inside the layer), and an RMS norm over the whole key
    projection (all heads at once), before the heads are split."""

    name = "olmo2"

    def attention_input(self, layer, states):
        return states

    def kv_modules(self, layer) -> list:
        return [layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.k_norm]

    def project_key(self, attn, x, hidden_shape):
        return attn.k_norm(attn.k_proj(x)).view(hidden_shape)


class GPT2Adapter(FamilyAdapter):
    """Learned absolute positions added once to the embeddings (no rotary), LayerNorm with bias, a fused `c_attn`
    Conv1D (K/V sliced from the module's output), and the decoder in `transformer.h` / `transformer.ln_f`."""

    name = "gpt2"
    decoder_name = "transformer"

    def layers(self, model):
        return self.decoder(model).h

    def final_norm(self, model):
        return self.decoder(model).ln_f

    def new_exit_norm(self, model):
        return torch.nn.LayerNorm(model.config.hidden_size, eps=model.config.layer_norm_epsilon)

    def embed(self, model, input_ids, position_ids):
        decoder = self.decoder(model)
        h = decoder.wte(input_ids)
        return decoder.drop(h + decoder.wpe(position_ids).to(h.device))

    def positions(self, model, h, position_ids) -> dict:
        return {}

    def run_layer(self, model, j, h, inputs: LayerInputs, cache):
        return self.layers(model)[j](
            h,
            **cache_kwargs(cache),
            attention_mask=inputs.masks["full_attention"],
            position_ids=inputs.position_ids,
            use_cache=cache is not None,
            **inputs.attention,
        )

    def attention_input(self, layer, states):
        return layer.ln_1(states)

    def project_key_value(self, layer, x):
        attn = layer.attn
        hidden_shape = (*x.shape[:-1], -1, attn.head_dim)
        _, key, value = attn.c_attn(x).split(attn.split_size, dim=2)
        return key.view(hidden_shape), value.view(hidden_shape)

    def kv_modules(self, layer) -> list:
        return [layer.ln_1, layer.attn.c_attn]  # the fused projection is read whole


__all__ = [
    "FamilyAdapter",
    "Gemma2Adapter",
    "Gemma3Adapter",
    "GPT2Adapter",
    "LayerInputs",
    "MistralAdapter",
    "Olmo2Adapter",
    "Phi3Adapter",
    "Qwen2Adapter",
    "Qwen3Adapter",
    "select_rows",
]
