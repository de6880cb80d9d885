"""Issue 20: table drafts (`speculative_table_drafts=True`): rows whose own text offers no match draft from a stored
table of frequent continuations, verified at full depth like every copied draft."""

import pytest
import torch
from conftest import LayerCalls, chi_square_p, make_base, padded_batch
from helpers import STATIC_REFUSAL, models_per_family, refused_before_decoding, sliding_window, static_cache_refused

import ee_transformers as eet
from ee_transformers.draft_table import build_draft_table, table_drafts

LAYERS = 4


@pytest.fixture(scope="module")
def models(base_dirs):
    """{family: (early-exit model storing a table of its base's own greedy text, base)}, built once per module."""

    def store_table(model, base):
        ids, mask = padded_batch(batch=3)
        text = base.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        model.set_draft_table(text, min_count=1)  # (pads included: a table only proposes drafts)

    return models_per_family(base_dirs, store_table)


# --- the table -------------------------------------------------------------------------------------------------------


def test_the_table_keeps_each_contexts_most_frequent_continuation():
    v = 10
    keys, following = build_draft_table([[1, 2, 3, 1, 2, 3, 1, 2, 4], [5, 1, 2, 4, 7]], v, min_count=2)
    table = {int(k): int(n) for k, n in zip(keys, following)}
    # pair (1, 2) was followed by 3 twice and 4 twice: the tie goes to the lower id; (2, 3) -> 1 twice
    assert table[1 * v + 2] == 3 and table[2 * v + 3] == 1
    # single tokens: 1 -> 2 four times, 2 -> 3 / 4 twice each (tie: 3), 3 -> 1 twice
    assert table[v * v + 1] == 2 and table[v * v + 2] == 3 and table[v * v + 3] == 1
    assert 5 * v + 1 not in table and v * v + 4 not in table  # seen once: below min_count
    assert keys.tolist() == sorted(keys.tolist())  # lookups search the keys
    keys, _ = build_draft_table([[1, 2, 3]], v, min_count=1)
    assert keys.tolist() == [1 * v + 2, v * v + 1, v * v + 2]
    with pytest.raises(ValueError, match=r"`min_count` must be an integer >= 1, got 0"):
        build_draft_table([[1, 2, 3]], v, min_count=0)
    with pytest.raises(ValueError, match=r"`blocks` must hold token ids in \[0, 10\)"):
        build_draft_table([[1, 2, 30]], v)


def test_table_drafts_chain_from_each_rows_last_two_tokens():
    v = 10
    keys, following = build_draft_table([[1, 2, 3, 4, 5], [7, 2, 8], [6, 2]], v, min_count=1)
    tokens = torch.tensor([[0, 1, 2, 0], [9, 7, 2, 0], [0, 9, 9, 0], [0, 5, 2, 0]])
    length = torch.tensor([3, 3, 3, 3])
    drafts, counts = table_drafts(keys, following, tokens, length, torch.tensor([3, 3, 3, 2]), v)
    # row 0: (1, 2) -> 3, (2, 3) -> 4, (3, 4) -> 5; row 1: (7, 2) -> 8, then nothing follows 8
    # row 2: nothing follows 9; row 3: the pair (5, 2) is unknown, the single token 2 -> 3 (tie 3 / 8: 3), budget 2
    assert counts.tolist() == [3, 1, 0, 2]
    assert drafts[0].tolist() == [3, 4, 5] and drafts[1, 0] == 8 and drafts[3, :2].tolist() == [3, 4]
    empty = torch.zeros(0, dtype=torch.long)
    assert table_drafts(empty, empty, tokens, length, torch.tensor([3, 3, 3, 2]), v)[1].tolist() == [0] * 4


# --- exactness and what it saves -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_table_drafts_equal_full_depth_greedy(models, family, cache_implementation):
    model, base = models(family)
    ids, mask = padded_batch(batch=3)
    kwargs = dict(max_new_tokens=20, do_sample=False, cache_implementation=cache_implementation)
    if sliding_window(base):  # the matrix's window (4) is shorter than the generation: refused, not decoded wrongly
        with pytest.raises(ValueError, match="prompt_lookup_num_tokens.*sliding-window attention"):
            model.generate(
                ids, attention_mask=mask, prompt_lookup_num_tokens=3, speculative_table_drafts=True, **kwargs
            )
        return
    sources = (
        dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=3),
        dict(prompt_lookup_num_tokens=2, assistant_early_exit=2, num_assistant_tokens=2),  # exit drafts for the rest
    )
    if static_cache_refused(cache_implementation):  # transformers before 5.24 cannot crop static layers
        for source in sources:
            with pytest.raises(ValueError, match=STATIC_REFUSAL):
                model.generate(ids, attention_mask=mask, speculative_table_drafts=True, **kwargs, **source)
        return
    expected = base.generate(ids, attention_mask=mask, **kwargs)
    for source in sources:
        out = model.generate(
            ids, attention_mask=mask, return_dict_in_generate=True, speculative_table_drafts=True, **kwargs, **source,
            speculative_gate=False, speculative_history_tokens=0,  # the table's drafts in every round
        )  # fmt: skip
        assert torch.equal(out.sequences, expected), source
        assert (out.table_accepted_tokens <= out.table_draft_tokens).all()
        assert (out.table_draft_tokens <= out.context_draft_tokens).all()
        assert int(out.table_accepted_tokens.sum()) > 0  # the table holds the model's own text: drafts were right


def test_accepted_table_drafts_save_full_steps(models):
    model, base = models("llama")
    ids, mask = padded_batch(batch=3)
    new = 24
    kwargs = dict(max_new_tokens=new, do_sample=False, prompt_lookup_num_tokens=3, return_dict_in_generate=True)
    kwargs.update(speculative_gate=False, speculative_history_tokens=0)  # two calls compared round for round
    context_only = model.generate(ids, attention_mask=mask, **kwargs)
    counter = LayerCalls(model)
    try:
        out = model.generate(ids, attention_mask=mask, speculative_table_drafts=True, **kwargs)
    finally:
        counter.remove()
    assert torch.equal(out.sequences, context_only.sequences)
    rounds = len(out.draft_lengths)
    assert counter.calls == [1 + rounds] * LAYERS  # prefill + one forward of every layer a round
    assert rounds < len(context_only.draft_lengths)  # the table's drafts saved rounds the context alone could not
    assert int(out.table_accepted_tokens.sum()) > 0
    # a row's forwards saved are its accepted drafts: rounds + accepted = tokens after the prefill's
    assert (out.verify_rounds + out.accepted_tokens <= new - 1).all()


def test_sampling_with_table_drafts_follows_the_full_models_distribution(tmp_path):
    vocab, rows = 8, 6000
    base = make_base("llama", vocab_size=vocab, eos_token_id=None, pad_token_id=0, bos_token_id=1)
    with torch.no_grad():
        base.lm_head.weight.mul_(6.0)  # peaked distributions: table drafts are often, not always, right
    base.save_pretrained(tmp_path)
    model = eet.from_base(tmp_path, exit_layers=[0, 1, 2]).eval()
    model.set_draft_table(base.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=40, do_sample=False), 1)
    ids = torch.tensor([[5, 3, 7, 2]]).repeat(rows, 1)  # nothing repeats: every draft comes from the table
    kwargs = dict(max_new_tokens=3, do_sample=True, temperature=0.9, pad_token_id=0)

    def pairs(out):
        new = out[:, ids.shape[1] :]
        return new[:, 1] * vocab + new[:, 2]

    torch.manual_seed(0)
    plain = pairs(model.generate(ids, **kwargs))
    out = model.generate(
        ids,
        prompt_lookup_num_tokens=2,
        max_matching_ngram_size=1,
        speculative_table_drafts=True,
        speculative_gate=False,
        return_dict_in_generate=True,
        **kwargs,
    )  # no gate: a new model's first rounds decode plainly to time the plain width, and this call has two
    rate = float(out.table_accepted_tokens.sum() / out.table_draft_tokens.sum())
    assert 0.05 < rate < 0.95, rate  # the rule is exercised both ways
    assert chi_square_p(plain, pairs(out.sequences)) > 1e-3


# --- storing ---------------------------------------------------------------------------------------------------------


def test_a_stored_table_and_setting_survive_a_remote_code_reload(models, tmp_path):
    from transformers import AutoModelForCausalLM

    model, base = models("llama")
    model.generation_config.prompt_lookup_num_tokens = 3
    model.generation_config.speculative_table_drafts = True
    try:
        model.save_pretrained(tmp_path)
    finally:
        model.generation_config.prompt_lookup_num_tokens = None
        del model.generation_config.speculative_table_drafts
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert loaded.config.draft_table_size == model.config.draft_table_size
    assert torch.equal(loaded.draft_table_keys, model.draft_table_keys)
    assert torch.equal(loaded.draft_table_next, model.draft_table_next)
    ids, mask = padded_batch(batch=3)
    out = loaded.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    assert int(out.table_draft_tokens.sum()) > 0  # a plain generate used the stored setting
    assert torch.equal(out.sequences, base.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False))


def test_set_draft_table_refuses_text_with_nothing_to_store(models):
    model, _ = models("llama")
    with pytest.raises(ValueError, match=r"hold no continuation seen `min_count`=2 times"):
        model.set_draft_table([[3, 4, 5, 6]])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_lookup_num_tokens=3, speculative_table_drafts="yes"), r"must be True, False or None, got 'yes'"),
        (dict(prompt_lookup_num_tokens=3, speculative_table_drafts=1), r"must be True, False or None, got 1"),
        (dict(assistant_early_exit=2, speculative_table_drafts=True), r"needs `prompt_lookup_num_tokens`"),
        (dict(speculative_table_drafts=True), r"`speculative_table_drafts` is a setting of speculative decoding"),
    ],
)
def test_bad_table_arguments_raise_before_decoding(models, kwargs, match):
    refused_before_decoding(models("llama")[0], match, **kwargs)


def test_table_drafts_without_a_stored_table_raise_before_decoding(base_dirs):
    model = eet.from_base(base_dirs["llama"][0], exit_layers=[0, 1, 2]).eval()
    refused_before_decoding(
        model, r"needs a draft table stored in the model.*set_draft_table", prompt_lookup_num_tokens=3,
        speculative_table_drafts=True,
    )  # fmt: skip


# --- fitting, calibration, the benchmark ------------------------------------------------------------------------------


def test_fitting_stores_the_fitting_datas_table(base_dirs):
    from ee_transformers.training.fit_exit_heads import FitConfig, fit_exit_heads

    folder, _ = base_dirs["llama"]
    blocks = torch.randint(2, 12, (4, 16), generator=torch.Generator().manual_seed(0))  # 10 tokens: pairs repeat
    model = eet.from_base(folder, exit_layers=[1])
    fit_exit_heads(model, blocks, config=FitConfig(steps=1, batch_size=2, progress=False))
    keys, following = build_draft_table(blocks, model.config.vocab_size)
    assert model.config.draft_table_size == keys.numel() > 0
    assert torch.equal(model.draft_table_keys.cpu(), keys) and torch.equal(model.draft_table_next.cpu(), following)
    model = eet.from_base(folder, exit_layers=[1])
    fit_exit_heads(model, blocks, config=FitConfig(steps=1, batch_size=2, draft_table=False, progress=False))
    assert model.config.draft_table_size is None and not hasattr(model, "draft_table_keys")


def test_lossless_calibration_times_table_drafts_when_a_table_is_stored():
    from ee_transformers.training import calibrate_lossless as lossless

    config = lossless.LosslessCalibrationConfig(lookup_tokens=[2, 4], ngram_sizes=[3])
    with_table = lossless.lossless_candidates(config, stored_table=True)
    assert [k.get("speculative_table_drafts") for k in with_table] == [None, None, True, True]
    assert all("speculative_table_drafts" not in k for k in lossless.lossless_candidates(config))
    off = lossless.LosslessCalibrationConfig(lookup_tokens=[2], ngram_sizes=[3], table_drafts=False)
    assert len(lossless.lossless_candidates(off, stored_table=True)) == 1
    assert "speculative_table_drafts" in lossless.STORED_FIELDS


def test_bench_lossless_times_context_rows_with_table_drafts(models):
    from ee_transformers.tools.bench import plain_twin, random_prompts
    from ee_transformers.tools.bench.lossless import LosslessConfig, run_lossless

    model, _ = models("llama")
    config = LosslessConfig(
        batch_sizes=[1, 2], num_prompts=2, prompt_tokens=8, new_tokens=8, rounds=1, threads=1, lookup=["2:3"],
        table_drafts=True, heuristic_schedule=True,
    )  # fmt: skip
    report = run_lossless(model, plain_twin(model), random_prompts(99, 2, 8), config, log=lambda *_: None)
    rows = {(r["batch_size"], r["who"], r["name"]) for r in report["results"]}
    assert {
        (1, "ours", "prompt lookup N=2 G=3, table drafts"),
        (2, "ours", "prompt lookup N=2 G=3, table drafts"),
    } <= rows
    assert (2, "ours", "prompt lookup N=2 G=3, table drafts, heuristic") in rows
    heuristic = [r for r in report["results"] if r["name"].endswith("heuristic")]
    assert len(heuristic) == 4 and all(r["kwargs"]["num_assistant_tokens_schedule"] == "heuristic" for r in heuristic)
    assert all(r["identical"] for r in report["results"])


def test_bench_lossless_table_from_a_text_file_and_a_missing_one(base_dirs, tmp_path):
    from helpers import numbered_tokenizer

    from ee_transformers.tools.arguments import InputError
    from ee_transformers.tools.bench.lossless import store_table_from

    model = eet.from_base(base_dirs["llama"][0], exit_layers=[0, 1, 2]).eval()
    text = tmp_path / "text.txt"
    text.write_text("w5 w6 w7 w5 w6 w8 w5 w6 w7")
    entries, tokens = store_table_from(model, numbered_tokenizer(), str(text))
    keys, _ = build_draft_table([[5, 6, 7, 5, 6, 8, 5, 6, 7]], model.config.vocab_size)
    assert (entries, tokens) == (keys.numel(), 9) and torch.equal(model.draft_table_keys, keys)
    with pytest.raises(InputError, match=r"`--table-from` must be 'training', 'austen', 'python' or a text file"):
        store_table_from(model, None, str(tmp_path / "none.txt"))


def test_a_passed_copy_of_the_stored_config_decodes_at_full_depth_when_asked(models):
    """A stored table setting in a copy of `model.generation_config` is the stored setting, not a stray argument:
    `early_exit=False` (or the draft sources turned off) decodes at full depth instead of raising."""
    import copy

    model, base = models("llama")
    ids, mask = padded_batch(batch=2)
    model.generation_config.prompt_lookup_num_tokens = 2
    model.generation_config.speculative_table_drafts = True
    try:
        config = copy.deepcopy(model.generation_config)
        config.update(max_new_tokens=6, do_sample=False)
        expected = base.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(
            model.generate(ids, attention_mask=mask, generation_config=config, early_exit=False), expected
        )
        with pytest.raises(ValueError, match="`speculative_table_drafts` is a setting of speculative decoding"):
            config.speculative_table_drafts = False  # differs from the stored value: given in this call
            model.generate(ids, attention_mask=mask, generation_config=config, early_exit=False)
    finally:
        model.generation_config.prompt_lookup_num_tokens = None
        del model.generation_config.speculative_table_drafts
