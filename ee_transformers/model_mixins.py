"""The mixins the early-exit models are built from, beside `EarlyExitMixin` (modeling_early_exit.py, where the family
classes are): the exit heads every early-exit model carries (`ExitHeadsMixin`), the family's bare decoder with exit
features (`EarlyExitDecoderMixin`), both output classes, and two bases of `EarlyExitMixin`: the draft state a causal
LM stores (`DraftStateMixin`) and continuous batching on it (`ContinuousBatchingMixin`). Importable from
modeling_early_exit as before.

Part of the Hub runtime: imports only torch, transformers and its siblings.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import ContinuousBatchingConfig
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from .compat import CACHE, cache_argument, cache_kwargs, cache_of
from .decode_core import is_lean
from .draft_table import build_draft_table
from .drafts import Drafter
from .exit_heads import ConfidenceHead, ExitHead
from .families import FamilyAdapter
from .paged_early_exit import check_paged_exits, loaded_layers_config, paged_step
from .paged_speculative import DRAFT_FIELD, attach_paged_drafts, check_paged_drafts
from .request import paged_draft_settings, speculation_requested, stored_draft_settings

logger = logging.get_logger(__name__)
_UNSET = object()  # continuous batching's exit settings: not resolved yet


@dataclass
class EarlyExitCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus:

    exit_logits: with `output_exit_logits=True`, one `(batch, seq, vocab)` tensor per exit in `config.exit_layers`.
    exit_layers: in early-exit decoding, `(batch,)` the decoder layer each row's logits come from.
    """

    exit_logits: tuple[torch.Tensor, ...] | None = None
    exit_layers: torch.LongTensor | None = None


class ExitHeadsMixin:
    """Exit heads and their initialisation, shared by the causal LMs and the bare decoders (`AutoModel`)."""

    family: FamilyAdapter = FamilyAdapter()

    def _add_exit_heads(self, config):
        rank = config.exit_adapter_rank if config.exit_head == "adapter" else None
        self.exit_heads = nn.ModuleList(
            [ExitHead(self.family.new_exit_norm(self), config.hidden_size, rank) for _ in config.exit_layers]
        )
        self.confidence_heads = None
        if config.exit_confidence_heads:
            self.confidence_heads = nn.ModuleList([ConfidenceHead(config.hidden_size) for _ in config.exit_layers])
        modules = [self.exit_heads] + ([self.confidence_heads] if self.confidence_heads is not None else [])
        for container in modules:
            for module in reversed(list(container.modules())):  # children before parents, as transformers does
                self._init_weights(module)

    def _init_weights(self, module):
        # exit modules say how they start (`_ee_init`); transformers visits children before parents and skips
        # anything already initialised, so this is decided per leaf module
        how = getattr(module, "_ee_init", None)
        if how == "final_norm":  # an exit norm starts as the final norm: exactly "apply the final norm early"
            final_norm = self.family.final_norm(self)
            init.copy_(module.weight, final_norm.weight)
            if getattr(module, "bias", None) is not None:  # LayerNorm (GPT-2)
                init.copy_(module.bias, final_norm.bias)
        elif how == "zeros":  # adapter up-projections and confidence heads start silent
            init.zeros_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        else:
            super()._init_weights(module)

    def _adjust_missing_and_unexpected_keys(self, loading_info):
        # exit heads absent from a plain checkpoint are expected: keep them out of transformers' load report and
        # name them once ourselves (from_pretrained)
        heads = ("exit_heads.", "confidence_heads.")
        self._missing_exit_modules = sorted(
            {".".join(key.split(".")[:2]) for key in loading_info.missing_keys if key.startswith(heads)}
        )
        loading_info.missing_keys = {key for key in loading_info.missing_keys if not key.startswith(heads)}
        super()._adjust_missing_and_unexpected_keys(loading_info)


@dataclass
class EarlyExitModelOutput(BaseModelOutputWithPast):
    """`BaseModelOutputWithPast` plus `exit_hidden_states`: with `output_exit_hidden_states=True`, one
    `(batch, seq, hidden)` tensor per exit: that exit head's output (the LM-head input it would feed)."""

    exit_hidden_states: tuple[torch.Tensor, ...] | None = None


class EarlyExitDecoderMixin(ExitHeadsMixin):
    """The family's bare decoder (what `AutoModel` gives for a plain checkpoint) plus the exit heads, whose outputs
    are exit features: `last_hidden_state` is exactly the family's decoder output."""

    def __init__(self, config):
        config.validate_early_exit()
        super().__init__(config)
        self._add_exit_heads(config)

    @cache_argument
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        output_exit_hidden_states: bool = False,
        **kwargs,
    ) -> EarlyExitModelOutput:
        user_hidden = kwargs.get("output_hidden_states", False)
        if output_exit_hidden_states:
            kwargs["output_hidden_states"] = True
        out = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwargs(cache),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        exit_states = None
        if output_exit_hidden_states:  # hidden_states[e + 1] is the residual stream leaving layer e
            exit_states = tuple(
                self.exit_heads[i](out.hidden_states[layer + 1]) for i, layer in enumerate(self.config.exit_layers)
            )
        return EarlyExitModelOutput(
            last_hidden_state=out.last_hidden_state,
            **{CACHE: cache_of(out)},
            hidden_states=out.hidden_states if user_hidden else None,
            attentions=out.attentions,
            exit_hidden_states=exit_states,
        )


class DraftStateMixin:
    """What a causal LM stores for its drafts, for `EarlyExitMixin` (its base): the draft vocabulary, the draft table
    and the drafter of this process."""

    def set_draft_vocab(self, token_ids) -> None:
        """Stores `token_ids` (1-D, distinct, most frequent first; `training.frequent_tokens` counts them on the fitting
        data) for exit-head drafts that score only the first n of them: `generate(assistant_early_exit=...,
        assistant_vocab_size=n)`. Saved with the model (`draft_token_ids`, `config.draft_vocab_size`)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        vocab = self.config.vocab_size
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel():
            raise ValueError(f"`token_ids` must be distinct token ids in [0, {vocab}), at least one.")
        device = self.family.final_norm(self).weight.device
        self.register_buffer("draft_token_ids", ids.to(device))
        self.config.draft_vocab_size = ids.numel()

    def set_draft_table(self, blocks, min_count: int = 2) -> int:
        """Stores the table of frequent continuations of `blocks` (`(n, T)` token ids, or a list of 1-D sequences:
        text like the user's; `fit` stores its data's) for `generate(prompt_lookup_num_tokens=N,
        speculative_table_drafts=True)`: the rows without a context match draft from it (draft_table.py). Only
        continuations seen at least `min_count` times enter. Saved with the model (`draft_table_keys`,
        `draft_table_next`, `config.draft_table_size`). Returns the number of entries."""
        keys, following = build_draft_table(blocks, self.config.vocab_size, min_count)
        if keys.numel() == 0:
            raise ValueError(
                f"`blocks` hold no continuation seen `min_count`={min_count} times: give more text or a lower min_count."
            )
        device = self.family.final_norm(self).weight.device
        self.register_buffer("draft_table_keys", keys.to(device))
        self.register_buffer("draft_table_next", following.to(device))
        self.config.draft_table_size = keys.numel()
        return keys.numel()

    @property
    def drafter(self) -> Drafter:
        """This model's draft state in this process (drafts.py): the history index of earlier generations that
        copied drafts also draw from (`drafter.history`: `num_tokens`, `nbytes`, `save(path)`, `SuffixIndex.load`,
        `clear()`), the acceptance statistics and the step costs the gate measured. Never saved with the model."""
        drafter = self.__dict__.get("_drafter")
        if drafter is None:
            drafter = self.__dict__["_drafter"] = Drafter()
        return drafter


class ContinuousBatchingMixin:
    """transformers' continuous batching with early exit or lossless drafts, for `EarlyExitMixin` (its base: it calls
    the mixin's `exit_settings_for`)."""

    # continuous batching --------------------------------------------------------------------------------------------
    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        """transformers' continuous batching (`generate_batch`, `transformers serve --continuous-batching`) with
        early exit: each step runs through `paged_step` with the exit settings of `generation_config` over the
        stored ones (`paged_early_exit.py`); or, with `prompt_lookup_num_tokens` (passed or stored), lossless drafts
        verified inside each step at full depth (`paged_speculative.py`). The settings hold for this model's
        continuous batching until the next call; what the paged path cannot honour raises here."""
        settings = self.exit_settings_for(generation_config)
        cb_config = continuous_batching_config or ContinuousBatchingConfig()
        # `prompt_lookup_num_tokens`: drafts verified in the paged step (`paged_speculative.py`), at full depth
        drafts = paged_draft_settings(self, generation_config)
        if drafts is not None and speculation_requested(self, generation_config, {}):
            settings, cb_config = None, check_paged_drafts(self, generation_config, cb_config)
        else:
            drafts = None
        if settings is not None:
            cb_config = check_paged_exits(self, settings, generation_config, cb_config)
        unused = [n for n in stored_draft_settings(self, generation_config, {}) if drafts is None or n != DRAFT_FIELD]
        if unused:
            logger.warning_once(
                f"Continuous batching does not use the stored draft settings {unused} here (it verifies context "
                f"drafts, `{DRAFT_FIELD}`, unless the call asks for exits; they are lossless, so the text is the "
                "same; only their speed-up is lost)."
            )
        self._cb_exit_settings = settings
        manager = super().init_continuous_batching(generation_config, cb_config, workload_hints)
        if drafts is not None:
            attach_paged_drafts(self, manager, drafts)
        if is_lean(self) and manager.batch_processor is None:  # size the paged cache for the loaded layers only
            with loaded_layers_config(self):
                manager.warmup()
        return manager

    def _paged_forward(self, input_ids, position_ids, attention_mask, cache, logits_to_keep, kwargs):
        settings = getattr(self, "_cb_exit_settings", _UNSET)
        if settings is _UNSET:  # a manager not made by `init_continuous_batching`: the stored settings
            settings = self._cb_exit_settings = self.exit_settings_for()
            if settings is not None:
                check_paged_exits(self, settings, None, ContinuousBatchingConfig(allow_block_sharing=False))
        if settings is None:
            return None
        logits_indices = kwargs.pop("logits_indices", logits_to_keep)
        if not isinstance(logits_indices, torch.Tensor):
            raise ValueError("Early exit in continuous batching needs `logits_indices` (the tokens that get logits).")
        attention = {k: v for k, v in kwargs.items() if k not in ("logits_processor_args", "output_hidden_states")}
        logits, exit_layers = paged_step(
            self, settings, input_ids, position_ids, attention_mask, cache, logits_indices, attention
        )
        trace = getattr(self, "_paged_trace", None)
        if trace is not None:
            trace.add(input_ids, position_ids, logits_indices, exit_layers)
        return EarlyExitCausalLMOutput(logits=logits)
