"""Issue 11: lossless self-speculative decoding from the exit heads (`generate(assistant_early_exit=...)`)."""

import pytest
import torch
from conftest import LayerCalls, chi_square_p, make_base, padded_batch
from helpers import STATIC_REFUSAL, Collect, ee_model, static_cache_refused
from transformers import StoppingCriteria, StoppingCriteriaList

import ee_transformers as eet
import ee_transformers.speculative_early_exit as spec
from ee_transformers.compat import layer_skip_failure
from ee_transformers.tools.bench import plain_twin, random_prompts
from ee_transformers.tools.bench import speculative as bench_speculative
from ee_transformers.tools.bench.speculative import pass_through_above  # a copy: layers above E add nothing

LAYERS = 4  # tiny models: 4 decoder layers, exits after 0, 1, 2
NEVER_STOP = dict(assistant_confidence_threshold=0.0)  # draft all K tokens every round


def speculative(model, ids, mask=None, drafters=2, k=3, **kwargs):
    return model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        assistant_early_exit=drafters,
        num_assistant_tokens=k,
        return_dict_in_generate=True,
        **kwargs,
    )


# --- greedy: identical to full depth ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_greedy_equals_full_depth_greedy(base_dirs, family, cache_implementation):
    folder, base = base_dirs[family]
    model = ee_model(base_dirs, family)
    ids, mask = padded_batch(batch=3)
    kwargs = dict(max_new_tokens=12, cache_implementation=cache_implementation)
    if getattr(base.config, "sliding_window", None) and getattr(base.config, "use_sliding_window", True):
        # the matrix's window (4) is shorter than the generation: refused with a clear error rather than decoded
        # wrongly (generations inside the window are tested on their own)
        with pytest.raises(ValueError, match="sliding-window attention needs the whole generation inside the window"):
            speculative(model, ids, mask, 2, 2, **kwargs)
        return
    if static_cache_refused(cache_implementation):  # transformers before 5.24 cannot crop static layers
        with pytest.raises(ValueError, match=STATIC_REFUSAL):
            speculative(model, ids, mask, 2, 2, **kwargs)
        return
    expected = base.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    for drafters, k, extra in [
        (1, 3, NEVER_STOP),
        (3, 4, NEVER_STOP),
        (2, 2, {}),  # {}: transformers' default 0.4
        (2, 1, dict(num_assistant_tokens_schedule="heuristic", **NEVER_STOP)),
    ]:
        out = speculative(model, ids, mask, drafters, k, **kwargs, **extra)
        assert torch.equal(out.sequences, expected), (drafters, k, extra)
        assert set(out.exit_layers.unique().tolist()) <= {LAYERS - 1, -1}  # the final head decides (-1: ended)
        assert (out.accepted_tokens <= out.draft_tokens).all()


def test_greedy_with_logits_processors_sees_each_rows_own_prefix(base_dirs):
    # repetition penalty and n-gram blocking read the whole prefix, min_new_tokens its length: rows of different
    # lengths (ragged) must each be processed on their own prefix, drafts included, as plain generate does
    folder, base = base_dirs["qwen2"]
    model = ee_model(base_dirs, "qwen2")
    ids, mask = padded_batch(batch=3)
    processing = dict(repetition_penalty=1.8, no_repeat_ngram_size=2, min_new_tokens=6, max_new_tokens=14)
    expected = base.generate(ids, attention_mask=mask, do_sample=False, **processing)
    out = speculative(model, ids, mask, 1, 3, **processing, **NEVER_STOP)
    assert torch.equal(out.sequences, expected)
    assert out.accepted_tokens.unique().numel() > 1  # the rows did advance by different amounts


def test_ragged_rows_equal_their_prompts_alone_with_eos_and_stopping_criteria(base_dirs):
    model = ee_model(base_dirs, "llama")
    prompts = [[5, 17, 33], [8, 9, 10, 11, 12, 13, 14], [40, 41], [60, 7, 7, 3, 21]]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):  # left padding
        ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
    free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    eos = int(free[2, width + 3])  # row 2's fourth token ends it (and any other row that reaches that token)
    stop_token = int(free[0, width + 6])

    class StopAfter(StoppingCriteria):  # a user criterion: a row stops once its last token is `stop_token`
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == stop_token

    kwargs = dict(
        max_new_tokens=16, eos_token_id=eos, pad_token_id=0, stopping_criteria=StoppingCriteriaList([StopAfter()])
    )
    plain = model.generate(ids, attention_mask=mask, do_sample=False, early_exit=False, **kwargs)
    out = speculative(model, ids, mask, 1, 4, **kwargs, **NEVER_STOP)
    assert torch.equal(out.sequences, plain)
    for r, p in enumerate(prompts):  # each row, its prompt alone, unpadded
        alone = speculative(model, torch.tensor([p]), None, 1, 4, **kwargs, **NEVER_STOP).sequences[0, len(p) :]
        row = out.sequences[r, width:]
        assert torch.equal(row[: alone.numel()], alone), r
        assert (row[alone.numel() :] == 0).all()  # padding after the row's own end
    assert out.accepted_tokens.unique().numel() > 1  # ragged: rows accepted different numbers of drafts
    ends = (out.exit_layers >= 0).sum(-1)
    assert ends[2] <= 4 < ends.max()  # EOS ended row 2 by its fourth token, others went on


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_gaps_in_the_cache_are_compacted_away_exactly(base_dirs, monkeypatch, cache_implementation):
    # long enough for gaps to pile up past a quarter of the cache (dynamic) or for a static cache to fill up
    folder, base = base_dirs["llama"]
    model = ee_model(base_dirs, "llama")
    compactions = []
    real = spec.RaggedBatch.compact
    monkeypatch.setattr(
        spec.RaggedBatch, "compact", lambda self, *args: (compactions.append(self.slots.shape[1]), real(self, *args))[1]
    )
    ids, mask = padded_batch(batch=4, length=6)
    kwargs = dict(max_new_tokens=40, cache_implementation=cache_implementation)
    if static_cache_refused(cache_implementation):  # transformers before 5.24 cannot crop static layers
        with pytest.raises(ValueError, match=STATIC_REFUSAL):
            speculative(model, ids, mask, 2, 4, **kwargs, **NEVER_STOP)
        return
    out = speculative(model, ids, mask, 2, 4, **kwargs, **NEVER_STOP)
    assert torch.equal(out.sequences, base.generate(ids, attention_mask=mask, do_sample=False, **kwargs))
    assert compactions, "no compaction happened: the test does not cover it"


# --- what runs where ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
def test_shallow_layers_run_once_per_token_and_deep_layers_only_in_verification(base_dirs, batch):
    model = ee_model(base_dirs, "qwen3")
    ids, mask = padded_batch(batch=batch)
    counter = LayerCalls(model)
    out = speculative(model, ids, mask, drafters=2, k=3, max_new_tokens=12, **NEVER_STOP)
    counter.remove()
    prompt, exit_layer = ids.shape[1], 1
    rounds = out.draft_lengths.numel()
    fed = int((out.draft_lengths + 1).sum())  # each round feeds the last token and its drafts, once
    # every fed token once, in every layer (rows that ended early leave later forwards: RaggedBatch.retire)
    assert len(set(counter.positions)) == 1 and counter.positions[0] <= batch * (prompt + fed)
    assert batch > 1 or counter.positions[0] == prompt + fed
    assert counter.calls[: exit_layer + 1] == [1 + fed] * (exit_layer + 1)  # prefill + one call per fed token
    assert counter.calls[exit_layer + 1 :] == [1 + rounds] * (LAYERS - exit_layer - 1)  # prefill + one per round
    if batch == 1:  # fed = the tokens committed after the first (all but the last) + the rejected drafts
        new = out.sequences.shape[1] - prompt
        rejected = int(out.draft_tokens - out.accepted_tokens)
        assert fed == (new - 1) + rejected
        assert new == 1 + int(out.accepted_tokens) + int(out.verify_rounds)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_forced_full_acceptance_accepts_every_draft(base_dirs, cache_implementation):
    model = pass_through_above(ee_model(base_dirs, "mistral"), exit_layer=1)
    ids, mask = padded_batch(batch=3)
    if static_cache_refused(cache_implementation):  # transformers before 5.24 cannot crop static layers
        with pytest.raises(ValueError, match=STATIC_REFUSAL):
            speculative(model, ids, mask, 2, 3, max_new_tokens=13, cache_implementation=cache_implementation)
        return
    counter = LayerCalls(model)
    out = speculative(
        model, ids, mask, drafters=2, k=3, max_new_tokens=13, cache_implementation=cache_implementation, **NEVER_STOP
    )
    counter.remove()
    assert torch.equal(out.accepted_tokens, out.draft_tokens)
    assert out.acceptance_rate.tolist() == [1.0] * 3
    assert out.draft_lengths.tolist() == [3, 3, 3]  # 1 + 3 rounds x 4 tokens = 13
    assert counter.calls[2:] == [1 + 3, 1 + 3]
    plain = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=13,
        early_exit=False,
        cache_implementation=cache_implementation,
    )
    assert torch.equal(out.sequences, plain)


# --- sampling: the full model's distribution -------------------------------------------------------------------------


def test_sampling_follows_the_full_models_distribution(tmp_path, monkeypatch):
    vocab, rows = 8, 6000
    base = make_base("llama", vocab_size=vocab, eos_token_id=None, pad_token_id=0, bos_token_id=1)
    with torch.no_grad():
        base.lm_head.weight.mul_(8.0)  # peaked distributions, so that a draft head that differs is often rejected
    base.save_pretrained(tmp_path)
    model = eet.from_base(tmp_path, exit_layers=[0, 1, 2]).eval()
    torch.manual_seed(7)
    with torch.no_grad():
        model.exit_heads[0].norm.weight.mul_(torch.rand(model.config.hidden_size) * 2 + 0.2)
    ids = torch.tensor([[3, 4, 5, 6]]).repeat(rows, 1)  # one prompt, many independent rows
    kwargs = dict(max_new_tokens=3, do_sample=True, temperature=0.9, top_k=6, pad_token_id=0)

    def pairs(out):  # tokens 2 and 3 come from drafts, rejections and bonus tokens; token 1 from the prefill
        new = out[:, ids.shape[1] :]
        return new[:, 1] * vocab + new[:, 2]

    torch.manual_seed(0)
    plain = pairs(model.generate(ids, **kwargs))
    out = model.generate(
        ids, assistant_early_exit=1, num_assistant_tokens=2, return_dict_in_generate=True, **NEVER_STOP, **kwargs
    )
    rate = float(out.acceptance_rate.mean())
    assert 0.2 < rate < 0.95, rate  # drafts are often, not always, rejected: the rule is exercised
    assert chi_square_p(plain, pairs(out.sequences)) > 1e-3

    # the test has the power to see the classic mistake: resampling from p, not max(p - q, 0), after a rejection
    right = spec.accept_sampled

    def from_p_after_rejection(p, q, drafts, valid=None):
        accepted, _ = right(p, q, drafts, valid)
        return accepted, torch.multinomial(p[torch.arange(p.shape[0]), accepted], 1).squeeze(1)

    monkeypatch.setattr(spec, "accept_sampled", from_p_after_rejection)
    wrong = model.generate(ids, assistant_early_exit=1, num_assistant_tokens=2, **NEVER_STOP, **kwargs)
    assert chi_square_p(plain, pairs(wrong)) < 1e-6


# --- adaptive draft length -------------------------------------------------------------------------------------------


def test_confidence_threshold_and_learned_head_stop_drafting(base_dirs):
    model = pass_through_above(ee_model(base_dirs, "llama"), exit_layer=2)
    ids, mask = padded_batch(batch=2)
    run = lambda **kw: speculative(model, ids, mask, drafters=3, k=4, max_new_tokens=11, **kw).draft_lengths.tolist()
    assert run(assistant_confidence_threshold=0.0) == [4, 4]
    assert run(assistant_confidence_threshold=1.0) == [1] * 5  # no draft of a random tiny model has max_prob 1
    model.add_confidence_heads()  # with a learned head the model's own confidence decides, not max_prob
    with torch.no_grad():
        model.confidence_heads[2].proj.bias.fill_(10.0)
    assert run(assistant_confidence_threshold=0.9) == [4, 4]
    with torch.no_grad():
        model.confidence_heads[2].proj.bias.fill_(-10.0)
    assert run(assistant_confidence_threshold=0.1) == [1] * 5


def test_heuristic_schedule_grows_with_acceptance_and_shrinks_without(base_dirs):
    model = pass_through_above(ee_model(base_dirs, "llama"), exit_layer=1)
    ids, mask = padded_batch(batch=2)
    out = speculative(
        model, ids, mask, drafters=2, k=1, max_new_tokens=15, num_assistant_tokens_schedule="heuristic", **NEVER_STOP
    )
    assert out.draft_lengths.tolist() == [1, 3, 5, 1]  # every draft accepted: K grows by 2; the last round is cut to
    # the 2 tokens left (1 + 2 + 4 + 6 + 2 = 15)
    with torch.no_grad():  # a draft head that is always wrong: its logits negated
        model.exit_heads[1].norm.weight.neg_()
    out = speculative(
        model, ids, mask, drafters=2, k=4, max_new_tokens=8, num_assistant_tokens_schedule="heuristic", **NEVER_STOP
    )
    assert out.draft_lengths.tolist()[:4] == [4, 3, 2, 1]
    assert int(out.accepted_tokens.sum()) == 0


# --- outputs and stats -----------------------------------------------------------------------------------------------


def test_scores_logits_streamer_and_stats(base_dirs):
    folder, base = base_dirs["llama"]
    model = ee_model(base_dirs, "llama")
    ids, mask = padded_batch(batch=2)
    kwargs = dict(
        max_new_tokens=9, output_scores=True, output_logits=True, return_dict_in_generate=True, repetition_penalty=1.3
    )
    plain = base.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        assistant_early_exit=1,
        num_assistant_tokens=3,
        **kwargs,
        **NEVER_STOP,
    )
    assert torch.equal(out.sequences, plain.sequences)
    assert len(out.scores) == len(plain.scores) == len(out.logits) == 9
    for ours, theirs in zip(out.scores + out.logits, plain.scores + plain.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)

    stats = eet.ExitStats.from_generate(out, model)
    assert stats.draft_tokens == int(out.draft_tokens.sum()) and stats.accepted_tokens == int(out.accepted_tokens.sum())
    assert stats.acceptance_rate == pytest.approx(stats.accepted_tokens / stats.draft_tokens)
    assert stats.mean_accepted_length == pytest.approx(stats.accepted_tokens / stats.verify_rounds)
    assert "drafts accepted" in str(stats) and stats.mean_exit_layer == LAYERS - 1
    full_depth = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=3, return_dict_in_generate=True
    )
    assert "drafts accepted" not in str(eet.ExitStats.from_generate(full_depth, model))

    streamer = Collect()
    single = model.generate(
        ids[1:],
        max_new_tokens=9,
        do_sample=False,
        assistant_early_exit=1,
        num_assistant_tokens=3,
        streamer=streamer,
        **NEVER_STOP,
    )
    assert streamer.ended and torch.equal(streamer.chunks[0].flatten(), ids[1])
    assert torch.cat([c.flatten() for c in streamer.chunks[1:]]).tolist() == single[0, ids.shape[1] :].tolist()


def test_stored_defaults_and_their_round_trip(base_dirs, tmp_path):
    folder, base = base_dirs["qwen2"]
    model = ee_model(base_dirs, "qwen2")
    ids, mask = padded_batch(batch=2)
    expected = base.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    model.generation_config.assistant_early_exit = 2
    model.generation_config.num_assistant_tokens = 3
    model.generation_config.assistant_confidence_threshold = 0.0
    model.save_pretrained(tmp_path)
    loaded = eet.EarlyExitQwen2ForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.generation_config.assistant_early_exit == 2
    out = loaded.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, return_dict_in_generate=True)
    assert isinstance(out, spec.GenerateSpeculativeOutput) and out.draft_lengths.max() == 3
    assert torch.equal(out.sequences, expected)
    # an explicit None turns the stored mode off (transformers' meaning of a None kwarg)
    off = loaded.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=8,
        assistant_early_exit=None,
        return_dict_in_generate=True,
    )
    assert not isinstance(off, spec.GenerateSpeculativeOutput) and torch.equal(off.sequences, expected)
    # stored confident-exit defaults do not mix in: the speculative output stays exact
    loaded.set_exit_defaults(exit_criterion="max_prob", exit_threshold=0.0)
    again = loaded.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    assert torch.equal(again, expected)


# --- bad input -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(assistant_early_exit=4), r"assistant_early_exit.*allowed values are \[1, 3\]"),  # 4 = every layer
        (dict(assistant_early_exit=2), r"allowed values are \[1, 3\]"),  # no exit after layer 1
        (dict(assistant_early_exit=True), "assistant_early_exit"),
        (dict(assistant_early_exit=1, num_assistant_tokens=0), "num_assistant_tokens.*>= 1"),
        (dict(assistant_early_exit=1, num_assistant_tokens_schedule="fast"), "num_assistant_tokens_schedule"),
        (dict(assistant_early_exit=1, assistant_confidence_threshold=1.5), "assistant_confidence_threshold"),
        (dict(assistant_early_exit=1, num_beams=2), "beam search"),
        (dict(assistant_early_exit=1, exit_criterion="max_prob", exit_threshold=0.5), "exit_criterion"),
        (dict(assistant_early_exit=1, exit_threshold=0.5), "exit_threshold"),
        (dict(assistant_early_exit=1, early_exit=False), "early_exit"),
        (dict(assistant_early_exit=1, output_hidden_states=True), "output_hidden_states"),
        (dict(assistant_early_exit=1, streamer=Collect()), "streamer"),
    ],
)
def test_bad_speculative_arguments(base_dirs, kwargs, match):
    model = ee_model(base_dirs, exit_layers=(0, 2))
    ids, mask = padded_batch(batch=2)
    with pytest.raises(ValueError, match=match):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, **kwargs)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_sliding_window_attention_inside_the_window(tmp_path, cache_implementation):
    # the window counts cache slots: it is held like a static cache of window - 1 slots, so gaps never push a token out
    base = make_base("mistral", sliding_window=24)
    base.save_pretrained(tmp_path)
    model = eet.from_base(tmp_path, exit_layers=[1]).eval()
    ids, mask = padded_batch(batch=3)
    kwargs = dict(max_new_tokens=17, cache_implementation=cache_implementation)  # 7 + 17 = the window
    expected = base.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    if static_cache_refused(cache_implementation):  # transformers before 5.24 cannot crop static layers
        with pytest.raises(ValueError, match=STATIC_REFUSAL):
            speculative(model, ids, mask, drafters=2, k=4, **kwargs, **NEVER_STOP)
    else:
        out = speculative(model, ids, mask, drafters=2, k=4, **kwargs, **NEVER_STOP)
        assert torch.equal(out.sequences, expected)
    with pytest.raises(ValueError, match="max_length.*sliding_window"):
        model.generate(ids, attention_mask=mask, max_new_tokens=18, assistant_early_exit=2)


# --- the benchmark ---------------------------------------------------------------------------------------------------


def test_cost_model_of_a_round():
    costs = {
        "layer": {1: 1.0, 2: 1.5, 3: 2.0},
        "final_head": {1: 3.0, 2: 3.5, 3: 4.0},
        "draft_head": 3.0,
        "prefill": 10.0,
    }
    # plain: the prefill, then L layer steps and the final head for each of the 6 tokens after the first
    assert bench_speculative.ideal_ms(costs, num_layers=4, new_tokens=7) == 10 + 6 * (4 * 1.0 + 3.0)
    # a round of k = 2 drafts at E = 1: 3 fed tokens x 2 layers, 2 draft heads, 2 layers and the head at 3 positions
    per_round = 3 * 2 * 1.0 + 2 * 3.0 + 2 * 2.0 + 4.0
    assert bench_speculative.ideal_ms(costs, 4, 7, exit_layer=1, draft_lengths=[2, 2]) == 10 + 2 * per_round


def test_benchmark_runs_side_by_side_and_reports(base_dirs):
    model = ee_model(base_dirs, "llama")
    report = bench_speculative.run_benchmark(
        model,
        plain_twin(model),
        random_prompts(99, 2, 8),
        batch_sizes=[1, 2],
        exit_layers=[1],
        ks=[2],
        new_tokens=6,
        forced_rates=[1.0, 0.5],
        cost_repeats=2,
        log=lambda m: None,
    )
    rows = {(r["batch"], r["mode"], r["profile"]): r for r in report["results"]}
    theirs = {(1, "transformers", "heads"), (1, "transformers", "forced 1")}
    if layer_skip_failure() is not None:  # transformers before 5.22: its own exit drafts fail, and the report says so
        theirs = set()
        assert report["not_run"] == {"transformers' assistant_early_exit": layer_skip_failure()}
        assert layer_skip_failure() in bench_speculative.format_table(report)
    assert set(rows) == theirs | {
        (1, "ours", "heads"),
        (1, "ours", "forced 1"),
        (1, "ours", "forced 0.5"),
        (2, "ours", "heads"),
        (2, "ours", "forced 1"),
        (2, "ours", "forced 0.5"),
    }
    assert all(r["identical"] for r in report["results"])
    assert rows[(2, "ours", "forced 1")]["acceptance"] == 1.0 and rows[(1, "ours", "forced 0.5")]["acceptance"] < 1
    assert all(r["ideal_speedup"] > 0 for r in report["results"] if r["mode"] == "ours")
    assert model.generation_config.eos_token_id == 98  # the run's EOS switch-off is undone
    table = bench_speculative.format_table(report)
    assert "| 2 | ours | forced 1 | 1 | 2 | 1.00 |" in table and "realised / ideal >= 0.9" in table
