"""Early-exit decoding settings, the decoding loop used by `generate`, and exit statistics.

Part of the Hub runtime: imports only torch and transformers.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache_early_exit import EarlyExitCache
from .configuration_early_exit import EXIT_CRITERIA, EXIT_KV_MODES, EXIT_POLICIES


# generate() arguments that belong to early exit; popped before transformers sees them.
EXIT_ARGUMENTS = (
    "early_exit", "exit_criterion", "exit_threshold", "exit_policy", "exit_patience", "exit_kv", "exit_check_layers",
    "exit_forced",
)
SCORE_RANGES = {"max_prob": (0.0, 1.0), "margin": (0.0, 1.0), "entropy": (0.0, 1.0), "cosine": (-1.0, 1.0),
                "learned": (0.0, 1.0)}
# criteria that decide from the exit head's logits (so the LM head runs at every check)
LOGIT_CRITERIA = ("max_prob", "margin", "entropy")


def logit_score(logits: torch.Tensor, criterion: str) -> torch.Tensor:
    """Confidence of a logit criterion: `(..., V)` logits -> `(...)` scores in [0, 1], higher = more confident.
    The one definition used by decoding and by calibration."""
    probs = logits.float().softmax(-1)
    if criterion == "max_prob":
        return probs.max(-1).values
    if criterion == "margin":
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    if criterion == "entropy":  # 1 - H / log(V)
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
        return 1.0 - entropy / math.log(probs.shape[-1])
    raise ValueError(f"`criterion` {criterion!r} is not a logit criterion: allowed values are {list(LOGIT_CRITERIA)}.")


@dataclass
class ExitSettings:
    """Resolved early-exit decoding settings (see `resolve_exit_settings`)."""

    criterion: str
    thresholds: dict  # checked exit layer -> threshold (inf: only the stable-token rule can fire)
    policy: str = "batch"
    patience: int = 0
    kv: str = "immediate"
    forced: Callable | None = None  # benchmark only: forced(batch_size, device) -> (batch,) target exit layers

    @property
    def check_layers(self) -> list[int]:
        return sorted(self.thresholds)

    @property
    def needs_logits(self) -> bool:
        return self.criterion in LOGIT_CRITERIA or self.patience > 0


def resolve_exit_settings(config, early_exit=None, exit_criterion=None, exit_threshold=None, exit_policy=None,
                          exit_patience=None, exit_kv=None, exit_check_layers=None, exit_forced=None):
    """Merges `generate()` exit arguments with the defaults stored in `config`; None means full depth.

    Raises a `ValueError` naming the argument, the bad value and the allowed values.
    """
    given = dict(exit_criterion=exit_criterion, exit_threshold=exit_threshold, exit_policy=exit_policy,
                 exit_patience=exit_patience, exit_kv=exit_kv, exit_check_layers=exit_check_layers,
                 exit_forced=exit_forced)
    if early_exit not in (None, True, False):
        raise ValueError(f"`early_exit` must be True, False or None, got {early_exit!r}.")
    exit_layers = list(config.exit_layers or [])
    if not exit_layers:
        named = [name for name, value in given.items() if value is not None]
        if early_exit or named:
            bad = named[0] if named else "early_exit"
            raise ValueError(
                f"`{bad}` was given but this model has no exit heads (`config.exit_layers` is empty); build one with "
                "`ee_transformers.from_base(path, exit_layers=[...])`."
            )
        return None
    if early_exit is False:
        return None

    def pick(name):
        value = given[name]
        return getattr(config, name, None) if value is None else value

    criterion, threshold, patience = pick("exit_criterion"), pick("exit_threshold"), pick("exit_patience") or 0
    policy, kv, check_layers = pick("exit_policy") or "batch", pick("exit_kv") or "immediate", pick("exit_check_layers")
    if exit_forced is not None:
        if not callable(exit_forced):
            raise ValueError(f"`exit_forced` must be a callable (batch_size, device) -> exit layers, got {exit_forced!r}.")
        criterion, threshold = "forced", math.inf
    if criterion is None and threshold is None and not patience:
        if early_exit:
            raise ValueError("`early_exit=True` needs `exit_criterion` and `exit_threshold` (or calibrated defaults "
                             "stored in the model's config).")
        return None  # nothing configured: full depth

    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0 or patience == 1:
        raise ValueError(f"`exit_patience` must be 0 (off) or an integer >= 2, got {patience!r}.")
    if criterion is None:
        criterion = "max_prob"
    if criterion != "forced" and criterion not in EXIT_CRITERIA:
        raise ValueError(f"`exit_criterion` must be one of {list(EXIT_CRITERIA)}, got {criterion!r}.")
    if policy not in EXIT_POLICIES:
        raise ValueError(f"`exit_policy` must be one of {list(EXIT_POLICIES)}, got {policy!r}.")
    if kv not in EXIT_KV_MODES:
        raise ValueError(f"`exit_kv` must be one of {list(EXIT_KV_MODES)}, got {kv!r}.")
    if kv == "deferred" and policy == "row":
        raise ValueError("`exit_kv='deferred'` is supported with `exit_policy='batch'` only (rows of a batch would hold "
                         "different numbers of deferred tokens); use `exit_kv='immediate'` with `exit_policy='row'`.")
    if criterion == "learned" and not getattr(config, "exit_confidence_heads", False):
        raise ValueError("`exit_criterion='learned'` needs trained confidence heads, and this model has none; fit them "
                         "with the training script's confidence stage, or use one of "
                         f"{[c for c in EXIT_CRITERIA if c != 'learned']}.")

    if check_layers is None:
        check_layers = exit_layers
    check_layers = list(check_layers)
    unknown = [layer for layer in check_layers if layer not in exit_layers]
    if unknown or not check_layers or check_layers != sorted(set(check_layers)):
        raise ValueError(f"`exit_check_layers` must be a sorted, non-empty subset of the exits {exit_layers}, "
                         f"got {check_layers!r}.")

    if threshold is None:
        if not patience:
            raise ValueError(f"`exit_threshold` is required with `exit_criterion={criterion!r}`.")
        threshold = math.inf  # stable-token exits only
    thresholds = list(threshold) if isinstance(threshold, (list, tuple)) else [threshold] * len(check_layers)
    if len(thresholds) != len(check_layers):
        raise ValueError(f"`exit_threshold` has {len(thresholds)} values but {len(check_layers)} exits are checked "
                         f"({check_layers}); give one float or one per checked exit.")
    low, high = SCORE_RANGES.get(criterion, (-math.inf, math.inf))
    for value in thresholds:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"`exit_threshold` must hold numbers, got {value!r}.")
        if value != math.inf and not low <= value <= high:
            raise ValueError(f"`exit_threshold`={value!r} is outside the range of the {criterion!r} score: allowed "
                             f"values are {low} <= exit_threshold <= {high}.")
    return ExitSettings(criterion=criterion, thresholds=dict(zip(check_layers, map(float, thresholds))),
                        policy=policy, patience=patience, kv=kv, forced=exit_forced)


@dataclass
class GenerateEarlyExitOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `exit_layers`: `(batch, new_tokens)` decoder-layer index at which each token
    was decided (`num_hidden_layers - 1` = full depth, -1 where the row had already finished)."""

    exit_layers: torch.LongTensor | None = None


def exit_layers_after_eos(new_tokens: torch.Tensor, eos_token_id, full_depth: int) -> torch.LongTensor:
    """Exit layers of a full-depth generation: `full_depth` for every token a row decided, -1 after its EOS."""
    layers = torch.full_like(new_tokens, full_depth)
    if eos_token_id is None:
        return layers
    eos = torch.as_tensor(eos_token_id, device=new_tokens.device).flatten()
    is_eos = torch.isin(new_tokens, eos).long()
    finished_before = (is_eos.cumsum(-1) - is_eos) > 0  # an EOS strictly before this position
    return layers.masked_fill(finished_before, -1)


def early_exit_sample(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                      streamer=None, **model_kwargs):
    """The decoding loop of `generate` with early exit: transformers' sampling loop, except that the model returns,
    per row, the logits of the head the row exited at and that head's layer index, and is told which rows finished."""
    pad_token_id = generation_config._pad_token_tensor
    has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    return_dict = generation_config.return_dict_in_generate
    scores = () if return_dict and generation_config.output_scores else None
    raw_logits = () if return_dict and generation_config.output_logits else None
    if not model_kwargs.get("use_cache", True) or model_kwargs.get("cache") is None:
        raise ValueError("Early-exit decoding needs a KV cache: call generate with `use_cache=True`.")
    if pad_token_id is not None:
        pad_token_id = pad_token_id.to(input_ids.device)

    batch_size = input_ids.shape[0]
    unfinished_sequences = torch.ones(batch_size, dtype=torch.long, device=input_ids.device)
    model_kwargs["cache"] = EarlyExitCache.from_cache(model_kwargs["cache"])
    model_kwargs["exit_unfinished"] = unfinished_sequences
    step_exit_layers = []
    this_peer_finished = False

    outputs = model._prefill(input_ids, generation_config, model_kwargs)
    prefill_consumed = False
    while model._has_unfinished_sequences(this_peer_finished, synced_gpus, device=input_ids.device):
        if prefill_consumed:
            model_inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
            # compileable caches get a prepared 4D mask; deferred KV also needs the 2D padding mask
            model_inputs["exit_attention_mask"] = model_kwargs.get("attention_mask")
            outputs = model(**model_inputs, return_dict=True)
        prefill_consumed = True
        model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False)

        next_token_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
        next_token_scores = logits_processor(input_ids, next_token_logits)
        if scores is not None:
            scores += (next_token_scores,)
        if raw_logits is not None:
            raw_logits += (next_token_logits,)

        if generation_config.do_sample:
            probs = torch.nn.functional.softmax(next_token_scores, dim=-1)
            next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(next_token_scores, dim=-1)
        exit_layers = outputs.exit_layers.to(input_ids.device)
        if has_eos_stopping_criteria:
            next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)
            exit_layers = exit_layers.masked_fill(unfinished_sequences == 0, -1)
        step_exit_layers.append(exit_layers)

        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        unfinished_sequences = unfinished_sequences & ~stopping_criteria(input_ids, scores)
        model_kwargs["exit_unfinished"] = unfinished_sequences
        this_peer_finished = unfinished_sequences.max() == 0
        del outputs

    if streamer is not None:
        streamer.end()
    if not return_dict:
        return input_ids
    return GenerateEarlyExitOutput(
        sequences=input_ids,
        scores=scores,
        logits=raw_logits,
        cache=model_kwargs.get("cache"),
        exit_layers=torch.stack(step_exit_layers, dim=1),
    )


@dataclass
class ExitStats:
    """Summary of where generated tokens exited.

    mean_exit_layer: mean 0-based decoder-layer index of the deciding layer; histogram: {layer index: token count};
    compute_saved: share of decoder-layer forward passes skipped, relative to running every token at full depth
    (backfill and head checks are not counted here; the benchmark measures them).
    """

    num_tokens: int
    num_layers: int
    mean_exit_layer: float
    histogram: dict
    compute_saved: float

    @classmethod
    def from_exit_layers(cls, exit_layers: torch.Tensor, num_layers: int) -> "ExitStats":
        decided = exit_layers[exit_layers >= 0]
        if decided.numel() == 0:
            return cls(0, num_layers, float("nan"), {}, 0.0)
        values, counts = decided.unique(return_counts=True)
        layers_run = (decided + 1).double()
        return cls(
            num_tokens=int(decided.numel()),
            num_layers=num_layers,
            mean_exit_layer=float(decided.double().mean()),
            histogram={int(v): int(c) for v, c in zip(values.tolist(), counts.tolist())},
            compute_saved=float(1.0 - layers_run.mean() / num_layers),
        )

    @classmethod
    def from_generate(cls, output, model) -> "ExitStats":
        """From a `generate(..., return_dict_in_generate=True)` output of an early-exit model."""
        if getattr(output, "exit_layers", None) is None:
            raise ValueError("`output` has no `exit_layers`: call generate with `return_dict_in_generate=True`.")
        return cls.from_exit_layers(output.exit_layers, model.config.num_hidden_layers)

    def __str__(self):
        hist = ", ".join(f"{layer}: {count}" for layer, count in sorted(self.histogram.items()))
        return (f"{self.num_tokens} tokens, mean exit layer {self.mean_exit_layer:.2f} of {self.num_layers - 1}, "
                f"{100 * self.compute_saved:.1f}% of layer compute skipped; histogram {{{hist}}}")


__all__ = ["ExitSettings", "ExitStats", "GenerateEarlyExitOutput", "resolve_exit_settings", "early_exit_sample",
           "logit_score", "EXIT_ARGUMENTS", "LOGIT_CRITERIA"]
