"""A pool of early-exit models, switched while generating by their real-time exit profiles (HELIOS, part 2).

Early exits are complementary across models: a token that does not exit early on one model often does on another
(heads fitted on other text, another backbone). `EarlyExitPool([model_a, model_b]).generate(...)` decodes with one
model at a time and, every `pool_interval` tokens, moves the batch to the model whose exits on this request predict
the lowest cost per token. Read top to bottom:

    TokenCosts                     what a token costs on one model at each exit layer, in a unit common to the pool:
                                   parameters read (analytic, the default) or milliseconds (a `measure_costs` table)
    catch_up / pool_profile_exits  an inactive model's cache brought up to date by ONE full-depth forward over the
                                   positions it missed; the states it leaves at every checked exit, scored by that
                                   model's own criterion, give the exit each of those tokens would have taken there
    EarlyExitPool.generate         the request: the first model's `generate` runs the one early-exit decoding loop,
    _Request                       which asks the pool before every step which model (and cache) decides it; at an
                                   interval boundary: profiles -> predicted costs -> maybe another model

Design, and what it guarantees:

* One loop. The request is one `generate` call (transformers' sampling loop with early exit, `model.decode_with_exits`):
  its logits processors, stopping criteria, streamer, EOS padding and sampling RNG are those of one call whatever
  the pool does; the pool only changes the model and cache of the next step (`exit_switch`). So a pool of one model
  is that model's `generate`, and rows that end are padded (pad token, exit layer -1, model index -1) and keep being
  fed pad tokens, exactly as in `generate`.
* Exact hand-over. The catch-up leaves a model's last two positions missing, so a model that takes over starts with
  a full-depth prefill of them: every position it holds then ran every layer, which is the cache
  `model.generate(prefix)` builds, and the tokens it decides equal that call's. (Leaving one missing would make its
  first step an early-exit decoding step, whose skipped layers' K/V are backfilled: not the same cache.)
* Per batch: all rows sit on one model, and the pool compares models on the exits of all rows together. A row alone
  equals its row of a batch when the batch makes the same switches (it need not: the profile is the batch's).
  Grouping rows per model would split every step into one forward per group.
* Profiles: a model's running exit histogram on this request: its own `exit_layers` while active, its catch-up's
  exits while inactive (a decision per token, as the row policy makes it; with `exit_policy="batch"` a position
  takes the deepest of its rows' exits, a lower bound of the batch's). Tokens of rows that had ended are left out.
  The token decided at the last caught-up position is profiled at the next boundary.
* What the catch-up costs: per inactive model and boundary, a prefill-like forward over `pool_interval` positions
  (every layer) plus its criterion's checks on the positions still undecided at each checked exit (a logit criterion
  runs the LM head on them). In FLOPs that is those tokens at full depth; at small batch, where decoding is bound by
  reading weights, it reads each weight once for all `pool_interval` positions, about the price of a decoding step
  or two. `pool_profile_every=k` catches up and profiles inactive models only every k-th boundary (the first one
  always): the forwards are k times longer and k times rarer, the profiles up to k intervals stale. A model the pool
  switches to is always caught up first, and the choice made again with its fresh profile.

Not part of the Hub runtime: no runtime file imports it, so saved folders do not carry it and a pool needs this
package installed (`ee_transformers.EarlyExitPool`). It imports only torch, transformers and the runtime modules.
"""

import dataclasses
from collections import Counter
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .cache_early_exit import EarlyExitCache
from .compat import CACHE
from .decode_core import ExitCriterion, StepState, deprecated_aliases, first_confident_exit, run_layers
from .decode_loop import GenerateEarlyExitOutput
from .request import EXIT_ARGUMENTS, ExitSettings, merged_exit_values, refuse_with_exits, resolve_exit_settings


# ---------------------------------------------------------------------------------------------------------------------
# what a token costs on one model
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class TokenCosts:
    """What one decoded token costs on one model, piece by piece, in the pool's common unit.

    layers[j]: running decoder layer j; skipped[j]: what a token that exited before layer j still pays there (its K/V
    backfill; nothing with deferred K/V); checks[j]: the exit check at checked layer j; head: the LM-head call of a
    token decided without logits (at full depth, or by a criterion that computes none); reuse_logits: the checks
    compute logits, so a token exiting at a checked layer needs no further head call.
    """

    layers: list
    skipped: list
    checks: dict
    head: float
    reuse_logits: bool = False

    def of_exit(self, layer: int) -> float:
        """The cost of a token decided at decoder layer `layer`: the layers it ran, the checks it passed, the skipped
        layers' K/V and its head."""
        last = len(self.layers) - 1
        cost = sum(self.layers[: layer + 1]) + sum(self.skipped[layer + 1 :])
        cost += sum(c for j, c in self.checks.items() if j <= layer and j != last)
        if layer == last or layer not in self.checks or not self.reuse_logits:
            cost += self.head
        return cost

    def per_token(self, histogram: Counter) -> float | None:
        """The mean cost per token of an exit histogram `{layer: tokens}` (None when it is empty)."""
        tokens = sum(histogram.values())
        if tokens == 0:
            return None
        return sum(count * self.of_exit(layer) for layer, count in histogram.items()) / tokens


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def analytic_costs(model, settings) -> TokenCosts:
    """Costs in parameters read per token (decoding at small batch is bound by reading weights): a decoder layer's
    parameters; a check: its exit head (+ the LM head's `vocab x hidden` when the criterion needs logits, + the
    confidence head for `learned`); a skipped layer: its K/V backfill (the modules `family.kv_modules` names: input
    norm, K/V projections); a token decided without logits: the LM head (+ the final norm; an exit head in its place
    differs by a rounding error)."""
    layers = list(model.family.layers(model))
    num_layers = len(layers)
    lm_head = model.get_output_embeddings().weight.numel()
    full = [_numel(layer) for layer in layers]
    final_head = lm_head + _numel(model.family.final_norm(model))
    exits = list(model.config.exit_layers)
    checks = {}
    for j in settings.check_layers:
        index = exits.index(j)
        if settings.needs_logits:
            checks[j] = _numel(model.exit_heads[index]) + lm_head
        elif settings.criterion.needs_head_output:
            confidence = model.confidence_heads[index] if model.confidence_heads is not None else None
            checks[j] = _numel(model.exit_heads[index]) + _numel(confidence)
        else:  # decided from the residual stream alone (cosine, forced): a vector op
            checks[j] = model.config.hidden_size
    if settings.kv == "deferred":
        skipped = [0] * num_layers  # the token rides along with the next deep one: no weight is read for it alone
    else:
        skipped = [sum(_numel(m) for m in model.family.kv_modules(layer)) for layer in layers]
    return TokenCosts(full, skipped, checks, final_head, settings.needs_logits)


# the pieces of a `measure_costs` table the pool needs (and `cosine_check` / `learned_check`, read when present)
MEASURED_PIECES = ("layer", "final_head", "backfill", "deferred_extra", "head_check", "decision")


def measured_costs(table: dict, model, settings, rows: int) -> TokenCosts:
    """Costs in milliseconds from a `ee_transformers.tools.costs.measure_costs(model, ...)` table, at the measured row
    count nearest to `rows`."""
    measured = sorted(int(n) for n in table["ms"]["layer"])
    at = str(min(measured, key=lambda n: (abs(n - rows), n)))
    ms = {name: times[at] for name, times in table["ms"].items()}
    num_layers = model.config.num_hidden_layers
    layers = [ms["layer"]] * num_layers
    if settings.needs_logits:
        check = ms["head_check"]
    else:
        name = {"cosine": "cosine_check", "learned": "learned_check"}.get(settings.criterion.name, "decision")
        check = ms.get(name, ms["decision"])
    skipped = ms["deferred_extra"] if settings.kv == "deferred" else ms["backfill"]
    return TokenCosts(
        layers,
        [skipped] * num_layers,
        {j: check for j in settings.check_layers},
        ms["final_head"],
        settings.needs_logits,
    )


# ---------------------------------------------------------------------------------------------------------------------
# catching an inactive model up, and its profile
# ---------------------------------------------------------------------------------------------------------------------
def catch_up(model, input_ids, attention_mask, position_ids, cache, layers) -> dict:
    """Runs `input_ids` `(B, q)` (the positions `cache` lacks) through every decoder layer of `model`, appending their
    K/V to `cache`: one parallel full-depth forward. Deferred exit states waiting in the cache join it at their layer,
    ahead of these positions, as in a deep decoding step. `attention_mask` `(B, past + q)` is the 2D mask.

    Returns `{layer: (h_out, h_in)}` for each layer in `layers`: `(B, q, D)` residual streams leaving / entering it.
    """
    fam = model.family
    h = fam.embed(model, input_ids, position_ids)  # (B, q, D)
    q = h.shape[1]
    inputs = fam.layer_inputs(model, h, attention_mask, cache, position_ids)
    num_layers, join = model.config.num_hidden_layers, isinstance(cache, EarlyExitCache)
    states = run_layers(model, h, inputs, cache, 0, num_layers, keep=layers, join=join, mask_2d=attention_mask).states
    return {j: (h_out[:, -q:], h_in[:, -q:]) for j, (h_out, h_in) in states.items()}


def pool_profile_exits(model, settings, at_exit, shape, running=None) -> torch.LongTensor:
    """The exit layer `(B, q)` each position's token would take on `model` under `settings`, from the states of
    `catch_up`: the first checked exit whose criterion holds, else full depth (decoding's own exit rule,
    `first_confident_exit`, patience included). Decided per token (row policy); with the batch policy a position takes
    the deepest exit of its `running` rows `(B, q)` (default: all), as a batch step waits for its deepest row but never
    for one that has ended."""
    batch, q = shape
    n, num_layers = batch * q, model.config.num_hidden_layers
    if n == 0:
        return torch.full((batch, q), num_layers - 1, dtype=torch.long, device=model.device)
    per_token = dataclasses.replace(settings, policy="row")
    state = StepState(per_token, n, model.device, None)  # n tokens checked as one step of n rows
    states = {j: tuple(t.reshape(n, -1) for t in at_exit[j]) for j in settings.check_layers}
    exits = first_confident_exit(model, per_token, states, state, num_layers).view(batch, q)
    if settings.policy == "batch":
        counted = exits if running is None else exits.masked_fill(~running, -1)
        exits = counted.max(0, keepdim=True).values.expand(batch, q)
    return exits


# ---------------------------------------------------------------------------------------------------------------------
# the pool
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class PoolSwitch:
    """The pool moved the batch from model `source` to model `target`; `token` is the index (among the new tokens) of
    the first token `target` decided; `predicted` the predicted cost per token of every model at that boundary."""

    token: int
    source: int
    target: int
    predicted: tuple


@dataclass
class GenerateEarlyExitPoolOutput(GenerateEarlyExitOutput):
    """`GenerateEarlyExitOutput` of a pool (`cache` is the last active model's), plus:

    model_indices: `(batch, new_tokens)` the index of the model that decided each token (-1 after a row's end).
    switches: the `PoolSwitch`es, in order.
    profiles: per model, its exit histogram `{layer: tokens}` on this request (its own tokens and caught-up ones).
    caught_up: per model, the positions (rows x tokens) its catch-up forwards ran.
    """

    model_indices: torch.LongTensor | None = None
    switches: tuple | None = None
    profiles: tuple | None = None
    caught_up: tuple | None = None


def _check_positive_int(name, value, meaning):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1 ({meaning}), got {value!r}.")


def _is_early_exit_model(model) -> bool:
    # duck-typed: a model loaded with trust_remote_code has classes of another module
    return (
        all(hasattr(model, name) for name in ("family", "exit_heads", "exit_logits_from_hidden", "decode_with_exits"))
        and getattr(getattr(model, "config", None), "exit_layers", None) is not None
    )


def _first_vocab_difference(a: dict, b: dict):
    if a == b:
        return None
    token = min((t for t in set(a) | set(b) if a.get(t) != b.get(t)), key=str)
    return token, a.get(token), b.get(token)


class EarlyExitPool:
    """Early-exit models sharing one vocabulary that decode a request together: one model at a time, moved every
    `pool_interval` tokens to the one whose exits on this request predict the lowest cost per token.

    models: early-exit causal LMs (`ee_transformers.from_base`, any supported family) with the same vocabulary (and,
    where they carry one, the same tokenizer), on one device. The request's generation settings (EOS, pad, lengths,
    sampling) are resolved once, by the first model's `generate`; exit settings are the call's, else each model's own
    stored ones (a model with none decodes at full depth).
    """

    def __init__(self, models):
        if not isinstance(models, (list, tuple)) or not models:
            raise ValueError(f"`models` must be a non-empty list of early-exit models, got {models!r}.")
        for i, model in enumerate(models):
            if not _is_early_exit_model(model):
                raise ValueError(
                    f"`models[{i}]` ({type(model).__name__}) is not an early-exit model: allowed are "
                    "early-exit causal LMs (`ee_transformers.from_base(path, exit_layers=[...])`)."
                )
        first = models[0]
        for i, model in enumerate(models[1:], start=1):
            sizes = (first.config.vocab_size, model.config.vocab_size)
            heads = (first.get_output_embeddings().weight.shape[0], model.get_output_embeddings().weight.shape[0])
            if sizes[0] != sizes[1] or heads[0] != heads[1]:
                raise ValueError(
                    f"`models` must share one vocabulary: models[0] has vocab_size {sizes[0]} (LM head "
                    f"{heads[0]} rows), models[{i}] has {sizes[1]} ({heads[1]} rows)."
                )
            tokenizers = (getattr(first, "tokenizer", None), getattr(model, "tokenizer", None))
            if None not in tokenizers:
                diff = _first_vocab_difference(tokenizers[0].get_vocab(), tokenizers[1].get_vocab())
                if diff is not None:
                    raise ValueError(
                        f"`models` must share one tokenizer: models[0] and models[{i}] disagree on token "
                        f"{diff[0]!r} (id {diff[1]} vs {diff[2]})."
                    )
            if model.device != first.device:
                raise ValueError(
                    f"`models` must sit on one device: models[0] is on {first.device}, models[{i}] on {model.device}."
                )
        self.models = list(models)

    def __len__(self):
        return len(self.models)

    @torch.no_grad()
    def generate(
        self, inputs=None, generation_config=None, *, pool_interval=16, pool_profile_every=1, pool_costs=None, **kwargs
    ):
        """`model.generate` over the pool: greedy or sampling, logits processors, stopping criteria, streamers, padded
        batches, `num_return_sequences`, exit settings (`exit_criterion=...`, over each model's stored settings).

        pool_interval: tokens between switching decisions.
        pool_profile_every: catch up and profile the inactive models at every k-th interval boundary (1: every one).
        pool_costs: None (analytic costs: parameters read per token), or one `measure_costs` table per model
        (`ee_transformers.tools.costs.measure_costs`: milliseconds on your machine).

        With `return_dict_in_generate=True` returns a `GenerateEarlyExitPoolOutput` (`sequences`, `exit_layers`,
        `model_indices`, `switches`, `profiles`, `caught_up`), else the sequences.
        """
        self._check_pool_arguments(pool_interval, pool_profile_every, pool_costs, kwargs)
        settings = self._exit_settings(generation_config, kwargs)
        if kwargs.get("cache_implementation") not in (None, "dynamic"):
            raise ValueError(
                f"`cache_implementation={kwargs['cache_implementation']!r}` is not available from the "
                "pool: every model keeps one dynamic cache."
            )
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            raise ValueError(
                "`inputs` must be a `(batch, length)` tensor of token ids (the pool takes no `inputs_embeds`)."
            )

        request = _Request(self.models, settings, input_ids.shape[1], pool_interval, pool_profile_every, pool_costs)
        kwargs[CACHE] = request.caches[0]
        streamer = kwargs.pop("streamer", None)
        # the first model's generate prepares the request (config, logits processors, stopping criteria, expansion)
        # and runs the early-exit loop, which asks `request` before every step which model decides it
        out = self.models[0].decode_with_exits(
            inputs, generation_config, settings[0], streamer=streamer, exit_switch=request, **kwargs
        )
        if not isinstance(out, GenerateEarlyExitOutput):
            return out
        return GenerateEarlyExitPoolOutput(**out, **request.summary(out.exit_layers))

    def _check_pool_arguments(self, pool_interval, pool_profile_every, pool_costs, kwargs):
        _check_positive_int("pool_interval", pool_interval, "tokens between switching decisions")
        _check_positive_int("pool_profile_every", pool_profile_every, "profile inactive models every k-th boundary")
        if pool_costs is not None and (
            not isinstance(pool_costs, (list, tuple))
            or len(pool_costs) != len(self)
            or not all(set(MEASURED_PIECES) <= set(t.get("ms", ())) for t in pool_costs)
        ):
            raise ValueError(
                f"`pool_costs` must be None or a list of {len(self)} `measure_costs` tables (dicts whose "
                f"'ms' holds at least {list(MEASURED_PIECES)}), one per model."
            )
        for name in ("cache", "past_key_values"):
            if kwargs.get(name) is not None:
                raise ValueError(f"`{name}` cannot be passed to the pool: every model keeps its own cache.")

    def _exit_settings(self, generation_config, kwargs) -> list:
        """Each model's exit settings: the call's (kwargs, popped, over `generation_config`) over the model's own
        stored ones; a model with none decodes at full depth. Each model refuses what decoding with exits cannot do."""
        values = {name: kwargs.pop(name) for name in EXIT_ARGUMENTS if name in kwargs}
        settings = []
        for model in self.models:
            resolved = resolve_exit_settings(model.config, merged_exit_values(model, generation_config, dict(values)))
            settings.append(resolved if resolved is not None else ExitSettings(ExitCriterion(), thresholds={}))
            refuse_with_exits(model, generation_config, kwargs)  # beams, assistants, per-layer outputs, compile
        return settings


class _Request:
    """The pool's side of one request: each model's cache and exit profile, the active model, the switches. The
    early-exit loop calls it before every decoding step (`exit_switch`); at an interval boundary it profiles, predicts
    and may hand the loop another model."""

    def __init__(self, models, settings, prompt_length, interval, profile_every, pool_costs):
        self.models, self.settings, self.prompt_length = models, settings, prompt_length
        self.interval, self.profile_every, self.pool_costs = interval, profile_every, pool_costs
        self.caches = [EarlyExitCache.from_cache(DynamicCache(config=m.config)) for m in models]
        self.costs = [analytic_costs(m, s) for m, s in zip(models, settings)] if pool_costs is None else None
        self.profiles = [Counter() for _ in models]
        self.caught_up = [0] * len(models)
        self.active, self.deciders, self.switches = 0, [], []

    def __call__(self, input_ids, attention_mask, exit_layers, unfinished):
        steps = len(exit_layers)
        if steps:  # the last step's decided tokens join the active model's profile
            self.profiles[self.active].update(exit_layers[-1][exit_layers[-1] >= 0].tolist())
        switch = None
        if steps and steps % self.interval == 0:
            if attention_mask is None:  # generate drops an all-ones mask
                attention_mask = torch.ones_like(input_ids)
            switch = self.boundary(steps // self.interval, input_ids, attention_mask, exit_layers)
        self.deciders.append(self.active)
        return switch

    def boundary(self, index, input_ids, attention_mask, exit_layers):
        """Profiles the inactive models (every `profile_every`-th boundary, the first included), then moves to the
        model with the lowest predicted cost per token (ties stay). A model taken over is caught up first, and the
        choice made again with its fresh profile."""
        fresh = set()
        if (index - 1) % self.profile_every == 0:
            for i in range(len(self.models)):
                if i != self.active:
                    self.catch_up(i, input_ids, attention_mask, exit_layers)
                    fresh.add(i)
        while True:
            predicted = tuple(self.predicted(i, input_ids.shape[0]) for i in range(len(self.models)))
            known = [(cost, i != self.active, i) for i, cost in enumerate(predicted) if cost is not None]
            target = min(known)[2] if known else self.active
            if target == self.active:
                return None
            if target in fresh:
                self.switches.append(PoolSwitch(len(exit_layers), self.active, target, predicted))
                self.active = target
                return self.models[target], self.caches[target], self.settings[target]
            self.catch_up(target, input_ids, attention_mask, exit_layers)  # chosen on a stale profile
            fresh.add(target)

    def predicted(self, i, rows):
        costs = (
            self.costs[i]
            if self.costs is not None
            else measured_costs(self.pool_costs[i], self.models[i], self.settings[i], rows)
        )
        return costs.per_token(self.profiles[i])

    def catch_up(self, i, input_ids, attention_mask, exit_layers):
        """Model i's cache brought up to date but for the last two positions (its next step, should it take over,
        prefills them at full depth), and its profile updated with the exits of the generated tokens (of rows still
        going) that its forward decided."""
        model, cache, settings = self.models[i], self.caches[i], self.settings[i]
        start, stop = cache.get_seq_length(), input_ids.shape[1] - 2
        if stop <= start:
            return
        mask = attention_mask[:, :stop]
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, start:stop]
        at_exit = catch_up(model, input_ids[:, start:stop], mask, position_ids, cache, settings.check_layers)
        self.caught_up[i] += input_ids.shape[0] * (stop - start)
        # position p decides token p + 1: generated step p + 1 - prompt_length, if its row was still going
        steps = exit_layers[max(start + 1 - self.prompt_length, 0) : stop + 1 - self.prompt_length]
        if steps:
            decided = torch.stack(steps, dim=1).to(input_ids.device) >= 0  # (B, k): what the last k positions decide
            k = decided.shape[1]  # (the prompt's positions decide no generated token: they are not scored)
            states = {j: (h_out[:, -k:], h_in[:, -k:]) for j, (h_out, h_in) in at_exit.items()}
            exits = pool_profile_exits(model, settings, states, decided.shape, running=decided)
            self.profiles[i].update(exits[decided].tolist())

    def summary(self, exit_layers):
        """The pool's fields of the output, once the loop is done (the last step joins the active model's profile)."""
        last = exit_layers[:, -1]
        self.profiles[self.active].update(last[last >= 0].tolist())
        deciders = torch.tensor(self.deciders[: exit_layers.shape[1]], device=exit_layers.device)
        return dict(
            model_indices=torch.where(exit_layers >= 0, deciders.expand_as(exit_layers), -1),
            switches=tuple(self.switches),
            profiles=tuple(dict(sorted(p.items())) for p in self.profiles),
            caught_up=tuple(self.caught_up),
        )


# deprecated names, kept importable for one release: {old: new}
_RENAMED = {"profile_exits": "pool_profile_exits"}  # `profile_exits` is also `ee_transformers.profile_exits`'s


__getattr__ = deprecated_aliases(__name__, globals(), _RENAMED)


__all__ = [
    "EarlyExitPool",
    "GenerateEarlyExitPoolOutput",
    "PoolSwitch",
    "TokenCosts",
    "analytic_costs",
    "catch_up",
    "measured_costs",
    "pool_profile_exits",
]
