"""Early exit inside transformers' continuous batching (`generate_batch`, `init_continuous_batching`): exactness
against `generate` per prompt, layer calls really cut, the paged cache filled, refusals instead of silent full depth."""

import copy
import time
from collections import Counter

import pytest
import torch
from conftest import LayerCalls
from helpers import ee_model
from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig

import ee_transformers as eet
from ee_transformers import paged_early_exit
from ee_transformers.paged_early_exit import record_paged_exits

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]
NEW = 8
SMALL = dict(num_blocks=32, page_size=16, max_batch_tokens=64)  # sized for the tests: sizing from free memory is slow
CB = ContinuousBatchingConfig(auto_switch_to_flash=False, **SMALL)


def median_confidence(model):
    """The heads' median max-prob over the prompts' positions: a threshold there gives a mix of exits."""
    with torch.no_grad():
        logits = [t for p in PROMPTS for t in model(torch.tensor([p]), output_exit_logits=True).exit_logits]
    return float(torch.cat([t[0].softmax(-1).max(-1).values for t in logits]).median())


def config(**settings):
    return GenerationConfig(
        **{"max_new_tokens": NEW, "do_sample": False, "eos_token_id": -1, "pad_token_id": 0, **settings}
    )


def alone(model, gc, prompts=PROMPTS):
    """`generate` for each prompt alone: new tokens per prompt, and the sorted (position, input, exit) triples."""
    tokens, triples = [], []
    gc = copy.deepcopy(gc)
    gc.return_dict_in_generate = True  # in the config, not beside it (transformers deprecates mixing the two)
    for p in prompts:
        out = model.generate(torch.tensor([p]), generation_config=gc)
        seq = out.sequences[0].tolist()
        tokens.append(seq[len(p) :])
        layers = out.exit_layers[0].tolist()
        triples += [(len(p) - 1 + i, seq[len(p) - 1 + i], layer) for i, layer in enumerate(layers)]
    return tokens, sorted(triples)


def batched(model, gc, prompts=PROMPTS, cb=CB):
    with record_paged_exits(model) as trace:
        out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb, progress_bar=False)
    assert len(out) == len(prompts) and all(o.error is None for o in out.values())
    return [o.generated_tokens for o in out.values()], trace


def triples(trace):
    return sorted((p, t, e) for _, p, t, e in trace.records)


def test_generate_batch_equals_generate_per_prompt(base_dirs, family):
    model = ee_model(base_dirs, family)
    gc = config(exit_criterion="max_prob", exit_threshold=median_confidence(model), exit_policy="row")
    tokens, trace = batched(model, gc)
    want_tokens, want_triples = alone(model, gc)
    assert tokens == want_tokens
    assert triples(trace) == want_triples  # the same exit for every token
    assert len({e for *_, e in trace.records}) > 1, "expected a mix of exits"


def test_exits_off_equal_transformers_continuous_batching_of_the_base(base_dirs, family):
    folder, base = base_dirs[family]
    model = eet.from_base(folder, exit_layers=[0, 1, 2]).eval()
    want = base.generate_batch(PROMPTS, generation_config=config(), continuous_batching_config=CB, progress_bar=False)
    want = [o.generated_tokens for o in want.values()]
    assert batched(model, config())[0] == want  # no exit settings: full depth
    gc = config(exit_criterion="max_prob", exit_threshold=0.0, early_exit=False)
    tokens, trace = batched(model, gc)
    assert tokens == want and not trace.records  # early_exit=False: transformers' own forward


def test_the_fill_is_what_keeps_later_tokens_exact(base_dirs, monkeypatch):
    """Without writing the skipped layers' K/V, later tokens read empty cache slots and the text changes."""
    model = ee_model(base_dirs)
    gc = config(exit_criterion="max_prob", exit_threshold=median_confidence(model), exit_policy="row")
    want, _ = alone(model, gc)
    assert batched(model, gc)[0] == want
    monkeypatch.setattr(paged_early_exit, "_fill_skipped", lambda *args: None)
    assert batched(model, gc)[0] != want


def test_row_policy_runs_deep_layers_only_for_tokens_that_did_not_exit(base_dirs):
    model = ee_model(base_dirs)
    prompt_tokens = sum(map(len, PROMPTS))
    counter = LayerCalls(model)
    tokens, trace = batched(model, config(exit_criterion="max_prob", exit_threshold=0.0, exit_check_layers=[0]))
    counter.remove()
    decoded = (NEW - 1) * len(PROMPTS)  # the first new token of each request comes from its prompt's last token
    assert counter.positions == [prompt_tokens + decoded] + [prompt_tokens] * 3  # deeper layers: prompts only
    assert {e for *_, e in trace.records} == {0}
    # a mix: each layer above 0 runs exactly the decode tokens that had not exited below it
    model = ee_model(base_dirs)
    gc = config(exit_criterion="max_prob", exit_threshold=median_confidence(model), exit_policy="row")
    counter = LayerCalls(model)
    _, trace = batched(model, gc)
    counter.remove()
    decode_exits = [e for _, p, t, e in trace.records if not _prompt_end(p, t)]
    assert len(decode_exits) == decoded and len(set(decode_exits)) > 1
    for j in range(1, 4):
        assert counter.positions[j] == prompt_tokens + sum(e >= j for e in decode_exits), (j, Counter(decode_exits))


def _prompt_end(position, token):
    return any(position == len(p) - 1 and token == p[-1] for p in PROMPTS)


def test_batch_policy_stops_every_decode_token_of_a_step_at_one_exit(base_dirs):
    model = ee_model(base_dirs)
    gc = config(exit_criterion="max_prob", exit_threshold=median_confidence(model) * 0.8, exit_policy="batch")
    _, trace = batched(model, gc)
    by_step = {}
    for step, p, t, e in trace.records:
        if not _prompt_end(p, t):
            by_step.setdefault(step, set()).add(e)
    assert by_step and all(len(layers) == 1 for layers in by_step.values()), by_step
    # one request alone: the batch policy equals generate's
    tokens, trace = batched(model, gc, prompts=PROMPTS[:1])
    assert (tokens, triples(trace)) == alone(model, gc, PROMPTS[:1])


def test_requests_that_join_while_others_decode(base_dirs):
    model = ee_model(base_dirs, "qwen2-sliding")
    gc = config(exit_criterion="max_prob", exit_threshold=median_confidence(model), exit_policy="row")
    gc.max_new_tokens = 12
    want, _ = alone(model, gc)
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=CB)
    manager.start()
    try:
        first = manager.add_request(PROMPTS[0], max_new_tokens=12, streaming=True)
        seen = []
        deadline = time.time() + 60
        while len(seen) < 3 and time.time() < deadline:  # the first request is mid-generation ...
            out = manager.get_result(first, timeout=1)
            seen = out.generated_tokens if out else seen
        assert 3 <= len(seen) < 12
        later = [manager.add_request(p, max_new_tokens=12) for p in PROMPTS[1:]]  # ... when the others join
        results = {}
        while len(results) < 3 and time.time() < deadline:
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out.generated_tokens
    finally:
        manager.stop(block=True, timeout=5)
    assert [results[r] for r in [first, *later]] == want


def test_chunked_prompts_share_steps_with_decode_tokens(base_dirs):
    """A token budget of 6 splits the prompts into chunks that run next to other requests' decode tokens."""
    model = ee_model(base_dirs, "gemma3")
    gc = config(exit_criterion="max_prob", exit_threshold=median_confidence(model), exit_policy="row")
    prompts = [list(range(3, 14)), [40, 41], list(range(50, 58))]  # 11 = 6 + 5, 8 = 6 + 2 or 4 + 4: no 1-token end
    tokens, trace = batched(
        model, gc, prompts, ContinuousBatchingConfig(auto_switch_to_flash=False, **{**SMALL, "max_batch_tokens": 6})
    )
    assert (tokens, triples(trace)) == alone(model, gc, prompts)


def test_lean_model_decodes_in_continuous_batching(base_dirs):
    model = ee_model(base_dirs)
    model.set_exit_max_layer(1)
    counter = LayerCalls(model)
    tokens, trace = batched(model, config())  # no settings: every token exits at exit_max_layer
    counter.remove()
    assert counter.calls[2:] == [0, 0]
    assert {e for *_, e in trace.records} == {1}
    assert (tokens, triples(trace)) == alone(model, config())


def test_a_lean_model_pages_only_its_loaded_layers(base_dirs):
    """The layers a lean model does not load get no paged-cache pages: a block holds the loaded layers only."""
    sizes = {}
    for depth in (4, 2):
        model = ee_model(base_dirs, "qwen2-sliding")
        if depth < 4:
            model.set_exit_max_layer(depth - 1)
        manager = model.init_continuous_batching(generation_config=config(), continuous_batching_config=CB)
        if manager.batch_processor is None:  # a full model's cache is made when the manager warms up or starts
            manager.warmup()
        cache = manager.batch_processor.cache
        assert sorted(cache.layer_to_allocator) == list(range(depth))
        sizes[depth] = cache.cache_tensor.numel()  # bytes (uint8) of every page, trash slots included
        manager.stop(block=True, timeout=5)
        assert "get_text_config" not in vars(model.config)  # the loaded-layers view was only for the sizing
    assert sizes[2] < 0.6 * sizes[4], sizes  # half the layers: about half the bytes for the same blocks


def test_sampling_runs_on_the_exit_heads(base_dirs):
    model = ee_model(base_dirs)
    gc = config(exit_criterion="max_prob", exit_threshold=0.0, exit_check_layers=[0], do_sample=True, temperature=1.0)
    counter = LayerCalls(model)
    tokens, _ = batched(model, gc)
    counter.remove()
    assert all(len(t) == NEW and all(0 <= x < model.config.vocab_size for x in t) for t in tokens)
    assert counter.positions[1] == sum(map(len, PROMPTS))


@pytest.mark.parametrize(
    "settings, cb, named",
    [
        (dict(exit_kv="deferred"), CB, "exit_kv"),
        (dict(compile_config=CompileConfig()), CB, "compile"),
        (dict(), ContinuousBatchingConfig(auto_switch_to_flash=False, use_cuda_graph=True, **SMALL), "use_cuda_graph"),
        (dict(exit_policy="sideways"), CB, "exit_policy"),
    ],
)
def test_what_continuous_batching_cannot_honour_raises(base_dirs, settings, cb, named):
    model = ee_model(base_dirs)
    gc = config(exit_criterion="max_prob", exit_threshold=0.5, **settings)
    with pytest.raises(ValueError, match=named):
        model.generate_batch(PROMPTS, generation_config=gc, continuous_batching_config=cb, progress_bar=False)


def test_stored_settings_apply_without_a_config(base_dirs):
    model = ee_model(base_dirs)
    model.set_exit_defaults(exit_criterion="max_prob", exit_threshold=0.0, exit_check_layers=[0])
    model.generation_config.update(max_new_tokens=NEW, eos_token_id=-1, do_sample=False)
    with record_paged_exits(model) as trace:
        model.generate_batch(PROMPTS, continuous_batching_config=CB, progress_bar=False)
    assert {e for *_, e in trace.records} == {0}
