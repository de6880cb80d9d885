"""Issue 20, item 3: exit-head drafts from a frequent-token draft vocabulary (`assistant_vocab_size`), stored in the
folder; lossless like every draft, and the full LM head never runs while drafting."""

import pytest
import torch
from conftest import chi_square_p, make_base, padded_batch
from helpers import STATIC_REFUSAL, models_per_family, refused_before_decoding, static_cache_refused
from transformers import AutoModelForCausalLM

import ee_transformers as eet
import ee_transformers.speculative_early_exit as spec
from ee_transformers.training.data import frequent_tokens
from ee_transformers.training.fit_exit_heads import FitConfig, fit_exit_heads

VOCAB = 99  # the matrix's tiny models
DRAFT_VOCAB = 40


@pytest.fixture(scope="module")
def models(base_dirs):
    """{family: (early-exit model with a stored draft vocabulary, base)}, built once per module."""

    def store_vocab(model, base):
        ids, _ = padded_batch(batch=8, length=12, seed=3)
        model.set_draft_vocab(frequent_tokens(ids, DRAFT_VOCAB, model.config.vocab_size))

    return models_per_family(base_dirs, store_vocab)


def test_frequent_tokens_are_ordered_by_count_then_id():
    blocks = torch.tensor([[5, 5, 5, 2, 2, 7], [7, 9, 1, 1, 1, 1]])
    assert frequent_tokens(blocks, 4, vocab_size=10).tolist() == [1, 5, 2, 7]
    assert frequent_tokens(blocks, 10, vocab_size=10).tolist() == [1, 5, 2, 7, 9, 0, 3, 4, 6, 8]  # unseen: by id


def test_draft_head_scores_exactly_the_stored_tokens(models, family):
    model, _ = models(family)
    settings = spec.SpeculativeSettings(exit_layer=1, exit_index=1, num_tokens=2, vocab_size=25)
    full_settings = spec.SpeculativeSettings(exit_layer=1, exit_index=1, num_tokens=2)
    h = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        some, _ = spec.draft_head(model, settings, h)
        full, _ = spec.draft_head(model, full_settings, h)
    ids = model.draft_token_ids[:25]
    torch.testing.assert_close(some[:, ids], full[:, ids])  # the copied rows, softcapping included (Gemma)
    outside = torch.ones(full.shape[-1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(some[:, outside]).all()


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_greedy_with_a_draft_vocabulary_equals_full_depth_greedy(models, family, cache_implementation):
    model, base = models(family)
    ids, mask = padded_batch(batch=3)
    kwargs = dict(max_new_tokens=12, do_sample=False, cache_implementation=cache_implementation)
    sources = [
        dict(assistant_early_exit=2, num_assistant_tokens=3, assistant_confidence_threshold=0.0),
        dict(assistant_early_exit=1, num_assistant_tokens=2, prompt_lookup_num_tokens=3),
    ]
    if getattr(base.config, "sliding_window", None) and getattr(base.config, "use_sliding_window", True):
        with pytest.raises(ValueError, match="sliding-window attention"):
            model.generate(ids, attention_mask=mask, assistant_vocab_size=DRAFT_VOCAB, **kwargs, **sources[0])
        return
    if static_cache_refused(cache_implementation):  # transformers before 5.24 cannot crop static layers
        for source in sources:
            with pytest.raises(ValueError, match=STATIC_REFUSAL):
                model.generate(ids, attention_mask=mask, assistant_vocab_size=DRAFT_VOCAB, **kwargs, **source)
        return
    expected = base.generate(ids, attention_mask=mask, **kwargs)
    for source in sources:
        for n in (1, DRAFT_VOCAB):
            out = model.generate(ids, attention_mask=mask, assistant_vocab_size=n, **kwargs, **source)
            assert torch.equal(out, expected), (source, n)


def test_drafting_never_calls_the_full_lm_head(models):
    model, _ = models("llama")
    ids, mask = padded_batch(batch=2)
    calls = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    try:
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=10,
            assistant_early_exit=2,
            num_assistant_tokens=3,
            assistant_confidence_threshold=0.0,
            assistant_vocab_size=DRAFT_VOCAB,
            return_dict_in_generate=True,
        )
    finally:
        hook.remove()
    rounds = len(out.draft_lengths)
    assert rounds >= 2 and int(out.draft_tokens.sum()) > 0
    assert len(calls) == 1 + rounds  # the prefill, then one verification per round: no draft used the full head
    calls.clear()
    hook = model.lm_head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    try:  # the full vocabulary drafts with the full head: one call per draft step besides
        model.generate(ids, attention_mask=mask, max_new_tokens=10, assistant_early_exit=2, num_assistant_tokens=3)
    finally:
        hook.remove()
    assert len(calls) > 1 + rounds


def test_sampling_with_a_draft_vocabulary_follows_the_full_models_distribution(tmp_path):
    vocab, rows = 8, 6000
    base = make_base("llama", vocab_size=vocab, eos_token_id=None, pad_token_id=0, bos_token_id=1)
    with torch.no_grad():
        base.lm_head.weight.mul_(8.0)
    base.save_pretrained(tmp_path)
    model = eet.from_base(tmp_path, exit_layers=[0, 1, 2]).eval()
    model.set_draft_vocab([3, 5, 2, 6])  # the draft head can never propose half of the tokens: q = 0 there
    ids = torch.tensor([[3, 4, 5, 6]]).repeat(rows, 1)
    kwargs = dict(max_new_tokens=3, do_sample=True, temperature=0.9, top_k=6, pad_token_id=0)

    def pairs(out):
        new = out[:, ids.shape[1] :]
        return new[:, 1] * vocab + new[:, 2]

    torch.manual_seed(0)
    plain = pairs(model.generate(ids, **kwargs))
    out = model.generate(
        ids,
        assistant_early_exit=1,
        num_assistant_tokens=2,
        assistant_confidence_threshold=0.0,
        assistant_vocab_size=4,
        return_dict_in_generate=True,
        **kwargs,
    )
    assert 0.1 < float(out.acceptance_rate.mean()) < 0.95
    assert chi_square_p(plain, pairs(out.sequences)) > 1e-3


def test_the_draft_vocabulary_is_saved_and_reloaded_with_remote_code(models, tmp_path):
    model, _ = models("llama")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert loaded.config.draft_vocab_size == DRAFT_VOCAB
    assert torch.equal(loaded.draft_token_ids, model.draft_token_ids)
    ids, mask = padded_batch(batch=2)
    kwargs = dict(max_new_tokens=8, assistant_early_exit=2, num_assistant_tokens=2, assistant_vocab_size=10)
    assert torch.equal(
        loaded.generate(ids, attention_mask=mask, **kwargs), model.generate(ids, attention_mask=mask, **kwargs)
    )


def test_fitting_stores_the_fitting_datas_most_frequent_tokens(base_dirs):
    folder, _ = base_dirs["llama"]
    model = eet.from_base(folder, exit_layers=[1])
    blocks = torch.randint(2, 30, (4, 16), generator=torch.Generator().manual_seed(0))
    fit_exit_heads(model, blocks, config=FitConfig(steps=1, batch_size=2, draft_vocab_size=12, progress=False))
    assert model.config.draft_vocab_size == 12
    assert torch.equal(model.draft_token_ids.cpu(), frequent_tokens(blocks, 12, model.config.vocab_size))
    model = eet.from_base(folder, exit_layers=[1])
    fit_exit_heads(model, blocks, config=FitConfig(steps=1, batch_size=2, draft_vocab_size=0, progress=False))
    assert model.config.draft_vocab_size is None and not hasattr(model, "draft_token_ids")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_lookup_num_tokens=2, assistant_vocab_size=10), r"`assistant_vocab_size`.*needs `assistant_early"),
        (dict(assistant_vocab_size=10), r"`assistant_vocab_size`.*does not decode speculatively"),
        (dict(exit_threshold=0.5, assistant_vocab_size=10), r"`assistant_vocab_size`.*does not decode speculatively"),
        (dict(assistant_early_exit=2, assistant_vocab_size=0), r"`assistant_vocab_size` must be an integer in \[1, 99"),
        (dict(assistant_early_exit=2, assistant_vocab_size=2.5), r"`assistant_vocab_size` must be an integer in"),
        (dict(assistant_early_exit=2, assistant_vocab_size=100), r"must be an integer in \[1, 99\]"),
        (dict(assistant_early_exit=2, assistant_vocab_size=41), r"stores 40 .*allowed values are 1..40"),
    ],
)
def test_bad_draft_vocabulary_arguments_raise_before_decoding(models, kwargs, match):
    refused_before_decoding(models("llama")[0], match, **kwargs)


def test_a_model_without_a_stored_draft_vocabulary_says_how_to_get_one(base_dirs):
    model = eet.from_base(base_dirs["llama"][0], exit_layers=[0, 1, 2]).eval()
    ids, mask = padded_batch(batch=1)
    with pytest.raises(ValueError, match=r"stores 0 .*set_draft_vocab.*--draft-vocab-size"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_early_exit=2, assistant_vocab_size=8)
    with pytest.raises(ValueError, match=r"`token_ids` must be distinct token ids in \[0, 99\)"):
        model.set_draft_vocab([3, 3, 4])
    with pytest.raises(ValueError, match=r"`token_ids` must be distinct"):
        model.set_draft_vocab([99])
    model.config.draft_vocab_size = 0
    with pytest.raises(ValueError, match=r"`draft_vocab_size` must be None or an integer in \[1, 99\]"):
        model.config.validate_early_exit()


def test_bench_lossless_times_exit_drafts_with_and_without_the_draft_vocabulary(models):
    from ee_transformers.tools.bench import plain_twin, random_prompts
    from ee_transformers.tools.bench.lossless import LosslessConfig, run_lossless

    model, _ = models("llama")
    config = LosslessConfig(
        batch_sizes=[2], num_prompts=2, prompt_tokens=8, new_tokens=6, rounds=1, threads=1, exits=[2], vocab_sizes=[8]
    )
    calls = []
    real = spec.draft_vocab_head
    try:
        spec.draft_vocab_head = lambda model, n: calls.append(n) or real(model, n)
        report = run_lossless(model, plain_twin(model), random_prompts(99, 2, 8), config, log=lambda *_: None)
    finally:
        spec.draft_vocab_head = real
    names = {r["name"] for r in report["results"]}
    assert {"exit drafts @2", "exit drafts @2, top-8 draft vocabulary"} <= names
    assert "context + exit drafts @2, top-8 draft vocabulary" in names
    assert calls and set(calls) == {8}  # the vocabulary rows really drafted from it
    assert all(r["identical"] for r in report["results"])


def test_lossless_calibration_drafts_from_the_stored_vocabulary_and_stores_it(models, tmp_path):
    from ee_transformers.training import calibrate_lossless as lossless

    config = lossless.LosslessCalibrationConfig(lookup_tokens=[2], ngram_sizes=[3], exits=[2], draft_vocab_size=16)
    exit_rows = [k for k in lossless.lossless_candidates(config, stored_vocab=40) if "assistant_early_exit" in k]
    assert exit_rows and all(k["assistant_vocab_size"] == 16 for k in exit_rows)
    assert all("assistant_vocab_size" not in k for k in lossless.lossless_candidates(config, stored_vocab=0))
    model, _ = models("llama")
    report = {"chosen": {"assistant_early_exit": 2, "num_assistant_tokens": 2, "assistant_vocab_size": 16}}
    lossless.apply_lossless_calibration(model, report)
    try:
        model.save_pretrained(tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
        assert loaded.generation_config.assistant_vocab_size == 16
        calls = []
        real = spec.draft_vocab_head
        spec.draft_vocab_head = lambda model, n: calls.append(n) or real(model, n)
        try:  # a plain generate on the folder drafts from the stored vocabulary
            ids, mask = padded_batch(batch=1)
            loaded.generate(ids, attention_mask=mask, max_new_tokens=6)
        finally:
            spec.draft_vocab_head = real
        assert calls and set(calls) == {16}
    finally:
        lossless.apply_lossless_calibration(model, {"chosen": None})
