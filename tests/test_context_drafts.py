"""Issue 20: context drafts (`prompt_lookup_num_tokens`) in our speculative engine, alone and with exit-head drafts, at
any batch size."""

import pytest
import torch
from conftest import LayerCalls, chi_square_p, make_base, padded_batch
from helpers import STATIC_REFUSAL, models_per_family, refused_before_decoding, sliding_window, static_cache_refused

import ee_transformers as eet
import ee_transformers.speculative_early_exit as spec
from ee_transformers.compat import layer_skip_failure

LAYERS = 4  # tiny models: 4 decoder layers; exits after 0, 1, 2
SOURCES = [  # every source alone and both together
    dict(prompt_lookup_num_tokens=3),
    dict(prompt_lookup_num_tokens=10, max_matching_ngram_size=3),
    dict(prompt_lookup_num_tokens=2, num_assistant_tokens_schedule="heuristic"),
    dict(
        prompt_lookup_num_tokens=4, assistant_early_exit=2, num_assistant_tokens=3, assistant_confidence_threshold=0.0
    ),
    dict(prompt_lookup_num_tokens=3, assistant_early_exit=1, num_assistant_tokens=2),  # exit drafts stop when unsure
    dict(prompt_lookup_num_tokens=2, speculative_verify_width=6),  # wider rounds, fillers after the drafts
    dict(prompt_lookup_num_tokens=3, speculative_gate=False),  # every round drafts what it finds (no gate)
]


@pytest.fixture(scope="module")
def models(base_dirs):
    """{family: (early-exit model, base)}, built once per module."""
    return models_per_family(base_dirs)


# --- the drafts ------------------------------------------------------------------------------------------------------


def _batch(rows, budget):
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):  # left padding
        ids[r, width - len(row) :], mask[r, width - len(row) :] = torch.tensor(row), 1
    batch = spec.RaggedBatch(ids, mask, width + 8, pad_mode=False, pad_token_id=0)
    return batch, torch.full((len(rows),), budget)


def _chains(batch, budget, ngram_size):
    """Each row's chain from its own text alone (no history, no table)."""
    texts = spec.RowTexts(batch, ngram_size)
    return [row.chain(row.tail(), n) for row, n in zip(texts.rows, budget.tolist())]


def test_context_drafts_copy_what_followed_the_longest_matching_suffix():
    batch, budget = _batch(
        [
            [5, 6, 7, 8, 9, 1, 2, 6, 7],  # "6 7" occurred at 1: its continuation 8 9 1
            [3, 4, 5, 3, 9, 9, 5],  # no "9 5" before; "5" at 2: 3 9 9
            [2, 3, 4, 5],  # nothing repeats
            [1, 2, 1, 2, 1, 2],  # "1 2" at 0 and 2; at 2 the match extends back over "1 2 1 2": 1 2, then the end
        ],
        budget=3,
    )
    chains = _chains(batch, budget, ngram_size=2)
    assert chains[2] is None
    assert [c.tokens for c in (chains[0], chains[1], chains[3])] == [[8, 9, 1], [3, 9, 9], [1, 2]]
    assert chains[3].match == 4 and chains[0].match == 2
    # a longer n-gram wins over a later shorter one, and the budget caps the count per row
    batch, _ = _batch([[7, 1, 2, 3, 4, 2, 3, 9, 1, 2, 3]], budget=2)
    (chain,) = _chains(batch, torch.tensor([2]), ngram_size=3)
    assert chain.tokens == [4, 2]  # "1 2 3" at 1, not "2 3" at 5
    # the left pads of a row are not its text
    batch, _ = _batch([[9, 9, 9, 9], [4, 0, 0]], budget=2)
    chains = _chains(batch, torch.tensor([2, 2]), ngram_size=1)
    assert chains[0].tokens == [9] and chains[1].tokens == [0]  # the longest match (at 1) leaves one token; row 1: "0"


def test_context_drafts_follow_the_most_frequent_continuation():
    # "1 2" is followed by 3 twice and by 4 once (the latest): the frequent one wins, with its share
    batch, budget = _batch([[1, 2, 3, 8, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2]], budget=3)
    (chain,) = _chains(batch, budget, ngram_size=2)
    assert chain.tokens[0] == 3 and chain.support == 3
    assert chain.shares[0] == pytest.approx(2 / 3) and chain.shares[1] == pytest.approx(1 / 3)


# --- exactness -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_context_drafts_equal_full_depth_greedy(models, family, cache_implementation):
    model, base = models(family)
    ids, mask = padded_batch(batch=3)
    kwargs = dict(max_new_tokens=20, do_sample=False, cache_implementation=cache_implementation)
    if sliding_window(base):  # the matrix's window (4) is shorter than the generation: refused, not decoded wrongly
        with pytest.raises(ValueError, match="prompt_lookup_num_tokens.*sliding-window attention"):
            model.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=3, **kwargs)
        return
    if static_cache_refused(cache_implementation):  # transformers before 5.24 cannot crop static layers
        for source in SOURCES:
            with pytest.raises(ValueError, match=STATIC_REFUSAL):
                model.generate(ids, attention_mask=mask, **kwargs, **source)
        return
    expected = base.generate(ids, attention_mask=mask, **kwargs)
    accepted = 0
    for source in SOURCES:
        out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs, **source)
        assert torch.equal(out.sequences, expected), source
        assert set(out.exit_layers.unique().tolist()) <= {LAYERS - 1, -1}  # the final head decides (-1: ended)
        assert (out.context_accepted_tokens <= out.context_draft_tokens).all()
        assert (out.accepted_tokens <= out.draft_tokens).all()
        accepted += int(out.context_accepted_tokens.sum())
    assert accepted > 0  # the random models' text repeats itself: context drafts were accepted somewhere


def test_sliding_window_families_inside_the_window(tmp_path):
    base = make_base("qwen2-sliding", sliding_window=64)
    base.save_pretrained(tmp_path)
    model = eet.from_base(tmp_path, exit_layers=[0, 1, 2]).eval()
    ids, mask = padded_batch(batch=2)
    for cache_implementation in (None, "static"):
        kwargs = dict(max_new_tokens=24, do_sample=False, cache_implementation=cache_implementation)
        expected = base.generate(ids, attention_mask=mask, **kwargs)
        for source in SOURCES[:1] + SOURCES[3:4]:
            if static_cache_refused(cache_implementation):  # transformers before 5.24 cannot crop static layers
                with pytest.raises(ValueError, match=STATIC_REFUSAL):
                    model.generate(ids, attention_mask=mask, **kwargs, **source)
                continue
            assert torch.equal(model.generate(ids, attention_mask=mask, **kwargs, **source), expected)


def test_a_batch_row_equals_its_prompt_alone_with_eos(models):
    model, base = models("llama")
    prompts = [[5, 17, 33, 5, 17], [8, 9, 10, 11, 12, 13, 14], [40, 41], [60, 7, 7, 3, 21]]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
    free = base.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=int(free[2, width + 5]), pad_token_id=0)
    expected = base.generate(ids, attention_mask=mask, **kwargs)
    for source in (SOURCES[0], SOURCES[3]):
        out = model.generate(ids, attention_mask=mask, **kwargs, **source)
        assert torch.equal(out, expected), source
        for r, p in enumerate(prompts):
            alone = model.generate(torch.tensor([p]), **kwargs, **source)[0, len(p) :]
            assert torch.equal(out[r, width:][: alone.numel()], alone), (source, r)


# --- what it saves ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
def test_accepted_context_drafts_save_full_steps(models, batch):
    model, base = models("llama")
    ids, mask = padded_batch(batch=batch)
    new = 30
    counter = LayerCalls(model)
    try:
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, prompt_lookup_num_tokens=4,
            return_dict_in_generate=True, speculative_gate=False,
        )  # fmt: skip
    finally:
        counter.remove()
    assert torch.equal(out.sequences, base.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False))
    rounds = len(out.draft_lengths)
    # a context round is ONE forward of every layer over the row's last token and its drafts: prefill + a call a round
    assert counter.calls == [1 + rounds] * LAYERS
    rows = counter.call_rows[0][1:]  # after the prefill: rows that ended early leave the forward
    assert counter.positions[0] == ids.numel() + sum(r * (k + 1) for r, k in zip(rows, out.draft_lengths.tolist()))
    assert rows == sorted(rows, reverse=True) and rows[0] == batch
    # each round gives a row its accepted drafts plus one token, so full-depth forwards saved = drafts accepted
    if batch == 1:
        assert int(out.verify_rounds[0]) + int(out.accepted_tokens[0]) == new - 1  # the first token: prefill
    assert rounds < new - 1 and int(out.context_accepted_tokens.sum()) > 0


def test_a_verify_width_widens_only_the_rounds_that_verify_drafts(models):
    model, base = models("llama")
    ids, mask = padded_batch(batch=2)
    new = 24
    # every round drafts what it can, from the row's text alone: the calls below compare their rounds
    fixed = dict(speculative_gate=False, speculative_history_tokens=0)
    kwargs = dict(
        max_new_tokens=new, do_sample=False, prompt_lookup_num_tokens=2, return_dict_in_generate=True, **fixed
    )
    narrow = model.generate(ids, attention_mask=mask, **kwargs)
    out = model.generate(ids, attention_mask=mask, speculative_verify_width=6, **kwargs)
    assert torch.equal(out.sequences, narrow.sequences)
    assert torch.equal(out.sequences, base.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False))
    widths = (out.draft_lengths + 1)[: len(out.draft_lengths) // 2]  # positions fed per row; far from max_length
    assert ((widths == 1) | (widths >= 6)).all() and (widths >= 6).any()  # a round with a draft: 6 wide, else 1
    near_end = torch.tensor([[3, 4, 3, 4, 3]])  # "3 4" repeats: a draft every round, but 2 tokens left at most
    out = model.generate(near_end, max_new_tokens=3, prompt_lookup_num_tokens=2, speculative_verify_width=8,
                         return_dict_in_generate=True, do_sample=False, **fixed)  # fmt: skip
    assert int(out.draft_lengths.max()) <= 2  # fillers stop at max_length: no positions generate would never reach
    # the fillers are never accepted: the same drafts are counted as without them
    assert torch.equal(out.accepted_tokens, model.generate(near_end, max_new_tokens=3, prompt_lookup_num_tokens=2,
                       return_dict_in_generate=True, do_sample=False, **fixed).accepted_tokens)  # fmt: skip


def test_without_matches_a_round_is_one_plain_step(models):
    model, base = models("llama")
    ids = torch.tensor([[3, 4, 5]])
    counter = LayerCalls(model)
    try:  # max_new_tokens=2: after the prefill's token no drafts can be committed, so no round drafts
        out = model.generate(ids, max_new_tokens=2, prompt_lookup_num_tokens=5, return_dict_in_generate=True)
    finally:
        counter.remove()
    assert out.draft_lengths.tolist() == [0] and counter.positions == [3 + 1] * LAYERS
    assert torch.equal(out.sequences, base.generate(ids, max_new_tokens=2, do_sample=False))


# --- sampling --------------------------------------------------------------------------------------------------------


def test_sampling_with_context_drafts_follows_the_full_models_distribution(tmp_path, monkeypatch):
    vocab, rows = 8, 6000
    base = make_base("llama", vocab_size=vocab, eos_token_id=None, pad_token_id=0, bos_token_id=1)
    with torch.no_grad():
        base.lm_head.weight.mul_(6.0)  # peaked distributions: copied drafts are often, not always, right
    base.save_pretrained(tmp_path)
    model = eet.from_base(tmp_path, exit_layers=[0, 1, 2]).eval()
    # the model's own greedy text as the prompt: it repeats itself, so copied drafts are often (not always) sampled
    ids = base.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=12, do_sample=False).repeat(rows, 1)
    # the gate off: this test is about the acceptance rule, which must be exercised whatever the rounds cost
    kwargs = dict(max_new_tokens=3, do_sample=True, temperature=0.9, pad_token_id=0, speculative_gate=False)

    def pairs(out):  # tokens 2 and 3 come from drafts, rejections and bonus tokens; token 1 from the prefill
        new = out[:, ids.shape[1] :]
        return new[:, 1] * vocab + new[:, 2]

    torch.manual_seed(0)
    plain = pairs(model.generate(ids, **{**kwargs, "speculative_gate": None}))
    for source in (dict(prompt_lookup_num_tokens=2, max_matching_ngram_size=1), dict(SOURCES[3], max_new_tokens=3)):
        out = model.generate(ids, return_dict_in_generate=True, **{**kwargs, **source})
        rate = float(out.context_accepted_tokens.sum() / out.context_draft_tokens.sum())
        assert 0.05 < rate < 0.9, rate  # the rule is exercised both ways
        assert chi_square_p(plain, pairs(out.sequences)) > 1e-3, source

    # the test has the power to see the classic mistake: after a rejected copied draft, drawing from p (d included)
    right = spec.accept_sampled

    def from_p_after_rejection(p, q, drafts, valid=None):
        accepted, _ = right(p, q, drafts, valid)
        return accepted, torch.multinomial(p[torch.arange(p.shape[0]), accepted], 1).squeeze(1)

    monkeypatch.setattr(spec, "accept_sampled", from_p_after_rejection)
    wrong = model.generate(ids, prompt_lookup_num_tokens=2, max_matching_ngram_size=1, **kwargs)
    assert chi_square_p(plain, pairs(wrong)) < 1e-6


# --- settings --------------------------------------------------------------------------------------------------------


def test_stored_prompt_lookup_is_used_by_a_plain_generate_after_reload(models, tmp_path):
    from transformers import AutoModelForCausalLM

    model, base = models("llama")
    model.generation_config.prompt_lookup_num_tokens = 4
    model.generation_config.max_matching_ngram_size = 3
    try:
        model.save_pretrained(tmp_path)
    finally:
        model.generation_config.prompt_lookup_num_tokens = None
        model.generation_config.max_matching_ngram_size = None
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert loaded.generation_config.prompt_lookup_num_tokens == 4
    ids, mask = padded_batch(batch=2)
    out = loaded.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    assert int(out.context_draft_tokens.sum()) > 0  # the stored setting was used, at batch 2
    assert torch.equal(out.sequences, base.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False))
    off = loaded.generate(ids, attention_mask=mask, max_new_tokens=5, prompt_lookup_num_tokens=None)
    assert torch.equal(off, base.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_lookup_num_tokens=0), r"`prompt_lookup_num_tokens` must be an integer >= 1, got 0"),
        (dict(prompt_lookup_num_tokens=-2), r"`prompt_lookup_num_tokens` must be an integer >= 1, got -2"),
        (dict(prompt_lookup_num_tokens=2.5), r"`prompt_lookup_num_tokens` must be an integer >= 1, got 2.5"),
        (dict(prompt_lookup_num_tokens=True), r"`prompt_lookup_num_tokens` must be an integer >= 1, got True"),
        (dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=0), r"`max_matching_ngram_size` must be"),
        (dict(prompt_lookup_num_tokens=3, num_beams=2), r"`prompt_lookup_num_tokens` does not support beam search"),
        (dict(prompt_lookup_num_tokens=3, output_hidden_states=True), r"`output_hidden_states=True` is not available"),
        (dict(prompt_lookup_num_tokens=3, exit_threshold=0.5), r"cannot be combined with `exit_threshold`"),
        (dict(prompt_lookup_num_tokens=3, assistant_early_exit=4), r"`assistant_early_exit`.*allowed values"),
        (dict(prompt_lookup_num_tokens=3, speculative_max_batch_size=0), r"`speculative_max_batch_size` must be an"),
        (dict(prompt_lookup_num_tokens=3, speculative_verify_width=0), r"`speculative_verify_width` must be an"),
        (dict(prompt_lookup_num_tokens=3, speculative_verify_width=2.5), r"`speculative_verify_width` must be an"),
        (dict(assistant_early_exit=2, speculative_verify_width=4), r"`speculative_verify_width`.*needs `prompt_"),
        (dict(speculative_verify_width=4), r"`speculative_verify_width` is a setting of speculative decoding"),
    ],
)
def test_bad_context_draft_arguments_raise_before_decoding(models, kwargs, match):
    refused_before_decoding(models("llama")[0], match, **kwargs)


# --- the benchmark ---------------------------------------------------------------------------------------------------


def test_bench_lossless_runs_side_by_side_and_reports(models):
    from ee_transformers.tools.bench import plain_twin, random_prompts
    from ee_transformers.tools.bench.lossless import LosslessConfig, format_lossless, run_lossless

    model, _ = models("llama")
    config = LosslessConfig(
        batch_sizes=[1, 2], num_prompts=2, prompt_tokens=8, new_tokens=6, rounds=1, threads=1, exits=[2]
    )
    report = run_lossless(model, plain_twin(model), random_prompts(99, 2, 8), config, log=lambda *_: None)
    rows = {(r["batch_size"], r["who"], r["name"]) for r in report["results"]}
    assert (1, "transformers", "prompt lookup N=10 G=2") in rows and (2, "ours", "prompt lookup N=10 G=2") in rows
    assert (2, "transformers", "prompt lookup N=10 G=2") not in rows  # transformers refuses batch > 1
    assert (2, "ours", "context + exit drafts @2") in rows
    assert all(r["identical"] and r["speedup"] > 0 for r in report["results"])
    assert "prompt lookup N=4 G=3" in format_lossless(report)
    if layer_skip_failure() is None:
        assert (1, "transformers", "exit drafts @2") in rows and "not_run" not in report
    else:  # transformers before 5.22: its own exit drafts fail, so their row is left out and the report says why
        assert not any(who == "transformers" and "exit" in name for _, who, name in rows)
        assert report["not_run"] == {"transformers exit drafts": layer_skip_failure()}
        assert f"transformers exit drafts: {layer_skip_failure()}" in format_lossless(report)


@pytest.mark.parametrize("value", ["4", "0:2", "4:x", "4:3:0", "4:3:1:2"])
def test_bench_lossless_refuses_bad_lookup_settings(value):
    from ee_transformers.tools.bench.lossless import LosslessConfig

    with pytest.raises(ValueError, match="`lookup` takes N:G pairs"):
        LosslessConfig(lookup=[value])


def test_rows_that_ended_leave_the_forward_and_the_rest_is_unchanged(models):
    model, base = models("llama")
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 30, 41, 52, 63, 74, 85, 96], [5, 6, 7, 8, 5, 6, 7, 8]]
    ids = torch.tensor(prompts)
    counter = LayerCalls(model)
    try:
        out = model.generate(
            ids, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=3, return_dict_in_generate=True
        )
    finally:
        counter.remove()
    assert torch.equal(out.sequences, base.generate(ids, max_new_tokens=40, do_sample=False))
    rounds = out.verify_rounds.tolist()
    assert len(set(rounds)) > 1  # rows finished after different numbers of rounds
    rows = counter.call_rows[LAYERS - 1][1:]
    # a row that has ended is dropped once a quarter of the live rows have (here: at the first)
    assert rows[: min(rounds)] == [3] * min(rounds) and rows[-1] < 3
    assert sum(rows) == sum(rounds)  # every row of every forward was still going: none ran after its end


def test_settings_of_the_call_win_over_stored_draft_settings(models):
    model, base = models("llama")
    ids, mask = padded_batch(batch=2)
    model.generation_config.prompt_lookup_num_tokens = 3
    try:
        # confident exits asked in the call: they run (every token exits at layer 0), the stored drafts give way
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, exit_criterion="max_prob", exit_threshold=0.0,
            exit_check_layers=[0], return_dict_in_generate=True,
        )  # fmt: skip
        assert set(out.exit_layers.unique().tolist()) == {0}
        # full depth asked: plain greedy at batch 2 (transformers' own prompt lookup would refuse batch 2)
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=6, early_exit=False)
        assert torch.equal(plain, base.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
        # both in one call: refused
        with pytest.raises(ValueError, match="cannot be combined with `exit_threshold`"):
            model.generate(ids, attention_mask=mask, max_new_tokens=6, prompt_lookup_num_tokens=2, exit_threshold=0.5)
    finally:
        model.generation_config.prompt_lookup_num_tokens = None


def test_benchmarks_time_only_the_draft_sources_a_row_names(models):
    from ee_transformers.tools.bench.timing import only_these_drafts

    model, _ = models("llama")
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    model.generation_config.prompt_lookup_num_tokens = 3
    try:
        kwargs = dict(max_new_tokens=10, return_dict_in_generate=True, assistant_confidence_threshold=0.0)
        kwargs["speculative_gate"] = False  # every round drafts: the sources below are what is compared
        # transformers' semantics: a stored setting the call leaves unset joins in
        both = model.generate(ids, assistant_early_exit=2, **kwargs)
        assert int(both.context_draft_tokens.sum()) > 0
        # a benchmark row that names exit drafts times exit drafts only
        exit_only = model.generate(ids, **{**only_these_drafts(dict(assistant_early_exit=2)), **kwargs})
        assert int(exit_only.context_draft_tokens.sum()) == 0 and int(exit_only.draft_tokens.sum()) > 0
        assert only_these_drafts({"exit_threshold": 0.5}) == {"exit_threshold": 0.5}  # no drafts named: unchanged
    finally:
        model.generation_config.prompt_lookup_num_tokens = None


def test_a_lean_model_decodes_at_its_depth_despite_stored_draft_settings(base_dirs, tmp_path):
    """Stored drafts need every layer to verify: a lean model of the folder decodes at its loaded depth (a warning
    says so), while drafts asked for in the call still raise."""
    model = eet.from_base(base_dirs["llama"][0], exit_layers=[0, 1, 2]).eval()
    model.generation_config.prompt_lookup_num_tokens = 2
    model.save_pretrained(tmp_path)
    lean = eet.EarlyExitLlamaForCausalLM.from_pretrained(tmp_path, exit_max_layer=1).eval()
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    counter = LayerCalls(lean)
    out = lean.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    counter.remove()
    assert counter.calls[2:] == [0, 0] and (out.exit_layers == 1).all()
    with pytest.raises(ValueError, match="holds decoder layers 0..1 only"):
        lean.generate(ids, max_new_tokens=2, prompt_lookup_num_tokens=2)
