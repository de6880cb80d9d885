"""Early-exit causal LMs for the Llama, Mistral, Qwen2, Qwen3, Gemma 3, Gemma 2, Phi-3, OLMo 2 and GPT-2 families.

Each class is the family's own `...ForCausalLM` (same modules, same weight names, so any plain checkpoint loads as it
is) plus exit heads after `config.exit_layers`, all feeding the one shared LM head. One core, `EarlyExitMixin`, runs
the decoder layers itself so it can stop early; what differs between families sits in `families.py`.

Part of the Hub runtime: imports only torch, transformers and its siblings (flat, single-dot), so `save_pretrained`
copies these files next to the weights and `trust_remote_code=True` loads them without this package.
"""

import contextlib
import contextvars
import copy
import json
import os

import torch
from torch import nn
from transformers import (
    AutoTokenizer,
    Gemma2ForCausalLM,
    Gemma2Model,
    Gemma3ForCausalLM,
    Gemma3TextModel,
    GenerationConfig,
    GPT2LMHeadModel,
    GPT2Model,
    LlamaForCausalLM,
    LlamaModel,
    MistralForCausalLM,
    MistralModel,
    Olmo2ForCausalLM,
    Olmo2Model,
    Phi3ForCausalLM,
    Phi3Model,
    Qwen2ForCausalLM,
    Qwen2Model,
    Qwen3ForCausalLM,
    Qwen3Model,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import GENERATION_CONFIG_NAME, logging

from .compat import CACHE, cache_argument, cache_kwargs, cache_of
from .configuration_early_exit import (
    EarlyExitGemma2Config,
    EarlyExitGemma3Config,
    EarlyExitGPT2Config,
    EarlyExitLlamaConfig,
    EarlyExitMistralConfig,
    EarlyExitOlmo2Config,
    EarlyExitPhi3Config,
    EarlyExitQwen2Config,
    EarlyExitQwen3Config,
)
from .decode_core import is_lean
from .decode_loop import GenerateEarlyExitOutput, exit_layers_after_eos
from .exit_heads import ConfidenceHead
from .families import (
    FamilyAdapter,
    Gemma2Adapter,
    Gemma3Adapter,
    GPT2Adapter,
    MistralAdapter,
    Olmo2Adapter,
    Phi3Adapter,
    Qwen2Adapter,
    Qwen3Adapter,
)
from .generation_early_exit import early_exit_generate
from .lean_early_exit import deepen, set_exit_max_layer, shed_layers
from .model_mixins import (  # the exit heads, the draft state, the bare decoder, the outputs, continuous batching
    ContinuousBatchingMixin,
    DraftStateMixin,
    EarlyExitCausalLMOutput,
    EarlyExitDecoderMixin,
    EarlyExitModelOutput,
    ExitHeadsMixin,
)
from .paged_early_exit import is_paged
from .request import (
    EXIT_ARGUMENTS,
    EXIT_FIELDS,
    MAX_BATCH_FIELD,
    OUR_FIELDS,
    ExitSettings,
    check_exit_argument,
    exit_settings_for,
    merged_exit_values,
    resolve_exit_settings,
    resolve_request,
)
from .speculative_early_exit import speculative_generate

logger = logging.get_logger(__name__)


def _keep_exit_settings_on_reload(generation_config: GenerationConfig) -> None:
    """Clears the `_from_model_config` mark of a generation config that holds exit settings: transformers reads a
    file so marked without its custom entries (`GenerationConfig.__init__`), so the settings would be lost. Our
    speculative fields (`OUR_FIELDS`, `speculative_max_batch_size`) are custom entries too."""
    custom = EXIT_ARGUMENTS + OUR_FIELDS + (MAX_BATCH_FIELD,)
    if any(getattr(generation_config, name, None) is not None for name in custom):
        generation_config._from_model_config = False


def _exit_settings_dropped_on_load(model, folder: str) -> dict:
    """The exit settings of a local `folder`'s generation_config.json that transformers did not load because the file
    carries `"_from_model_config": true` (written by versions before `_keep_exit_settings_on_reload` ran on save)."""
    path = os.path.join(folder, GENERATION_CONFIG_NAME)
    if not (
        model.generation_config is not None and model.generation_config._from_model_config and os.path.isfile(path)
    ):
        return {}
    with open(path, encoding="utf-8") as file:
        stored = json.load(file)
    return {name: stored[name] for name in EXIT_ARGUMENTS if stored.get(name) is not None}


# (model, generation config) a `without_stored_settings` block shows its own thread or task
_CALL_VIEW = contextvars.ContextVar("call_generation_config", default=None)


class EarlyExitMixin(ContinuousBatchingMixin, DraftStateMixin, ExitHeadsMixin):
    """The early-exit causal LM shared by every family. Mixed in before the family's `...ForCausalLM`.

    Exit settings are generation settings: `generate(exit_criterion=..., exit_threshold=...)`, or the same names on a
    `GenerationConfig`, or stored in `model.generation_config` (calibration writes them there; `from_pretrained`
    and `from_base` take them as keyword arguments). With none set, `generate` is the family's own, at full depth.
    """

    base_model_class = None  # the family's early-exit decoder for AutoModel (set per family below)

    def __init__(self, config, exit_max_layer: int | None = None):
        """`exit_max_layer` (an exit layer, or the last layer): build only decoder layers 0..exit_max_layer (the rest
        are `ShedLayer` placeholders, see lean_early_exit.py); `from_pretrained(..., exit_max_layer=E)` passes it
        here, before any weight is read."""
        config.validate_early_exit()
        super().__init__(config)
        self._add_exit_heads(config)
        self.tokenizer = None  # set when loaded with the model; saved with it
        self.exit_max_layer = config.num_hidden_layers - 1  # the deepest resident decoder layer
        if config.draft_vocab_size:  # filled from the checkpoint
            self.register_buffer("draft_token_ids", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        if config.draft_table_size:
            for name in ("draft_table_keys", "draft_table_next"):
                self.register_buffer(name, torch.zeros(config.draft_table_size, dtype=torch.long))
        if exit_max_layer is not None:
            shed_layers(self, exit_max_layer)

    def set_exit_max_layer(self, exit_max_layer: int):
        """Keeps exactly decoder layers 0..`exit_max_layer` resident (an exit layer, or the last layer): deeper ones
        are shed (their memory freed), missing ones are read from the checkpoint folder. Between generate calls."""
        return set_exit_max_layer(self, exit_max_layer)

    def add_confidence_heads(self) -> nn.ModuleList:
        """Adds untrained learned-confidence heads (one per exit) and records them in the config."""
        if self.confidence_heads is None:
            device = self.family.final_norm(self).weight.device
            self.confidence_heads = nn.ModuleList(
                [ConfidenceHead(self.config.hidden_size).to(device) for _ in self.config.exit_layers]
            )
            for module in reversed(list(self.confidence_heads.modules())):
                self._init_weights(module)  # zero-start: a fresh head says 0.5 everywhere
        self.config.exit_confidence_heads = True
        return self.confidence_heads

    # loading and saving -------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`from_pretrained` of the family class. Exit architecture fields (`exit_layers=...`) and exit settings
        (`exit_criterion=...`, validated here before any weight is read) may be passed as keyword arguments; the
        settings become the model's generation defaults. Exit heads missing from the checkpoint start from its final
        norm and are reported once by name. `exit_max_layer=E` (an exit layer, or the last layer) builds and loads
        decoder layers 0..E only: the others are never read (lean_early_exit.py)."""
        settings = {name: kwargs.pop(name) for name in EXIT_ARGUMENTS if name in kwargs}
        for name, value in settings.items():
            check_exit_argument(name, value)
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        missing = getattr(model, "_missing_exit_modules", [])
        if missing:
            logger.warning(
                f"Initialised {', '.join(missing)} from the final norm / as untrained: not in the checkpoint."
            )
        legacy = {k: v for k, v in model.config.pop_legacy_exit_settings().items() if v is not None}
        if not (
            legacy.get("exit_criterion") or legacy.get("exit_threshold") is not None or legacy.get("exit_patience")
        ):
            legacy = {}  # the first wave stored policy/kv defaults even with exits off
        path = str(pretrained_model_name_or_path)
        dropped = {}
        if kwargs.get("generation_config") is None:  # else the passed config replaced the file
            dropped = _exit_settings_dropped_on_load(model, os.path.join(path, kwargs.get("subfolder") or ""))
        model.set_exit_defaults(**{**legacy, **dropped, **settings})
        if (
            model.tokenizer is None
            and os.path.isdir(path)
            and any(os.path.exists(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json"))
        ):
            try:
                model.tokenizer = AutoTokenizer.from_pretrained(path, config=model.config)
            except Exception as error:  # a broken tokenizer must not stop the model from loading
                logger.warning(f"Could not load the tokenizer in {path}: {error}")
        return (model, info) if want_info else model

    def set_exit_defaults(self, **settings) -> None:
        """Stores exit settings (`exit_criterion=...`; None clears one) in `model.generation_config`, validated
        together, so a later `generate()` without exit arguments uses them and `save_pretrained` writes them to
        `generation_config.json`."""
        unknown = sorted(set(settings) - set(EXIT_ARGUMENTS))
        if unknown:
            raise ValueError(f"Unknown exit setting(s) {unknown}: allowed names are {list(EXIT_ARGUMENTS)}.")
        if self.generation_config is None:
            self.generation_config = GenerationConfig()
        values = merged_exit_values(self)
        values.update(settings)
        resolve_exit_settings(self.config, values)  # raises on a bad value or combination
        for name, value in settings.items():
            setattr(self.generation_config, name, value)
        _keep_exit_settings_on_reload(self.generation_config)

    @property
    def exit_defaults(self) -> dict:
        """The exit settings stored in `model.generation_config` (None = not set)."""
        return {name: getattr(self.generation_config, name, None) for name in EXIT_FIELDS}

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Saves weights, config (with `auto_map` for AutoModelForCausalLM and AutoModel), generation config (with
        the exit settings) and this runtime code; also the tokenizer loaded with the model, and a model card when
        `ee_transformers` is installed (it registers `model_card_writer`)."""
        if is_lean(self):
            raise ValueError(
                f"This model holds decoder layers 0..{self.exit_max_layer} only (`exit_max_layer`); "
                "saving it would write a checkpoint without the others. Load every layer first: "
                f"`model.set_exit_max_layer({self.config.num_hidden_layers - 1})`."
            )
        if self.base_model_class is not None:  # AutoModel -> the family's early-exit decoder
            auto_map = dict(getattr(self.config, "auto_map", None) or {})
            auto_map["AutoModel"] = f"{type(self).__module__.split('.')[-1]}.{self.base_model_class.__name__}"
            self.config.auto_map = auto_map
        if self.generation_config is not None:  # settings set as attributes, not through set_exit_defaults
            _keep_exit_settings_on_reload(self.generation_config)
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(save_directory)
            writer = getattr(EarlyExitMixin, "model_card_writer", None)
            if writer is not None:
                writer(self, save_directory)

    # heads --------------------------------------------------------------------------------------------------------
    def exit_logits_from_hidden(self, exit_index: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits of exit `exit_index` (position in `config.exit_layers`) for the residual stream leaving its layer."""
        return self.family.head_logits(self, self.exit_heads[exit_index](hidden_states))

    def head_input(self, layer: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """The LM head's input for residual states leaving decoder layer `layer`: its exit head, or the final norm."""
        if layer == self.config.num_hidden_layers - 1:
            return self.family.final_norm(self)(hidden_states)
        return self.exit_heads[self.config.exit_layers.index(layer)](hidden_states)

    # forward ------------------------------------------------------------------------------------------------------
    @cache_argument
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        output_exit_logits: bool = False,
        **kwargs,
    ) -> EarlyExitCausalLMOutput:
        """The family's forward (all layers run), plus `output_exit_logits`: also return `exit_logits`, one
        `(batch, seq, vocab)` tensor per exit. Early-exit decoding runs in `generate`."""
        if is_paged(cache) and not output_exit_logits:  # a continuous-batching step
            with torch.no_grad():
                out = self._paged_forward(input_ids, position_ids, attention_mask, cache, logits_to_keep, dict(kwargs))
            if out is not None:
                return out
        user_hidden = kwargs.get("output_hidden_states", False)
        if output_exit_logits:
            kwargs["output_hidden_states"] = True
        out = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwargs(cache),
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        exit_logits = None
        if output_exit_logits:
            # hidden_states[e + 1] is the residual stream leaving layer e (only the last entry is after the final norm)
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            exit_logits = tuple(
                self.exit_logits_from_hidden(i, out.hidden_states[layer + 1][:, keep])
                for i, layer in enumerate(self.config.exit_layers)
            )
        return EarlyExitCausalLMOutput(
            loss=out.loss,
            logits=out.logits,
            **{CACHE: cache_of(out)},
            hidden_states=out.hidden_states if user_hidden else None,
            attentions=out.attentions,
            exit_logits=exit_logits,
        )

    # generate -----------------------------------------------------------------------------------------------------
    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, **kwargs):
        """`GenerationMixin.generate` plus early exit.

        Exit settings (generation settings; precedence: these kwargs, then `generation_config`, then
        `model.generation_config`): `exit_criterion` ("max_prob", "margin", "entropy", "cosine", "learned", or a
        registered / given `ExitCriterion`), `exit_threshold` (float or one per checked exit), `exit_policy` ("batch",
        "row"), `exit_patience` (0 or k >= 2: stable-token exits), `exit_kv` ("immediate", "deferred"),
        `exit_check_layers`; `early_exit=False` forces full depth. With exits on, the decoding loop is
        `early_exit_generate`, passed to transformers as `custom_generate`. With `return_dict_in_generate=True` the
        output also has `exit_layers` `(batch, new_tokens)`.

        Lossless self-speculative decoding: `assistant_early_exit=e + 1` (transformers' argument: the number of layers
        that draft) drafts with the exit head after layer `e` and verifies with the layers above it, at any batch size
        (`speculative_early_exit.py`); `num_assistant_tokens`, `num_assistant_tokens_schedule` and
        `assistant_confidence_threshold` as in transformers; `assistant_vocab_size=n` (ours) lets the exit head score
        only the n most frequent tokens the model stores (`set_draft_vocab`), a far cheaper draft head;
        `speculative_verify_width=w` (ours) feeds context rounds at least w positions per row (fillers never
        accepted), for CPUs whose kernels are slower at 2-3 rows than at 4-8; `speculative_table_drafts=True` (ours)
        lets the rows without a context match draft from the model's stored table (`set_draft_table`);
        `speculative_history_tokens=n` (ours) sizes the history of earlier generations copied drafts also come from
        (0: off); `speculative_gate=False` (ours) drafts in every round, even where the gate expects no gain.
        """
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        batch_size = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.ndim == 2 else None
        request = resolve_request(self, generation_config, kwargs, batch_size)  # the one decision (request.py)
        kwargs = dict(request.kwargs)
        if request.mode == "speculative":
            return super().generate(
                inputs,
                generation_config=generation_config,
                custom_generate=speculative_generate,
                spec_streamer=kwargs.pop("streamer", None),
                **request.speculative,
                **kwargs,
            )
        if generation_config is not None and request.stored_off:  # a passed copy of the stored config carries them
            generation_config = copy.deepcopy(generation_config)
            for name in request.stored_off:
                setattr(generation_config, name, None)
        with self.without_stored_settings(request.stored_off):
            if request.mode == "exits":
                return self.decode_with_exits(inputs, generation_config, request.exit_settings, **kwargs)
            eos = kwargs.get("eos_token_id", getattr(generation_config or self.generation_config, "eos_token_id", None))
            out = super().generate(inputs, generation_config=generation_config, **kwargs)
        return self._with_full_depth_exit_layers(out, ids, eos)

    # `generation_config`: what this thread's call sees -----------------------------------------------------------
    @property
    def generation_config(self):
        """The stored generation settings (`generation_config.json`); inside `without_stored_settings`, for the
        thread (or task) in that block only, a copy without the settings it hides."""
        view = _CALL_VIEW.get()
        if view is not None and view[0] is self:
            return view[1]
        return self.__dict__.get("_stored_generation_config")

    @generation_config.setter
    def generation_config(self, value):
        self.__dict__["_stored_generation_config"] = value

    @contextlib.contextmanager
    def without_stored_settings(self, names):
        """While the block runs, this thread's (or task's) `self.generation_config` is a copy without the stored
        settings `names` (the draft settings a call turned off: transformers would otherwise refill them into the
        call's config). The stored config itself is not touched, so concurrent calls on one model each see their
        own settings."""
        stored = self.generation_config
        names = [n for n in names if getattr(stored, n, None) is not None]
        if not names:
            yield
            return
        view = copy.deepcopy(stored)
        for name in names:
            setattr(view, name, None)
        token = _CALL_VIEW.set((self, view))
        try:
            yield
        finally:
            _CALL_VIEW.reset(token)

    def decode_with_exits(self, inputs, generation_config, settings: ExitSettings, streamer=None, **kwargs):
        """transformers' `generate` with the confident-exit loop (`early_exit_generate`) and resolved `settings`
        (`request.resolve_request`); the pool calls it with its switch (`exit_switch`)."""
        return super().generate(
            inputs,
            generation_config=generation_config,
            custom_generate=early_exit_generate,
            exit_settings=settings,
            exit_streamer=kwargs.pop("streamer", streamer),
            **kwargs,
        )

    def exit_settings_for(self, generation_config=None, kwargs=None) -> ExitSettings | None:
        """The exit settings a decode uses (kwargs over `generation_config` over `self.generation_config`), validated;
        None for full depth (`request.exit_settings_for`). Pops the exit names from `kwargs`."""
        return exit_settings_for(self, generation_config, kwargs)

    def deepen(self, cache, attention_mask) -> int:
        """A lean model's quality guard breached: loads the next layers and brings their K/V up to date
        (`lean_early_exit.deepen`). Returns the new `exit_max_layer`."""
        return deepen(self, cache, attention_mask)

    def _with_full_depth_exit_layers(self, out, input_ids, eos_token_id):
        """A full-depth `generate` output with `exit_layers` (every token at the last layer, -1 after EOS)."""
        if type(out) is not GenerateDecoderOnlyOutput or input_ids is None:
            return out
        prompt_length = input_ids.shape[1]
        exit_layers = exit_layers_after_eos(
            out.sequences[:, prompt_length:], eos_token_id, self.config.num_hidden_layers - 1
        )
        return GenerateEarlyExitOutput(**{**out, "exit_layers": exit_layers})


# ---------------------------------------------------------------------------------------------------------------------
# the families
# ---------------------------------------------------------------------------------------------------------------------
class EarlyExitLlamaModel(EarlyExitDecoderMixin, LlamaModel):
    config_class = EarlyExitLlamaConfig
    family = FamilyAdapter(bare=True)


class EarlyExitLlamaForCausalLM(EarlyExitMixin, LlamaForCausalLM):
    config_class = EarlyExitLlamaConfig
    config: EarlyExitLlamaConfig
    family = FamilyAdapter()
    base_model_class = EarlyExitLlamaModel


class EarlyExitMistralModel(EarlyExitDecoderMixin, MistralModel):
    config_class = EarlyExitMistralConfig
    family = MistralAdapter(bare=True)


class EarlyExitMistralForCausalLM(EarlyExitMixin, MistralForCausalLM):
    config_class = EarlyExitMistralConfig
    config: EarlyExitMistralConfig
    family = MistralAdapter()
    base_model_class = EarlyExitMistralModel


class EarlyExitQwen2Model(EarlyExitDecoderMixin, Qwen2Model):
    config_class = EarlyExitQwen2Config
    family = Qwen2Adapter(bare=True)


class EarlyExitQwen2ForCausalLM(EarlyExitMixin, Qwen2ForCausalLM):
    config_class = EarlyExitQwen2Config
    config: EarlyExitQwen2Config
    family = Qwen2Adapter()
    base_model_class = EarlyExitQwen2Model


class EarlyExitQwen3Model(EarlyExitDecoderMixin, Qwen3Model):
    config_class = EarlyExitQwen3Config
    family = Qwen3Adapter(bare=True)


class EarlyExitQwen3ForCausalLM(EarlyExitMixin, Qwen3ForCausalLM):
    config_class = EarlyExitQwen3Config
    config: EarlyExitQwen3Config
    family = Qwen3Adapter()
    base_model_class = EarlyExitQwen3Model


class EarlyExitGemma3Model(EarlyExitDecoderMixin, Gemma3TextModel):
    config_class = EarlyExitGemma3Config
    family = Gemma3Adapter(bare=True)


class EarlyExitGemma3ForCausalLM(EarlyExitMixin, Gemma3ForCausalLM):
    config_class = EarlyExitGemma3Config
    config: EarlyExitGemma3Config
    family = Gemma3Adapter()
    base_model_class = EarlyExitGemma3Model


class EarlyExitGemma2Model(EarlyExitDecoderMixin, Gemma2Model):
    config_class = EarlyExitGemma2Config
    family = Gemma2Adapter(bare=True)


class EarlyExitGemma2ForCausalLM(EarlyExitMixin, Gemma2ForCausalLM):
    config_class = EarlyExitGemma2Config
    config: EarlyExitGemma2Config
    family = Gemma2Adapter()
    base_model_class = EarlyExitGemma2Model


class EarlyExitPhi3Model(EarlyExitDecoderMixin, Phi3Model):
    config_class = EarlyExitPhi3Config
    family = Phi3Adapter(bare=True)


class EarlyExitPhi3ForCausalLM(EarlyExitMixin, Phi3ForCausalLM):
    config_class = EarlyExitPhi3Config
    config: EarlyExitPhi3Config
    family = Phi3Adapter()
    base_model_class = EarlyExitPhi3Model


class EarlyExitOlmo2Model(EarlyExitDecoderMixin, Olmo2Model):
    config_class = EarlyExitOlmo2Config
    family = Olmo2Adapter(bare=True)


class EarlyExitOlmo2ForCausalLM(EarlyExitMixin, Olmo2ForCausalLM):
    config_class = EarlyExitOlmo2Config
    config: EarlyExitOlmo2Config
    family = Olmo2Adapter()
    base_model_class = EarlyExitOlmo2Model


class EarlyExitGPT2Model(EarlyExitDecoderMixin, GPT2Model):
    config_class = EarlyExitGPT2Config
    family = GPT2Adapter(bare=True)


class EarlyExitGPT2ForCausalLM(EarlyExitMixin, GPT2LMHeadModel):
    config_class = EarlyExitGPT2Config
    config: EarlyExitGPT2Config
    family = GPT2Adapter()
    base_model_class = EarlyExitGPT2Model


# The family table: plain `model_type` -> early-exit causal LM. Adding a family: its adapter (families.py), its config
# (configuration_early_exit.py), its two classes above, and one line here.
FAMILIES = {
    "llama": EarlyExitLlamaForCausalLM,
    "mistral": EarlyExitMistralForCausalLM,
    "qwen2": EarlyExitQwen2ForCausalLM,
    "qwen3": EarlyExitQwen3ForCausalLM,
    "gemma3_text": EarlyExitGemma3ForCausalLM,
    "gemma2": EarlyExitGemma2ForCausalLM,
    "phi3": EarlyExitPhi3ForCausalLM,
    "olmo2": EarlyExitOlmo2ForCausalLM,
    "gpt2": EarlyExitGPT2ForCausalLM,
}

for _model_class in FAMILIES.values():
    _model_class.config_class.register_for_auto_class()
    _model_class.register_for_auto_class("AutoModelForCausalLM")


__all__ = [
    "FAMILIES",
    "EarlyExitCausalLMOutput",
    "EarlyExitDecoderMixin",
    "EarlyExitMixin",
    "EarlyExitModelOutput",
    "EarlyExitLlamaForCausalLM",
    "EarlyExitLlamaModel",
    "EarlyExitMistralForCausalLM",
    "EarlyExitMistralModel",
    "EarlyExitQwen2ForCausalLM",
    "EarlyExitQwen2Model",
    "EarlyExitQwen3ForCausalLM",
    "EarlyExitQwen3Model",
    "EarlyExitGemma3ForCausalLM",
    "EarlyExitGemma3Model",
    "EarlyExitGemma2ForCausalLM",
    "EarlyExitGemma2Model",
    "EarlyExitPhi3ForCausalLM",
    "EarlyExitPhi3Model",
    "EarlyExitOlmo2ForCausalLM",
    "EarlyExitOlmo2Model",
    "EarlyExitGPT2ForCausalLM",
    "EarlyExitGPT2Model",
]
