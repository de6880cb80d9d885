"""Issue 27: the draft heart (drafts.py) - the history index of earlier generations, acceptance learned per draft kind
and row, measured step costs, and the never-slower gate - and what `generate` does with it."""

import random

import pytest
import torch
from conftest import LayerCalls, padded_batch
from helpers import models_per_family

from ee_transformers.drafts import (
    MAX_PEERS,
    PLAIN_REFRESH,
    REFRESH_BAND,
    TRUSTED,
    Drafter,
    PackedCosts,
    StepCosts,
    SuffixIndex,
    cheapest_width,
    pace_setters,
    peers_of,
    plan_packed,
    plan_padded,
    plan_padded_fresh,
)

LAYERS = 4


@pytest.fixture(scope="module")
def models(base_dirs):
    return models_per_family(base_dirs)


# --- the index ---------------------------------------------------------------------------------------------------------


def test_history_documents_are_matched_but_never_spanned():
    index = SuffixIndex(ngram_size=2)
    index.add_document([1, 2, 3, 4])
    index.add_document([5, 1, 2, 9])
    chain = index.chain([7, 1, 2], 5, "history")
    assert chain.tokens == [9] and chain.support == 2 and chain.shares == [0.5]  # a tie: the latest; its document
    # ends after 9 (the chain does not run on into another document)
    assert index.chain([3, 4], 3) is None  # 4 ends its document: nothing follows it there
    assert index.chain([8, 8], 3) is None


def test_history_budget_evicts_the_oldest_documents_and_reports_its_size():
    index = SuffixIndex(ngram_size=2, max_tokens=12)
    for k in range(10):
        index.add_document([100 + k, 1, 2, 50 + k])
    assert index.num_tokens <= 12 and len(index.documents) == 2  # 4 tokens + separator each
    assert index.chain([1, 2], 1).tokens == [59]  # the latest document's continuation
    assert index.chain([100, 1], 2).match == 1  # "100 1" was evicted: only "1" still matches
    assert index.nbytes > 0
    index.resize(0)
    assert index.num_tokens == 0 and index.chain([1, 2], 1) is None
    index.add_document([1, 2, 3])  # a zero budget holds nothing
    assert index.num_tokens == 0
    with pytest.raises(ValueError, match="`max_tokens` must be an integer >= 0 or None"):
        SuffixIndex(max_tokens=-1)


def test_history_eviction_reindexes_and_stays_correct():
    index = SuffixIndex(ngram_size=3, max_tokens=2000)
    for k in range(600):  # evicts far more than the budget: the dead n-grams are dropped by a re-index
        index.add_document([k % 7, k % 5, k % 3, k])
    assert index.num_tokens <= 2000
    live = {t for s, e in index.documents for t in index.tokens[s - index.base : e - index.base]}
    assert 599 in live and 0 not in {index.tokens[e - 1 - index.base] for s, e in index.documents}
    chain = index.chain([599 % 7, 599 % 5, 599 % 3], 1)
    assert chain is not None and chain.tokens[0] in live


def test_history_save_and_load_round_trip(tmp_path):
    index = SuffixIndex(ngram_size=3, max_tokens=100)
    index.add_document([1, 2, 3, 4])
    index.add_document([2, 3, 5])
    index.save(tmp_path / "history.pt")
    again = SuffixIndex.load(tmp_path / "history.pt")
    assert (again.ngram_size, again.max_tokens, again.num_tokens) == (3, 100, index.num_tokens)
    assert again.chain([2, 3], 2).tokens == index.chain([2, 3], 2).tokens == [5]


# --- acceptance ----------------------------------------------------------------------------------------------------------


def test_acceptance_is_learned_per_kind_of_draft_and_per_row():
    drafter = Drafter()
    row = SuffixIndex(2)
    row.extend([1, 2, 3, 1, 2, 3, 1, 2])
    first = drafter.propose(row, row.tail(), 3)
    assert first.source == "context" and first.tokens == [3, 1, 2]
    assert all(a >= b for a, b in zip(first.probs, first.probs[1:]))  # cumulative: non-increasing
    for _ in range(20):  # every such draft is rejected
        drafter.observe(drafter.propose(row, row.tail(), 3), 0)
    low = drafter.propose(row, row.tail(), 3)
    assert low.probs[0] < first.probs[0] / 4
    other = SuffixIndex(2)
    other.extend([1, 2, 3, 1, 2, 3, 1, 2])  # the same kind of draft, a fresh row: the learned rate, no row factor
    assert low.probs[0] < drafter.propose(other, other.tail(), 3).probs[0] < first.probs[0]


def test_the_source_that_expects_the_most_accepted_drafts_wins():
    drafter = Drafter()
    drafter.finish([4, 5, 6, 7, 8])
    drafter.finish([4, 5, 6, 7, 8])
    row = SuffixIndex(2)
    row.extend([4, 5, 1, 4, 5, 2, 4, 5])  # its own text: "4 5" -> 1 or 2, half each; the history: 6 7 8, always
    chain = drafter.propose(row, row.tail(), 3)
    assert chain.source == "history" and chain.tokens == [6, 7, 8] and chain.support == 2
    assert drafter.propose(row, row.tail(), 3, history=False).tokens == [2, 4, 5]  # the tie: the latest


def test_a_row_copies_what_a_row_beside_it_has_written():
    """Peers: the texts of the rows decoded at the same time; a row behind drafts what a row ahead already wrote (its
    own text and the history have no match), and not with the history off."""
    drafter = Drafter()
    ahead, behind, other = SuffixIndex(2), SuffixIndex(2), SuffixIndex(2)
    ahead.extend([9, 4, 5, 6, 7, 8])
    behind.extend([3, 4, 5])
    other.extend([1, 2])
    chain = drafter.propose(behind, behind.tail(), 3, peers=[other, ahead])
    assert chain.source == "peer" and chain.tokens == [6, 7, 8]
    assert drafter.propose(behind, behind.tail(), 3) is None
    assert drafter.propose(behind, behind.tail(), 3, history=False, peers=[ahead]) is None
    assert peers_of([ahead, behind, other], 1) == [ahead, other]
    assert peers_of([SuffixIndex(2) for _ in range(MAX_PEERS + 2)], 0) == []  # too wide: no peer lookups


# --- costs and the gate ----------------------------------------------------------------------------------------------


def test_step_costs_interpolate_and_distrust_a_single_timing():
    costs = StepCosts()
    assert costs.cost(("padded", 8, 3)) == pytest.approx(1.2)  # nothing measured: the prior, in its own units
    for _ in range(TRUSTED):
        costs.observe(("padded", 8, 1), 0.010)
        costs.observe(("padded", 8, 5), 0.020)
    assert costs.cost(("padded", 8, 3)) == pytest.approx(0.015)  # between two measured widths
    assert costs.cost(("padded", 8, 9)) == pytest.approx(0.020 * 1.8 / 1.4)  # beyond: the prior's slope
    costs.observe(("padded", 8, 2), 1.0)  # one slow timing of width 2: at most its estimate
    assert costs.cost(("padded", 8, 2)) == pytest.approx(0.0125)
    assert costs.cost(("padded", 1, 1)) == pytest.approx(1.0)  # another group: its own prior


def test_packed_costs_separate_tokens_logits_rows_and_attention():
    costs = StepCosts()
    early = PackedCosts(costs)
    for _ in range(TRUSTED):
        early.observe(4, 4, 100, 2.0)
    assert early.coefficients() is None
    assert early.cost(4, 4, 100) == costs.cost(("packed", 4)) == 2.0  # too few steps: the width table
    packed = PackedCosts(StepCosts())
    truth = lambda t, r, k, d: 0.05 + 0.002 * t + 0.003 * r + 1e-6 * t * k + 0.01 * d  # noqa: E731
    steps = [(1024, 3, 1100, 0), (64, 2, 300, 0), (32, 32, 4000, 0), (16, 16, 2000, 0), (40, 32, 4100, 1)]
    steps += [(t, min(t, 8), 50 * t, t % 2) for t in range(8, 24)]
    for t, r, k, d in steps:
        packed.observe(t, r, k, truth(t, r, k, d), drafted=bool(d))
    assert packed.coefficients() == pytest.approx([0.05, 0.002, 0.003, 1024e-6, 0.01], rel=1e-6)
    # a draft costs a token, a logits row and a key more: more than a prefill token of the same width
    assert packed.cost(58, 58, 4058, drafted=True) == pytest.approx(truth(58, 58, 4058, 1))
    assert packed.cost(58, 58, 4058, drafted=True) > packed.cost(58, 33, 4058, drafted=True)
    never_negative = PackedCosts(StepCosts())
    for t in range(1, 20):  # seconds that shrink with the tokens: no coefficient below zero predicts less than 0
        never_negative.observe(t, t, t, 1.0 / t)
    assert all(b >= 0 for b in never_negative.coefficients()) and never_negative.cost(100, 100, 100) >= 0


def test_packed_costs_price_a_draft_linearly_when_drafted_steps_share_one_width():
    # batch 1: plain steps of 1 token and drafted steps of 5 only, so the drafted-step term cannot be told apart from
    # the tokens'; the fit must not put the 4 drafts' extra seconds on that term (a single draft priced like four)
    rng = random.Random(0)
    packed = PackedCosts(StepCosts())
    for keys in range(100, 160):
        packed.observe(1, 1, keys, 0.0609 * rng.uniform(0.97, 1.03))
        packed.observe(5, 5, keys + 4, 0.0842 * rng.uniform(0.97, 1.03), drafted=True)
    assert packed.coefficients()[4] == pytest.approx(0.0, abs=1e-4)
    plain, drafted = packed.cost(1, 1, 150), [packed.cost(1 + n, 1 + n, 150 + n, drafted=True) for n in range(1, 5)]
    assert drafted[-1] == pytest.approx(0.0842, rel=0.02)
    steps = [b - a for a, b in zip([plain, *drafted], drafted)]
    assert max(steps) == pytest.approx(min(steps), rel=0.05)  # each draft adds the same, a quarter of four's


def test_the_padded_gate_drafts_only_where_it_pays():
    flat = lambda width: 1.0  # noqa: E731 - verification positions cost nothing extra
    steep = lambda width: 1.0 + 0.5 * (width - 1)  # noqa: E731 - each position costs half a step
    assert plan_padded([[0.9, 0.8, 0.1]], [True], flat) == 3
    assert plan_padded([[0.9, 0.8, 0.1]], [True], steep) == 2  # 1.7 / 1.5 beats 1.8 / 2.0 and plain's 1 / 1
    assert plan_padded([[0.3, 0.1]], [True], steep) == 0  # 1.3 / 1.5 < 1: a plain step
    assert plan_padded([[], []], [True, True], flat) == 0
    # the rows that set the pace decide: a fast row ahead of a row with nothing to draft does not make it pay
    assert plan_padded([[0.9, 0.9], []], [False, True], steep) == 0
    assert pace_setters([10, 12, 11, 10], [True, True, False, True]) == [True, False, False, True]
    # two level rows, one with a likely draft: the batch moves only with the other, so the draft is worth less
    one_of_two, cost = [[0.9], []], lambda width: 1.0 + 0.3 * (width - 1)  # noqa: E731
    assert plan_padded(one_of_two, [True, True], cost) == 1  # the rows' mean: 1.45 / 1.3
    assert plan_padded(one_of_two, [True, True], cost, beyond=0.5) == 0  # 1.225 / 1.3: a plain step
    assert plan_padded([[0.9], [0.9]], [True, True], cost, beyond=0.0) == 1  # both keep it: 1 + 0.81, all of it


def test_the_padded_gate_prices_a_round_at_its_cheapest_wider_width():
    # kernels slow at 2-3 positions and fast at 5 (BENCHMARKS 5g's CPU): 1, 2, 3, 4, 5 positions
    bumpy = {1: 1.0, 2: 1.8, 3: 2.1, 4: 1.55, 5: 1.35}.__getitem__
    assert cheapest_width(bumpy, 2, 5) == 5 and cheapest_width(bumpy, 2, 3) == 2 and cheapest_width(bumpy, 2) == 2
    assert cheapest_width(lambda width: 1.0, 2, 5) == 2  # equal costs: the narrowest
    one_draft = [[0.8]]  # 1.8 tokens: at 2 positions 1.8 / 1.8, plain speed; fed 5 positions 1.8 / 1.35
    assert plan_padded(one_draft, [True], bumpy) == 0
    fed = lambda least: cheapest_width(bumpy, least, 5)  # noqa: E731
    assert plan_padded(one_draft, [True], bumpy, fed=fed) == 1
    assert plan_padded([[0.9, 0.8, 0.5, 0.2]], [True], bumpy, fed=fed) == 4  # every draft where they cost alike
    costs, group = StepCosts(), ("context", 1)
    for _ in range(TRUSTED):
        for width in range(1, 6):
            costs.observe((*group, width), bumpy(width))
    assert plan_padded_fresh(one_draft, [True], costs, group) == 0
    assert plan_padded_fresh(one_draft, [True], costs, group, most_fed=5) == 1
    once = StepCosts()  # wider widths timed once, fast: not trusted yet, they do not draw the round to them
    for _ in range(TRUSTED):
        for width in range(1, 4):
            once.observe((*group, width), bumpy(width))
    once.observe((*group, 4), bumpy(4))
    once.observe((*group, 5), bumpy(5))
    assert not once.trusted((*group, 5)) and once.trusted((*group, 3))
    assert once.cheapest(group, 2, 5) == 2 and costs.cheapest(group, 2, 5) == 5
    assert plan_padded_fresh(one_draft, [True], once, group, most_fed=5) == 0


def test_the_padded_gate_times_a_stale_or_unknown_plain_width_before_a_marginal_draft():
    group, costs = ("context", 8), StepCosts()
    for _ in range(TRUSTED):  # the wider widths timed, plain never: its estimate would be the prior's guess
        costs.observe((*group, 2), 1.5)
        costs.observe((*group, 3), 1.65)
    # one row sets the pace: 2.98 / 1.65 against plain; 1.7 / 1.5 = 1.13x
    sure, marginal = [[0.99, 0.99]], [[0.7, 0.1]]
    assert costs.age((*group, 1)) is None and plan_padded_fresh(sure, [True], costs, group) == 0
    for _ in range(TRUSTED):
        costs.observe((*group, 1), 1.0)
    assert costs.age((*group, 1)) == 0
    assert plan_padded_fresh(sure, [True], costs, group) == 2
    assert plan_padded_fresh(marginal, [True], costs, group) == 1  # fresh: 1.13x > MARGIN, it drafts
    for _ in range(PLAIN_REFRESH):  # drafted rounds since the latest plain one
        costs.observe((*group, 2), 1.5)
    assert costs.age((*group, 1)) == PLAIN_REFRESH
    assert 1.7 / 1.5 < REFRESH_BAND < 2.98 / 1.65
    assert plan_padded_fresh(marginal, [True], costs, group) == 0  # stale and marginal: a plain round times it
    assert plan_padded_fresh(sure, [True], costs, group) == 2  # stale, but drafting wins by far
    costs.observe((*group, 1), 1.0)
    assert plan_padded_fresh(marginal, [True], costs, group) == 1
    assert plan_padded_fresh([[]], [True], costs, ("context", 3)) == 0  # nothing to draft: plain


def test_the_packed_gate_adds_the_likeliest_drafts_first_and_shrinks_under_load():
    light = lambda tokens: 1.0 + 0.01 * tokens  # noqa: E731 - a step barely grows with its tokens
    assert plan_packed([[0.9, 0.8], [0.5], []], 3, light) == [2, 1, 0]
    heavy = lambda tokens: 0.1 * tokens  # noqa: E731 - saturated: cost proportional to tokens
    assert plan_packed([[0.9, 0.8], [0.5], []], 3, heavy) == [0, 0, 0]  # no draft gives back its cost
    assert plan_packed([[0.99, 0.99], [0.2]], 2, lambda t: 1.0 + 0.3 * t) == [2, 0]


# --- in generate -----------------------------------------------------------------------------------------------------


def test_history_drafts_repeat_an_earlier_generation_exactly(models, family):
    model, base = models(family)
    model.drafter.history.clear()
    ids, mask = padded_batch(batch=2)
    kwargs = dict(max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4, return_dict_in_generate=True)
    kwargs["max_length"] = None
    if family in ("mistral", "gemma2", "gemma3_text") or getattr(base.config, "use_sliding_window", False):
        kwargs["max_new_tokens"] = 2  # inside the matrix's window of 4 only a short generation is allowed
    expected = base.generate(ids, attention_mask=mask, max_new_tokens=kwargs["max_new_tokens"], do_sample=False)
    try:
        first = model.generate(ids, attention_mask=mask, speculative_gate=False, **kwargs)
    except ValueError as e:  # sliding-window families refuse generations longer than their window
        assert "sliding-window attention" in str(e)
        return
    assert torch.equal(first.sequences, expected)
    assert model.drafter.history.num_tokens >= 2 * (kwargs["max_new_tokens"] - 1)  # each row's generation entered
    again = model.generate(ids, attention_mask=mask, speculative_gate=False, **kwargs)
    assert torch.equal(again.sequences, expected)
    if kwargs["max_new_tokens"] > 2:
        assert int(again.history_accepted_tokens.sum()) > 0  # the first call's text: drafted and kept
        assert int(again.verify_rounds.max()) < int(first.verify_rounds.max())
    none = model.generate(ids, attention_mask=mask, speculative_gate=False, speculative_history_tokens=0, **kwargs)
    assert torch.equal(none.sequences, expected) and int(none.history_draft_tokens.sum()) == 0


def test_a_gated_round_is_one_plain_step(models):
    model, base = models("llama")
    ids = base.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=9, do_sample=False)  # its own text: it repeats
    drafter = model.drafter
    drafter.history.clear()
    saved = drafter.costs
    drafter.costs = StepCosts()
    try:
        for _ in range(TRUSTED):  # a machine where every extra position costs a whole step: nothing can pay
            for width in range(1, 12):
                drafter.costs.observe(("context", 1, width), float(width))
        counter = LayerCalls(model)
        try:
            out = model.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3,
                                 return_dict_in_generate=True)  # fmt: skip
        finally:
            counter.remove()
        assert out.draft_lengths.tolist() == [0] * 7 and int(out.draft_tokens.sum()) == 0
        assert counter.positions == [ids.shape[1] + 7] * LAYERS  # prefill, then one position per step
        assert torch.equal(out.sequences, base.generate(ids, max_new_tokens=8, do_sample=False))
        drafter.costs = StepCosts()
        for _ in range(TRUSTED):  # verification positions for free: the same text drafts and saves steps
            for width in range(1, 12):
                drafter.costs.observe(("context", 1, width), 1.0)
        free = model.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3,
                              return_dict_in_generate=True, speculative_history_tokens=0)  # fmt: skip
        assert torch.equal(free.sequences, out.sequences) and len(free.draft_lengths) < 7
    finally:
        drafter.costs = saved


def test_a_gated_round_is_fed_at_its_cheapest_width(models):
    model, base = models("llama")
    ids = base.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=9, do_sample=False)  # its own text: it repeats
    drafter, saved = model.drafter, model.drafter.costs
    drafter.history.clear()
    drafter.costs = StepCosts()
    try:
        for _ in range(TRUSTED):  # 1 position 1 s, 2-3 positions 3 s, 4 positions 1.5 s: one draft pays only fed 4
            for width, seconds in {1: 1.0, 2: 3.0, 3: 3.0, 4: 1.5}.items():
                drafter.costs.observe(("context", 1, width), seconds)
        out = model.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3,
                             return_dict_in_generate=True, speculative_history_tokens=0)  # fmt: skip
        assert torch.equal(out.sequences, base.generate(ids, max_new_tokens=8, do_sample=False))
        drafted = [k for k in out.draft_lengths.tolist() if k]
        assert drafted and set(drafted) == {3}  # never 1 or 2 drafts fed 2-3 positions: fed 4, drafts then fillers
        assert int(out.draft_tokens.sum()) < 3 * len(drafted)  # some of those positions were fillers
    finally:
        drafter.costs = saved


def test_the_history_is_never_saved_with_the_model(models, tmp_path):
    model, _ = models("llama")
    model.drafter.history.clear()
    model.save_pretrained(tmp_path / "before")
    model.generate(torch.tensor([[3, 4, 3, 4]]), max_new_tokens=4, prompt_lookup_num_tokens=2)
    assert model.drafter.history.num_tokens > 0
    model.save_pretrained(tmp_path / "after")
    files = lambda d: {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()}  # noqa: E731
    # a folder saved with a filled history is byte for byte the folder saved without one
    assert files(tmp_path / "after") == files(tmp_path / "before")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_lookup_num_tokens=2, speculative_history_tokens=-1), r"`speculative_history_tokens` must be"),
        (dict(prompt_lookup_num_tokens=2, speculative_history_tokens=1.5), r"`speculative_history_tokens` must be"),
        (dict(prompt_lookup_num_tokens=2, speculative_gate="yes"), r"`speculative_gate` must be True, False or None"),
        (dict(assistant_early_exit=1, speculative_history_tokens=10), r"needs `prompt_lookup_num_tokens`"),
        (dict(speculative_gate=False), r"`speculative_gate` is a setting of speculative decoding"),
    ],
)
def test_bad_draft_settings_raise_naming_the_setting(models, kwargs, match):
    model, _ = models("llama")
    with pytest.raises(ValueError, match=match):
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, **kwargs)
