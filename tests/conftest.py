"""The family matrix: tiny random models of every supported family and variant, built in fixtures (no hub).

Every invariant test that takes the `family` fixture runs over all of `FAMILIES`. A row is a `FamilySpec` (the plain
config class, the plain model class, the config fields beyond `TINY`); it unpacks as that 3-tuple too.
"""

import logging
import sys
import warnings
from typing import NamedTuple

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

from ee_transformers.compat import cache_of

torch.set_num_threads(1)


# --- deprecated call patterns fail the suite ------------------------------------------------------------------------
# pyproject's `filterwarnings` makes a FutureWarning / DeprecationWarning whose origin is this package or its tests an
# error. transformers reports some deprecated call patterns through its logger instead (e.g. "Passing
# `generation_config` together with generation-related arguments is deprecated"), once per process: this handler
# re-issues such a record as a FutureWarning whose origin is the code that made the call, so the same filters judge it
# and `pytest.warns` can assert it; the fixture below re-arms `warning_once`. The origin: the first frame above the
# innermost `generate` that is not a `generate` of transformers, a decorator (torch's, functools', transformers'), or
# the runtime (`ee_transformers.<module>`, or a Hub folder's copy of it: its `generate` methods and decode paths pass a
# caller's arguments on). So a test's or a library module's (`ee_transformers.tools`, `.measure`, `.training`,
# `.utils`) call is blamed on itself, and a call transformers makes inside its own loop (its assistant's `generate`)
# on transformers.
WRAPPERS = {"torch", "functools", "contextlib"}
LIBRARY = {"tools", "measure", "training", "utils", "convert"}


def _module(frame) -> str:
    return frame.f_globals.get("__name__", "")


def _passes_on(frame) -> bool:
    """A frame between a caller and the `generate` that logged: a decorator, a `generate` of transformers (a runtime
    method's `super().generate`), or the runtime."""
    name = _module(frame)
    parts = name.split(".")
    runtime = parts[0] == "ee_transformers" and (len(parts) == 1 or (len(parts) == 2 and parts[1] not in LIBRARY))
    runtime |= parts[0] == "transformers_modules"  # the runtime as a Hub folder's remote code
    decorator = parts[0] in WRAPPERS or name.startswith("transformers.utils.")
    return runtime or decorator or (name.startswith("transformers") and frame.f_code.co_name == "generate")


def _caller_of_generate(frame):
    """(the frame that made the `generate` call that logged above `frame`, the innermost runtime frame on the way),
    or (None, None) when no `generate` is on the stack."""
    while frame is not None and frame.f_code.co_name != "generate":
        frame = frame.f_back
    inner = None
    while frame is not None and _passes_on(frame):
        if inner is None and _module(frame).startswith("ee_transformers"):
            inner = frame
        frame = frame.f_back
    return frame, inner


class DeprecationLogToWarning(logging.Handler):
    def emit(self, record):
        message = record.getMessage()
        if "deprecated" not in message:
            return
        frame, inner = _caller_of_generate(sys._getframe(1))
        if frame is None:  # not about a generate call: the first frame outside transformers and logging
            frame = sys._getframe(1)
            while frame.f_back is not None and _module(frame).split(".")[0] in {"transformers", "logging", __name__}:
                frame = frame.f_back
        where = f"called at {frame.f_code.co_filename}:{frame.f_lineno}"
        if inner is not None and inner is not frame:
            where += f", through {inner.f_code.co_filename}:{inner.f_lineno}"
        warnings.warn_explicit(
            f"{message} ({where})",
            FutureWarning,
            frame.f_code.co_filename,
            frame.f_lineno,
            module=_module(frame),
            registry=frame.f_globals.setdefault("__warningregistry__", {}),
        )


hf_logging.get_logger("transformers").addHandler(DeprecationLogToWarning())


@pytest.fixture(autouse=True)
def _rearm_warning_once():
    hf_logging.warning_once.cache_clear()  # a message logged "once" in an earlier test is reported again here


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
    max_position_embeddings=256,
)

# Small enough to bite within the tests' lengths: a 7-token prompt plus 6 new tokens is 13 positions, so sliding
# layers both mask (prefill) and evict (dynamic and static caches keep only the last window) during every test.
SLIDING_WINDOW = 4
MIXED_LAYERS = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
GEMMA_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]  # local first, as Gemma


class FamilySpec(NamedTuple):
    config_class: type
    model_class: type
    extra: dict


FAMILIES = {
    "llama": FamilySpec(LlamaConfig, LlamaForCausalLM, {}),
    "mistral": FamilySpec(MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "mistral-sliding": FamilySpec(MistralConfig, MistralForCausalLM, {"sliding_window": SLIDING_WINDOW}),
    "qwen2": FamilySpec(Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen2-sliding": FamilySpec(
        Qwen2Config,
        Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": SLIDING_WINDOW, "layer_types": MIXED_LAYERS},
    ),
    "qwen3": FamilySpec(Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    # Gemma: local/global alternation with a window that bites, local and global rotary bases, final soft-cap (the
    # Gemma 3 release has none; the test model sets one so the exits' soft-cap is checked on both)
    "gemma3": FamilySpec(
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "head_dim": 8,
            "query_pre_attn_scalar": 8,
            "sliding_window": SLIDING_WINDOW,
            "layer_types": GEMMA_LAYERS,
            "final_logit_softcapping": 0.2,
        },
    ),
    "gemma2": FamilySpec(
        Gemma2Config,
        Gemma2ForCausalLM,
        {
            "head_dim": 8,
            "query_pre_attn_scalar": 8,
            "sliding_window": SLIDING_WINDOW,
            "layer_types": GEMMA_LAYERS,
            "final_logit_softcapping": 0.2,
            "attn_logit_softcapping": 0.5,
        },
    ),
    # Phi-3 with partial rotary (as Phi-4-mini): half of each key head rotates
    "phi3": FamilySpec(Phi3Config, Phi3ForCausalLM, {"partial_rotary_factor": 0.5}),
    "olmo2": FamilySpec(Olmo2Config, Olmo2ForCausalLM, {}),
    # GPT-2's default init (std 0.02, residual projections scaled down) leaves a tiny model's residual stream almost
    # all embedding, so every exit would pick the same tokens; a larger init makes the layers matter
    # (num_key_value_heads: GPT-2 has no grouped K/V, and continuous batching sizes its paged cache from this field)
    "gpt2": FamilySpec(
        GPT2Config, GPT2LMHeadModel, {"n_inner": 64, "initializer_range": 0.2, "num_key_value_heads": 4}
    ),
}


def make_base(family: str, seed: int = 0, **overrides):
    """A tiny random base model of `family` (a key of `FAMILIES`), in eval mode."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **extra, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial norms, so tests can tell a copied norm from a fresh one
        for module in model.modules():
            if "norm" in type(module).__name__.lower():
                module.weight.uniform_(0.5, 1.5)
                if getattr(module, "bias", None) is not None:
                    module.bias.uniform_(-0.5, 0.5)
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


# --- references built from the base model's own code -----------------------------------------------------------------
def decoder_names(base) -> tuple[str, str, str]:
    """(decoder attribute, layer-list attribute, final-norm attribute) of a plain causal LM: GPT-2 keeps its blocks
    in `transformer.h` and its final norm in `transformer.ln_f`, the others in `model.layers` and `model.norm`."""
    if hasattr(base.get_decoder(), "h"):
        return base.base_model_prefix, "h", "ln_f"
    return base.base_model_prefix, "layers", "norm"


def base_with_layers(base, layers: list[int], final_norm=None):
    """A copy of the plain model `base` whose decoder holds only its layers `layers` (in that order), with
    `final_norm` (any module, e.g. an exit head) in place of its final norm when given. Built by the family's own
    classes from its own weights, so it is a reference independent of the early-exit runtime."""
    import copy

    decoder, layer_list, norm = decoder_names(base)
    config = copy.deepcopy(base.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [base.config.layer_types[j] for j in layers]
    model = type(base)(config).eval()
    prefix = f"{decoder}.{layer_list}."
    state = {}
    for key, value in base.state_dict().items():
        if key.startswith(prefix):
            j, rest = key[len(prefix) :].split(".", 1)
            if int(j) in layers:
                state[f"{prefix}{layers.index(int(j))}.{rest}"] = value
        else:
            state[key] = value
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("lm_head.weight")], (missing, unexpected)
    if final_norm is not None:
        setattr(getattr(model, decoder), norm, copy.deepcopy(final_norm))
    return model


def cut_at_exit(base, model, exit_index: int):
    """The base model cut after exit layer e = `model.config.exit_layers[exit_index]`, with that exit's head (norm,
    adapter) as its final norm: what a forced exit at e must equal, final soft-cap and all."""
    e = model.config.exit_layers[exit_index]
    return base_with_layers(base, list(range(e + 1)), final_norm=model.exit_heads[exit_index])


def own_kv(base, layer: int, states, attention_mask, position_ids):
    """Keys and values that decoder layer `layer` of `base` computes for residual states `states` `(B, T, D)`
    entering it: a one-layer copy of `base` (that layer only) is run on `states` as input embeddings and its cache
    is read. Returns its cache layer (sliding layers keep only their window)."""
    single = base_with_layers(base, [layer])
    if hasattr(single.get_decoder(), "wpe"):  # absolute positions are already in the residual stream
        single.get_decoder().wpe.weight.data.zero_()
    with torch.no_grad():
        out = single(inputs_embeds=states, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
    return cache_of(out).layers[0]


def cached(layer, kind: str = "keys"):
    """A cache layer's valid keys (or values), `(B, H, n, D)`, oldest first: a static layer's first
    `get_seq_length()` slots (a static sliding layer's whole window once full), a dynamic layer's tensor."""
    tensor = getattr(layer, kind)
    if type(layer).__name__.startswith("Static"):
        return tensor[:, :, : min(int(layer.get_seq_length()), tensor.shape[2])]
    return tensor


def chi_square_p(a, b, min_count=10):
    """p-value of a two-sample chi-square test that category samples `a` and `b` come from one distribution (cells
    with fewer than `min_count` pooled draws merged into one)."""
    cells = int(torch.cat([a, b]).max()) + 1
    ca, cb = torch.bincount(a, minlength=cells).double(), torch.bincount(b, minlength=cells).double()
    rare = (ca + cb) < min_count
    ca = torch.cat([ca[~rare], ca[rare].sum(0, keepdim=True)])
    cb = torch.cat([cb[~rare], cb[rare].sum(0, keepdim=True)])
    seen = (ca + cb) > 0
    ca, cb = ca[seen], cb[seen]
    total = ca + cb
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    stat = ((ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb).sum()
    return float(torch.special.gammaincc(torch.tensor((len(total) - 1) / 2, dtype=torch.float64), stat / 2))


class LayerCalls:
    """Per decoder layer: calls, positions run (rows x query tokens), rows run (summed) and the rows of each call
    (`call_rows`); forward pre-hooks, `remove()` takes them off."""

    def __init__(self, model):
        layers = model.family.layers(model)
        self.calls, self.positions, self.rows = [0] * len(layers), [0] * len(layers), [0] * len(layers)
        self.call_rows = [[] for _ in layers]
        self.handles = [
            layer.register_forward_pre_hook(self._hook(j), with_kwargs=True) for j, layer in enumerate(layers)
        ]

    def _hook(self, j):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.calls[j] += 1
            self.positions[j] += hidden.shape[0] * hidden.shape[1]
            self.rows[j] += hidden.shape[0]
            self.call_rows[j].append(hidden.shape[0])

        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()
