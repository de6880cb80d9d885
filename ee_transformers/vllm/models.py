"""Early-exit folders on vLLM's own model implementations: each family's vLLM class, subclassed, with the folder's
exit heads loaded beside it and, when exits are on, the seed's iteration-level exits (`exits.py`).

| family (plain `model_type`) | vLLM class | fill: the attention call of a skipped layer |
|---|---|---|
| Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3 | `LlamaForCausalLM`, ... | `layer.self_attn(positions, x)` |
| GPT-2 | `GPT2LMHeadModel` | `layer.attn(x)` (absolute positions were added to the embeddings) |
| OLMo 2 | none: vLLM 0.32 serves it through its transformers backend, which this plugin does not wrap | refused |

The decoder, its weights, its paged attention and its compilation stay vLLM's. What the package adds lives in its
runtime: the exit heads (`exit_heads.ExitHead`, on the family's own final-norm type, from the adapter's
`new_exit_norm`), the exit rule (`decode_core.check_exit`), the attention input of a skipped layer
(`FamilyAdapter.attention_input`). Exit logits go through vLLM's LM head and logits processor (soft-cap, scale), the
LM head's tensor-parallel shards all-gathered so that every rank takes the same decision.
"""

import importlib
from collections.abc import Iterable

import torch
from torch import nn

from ..exit_heads import ConfidenceHead, ExitHead
from ..modeling_early_exit import FAMILIES
from .config import plugin_settings
from .exits import _STEPS, ExitStep, ExitTaken, capture_keys_values, fill_layer, step_rows

# our family key -> (vLLM module, class, the skipped layer's attention module name, whether it takes positions)
VLLM_FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM", "self_attn", True),
    "mistral": ("mistral", "MistralForCausalLM", "self_attn", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", "self_attn", True),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "self_attn", True),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM", "self_attn", True),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", "self_attn", True),
    "phi3": ("phi3", "Phi3ForCausalLM", "self_attn", True),
    "gpt2": ("gpt2", "GPT2LMHeadModel", "attn", False),
}
UNSERVED = {"olmo2": "vLLM 0.32 serves OLMo 2 through its transformers backend, which this plugin does not wrap"}
OUR_PREFIXES = ("exit_heads.", "confidence_heads.", "draft_token_ids", "draft_table_keys", "draft_table_next")


class EarlyExitVllmMixin:
    """Mixed in before a family's vLLM causal LM. `family`: the package's adapter; `attention` / `positional`: the
    skipped layer's attention module name and whether it takes positions."""

    family = None
    attention, positional = "self_attn", True

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = self.config
        rank = config.exit_adapter_rank if config.exit_head == "adapter" else None
        self.exit_heads = nn.ModuleList(
            [ExitHead(self.family.new_exit_norm(self), config.hidden_size, rank) for _ in config.exit_layers]
        )
        self.confidence_heads = None
        if config.exit_confidence_heads:
            self.confidence_heads = nn.ModuleList([ConfidenceHead(config.hidden_size) for _ in config.exit_layers])
        self.ee = plugin_settings(vllm_config)  # what the folder and the server ask for (validated at start-up)
        self._decided = None  # the last step that decided at an exit, for `compute_logits`
        self._hooks = []
        if self.ee.exits is not None:
            self._hook_exit_layers(self.ee.exits.check_layers)
            for layer in self.family.layers(self)[min(self.ee.exits.check_layers) + 1 :]:
                getattr(layer, self.attention).attn.register_forward_pre_hook(capture_keys_values, with_kwargs=True)

    # exits ---------------------------------------------------------------------------------------------------------
    def _hook_exit_layers(self, layers):
        """A forward hook on each checked exit layer runs the exit check between it and the next layer."""
        key = id(self)
        paired = self.family.name != "gpt2"  # vLLM's layers return (hidden, residual), GPT-2's the stream
        for j in layers:

            def hook(module, args, kwargs, output, j=j):
                given = list(args) + [kwargs.get(n) for n in ("positions", "hidden_states", "residual")[len(args) :]]
                if paired:
                    hidden, residual = output
                    out = torch.ops.ee_transformers.exit_check(hidden, residual, given[1], given[2], key, j)
                    return out, residual
                return torch.ops.ee_transformers.exit_check(output, None, given[0], None, key, j)

            self._hooks.append(self.family.layers(self)[j].register_forward_hook(hook, with_kwargs=True))

    def exit_logits_from_hidden(self, exit_index: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """`(n, V)` logits of exit `exit_index` for residual states `(n, D)` leaving its layer, through vLLM's LM
        head and logits processor; the vocabulary shards are all-gathered (every rank decides alike)."""
        from vllm.distributed import tensor_model_parallel_all_gather

        local = self.logits_processor(self.lm_head, self.exit_heads[exit_index](hidden_states), skip_gather=True)
        return tensor_model_parallel_all_gather(local)[:, : self.config.vocab_size]

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        self._decided = None
        rows = None if self.ee.exits is None else step_rows(positions.shape[-1])
        if rows is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        step = _STEPS[id(self)] = ExitStep(self, self.ee.exits, positions, rows[1], stop=rows[0])
        try:
            hidden = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        except ExitTaken:
            self._fill(step)
            hidden = None
        finally:
            del _STEPS[id(self)]
        if step.layer is not None:
            self._decided = step
            self.exit_stats.record(step.layer, step.stop)
            if hidden is None:  # the LM head's input at the rows: the exit head's (what `compute_logits` gets)
                hidden = self.exit_heads[self.config.exit_layers.index(step.layer)](step.stream)
        return hidden

    def _fill(self, step):
        """The decode step stopped at `step.layer`: each layer above it writes its K/V of these tokens into the paged
        cache from the exit state, through its own attention input, projections, key norms and rotary (its
        attention module, stopped at the kernel: `exits.fill_layer`); the kernel and the output projection do not
        run."""
        layers = self.family.layers(self)
        for j in range(step.layer + 1, self.config.num_hidden_layers):
            if not self.ee.fill:  # tests only: shows that a later full-depth token reads the filled K/V
                break
            attention = getattr(layers[j], self.attention)
            x = self.family.attention_input(layers[j], step.stream)
            if self.positional:
                fill_layer(attention, attention.attn, lambda a=attention, x=x: a(step.positions, x))
            else:
                fill_layer(attention, attention.attn, lambda a=attention, x=x: a(hidden_states=x))

    def compute_logits(self, hidden_states):
        """The logits of the step's sampled tokens: the exit's where the step decided at one (the check's own when it
        computed them), else the final layer's."""
        step, self._decided = self._decided, None
        if step is None or hidden_states.shape[0] != step.n:
            return super().compute_logits(hidden_states)
        if step.logits is not None:
            return step.logits
        index = self.config.exit_layers.index(step.layer)
        if step.stop:  # the forward returned the exit head's output
            return super().compute_logits(hidden_states)
        return super().compute_logits(self.exit_heads[index](step.stream))

    # weights -------------------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's loader for the decoder and LM head; the exit heads (and confidence heads) by name here. The draft
        buffers of the folder are for `generate`'s drafts, not this engine's: read and dropped."""
        ours = dict(self.named_parameters())
        loaded, rest = set(), []
        for name, tensor in weights:
            if name.startswith(OUR_PREFIXES):
                if name in ours:
                    with torch.no_grad():
                        ours[name].copy_(tensor.to(ours[name].dtype))
                    loaded.add(name)
                continue
            rest.append((name, tensor))
        loaded |= set(super().load_weights(iter(rest)))
        missing = [n for n in ours if n.startswith(("exit_heads.", "confidence_heads.")) and n not in loaded]
        if missing:
            raise ValueError(
                f"The folder has no weights for {missing[:4]}: is it an early-exit folder of this package?"
            )
        return loaded


class ExitStats:
    """How many steps decided at each exit: decode steps (which stopped there) and prefill steps (read by tests and
    the benchmark through the engine's `collective_rpc`)."""

    def __init__(self):
        self.decode, self.prefill = {}, {}

    def record(self, layer, stop):
        counts = self.decode if stop else self.prefill
        counts[layer] = counts.get(layer, 0) + 1


def refusal(architecture: str) -> str | None:
    """Why vLLM cannot serve `architecture` here (one line), or None."""
    for key, ours in FAMILIES.items():
        if ours.__name__ == architecture and key in UNSERVED:
            return f"`{architecture}` cannot be served by vLLM here: {UNSERVED[key]}; serve it with `generate`."
    return None


def _unserved_base():
    from vllm.model_executor.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


class _Unserved:
    """Stands for a family vLLM cannot serve here while vLLM inspects the architecture; the start-up check refuses it
    before any model is built."""

    def __init__(self, *args, **kwargs):
        raise ValueError(refusal(type(self).__name__))


def _make_class(key: str) -> type:
    module, name, attention, positional = VLLM_FAMILIES[key]
    vllm_class = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
    ours = FAMILIES[key]

    def __init__(self, *, vllm_config, prefix=""):
        EarlyExitVllmMixin.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self.exit_stats = ExitStats()

    return type(
        ours.__name__,
        (EarlyExitVllmMixin, vllm_class),
        {
            "__init__": __init__,
            "__module__": __name__,
            "__doc__": f"{ours.__name__} on vLLM's `{name}`.",
            "family": ours.family,
            "attention": attention,
            "positional": positional,
        },
    )


def __getattr__(name):
    """The classes are built when vLLM asks for one (`ModelRegistry` imports them lazily by name)."""
    for key, ours in FAMILIES.items():
        if ours.__name__ == name:
            if key in UNSERVED:  # inspectable, so that vLLM reaches the start-up check, which refuses it
                cls = globals()[name] = type(name, (_Unserved, _unserved_base()), {"__module__": __name__})
                return cls
            cls = globals()[name] = _make_class(key)
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
