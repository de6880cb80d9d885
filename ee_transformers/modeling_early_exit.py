"""Early-exit causal LMs for the Llama, Mistral, Qwen2 and Qwen3 families.

Each class is the family's own `...ForCausalLM` (same modules, same weight names, so any plain checkpoint loads as it
is) plus exit heads after `config.exit_layers`, all feeding the one shared LM head. One core, `EarlyExitMixin`, runs
the decoder layers itself so it can stop early; what differs between families sits in `families.py`.

Part of the Hub runtime: imports only torch, transformers and its siblings (flat, single-dot), so `save_pretrained`
copies these files next to the weights and `trust_remote_code=True` loads them without this package.
"""

import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import (
    AutoTokenizer,
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging
from transformers.utils.deprecation import deprecate_kwarg

from .cache_early_exit import EarlyExitCache, RowSubsetCache
from .configuration_early_exit import (
    EarlyExitLlamaConfig,
    EarlyExitMistralConfig,
    EarlyExitQwen2Config,
    EarlyExitQwen3Config,
)
from .exit_heads import ConfidenceHead, ExitHead
from .families import FamilyAdapter, MistralAdapter, Qwen2Adapter, Qwen3Adapter
from .generation_early_exit import (
    EXIT_ARGUMENTS,
    GenerateEarlyExitOutput,
    early_exit_sample,
    exit_layers_after_eos,
    logit_score,
    resolve_exit_settings,
)


logger = logging.get_logger(__name__)


@dataclass
class EarlyExitCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus:

    exit_logits: with `output_exit_logits=True`, one `(batch, seq, vocab)` tensor per exit in `config.exit_layers`.
    exit_layers: in early-exit decoding, `(batch,)` the decoder layer each row's logits come from.
    """

    exit_logits: tuple[torch.Tensor, ...] | None = None
    exit_layers: torch.LongTensor | None = None


def _rows(t, rows, batch_size):
    """Selects `rows` of a per-row tensor; broadcast (batch 1) tensors and None pass through."""
    if t is None or not isinstance(t, torch.Tensor) or t.shape[0] != batch_size or batch_size == 1:
        return t
    return t.index_select(0, rows)


class _StepState:
    """What one decoding step remembers across its exit checks (stable-token runs, forced targets)."""

    def __init__(self, batch_size, device, unfinished, forced, patience):
        self.prev_argmax = self.run = None
        if patience:
            self.prev_argmax = torch.full((batch_size,), -1, dtype=torch.long, device=device)
            self.run = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.finished = None if unfinished is None else unfinished.to(device) == 0
        self.forced = None if forced is None else forced(batch_size, device).to(device)


class _Decided:
    """The rows decided in one step: each group's layer and logits, or its LM-head input when no logits were needed to
    decide; those groups share one LM-head call when the step ends (one weight read instead of one per exit)."""

    def __init__(self, batch_size):
        self.batch_size, self.groups = batch_size, []

    def add(self, rows, layer, logits=None, head_input=None):
        self.groups.append((rows, layer, logits, head_input))

    def finish(self, lm_head):
        """-> logits `(batch, vocab)` and exit layers `(batch,)`."""
        waiting = [g for g in self.groups if g[2] is None]
        if waiting:
            computed = lm_head(torch.cat([g[3] for g in waiting])).split([g[0].numel() for g in waiting])
            it = iter(computed)
            self.groups = [(r, l, next(it) if x is None else x, None) for r, l, x, _ in self.groups]
        first = self.groups[0][2]
        logits = first.new_zeros(self.batch_size, first.shape[-1])
        exit_layers = torch.full((self.batch_size,), -1, dtype=torch.long, device=first.device)
        for rows, layer, group_logits, _ in self.groups:
            logits.index_copy_(0, rows, group_logits)
            exit_layers.index_fill_(0, rows, layer)
        return logits, exit_layers


class EarlyExitMixin:
    """The early-exit core shared by every family. Mixed in before the family's `...ForCausalLM`."""

    family: FamilyAdapter = FamilyAdapter()

    def __init__(self, config):
        config.validate_early_exit()
        super().__init__(config)
        rank = config.exit_adapter_rank if config.exit_head == "adapter" else None
        self.exit_heads = nn.ModuleList([self._new_exit_head(rank) for _ in config.exit_layers])
        self.confidence_heads = None
        if config.exit_confidence_heads:
            self.confidence_heads = nn.ModuleList([ConfidenceHead(config.hidden_size) for _ in config.exit_layers])
        self._initialize_exit_modules()
        self.tokenizer = None  # set when loaded with the model; saved with it

    # construction -------------------------------------------------------------------------------------------------
    def _new_exit_head(self, rank):
        norm = type(self.model.norm)(self.config.hidden_size, eps=self.config.rms_norm_eps)
        return ExitHead(norm, self.config.hidden_size, rank).to(self.model.norm.weight.device)

    def _initialize_exit_modules(self):
        modules = [self.exit_heads] + ([self.confidence_heads] if self.confidence_heads is not None else [])
        for container in modules:
            for module in reversed(list(container.modules())):  # children before parents, as transformers does
                self._init_weights(module)

    def _init_weights(self, module):
        # exit modules say how they start (`_ee_init`); transformers visits children before parents and skips
        # anything already initialised, so this is decided per leaf module
        how = getattr(module, "_ee_init", None)
        if how == "final_norm":  # an exit norm starts as the final norm: exactly "apply the final norm early"
            init.copy_(module.weight, self.model.norm.weight)
        elif how == "zeros":  # adapter up-projections and confidence heads start silent
            init.zeros_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        else:
            super()._init_weights(module)

    def add_confidence_heads(self):
        """Adds untrained learned-confidence heads (one per exit) and records them in the config."""
        if self.confidence_heads is None:
            device = self.model.norm.weight.device
            self.confidence_heads = nn.ModuleList(
                [ConfidenceHead(self.config.hidden_size).to(device) for _ in self.config.exit_layers]
            )
            for module in reversed(list(self.confidence_heads.modules())):
                self._init_weights(module)  # zero-start: a fresh head says 0.5 everywhere
        self.config.exit_confidence_heads = True
        return self.confidence_heads

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`from_pretrained` of the family class; exit fields (`exit_layers=...`) may be passed as keyword arguments.
        Exit heads missing from the checkpoint start from its final norm and are reported once by name."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *model_args, output_loading_info=True,
                                              **kwargs)
        missing = getattr(model, "_missing_exit_modules", [])
        if missing:
            logger.warning(f"Initialised {', '.join(missing)} from the final norm / as untrained: not in the checkpoint.")
        path = str(pretrained_model_name_or_path)
        if model.tokenizer is None and os.path.isdir(path) and any(
            os.path.exists(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json")
        ):
            try:
                model.tokenizer = AutoTokenizer.from_pretrained(path, config=model.config)
            except Exception as error:  # a broken tokenizer must not stop the model from loading
                logger.warning(f"Could not load the tokenizer in {path}: {error}")
        return (model, info) if want_info else model

    def _adjust_missing_and_unexpected_keys(self, loading_info):
        # exit heads absent from a plain checkpoint are expected: keep them out of transformers' load report and
        # name them once ourselves (from_pretrained)
        heads = ("exit_heads.", "confidence_heads.")
        self._missing_exit_modules = sorted(
            {".".join(key.split(".")[:2]) for key in loading_info.missing_keys if key.startswith(heads)}
        )
        loading_info.missing_keys = {key for key in loading_info.missing_keys if not key.startswith(heads)}
        super()._adjust_missing_and_unexpected_keys(loading_info)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Saves weights, config (with `auto_map`) and this runtime code; also the tokenizer loaded with the model,
        and a model card when `ee_transformers` is installed (it registers `model_card_writer`)."""
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
        return self.lm_head(self.exit_heads[exit_index](hidden_states))

    # forward ------------------------------------------------------------------------------------------------------
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
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
        exit_settings=None,
        exit_unfinished=None,
        exit_attention_mask=None,
        **kwargs,
    ) -> EarlyExitCausalLMOutput:
        """The family's forward, plus:

        output_exit_logits: also return `exit_logits`, one `(batch, seq, vocab)` tensor per exit.
        exit_settings / exit_unfinished / exit_attention_mask: set by early-exit `generate`; with them the model runs
            only the layers each row needs and returns, per row, the logits of the head it exited at.
        """
        if exit_settings is not None:
            return self._early_exit_forward(input_ids, attention_mask, position_ids, cache, inputs_embeds,
                                            exit_settings, exit_unfinished, exit_attention_mask)
        user_hidden = kwargs.get("output_hidden_states", False)
        if output_exit_logits:
            kwargs["output_hidden_states"] = True
        out = super().forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs,
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
            loss=out.loss, logits=out.logits, cache=out.cache,
            hidden_states=out.hidden_states if user_hidden else None, attentions=out.attentions,
            exit_logits=exit_logits,
        )

    # early-exit decoding ------------------------------------------------------------------------------------------
    def _early_exit_forward(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, settings,
                            unfinished, exit_attention_mask):
        decoder = self.model
        h = decoder.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, q, D)
        if cache is None:
            raise ValueError("Early-exit decoding needs a cache (use_cache=True).")
        cache = EarlyExitCache.from_cache(cache)
        if position_ids is None:
            position_ids = (torch.arange(h.shape[1], device=h.device) + cache.get_seq_length()).unsqueeze(0)
        state = _StepState(h.shape[0], h.device, unfinished, settings.forced, settings.patience)
        if h.shape[1] > 1 or cache.get_seq_length() == 0:
            logits, exit_layers = self._full_depth_step(h, attention_mask, position_ids, cache, settings, state)
        else:
            mask_2d = exit_attention_mask if exit_attention_mask is not None else attention_mask
            logits, exit_layers = self._skipping_step(h, attention_mask, mask_2d, position_ids, cache, settings, state)
        return EarlyExitCausalLMOutput(logits=logits[:, None], cache=cache, exit_layers=exit_layers)

    def _check(self, settings, layer, h_out, h_in, rows, state):
        """One exit check for the running rows. h_out / h_in: `(n, D)` states leaving / entering `layer` at the last
        position; rows: `(n,)` their batch indices. Returns (a boolean `(n,)` exit decision, logits `(n, V)` or None,
        the exit head's output `(n, D)` or None): whatever the check computed, so `_decide` does not compute it again."""
        index = self.config.exit_layers.index(layer)
        criterion = settings.criterion
        logits = self.exit_logits_from_hidden(index, h_out) if settings.needs_logits else None
        head_out = self.exit_heads[index](h_out) if criterion == "learned" else None
        if criterion == "forced":
            confident = state.forced.index_select(0, rows) <= layer
        else:
            if criterion == "cosine":
                score = nn.functional.cosine_similarity(h_out.float(), h_in.float(), dim=-1)
            elif criterion == "learned":
                score = self.confidence_heads[index](head_out)
            else:
                score = logit_score(logits, criterion)
            confident = score >= settings.thresholds[layer]
        if settings.patience:
            argmax = logits.argmax(-1)
            same = argmax == state.prev_argmax.index_select(0, rows)
            run = torch.where(same, state.run.index_select(0, rows) + 1, torch.ones_like(argmax))
            state.prev_argmax.index_copy_(0, rows, argmax)
            state.run.index_copy_(0, rows, run)
            confident = confident | (run >= settings.patience)
        if state.finished is not None:  # a finished row never holds anything back
            confident = confident | state.finished.index_select(0, rows)
        if settings.policy == "batch":
            confident = confident.all().expand_as(confident)
        return confident, logits, head_out

    def _decide(self, decided, layer, h_last, idx, rows, logits=None, head_out=None):
        """Records rows `rows[idx]` as decided at `layer`: with the check's logits when it computed them, else with the
        exit head's (or final norm's) output, for the one LM-head call at the end of the step."""
        if logits is not None:
            decided.add(rows.index_select(0, idx), layer, logits=logits.index_select(0, idx))
        elif head_out is not None:
            decided.add(rows.index_select(0, idx), layer, head_input=head_out.index_select(0, idx))
        elif layer == self.config.num_hidden_layers - 1:
            decided.add(rows.index_select(0, idx), layer, head_input=self.model.norm(h_last.index_select(0, idx)))
        else:
            head = self.exit_heads[self.config.exit_layers.index(layer)]
            decided.add(rows.index_select(0, idx), layer, head_input=head(h_last.index_select(0, idx)))

    def _full_depth_step(self, h, attention_mask, position_ids, cache, settings, state):
        """Prefill: every layer runs for every position (the prompt's K/V are complete); the token of each row comes
        from the first exit whose criterion holds at the last position."""
        decoder, fam, config = self.model, self.family, self.config
        masks = fam.build_masks(config, h, attention_mask, cache, position_ids)
        position_embeddings = decoder.rotary_emb(h, position_ids)
        at_exit = {}
        for j, layer in enumerate(decoder.layers[: config.num_hidden_layers]):
            h_in = h
            h = layer(h, attention_mask=masks[fam.layer_type(config, j)], position_embeddings=position_embeddings,
                      position_ids=position_ids, cache=cache, use_cache=True)
            if j in settings.thresholds:
                at_exit[j] = (h[:, -1], h_in[:, -1])
        rows = torch.arange(h.shape[0], device=h.device)
        decided = _Decided(h.shape[0])
        for j in settings.check_layers:
            h_out, h_in = (t.index_select(0, rows) for t in at_exit[j])
            confident, logits, head_out = self._check(settings, j, h_out, h_in, rows, state)
            idx = confident.nonzero().squeeze(1)
            if idx.numel():
                self._decide(decided, j, h_out, idx, rows, logits, head_out)
                rows = rows.index_select(0, (~confident).nonzero().squeeze(1))
                if rows.numel() == 0:
                    return decided.finish(self.lm_head)
        last = h[:, -1].index_select(0, rows)
        self._decide(decided, config.num_hidden_layers - 1, last, torch.arange(rows.numel(), device=h.device), rows)
        return decided.finish(self.lm_head)

    def _backfill_kv(self, layer_idx, states, position_embeddings):
        """K/V of layer `layer_idx` for exit states `(n, q, D)`: its input norm, K/V projections, k-norm, rotary."""
        layer = self.model.layers[layer_idx]
        return self.family.key_value(layer.self_attn, layer.input_layernorm(states), position_embeddings)

    def _skipping_step(self, h, attention_mask, mask_2d, position_ids, cache, settings, state):
        """One decoding step (one new token per row) that stops each row at its exit.

        Row policy: exited rows leave the running batch; a deeper layer runs only for the rows still going, and the
        cache still gets one full-batch update per layer (exited rows' K/V backfilled from their exit states).
        Batch policy: the same, with all rows leaving together. Deferred KV: skipped layers get no K/V now; the exit
        states wait in the cache and join the next token that runs those layers.
        """
        decoder, fam, config = self.model, self.family, self.config
        num_layers, batch = config.num_hidden_layers, h.shape[0]
        deferred = settings.kv == "deferred"
        masks = fam.build_masks(config, h, attention_mask, cache, position_ids)
        pos_emb = decoder.rotary_emb(h, position_ids)
        rows = torch.arange(batch, device=h.device)  # running rows (batch indices)
        cur_pos, cur_emb, cur_masks = position_ids, pos_emb, masks
        exited_rows, exited_states = [], []
        decided = _Decided(batch)
        done = {}  # the exited rows, their exit states and rotary embeddings (row policy)
        layer_cache = cache  # what the layers see: the cache, or a view of it for the running rows

        def fill(layer_idx):  # full-batch K/V at `layer_idx`, exited rows backfilled (row policy, immediate)
            k, v = self._backfill_kv(layer_idx, done["states"], done["emb"])
            shape = (batch, *k.shape[1:])
            return (k.new_zeros(shape).index_copy_(0, done["rows"], k),
                    v.new_zeros(shape).index_copy_(0, done["rows"], v))

        for j, layer in enumerate(decoder.layers[:num_layers]):
            if deferred and (entry := cache.pop_pending(j)) is not None:
                # tokens that skipped layer j earlier run it now, ahead of the current token (they are earlier)
                h = torch.cat([entry.states, h], dim=1)
                cur_pos = torch.cat([entry.position_ids, cur_pos], dim=1)
                cur_emb = decoder.rotary_emb(h, cur_pos)
                cur_masks = fam.build_masks(config, h, mask_2d, cache, cur_pos, layer_idx=j)
            h_in = h
            h = layer(h, attention_mask=cur_masks[fam.layer_type(config, j)], position_embeddings=cur_emb,
                      position_ids=cur_pos, cache=layer_cache, use_cache=True)
            if j not in settings.thresholds or j == num_layers - 1:
                continue
            confident, logits, head_out = self._check(settings, j, h[:, -1], h_in[:, -1], rows, state)
            idx = confident.nonzero().squeeze(1)  # the one host sync of this check
            if idx.numel() == 0:
                continue
            self._decide(decided, j, h[:, -1], idx, rows, logits, head_out)
            if idx.numel() == rows.numel():  # every running row has exited at j
                if deferred:
                    cache.add_pending(j + 1, h, cur_pos)
                    return decided.finish(self.lm_head)
                done_rows, done_states = torch.cat(exited_rows + [rows]), torch.cat(exited_states + [h])
                states = done_states.index_select(0, torch.argsort(done_rows))  # back to batch order
                for skipped in range(j + 1, num_layers):
                    cache.update(*self._backfill_kv(skipped, states, pos_emb), skipped)
                return decided.finish(self.lm_head)
            # some rows exit: the rest go on as a smaller batch, through a view of the cache that backfills the others
            keep = (~confident).nonzero().squeeze(1)
            exited_rows.append(rows.index_select(0, idx))
            exited_states.append(h.index_select(0, idx))
            rows, h = rows.index_select(0, keep), h.index_select(0, keep)
            done["rows"], done["states"] = torch.cat(exited_rows), torch.cat(exited_states)
            done["emb"] = tuple(_rows(t, done["rows"], batch) for t in pos_emb)
            cur_masks = {name: _rows(m, rows, batch) for name, m in masks.items()}
            cur_emb = tuple(_rows(t, rows, batch) for t in pos_emb)
            cur_pos = _rows(position_ids, rows, batch)
            layer_cache = RowSubsetCache(cache, rows, fill)

        self._decide(decided, num_layers - 1, h[:, -1], torch.arange(rows.numel(), device=h.device), rows)
        return decided.finish(self.lm_head)

    # generate -----------------------------------------------------------------------------------------------------
    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate` plus early exit.

        Exit arguments: `early_exit` (False forces full depth), `exit_criterion` ("max_prob", "margin", "entropy",
        "cosine", "learned"), `exit_threshold` (float or one per checked exit), `exit_policy` ("batch", "row"),
        `exit_patience` (0 or k >= 2: stable-token exits), `exit_kv` ("immediate", "deferred"), `exit_check_layers`.
        Missing ones come from the config (calibration stores them there); none stored means full depth.
        With `return_dict_in_generate=True` the output also has `exit_layers` `(batch, new_tokens)`.
        """
        exit_kwargs = {name: kwargs.pop(name) for name in EXIT_ARGUMENTS if name in kwargs}
        settings = resolve_exit_settings(self.config, **exit_kwargs)
        if settings is not None:
            generation_config = kwargs.get("generation_config") or self.generation_config
            num_beams = kwargs.get("num_beams", generation_config.num_beams) or 1
            if num_beams > 1:
                raise ValueError(f"Early-exit decoding does not support beam search (`num_beams={num_beams}`); "
                                 "pass `early_exit=False` or `num_beams=1`.")
            for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"):
                if kwargs.get(name) is not None:
                    raise ValueError(f"Early-exit decoding cannot be combined with `{name}`; pass `early_exit=False`.")
            kwargs["exit_settings"] = settings
        return super().generate(*args, **kwargs)

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        if model_kwargs.get("exit_settings") is not None:
            return early_exit_sample(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                     synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
        prompt_length = input_ids.shape[1]
        out = super()._sample(input_ids, logits_processor, stopping_criteria, generation_config,
                              synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
        if not generation_config.return_dict_in_generate:
            return out
        exit_layers = exit_layers_after_eos(out.sequences[:, prompt_length:], generation_config.eos_token_id,
                                            self.config.num_hidden_layers - 1)
        return GenerateEarlyExitOutput(**{**out, "exit_layers": exit_layers})


class EarlyExitLlamaForCausalLM(EarlyExitMixin, LlamaForCausalLM):
    config_class = EarlyExitLlamaConfig
    config: EarlyExitLlamaConfig
    family = FamilyAdapter()


class EarlyExitMistralForCausalLM(EarlyExitMixin, MistralForCausalLM):
    config_class = EarlyExitMistralConfig
    config: EarlyExitMistralConfig
    family = MistralAdapter()


class EarlyExitQwen2ForCausalLM(EarlyExitMixin, Qwen2ForCausalLM):
    config_class = EarlyExitQwen2Config
    config: EarlyExitQwen2Config
    family = Qwen2Adapter()


class EarlyExitQwen3ForCausalLM(EarlyExitMixin, Qwen3ForCausalLM):
    config_class = EarlyExitQwen3Config
    config: EarlyExitQwen3Config
    family = Qwen3Adapter()


for _model_class in (EarlyExitLlamaForCausalLM, EarlyExitMistralForCausalLM, EarlyExitQwen2ForCausalLM,
                     EarlyExitQwen3ForCausalLM):
    _model_class.config_class.register_for_auto_class()
    _model_class.register_for_auto_class("AutoModelForCausalLM")


__all__ = [
    "EarlyExitCausalLMOutput",
    "EarlyExitMixin",
    "EarlyExitLlamaForCausalLM",
    "EarlyExitMistralForCausalLM",
    "EarlyExitQwen2ForCausalLM",
    "EarlyExitQwen3ForCausalLM",
]
