"""Issue 10: the HELIOS model pool: one decoding loop over several models, catch-up, profiles, switching.

The invariants run over the family matrix (`family` fixture, conftest.FAMILIES): a pool of one == the model; after a
switch (into another family) the pool continues exactly as the new model's own generate; a model's catch-up profile
== the exits of its own full-depth forward; a model left with deferred states is caught up exactly; a batch row ==
its prompt alone.
"""

import pytest
import torch
from conftest import FAMILIES, make_base, padded_batch
from helpers import ALWAYS, NEVER, Collect, model_with, numbered_tokenizer

import ee_transformers as eet
from ee_transformers.generation_early_exit import ExitCriterion, register_exit_criterion
from ee_transformers.pool_early_exit import EarlyExitPool

LAYERS = 4


def midpoint_threshold(model, ids, mask, quantile=0.5):
    """A max_prob threshold halfway between two confidences of the model's exits on the prompt (at `quantile`): a mix
    of exits, and no confidence sits on it (so float noise cannot flip a decision)."""
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=positions(mask), output_exit_logits=True).exit_logits
    conf = torch.cat([t.softmax(-1).max(-1).values[mask.bool()] for t in logits]).sort().values
    k = max(int(conf.numel() * quantile), 1)
    return float((conf[k - 1] + conf[k]) / 2)


def positions(mask):
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def extended(mask, new_tokens):
    return torch.cat([mask, mask.new_ones(mask.shape[0], new_tokens)], dim=1)


def partner(family):
    """The next family in FAMILIES (after the last: the first), so that every family leads a pool and joins one."""
    names = list(FAMILIES)
    return names[(names.index(family) + 1) % len(names)]


def cost_table(layer_ms):
    """A `measure_costs` table (milliseconds at 1 row) whose decoder layers take `layer_ms` each."""
    pieces = dict(
        layer=layer_ms,
        final_head=1.0,
        backfill=0.1,
        deferred_extra=0.05,
        head_check=1.0,
        cosine_check=0.01,
        learned_check=0.01,
        decision=0.01,
    )
    return {"ms": {name: {"1": ms} for name, ms in pieces.items()}}


def assert_same(out, ref):
    assert torch.equal(out.sequences, ref.sequences), (out.sequences, ref.sequences)
    assert torch.equal(out.exit_layers, ref.exit_layers), (out.exit_layers, ref.exit_layers)


# --- a pool of one model is that model ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["greedy-batch", "greedy-row", "deferred", "sampling", "full depth"])
def test_pool_of_one_equals_the_model(base_dirs, family, mode):
    model = model_with(base_dirs, family)
    ids, mask = padded_batch()
    quantile = 0.5 if mode == "greedy-row" else 0.2  # a batch-wide exit needs every row confident
    exit_kwargs = dict(exit_criterion="max_prob", exit_threshold=midpoint_threshold(model, ids, mask, quantile))
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=10,
        return_dict_in_generate=True,
        **{
            "greedy-batch": dict(do_sample=False, **exit_kwargs),
            "greedy-row": dict(do_sample=False, exit_policy="row", **exit_kwargs),
            "deferred": dict(do_sample=False, exit_kv="deferred", **exit_kwargs),
            "sampling": dict(do_sample=True, temperature=0.8, top_k=30, repetition_penalty=1.2, **exit_kwargs),
            "full depth": dict(do_sample=False),  # no exit settings: the model's plain generate
        }[mode],
    )
    torch.manual_seed(3)
    ref = model.generate(ids, **kwargs)
    torch.manual_seed(3)
    out = EarlyExitPool([model]).generate(ids, pool_interval=3, **kwargs)
    if mode != "full depth":
        assert len(ref.exit_layers.unique()) > 1, "expected a mix of exits"
    assert_same(out, ref)
    assert torch.equal(out.model_indices, torch.where(ref.exit_layers >= 0, 0, -1)) and out.switches == ()
    assert out.profiles[0] == {
        k: v for k, v in zip(*[t.tolist() for t in ref.exit_layers[ref.exit_layers >= 0].unique(return_counts=True)])
    }


# --- switching ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("second", ["always exits", "sometimes exits"])
def test_pool_moves_to_the_model_that_exits_and_continues_it_exactly(base_dirs, family, second):
    ids, mask = padded_batch()
    never = model_with(base_dirs, family, seed=5, **NEVER)
    exits = model_with(base_dirs, partner(family), seed=7)
    # "sometimes": deep layers then run after the switch, so they read the K/V the catch-up wrote (at quantile 0.7
    # some tokens reach full depth in every family's pool)
    threshold = 0.0 if second == "always exits" else midpoint_threshold(exits, ids, mask, quantile=0.7)
    exits.set_exit_defaults(exit_criterion="max_prob", exit_threshold=threshold, exit_policy="row")
    pool = EarlyExitPool([never, exits])
    out = pool.generate(
        ids, attention_mask=mask, max_new_tokens=12, pool_interval=4, do_sample=False, return_dict_in_generate=True
    )
    # the first interval is the first model's own generate; then the pool moves (per batch: every row at once)
    decided = out.exit_layers >= 0  # (a row that ended has -1 after its EOS)
    assert (out.model_indices[:, :4] == 0).all() and (out.model_indices[:, 4:][decided[:, 4:]] == 1).all()
    assert [(s.token, s.source, s.target) for s in out.switches] == [(4, 0, 1)]
    assert out.switches[0].predicted[1] < out.switches[0].predicted[0]
    p = ids.shape[1]
    first = never.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences[:, : p + 4], first.sequences)
    assert (out.exit_layers[:, :4] == LAYERS - 1).all()
    # after the switch: the second model's own generate continuing the same prefix with the same settings
    ref = exits.generate(
        out.sequences[:, : p + 4],
        attention_mask=extended(mask, 4),
        max_new_tokens=8,
        do_sample=False,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.exit_layers[:, 4:], ref.exit_layers)
    if second == "sometimes exits":
        assert (ref.exit_layers == LAYERS - 1).any() and (ref.exit_layers < LAYERS - 1).any()


@pytest.mark.parametrize("policy", ["row", "batch"])
def test_pool_stays_on_the_cheaper_model_and_profiles_the_other_from_its_catch_up(base_dirs, family, policy):
    ids, mask = padded_batch()
    cheap = model_with(base_dirs, family, seed=5, **ALWAYS)
    other = model_with(base_dirs, family, seed=7)
    threshold = midpoint_threshold(other, ids, mask, quantile=0.4)  # a mix of exits per row and per batch position
    other.set_exit_defaults(exit_criterion="max_prob", exit_threshold=threshold, exit_policy=policy)
    # min_new_tokens: no row ends (a tiny random model may draw EOS), so every row decides 9 tokens
    kwargs = dict(
        attention_mask=mask, max_new_tokens=9, min_new_tokens=9, do_sample=False, return_dict_in_generate=True
    )
    out = EarlyExitPool([cheap, other]).generate(ids, pool_interval=3, **kwargs)
    ref = cheap.generate(ids, **kwargs)
    assert_same(out, ref)
    assert out.switches == () and (out.model_indices == 0).all()
    assert out.profiles[0] == {0: 27}  # its own 9 tokens x 3 rows
    # the other model's profile: its criterion at every position its catch-ups ran (the last one, at the boundary
    # after 6 tokens, stopped two positions short of the sequence), on its own full-depth forward
    p = ids.shape[1]
    sequences = out.sequences[:, : p + 6]
    with torch.no_grad():
        logits = other(
            sequences,
            attention_mask=extended(mask, 6),
            position_ids=positions(extended(mask, 6)),
            output_exit_logits=True,
        ).exit_logits
    decided = slice(p - 1, p + 4)  # the positions that decided a generated token, up to the last caught-up one
    exits = torch.full((3, 5), LAYERS - 1)
    for layer, t in reversed(list(enumerate(logits))):  # the first confident exit wins
        exits[t[:, decided].softmax(-1).max(-1).values >= threshold] = layer
    if policy == "batch":  # a position takes the deepest of its rows' exits
        exits = exits.max(0, keepdim=True).values.expand(3, 5)
    assert len(exits.unique()) > 1, "expected a mix of exits"
    assert out.profiles[1] == dict(sorted(zip(*[v.tolist() for v in exits.flatten().unique(return_counts=True)])))
    assert out.caught_up[1] == 3 * (p + 4)  # every position once: the prompt and the tokens it missed


def test_batch_policy_profile_is_the_deepest_exit_of_the_rows_still_going(base_dirs):
    from transformers import DynamicCache

    from ee_transformers.generation_early_exit import merged_exit_values, resolve_exit_settings
    from ee_transformers.pool_early_exit import catch_up, pool_profile_exits

    ids, mask = padded_batch()
    model = model_with(base_dirs, seed=7)
    threshold = midpoint_threshold(model, ids, mask)
    settings = {
        policy: resolve_exit_settings(
            model.config,
            merged_exit_values(
                model, None, dict(exit_criterion="max_prob", exit_threshold=threshold, exit_policy=policy)
            ),
        )
        for policy in ("row", "batch")
    }
    with torch.no_grad():
        states = catch_up(model, ids, mask, positions(mask), DynamicCache(config=model.config), [0, 1, 2])
        per_row = pool_profile_exits(model, settings["row"], states, ids.shape)
        running = torch.ones_like(ids, dtype=torch.bool)
        running[1, 3:] = False  # row 1 has ended from position 3 on: it holds no position back
        batch = pool_profile_exits(model, settings["batch"], states, ids.shape, running=running)
    assert len(per_row.unique()) > 1, "expected a mix of exits"
    expected = per_row.masked_fill(~running, -1).max(0).values
    assert torch.equal(batch, expected.expand_as(batch))
    assert not torch.equal(expected, per_row.max(0).values), "row 1's exits must have mattered"


class FlipAfter(ExitCriterion):
    """Confident during the first `steps` decoding steps (counted by `begin_step`), never afterwards."""

    name = "flip_after"

    def __init__(self, steps):
        self.steps, self.calls = steps, 0

    def begin_step(self, batch_size, device):
        self.calls += 1
        return self.calls <= self.steps

    def score(self, check):
        return torch.full((check.h_out.shape[0],), 1.0 if check.step else 0.0)


def test_a_stale_profile_choice_is_caught_up_before_the_switch(base_dirs):
    ids, mask = padded_batch()
    register_exit_criterion("flip_after_test", FlipAfter(steps=3))  # exits early for 3 steps, then never
    first = model_with(base_dirs, seed=5, exit_criterion="flip_after_test", exit_threshold=0.5)
    second = model_with(base_dirs, seed=7, exit_criterion="max_prob", exit_threshold=0.0, exit_check_layers=[1])
    # inactive models are profiled at the first boundary only: the second's profile is stale when the first's
    # worsens, so the pool must catch it up before it takes over
    out = EarlyExitPool([first, second]).generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        pool_interval=2,
        pool_profile_every=100,
        do_sample=False,
        return_dict_in_generate=True,
    )
    assert len(out.switches) == 1 and out.switches[0].target == 1
    token, p = out.switches[0].token, ids.shape[1]
    assert token > 2, "the first model starts cheaper; only its later tokens make it dearer"
    assert out.caught_up[1] == 3 * (p + token - 2), "the second model was up to date when it took over"
    ref = second.generate(
        out.sequences[:, : p + token],
        attention_mask=extended(mask, token),
        max_new_tokens=12 - token,
        do_sample=False,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, ref.sequences)
    assert (out.exit_layers[:, token:] == 1).all()


def test_a_model_left_with_deferred_states_is_caught_up_exactly_and_can_take_over_again(base_dirs, family):
    ids, mask = padded_batch()
    # the first model exits at layer 2 with deferred K/V: when the pool leaves it, layer 3 still owes it a position
    deferred = model_with(
        base_dirs,
        family,
        seed=5,
        exit_criterion="max_prob",
        exit_threshold=0.0,
        exit_check_layers=[2],
        exit_kv="deferred",
    )
    register_exit_criterion("flip_after_pool_test", FlipAfter(steps=3))  # cheaper than it for 3 steps, then dearer
    flipping = model_with(
        base_dirs, family, seed=7, exit_criterion="flip_after_pool_test", exit_threshold=0.5, exit_check_layers=[0]
    )
    out = EarlyExitPool([deferred, flipping]).generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        min_new_tokens=12,  # no row ends (a tiny random model may draw EOS): every token is decided
        pool_interval=2,
        do_sample=False,
        return_dict_in_generate=True,
    )
    assert [(s.source, s.target) for s in out.switches] == [(0, 1), (1, 0)]
    back, p = out.switches[1].token, ids.shape[1]
    assert out.switches[0].token == 2 and back < 12
    # its catch-up ran the deferred position through layer 3, so every position it holds ran every layer: it goes on
    # exactly as its own generate from the same prefix
    ref = deferred.generate(
        out.sequences[:, : p + back],
        attention_mask=extended(mask, back),
        max_new_tokens=12 - back,
        min_new_tokens=12 - back,
        do_sample=False,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, ref.sequences)
    assert (out.exit_layers[:, back:] == 2).all() and (out.model_indices[:, back:] == 0).all()


def test_profile_every_k_boundaries_catches_up_less_often(base_dirs):
    ids, mask = padded_batch()
    cheap, other = model_with(base_dirs, seed=5, **ALWAYS), model_with(base_dirs, seed=7, **NEVER)
    p, runs = ids.shape[1], {}
    for every in (1, 2):
        runs[every] = EarlyExitPool([cheap, other]).generate(
            ids,
            attention_mask=mask,
            max_new_tokens=10,
            pool_interval=2,
            pool_profile_every=every,
            do_sample=False,
            return_dict_in_generate=True,
        )
    # boundaries after 2, 4, 6, 8 tokens; each catch-up stops two positions short of the sequence
    assert runs[1].caught_up[1] == 3 * (p + 8 - 2)  # every boundary
    assert runs[2].caught_up[1] == 3 * (p + 6 - 2)  # boundaries 1 and 3
    assert runs[1].profiles[1] == {LAYERS - 1: 3 * 7} and runs[2].profiles[1] == {LAYERS - 1: 3 * 5}
    assert_same(runs[2], runs[1])


def test_measured_costs_decide_instead_of_parameter_counts(base_dirs):
    ids, mask = padded_batch(batch=1)
    never, exits = model_with(base_dirs, seed=5, **NEVER), model_with(base_dirs, seed=7, **ALWAYS)

    kwargs = dict(attention_mask=mask, max_new_tokens=6, pool_interval=2, do_sample=False, return_dict_in_generate=True)
    pool = EarlyExitPool([never, exits])
    assert pool.generate(ids, **kwargs).switches[0].target == 1  # analytic: the exiting model is cheaper
    # measured: the exiting model's layers are 100x dearer (say, another machine's numbers): the pool stays
    out = pool.generate(ids, pool_costs=[cost_table(1.0), cost_table(100.0)], **kwargs)
    assert out.switches == () and (out.model_indices == 0).all()
    assert pool.generate(ids, pool_costs=[cost_table(1.0), cost_table(1.0)], **kwargs).switches[0].target == 1


# --- batches, ends, streamers ---------------------------------------------------------------------------------------


def test_batch_rows_equal_their_prompts_alone(base_dirs, family):
    ids, mask = padded_batch()
    never, exits = model_with(base_dirs, family, seed=5, **NEVER), model_with(base_dirs, family, seed=7)
    exits.set_exit_defaults(
        exit_criterion="max_prob", exit_threshold=midpoint_threshold(exits, ids, mask), exit_policy="row"
    )
    pool = EarlyExitPool([never, exits])
    # the second model's layers cost a hundredth: alone as in the batch, the pool moves to it at the first boundary
    # (on profiles a row alone may move at another boundary than its batch: the profile is the batch's)
    costs = [cost_table(1.0), cost_table(0.01)]
    kwargs = dict(max_new_tokens=9, pool_interval=3, pool_costs=costs, do_sample=False, return_dict_in_generate=True)
    batch = pool.generate(ids, attention_mask=mask, **kwargs)
    assert batch.switches and all((column == column[0]).all() for column in batch.model_indices.T)  # per batch
    for row in range(ids.shape[0]):
        keep = mask[row].bool()
        alone = pool.generate(ids[row : row + 1, keep], **kwargs)
        assert torch.equal(alone.sequences[0, keep.sum() :], batch.sequences[row, ids.shape[1] :])
        for name in ("exit_layers", "model_indices"):
            assert torch.equal(getattr(alone, name)[0], getattr(batch, name)[row]), name


@pytest.mark.parametrize("pool_size", [1, 2])
def test_rows_that_end_are_padded_as_one_generate_pads_them(base_dirs, pool_size):
    ids, mask = padded_batch()
    model = model_with(
        base_dirs,
        seed=7,
        exit_criterion="max_prob",
        exit_threshold=midpoint_threshold(model_with(base_dirs, seed=7), ids, mask),
    )
    models = [model] if pool_size == 1 else [model_with(base_dirs, seed=5, **NEVER), model]
    free = EarlyExitPool(models).generate(ids, attention_mask=mask, max_new_tokens=10, pool_interval=4, do_sample=False)
    p = ids.shape[1]
    eos = int(free[0, p + 3])  # row 0 ends with the last token of the first interval ...
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    out = EarlyExitPool(models).generate(ids, pool_interval=4, **kwargs)
    new = out.sequences[:, p:]
    ends = [int((row == eos).nonzero()[0]) if (row == eos).any() else None for row in new]
    assert ends[0] is not None and ends[0] <= 3, ends
    assert any(end is None or end > 3 for end in ends), "some row must go on after the first interval"
    for row, end in enumerate(ends):
        after = slice(end + 1 if end is not None else new.shape[1], None)
        assert (new[row, after] == 0).all() and (out.exit_layers[row, after] == -1).all()
        assert (out.model_indices[row, after] == -1).all() and (out.model_indices[row, : after.start] >= 0).all()
    if pool_size == 2:  # the first model's profile counts the tokens it decided and, once inactive, the tokens its
        # catch-up after 8 steps decided (steps 4-6) of rows still going: never a padded one
        assert [(s.token, s.target) for s in out.switches] == [(4, 1)]
        decided = out.exit_layers >= 0
        assert out.profiles[0] == {LAYERS - 1: int(decided[:, :7].sum())}
    if pool_size == 1:  # ... exactly as one generate call pads it; min_new_tokens holds over every interval
        assert_same(out, model.generate(ids, **kwargs))
        kwargs["min_new_tokens"] = 6
        out = EarlyExitPool(models).generate(ids, pool_interval=4, **kwargs)
        assert_same(out, model.generate(ids, **kwargs))
        assert not (out.sequences[:, p : p + 6] == eos).any()


def test_streamer_sees_the_prompt_once_then_every_step_for_the_whole_batch(base_dirs):
    ids, mask = padded_batch(batch=2)
    never, exits = model_with(base_dirs, seed=5, **NEVER), model_with(base_dirs, seed=7, **ALWAYS)
    free = EarlyExitPool([never, exits]).generate(
        ids, attention_mask=mask, max_new_tokens=8, pool_interval=3, do_sample=False
    )
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=8,
        pool_interval=3,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=int(free[0, -3]),
        return_dict_in_generate=True,
    )
    streamer, ends = Collect(), []
    streamer.end = lambda: ends.append(True)
    out = EarlyExitPool([never, exits]).generate(ids, streamer=streamer, **kwargs)
    assert out.switches and (out.sequences[0, -1] == 0), "a switch, and row 0 ended early"
    assert ends == [True] and torch.equal(streamer.chunks[0], ids)  # the prompt once, end() once
    assert torch.equal(torch.stack(streamer.chunks[1:], dim=1), out.sequences[:, ids.shape[1] :])  # every step


def test_scores_and_several_sequences_per_prompt_come_from_the_one_loop(base_dirs):
    ids, mask = padded_batch(batch=2)
    pool = EarlyExitPool([model_with(base_dirs, seed=5, **NEVER), model_with(base_dirs, seed=7, **ALWAYS)])
    out = pool.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        pool_interval=2,
        do_sample=True,
        num_return_sequences=2,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == (4, ids.shape[1] + 6) and out.model_indices.shape == out.exit_layers.shape == (4, 6)
    assert len(out.scores) == 6 and out.scores[0].shape == (4, 99)
    assert out.switches[0].token == 2 and out.caught_up[1] == 4 * ids.shape[1]  # the expanded batch, caught up


# --- bad input ------------------------------------------------------------------------------------------------------


def test_models_with_different_vocabularies_raise(base_dirs, tmp_path):
    model = model_with(base_dirs)
    make_base("llama", vocab_size=101).save_pretrained(tmp_path)
    bigger = eet.from_base(tmp_path, exit_layers=[0, 1, 2])
    with pytest.raises(ValueError, match=r"vocabulary.*vocab_size 99.*models\[1\] has 101"):
        EarlyExitPool([model, bigger])
    other = model_with(base_dirs, seed=5)
    model.tokenizer, other.tokenizer = numbered_tokenizer(), numbered_tokenizer()
    EarlyExitPool([model, other])  # the same tokenizer: fine
    vocab = other.tokenizer.get_vocab()
    swapped = {**vocab, "w2": vocab["w3"], "w3": vocab["w2"]}
    from tokenizers import Tokenizer
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    other.tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(tokenizer_models.WordLevel(swapped, unk_token="<pad>"))
    )
    with pytest.raises(ValueError, match=r"tokenizer.*'w2' \(id 2 vs 3\)"):
        EarlyExitPool([model, other])


@pytest.mark.parametrize(
    "models, match",
    [
        ([], r"`models` must be a non-empty list"),
        ("plain", r"`models\[1\]` \(LlamaForCausalLM\) is not an early-exit model"),
        (None, r"`models` must be a non-empty list"),
    ],
)
def test_bad_pools_raise(base_dirs, models, match):
    if models == "plain":
        models = [model_with(base_dirs), base_dirs["llama"][1]]
    with pytest.raises(ValueError, match=match):
        EarlyExitPool(models)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pool_interval=0), r"`pool_interval` must be an integer >= 1.*got 0"),
        (dict(pool_interval=2.5), r"`pool_interval`.*got 2.5"),
        (dict(pool_interval=True), r"`pool_interval`.*got True"),
        (dict(pool_profile_every=0), r"`pool_profile_every` must be an integer >= 1"),
        (dict(pool_costs=[{"ms": {}}]), r"`pool_costs` must be None or a list of 2"),
        (dict(pool_costs=[{"ms": {"layer": {"1": 1.0}}}] * 2), r"`pool_costs`.*at least \['layer', 'final_head'"),
        (dict(exit_threshold=1.5), r"`exit_threshold`"),
        (dict(num_beams=2), r"beam search"),
        (dict(cache_implementation="static"), r"`cache_implementation='static'`"),
        (dict(cache="mine"), r"`cache` cannot be passed to the pool"),
    ],
)
def test_bad_generate_arguments_raise(base_dirs, kwargs, match):
    pool = EarlyExitPool([model_with(base_dirs, **ALWAYS), model_with(base_dirs, seed=5, **NEVER)])
    with pytest.raises(ValueError, match=match):
        pool.generate(torch.tensor([[3, 4, 5]]), **{"max_new_tokens": 4, **kwargs})
