"""Drafts verified inside transformers' continuous batching (`paged_speculative.py`): token for token what plain
continuous batching of the base model and per-prompt `generate` answer, with drafts really accepted; the paged cache
rolled back; the budget following the step cost; refusals instead of silent changes."""

import math
import sys
import time
from collections import Counter

import pytest
import torch
import transformers
from conftest import FAMILIES
from helpers import ee_model
from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
from transformers.generation.continuous_batching.requests import RequestState

from ee_transformers import paged_speculative
from ee_transformers.drafts import Chain
from ee_transformers.paged_speculative import (
    PagedDrafts,
    accept_point_mass,
    accept_prefix,
    check_batching_internals,
    give_back_blocks,
    record_paged_drafts,
)

# text that repeats, so a tiny random model's greedy output (which soon loops) is drafted from its own context
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [12, 13, 14, 12, 13, 14, 12], [20, 21, 22, 23, 24, 25]]
NEW = 16
SMALL = dict(num_blocks=32, page_size=16, max_batch_tokens=64)
CB = ContinuousBatchingConfig(auto_switch_to_flash=False, **SMALL)
SLIDING = [f for f, spec in FAMILIES.items() if spec.extra.get("sliding_window") or "layer_types" in spec.extra]


def config(**settings):
    return GenerationConfig(
        **{"max_new_tokens": NEW, "do_sample": False, "eos_token_id": -1, "pad_token_id": 0, **settings}
    )


@pytest.fixture
def drafts_pay(monkeypatch):
    """Every step takes every draft the drafter offers (a step cost that does not grow with its tokens)."""
    monkeypatch.setattr(PagedDrafts, "cost", lambda self, tokens, rows, keys, drafted: 1.0)


def oracle(monkeypatch, model, prompts, answers):
    """The model's drafter proposes each request's true continuation (`answers`), wrong at the first draft one step
    in three and at the last one step in three: drafts are accepted and rejected whatever the model generates."""

    def propose(context, suffix, max_drafts, history=True, table=False, peers=()):
        text = context.tokens
        (r,) = [r for r, p in enumerate(prompts) if text[: len(p)] == p and len(text) - len(p) <= len(answers[r])]
        done = len(text) - len(prompts[r])
        tokens = list(answers[r][done : done + max_drafts])
        if not tokens:
            return None
        wrong = {1: 0, 2: len(tokens) - 1}.get(done % 3)
        if wrong is not None:
            tokens[wrong] = (tokens[wrong] + 1) % model.config.vocab_size
        return Chain(tokens, [1.0] * len(tokens), 1, 1, "context", probs=[0.9 ** (i + 1) for i in range(len(tokens))])

    monkeypatch.setattr(model.drafter, "propose", propose)
    monkeypatch.setattr(model.drafter, "observe", lambda chain, accepted, drafted=None: None)  # nothing to learn


def tokens_of(out):
    assert all(o.error is None for o in out.values())
    return [o.generated_tokens for o in out.values()]


def plain(base, gc, prompts=PROMPTS, cb=CB):
    """transformers' continuous batching of the base model."""
    return tokens_of(base.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb))


def drafted(model, gc, prompts=PROMPTS, cb=CB):
    with record_paged_drafts(model) as trace:
        out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb)
    return tokens_of(out), trace


def alone(base, gc, prompts=PROMPTS):
    return [base.generate(torch.tensor([p]), generation_config=gc)[0, len(p) :].tolist() for p in prompts]


def test_drafts_equal_plain_continuous_batching_and_generate(base_dirs, family, drafts_pay, monkeypatch):
    base, model = base_dirs[family][1], ee_model(base_dirs, family)
    want = plain(base, config())
    assert want == alone(base, config())
    tokens, trace = drafted(model, config(prompt_lookup_num_tokens=4))  # the model's own context drafts
    assert tokens == want
    oracle(monkeypatch, model, PROMPTS, want)  # drafts accepted and rejected, whatever this family generates
    tokens, trace = drafted(model, config(prompt_lookup_num_tokens=4))
    assert tokens == want
    assert trace.drafted > trace.accepted > trace.drafted / 3, trace.requests  # drafts really ran, some rejected
    assert len(trace.steps) > 0 and all(drafted >= accepted for _, drafted, accepted, _ in trace.steps)
    if family in SLIDING:  # a query stays inside the ring of the window (4): at most 3 drafts
        assert max(d for _, d, _, _ in trace.steps) <= 3 * len(PROMPTS)


@pytest.mark.parametrize("family", ["gemma3", "qwen2-sliding", "mistral-sliding"])
def test_sliding_layers_restore_the_ring_slots_rejected_drafts_wrote(base_dirs, family, drafts_pay, monkeypatch):
    """A draft's ring slot held K/V of the position one window back, still read by the next tokens: without the
    restore, a step after a rejection reads the rejected draft's K/V there and the text changes."""
    base, model = base_dirs[family][1], ee_model(base_dirs, family)
    want = plain(base, config())
    oracle(monkeypatch, model, PROMPTS, want)
    tokens, trace = drafted(model, config(prompt_lookup_num_tokens=3))
    assert tokens == want and trace.drafted > trace.accepted > 0
    monkeypatch.setattr(paged_speculative.RingSlots, "restore", lambda self, n: None)
    assert drafted(model, config(prompt_lookup_num_tokens=3))[0] != want


def test_rejected_drafts_are_rolled_back_in_the_paged_cache(base_dirs, drafts_pay, monkeypatch):
    """After every update, each running request's cache length is its tokens minus the one not yet fed, and it holds
    exactly the blocks that length needs (page 4: drafts cross pages); at the end every block is back in the pool."""
    base, model = base_dirs["llama"][1], ee_model(base_dirs)
    cb = ContinuousBatchingConfig(auto_switch_to_flash=False, num_blocks=64, page_size=4, max_batch_tokens=64)
    update, checked, seen = PagedDrafts.update_batch, Counter(), {}

    def update_and_check(self):
        update(self)
        cache = self.processor.cache
        seen.setdefault("free", cache.pool.num_free_sectors)
        for state in self.processor.scheduler.active_requests.values():
            if state.generated_len() == 0:
                continue
            assert state.position_offset == len(state.initial_tokens) + state.generated_len() - 1
            for allocator in cache.cache_allocators.values():
                blocks = len(allocator.block_table[state.request_id])
                assert blocks == math.ceil(state.position_offset / allocator.tokens_per_page), state
            checked["requests"] += 1
        seen["cache"] = cache

    monkeypatch.setattr(PagedDrafts, "update_batch", update_and_check)
    want = plain(base, config(), cb=cb)
    tokens, trace = drafted(model, config(prompt_lookup_num_tokens=5), cb=cb)
    assert tokens == want and checked["requests"] > 0
    assert trace.drafted > trace.accepted > 0, "some drafts rejected, some accepted"
    cache = seen["cache"]
    assert all(not allocator.block_table for allocator in cache.cache_allocators.values())
    cache.pool.try_to_free_sectors()
    assert cache.pool.num_free_sectors == cache.num_sectors  # every block given back


def test_without_the_rollback_the_text_changes(base_dirs, drafts_pay, monkeypatch):
    """The rollback is what keeps the text exact: leave the rejected positions in the request's length and later
    tokens read the rejected drafts' K/V at the wrong positions."""
    base, model = base_dirs["llama"][1], ee_model(base_dirs)
    want = plain(base, config())
    tokens, trace = drafted(model, config(prompt_lookup_num_tokens=5))
    assert tokens == want and trace.drafted > trace.accepted
    update = PagedDrafts.update_batch

    def no_rollback(self):
        keep = {r: (d.k, len(d.tokens) - 1) for r, d in self.step.items()}
        update(self)
        for state in self.processor.scheduler.active_requests.values():
            if state.request_id in keep:
                k, accepted = keep[state.request_id]
                state.position_offset += k - accepted

    monkeypatch.setattr(PagedDrafts, "update_batch", no_rollback)
    assert drafted(model, config(prompt_lookup_num_tokens=5))[0] != want


def test_give_back_returns_the_blocks_past_a_length(base_dirs):
    cb = ContinuousBatchingConfig(auto_switch_to_flash=False, num_blocks=16, page_size=4, max_batch_tokens=16)
    manager = ee_model(base_dirs).init_continuous_batching(generation_config=config(), continuous_batching_config=cb)
    manager.warmup()  # builds the batch processor and its paged cache
    cache = manager.batch_processor.cache
    (allocator,) = cache.cache_allocators.values()
    start = cache.pool.num_free_sectors
    state = RequestState(request_id="r", initial_tokens=[1] * 10)
    assert cache.can_store_request_tokens(state, 10) and len(allocator.block_table["r"]) == 3  # 3 blocks of 4
    free = cache.pool.count_free_blocks(allocator.index)
    assert give_back_blocks(cache, "r", 5) == 1 and len(allocator.block_table["r"]) == 2
    assert cache.pool.count_free_blocks(allocator.index) == free + 1
    assert give_back_blocks(cache, "r", 8) == 0 and len(allocator.block_table["r"]) == 2
    cache.free_blocks("r")
    cache.pool.try_to_free_sectors()
    assert cache.pool.num_free_sectors == start
    manager.stop(block=True, timeout=5)


def test_eos_inside_an_accepted_run_stops_there(base_dirs, drafts_pay):
    base, model = base_dirs["llama"][1], ee_model(base_dirs)
    full = plain(base, config())
    # an EOS the outputs reach after a few tokens, inside their repeated (drafted) part
    eos = Counter(t for row in full for t in row[4:]).most_common(1)[0][0]
    gc = config(eos_token_id=eos)
    want = plain(base, gc)
    assert any(len(row) < NEW for row in want), "the EOS must end some request early"
    tokens, trace = drafted(model, config(eos_token_id=eos, prompt_lookup_num_tokens=4))
    assert tokens == want and trace.accepted > 0


@pytest.mark.parametrize("new", [3, 6, 9])
def test_max_new_tokens_inside_an_accepted_run_is_honoured(base_dirs, drafts_pay, monkeypatch, new):
    """Drafts are offered even past the last allowed token (the room cap off): the commit stops at max_new_tokens."""
    monkeypatch.setattr(PagedDrafts, "_room", lambda self, state: self.settings.max_drafts)
    base, model = base_dirs["llama"][1], ee_model(base_dirs)
    want = plain(base, config(max_new_tokens=new))
    tokens, trace = drafted(model, config(max_new_tokens=new, prompt_lookup_num_tokens=6))
    assert tokens == want and all(len(t) == new for t in tokens)
    assert trace.accepted > 0


def test_requests_that_join_mid_flight_stream_in_order(base_dirs, drafts_pay):
    base, model = base_dirs["llama"][1], ee_model(base_dirs)
    want = plain(base, config(max_new_tokens=24), prompts=PROMPTS)
    manager = model.init_continuous_batching(
        generation_config=config(max_new_tokens=24, prompt_lookup_num_tokens=4), continuous_batching_config=CB
    )
    with record_paged_drafts(model) as trace:
        manager.start()
        try:
            first = manager.add_request(PROMPTS[0], max_new_tokens=24, streaming=True)
            streamed, deadline = [], time.time() + 60
            while (not streamed or len(streamed[-1]) < 4) and time.time() < deadline:  # mid-generation ...
                out = manager.get_result(first, timeout=1)
                if out is not None:
                    streamed.append(list(out.generated_tokens))
            assert 4 <= len(streamed[-1]) < 24
            later = [manager.add_request(p, max_new_tokens=24) for p in PROMPTS[1:]]  # ... the others join
            results = {}
            while len(results) < 3 and time.time() < deadline:
                out = manager.get_result(timeout=1)
                if out is None:
                    continue
                if out.request_id == first:
                    streamed.append(list(out.generated_tokens))
                if out.is_finished():
                    results[out.request_id] = out.generated_tokens
        finally:
            manager.stop(block=True, timeout=5)
    assert [results[r] for r in [first, *later]] == want
    assert all(b[: len(a)] == a and len(b) >= len(a) for a, b in zip(streamed, streamed[1:])), "streamed in order"
    assert trace.requests[first][1] > 0


def test_a_cancelled_request_leaves_nothing_behind(base_dirs, drafts_pay):
    """A request cancelled mid-stream frees its blocks and its draft state; the others answer what they would alone."""
    base, model = base_dirs["llama"][1], ee_model(base_dirs)
    want = plain(base, config(max_new_tokens=24), prompts=PROMPTS[1:])
    manager = model.init_continuous_batching(
        generation_config=config(max_new_tokens=24, prompt_lookup_num_tokens=4), continuous_batching_config=CB
    )
    manager.start()
    try:
        gone = manager.add_request(PROMPTS[0], max_new_tokens=24, streaming=True)
        others = [manager.add_request(p, max_new_tokens=24) for p in PROMPTS[1:]]
        deadline, seen = time.time() + 60, []
        while len(seen) < 3 and time.time() < deadline:
            out = manager.get_result(gone, timeout=1)
            seen = out.generated_tokens if out is not None else seen
        manager.cancel_request(gone)
        results = {}
        while len(results) < 2 and time.time() < deadline:
            out = manager.get_result(timeout=1)
            if out is not None and out.request_id in others and out.is_finished():
                results[out.request_id] = out.generated_tokens
        processor = manager.batch_processor
    finally:
        manager.stop(block=True, timeout=5)
    assert [results[r] for r in others] == want
    paged = processor._paged_drafts
    assert not paged.contexts and not paged.counts and paged.totals[1] > 0
    assert all(not allocator.block_table for allocator in processor.cache.cache_allocators.values())


def test_logprobs_are_the_models(base_dirs, drafts_pay):
    base, model = base_dirs["llama"][1], ee_model(base_dirs)
    cb = ContinuousBatchingConfig(auto_switch_to_flash=False, return_logprobs=True, **SMALL)
    want = base.generate_batch(PROMPTS, generation_config=config(), continuous_batching_config=cb)
    with record_paged_drafts(model) as trace:
        out = model.generate_batch(
            PROMPTS, generation_config=config(prompt_lookup_num_tokens=4), continuous_batching_config=cb
        )
    assert trace.accepted > 0
    for a, b in zip(want.values(), out.values()):
        assert a.generated_tokens == b.generated_tokens
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------------------------------
def test_accept_sampled_keeps_the_models_distribution():
    """Point-mass drafts: the first token is distributed as p_0, and after a kept first draft the second as p_1."""
    torch.manual_seed(0)
    probs = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25]])
    drafts, n = [1, 3], 20000
    runs = [accept_point_mass(probs, drafts) for _ in range(n)]
    first = Counter(r[0] for r in runs)
    for token in range(4):
        assert abs(first[token] / n - float(probs[0, token])) < 0.015, (token, first)
    second = Counter(r[1] for r in runs if r[0] == 1)
    m = sum(second.values())
    for token in range(4):
        assert abs(second[token] / m - float(probs[1, token])) < 0.03, (token, second)
    assert Counter(len(r) for r in runs)[3] > 0  # both drafts kept sometimes: the third token comes from p_2


def test_accept_greedy_keeps_the_longest_agreeing_prefix():
    assert accept_prefix([4, 5, 6, 7], [4, 5, 9]) == [4, 5, 6]
    assert accept_prefix([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]
    assert accept_prefix([3, 5], [4]) == [3]
    assert accept_prefix([3], []) == [3]


def test_sampling_with_drafts_runs_with_per_request_processors(base_dirs, drafts_pay):
    model = ee_model(base_dirs)
    cb = ContinuousBatchingConfig(auto_switch_to_flash=False, per_request_processors=True, **SMALL)
    gc = config(do_sample=True, temperature=0.3, top_k=5, prompt_lookup_num_tokens=4)
    tokens, trace = drafted(model, gc, cb=cb)
    assert all(len(t) == NEW and all(0 <= x < model.config.vocab_size for x in t) for t in tokens)
    assert trace.accepted > 0  # a low temperature keeps the loops, so drafts are kept


# ---------------------------------------------------------------------------------------------------------------------
# the budget
# ---------------------------------------------------------------------------------------------------------------------
def test_the_draft_budget_follows_the_step_cost(base_dirs, monkeypatch):
    """A step cost flat in its tokens takes the drafts; a cost linear in them (a saturated step) takes none, and the
    step is a plain step; every step's time is fed to the drafter's costs."""
    base, model = base_dirs["llama"][1], ee_model(base_dirs)
    want = plain(base, config())
    monkeypatch.setattr(PagedDrafts, "cost", lambda self, tokens, rows, keys, drafted: 1.0)
    tokens, flat = drafted(model, config(prompt_lookup_num_tokens=4))
    assert tokens == want and flat.drafted > 0
    monkeypatch.setattr(PagedDrafts, "cost", lambda self, tokens, rows, keys, drafted: float(tokens))
    tokens, linear = drafted(model, config(prompt_lookup_num_tokens=4))
    assert tokens == want and linear.drafted == 0 and not linear.steps
    observed = []
    monkeypatch.setattr(PagedDrafts, "cost", lambda self, tokens, rows, keys, drafted: 1.0)
    monkeypatch.setattr(model.drafter.packed, "observe", lambda *step, drafted=False: observed.append((*step, drafted)))
    drafted(model, config(prompt_lookup_num_tokens=4))
    # every step: its tokens, logits rows (at most one per token) and keys read (at least its tokens), and its time
    assert observed and all(t >= r >= 1 and k >= t and s > 0 for t, r, k, s, _ in observed), observed
    assert any(d for *_, d in observed) and not all(d for *_, d in observed)  # drafted steps and plain ones


def test_at_saturation_drafting_shrinks_to_none(base_dirs, monkeypatch):
    """A step cost flat up to 8 packed tokens and linear past them (a machine saturated at 8): one request drafts,
    twelve decoding together (12 tokens already) draft nothing, with the same text as plain continuous batching.
    (A step of prefill chunks is another matter: its tokens produce none this step, so a few drafts may pay there.)"""
    base, model = base_dirs["llama"][1], ee_model(base_dirs)
    monkeypatch.setattr(PagedDrafts, "cost", lambda self, tokens, rows, keys, drafted: max(1.0, tokens / 8))
    alone_tokens, one = drafted(model, config(prompt_lookup_num_tokens=4), prompts=PROMPTS[:1])
    assert alone_tokens == plain(base, config(), prompts=PROMPTS[:1]) and one.drafted > 0
    many = [[5 + i, 6 + i, 5 + i, 6 + i, 5 + i] for i in range(12)]  # one prefill step, then 12 decodes per step
    tokens, loaded = drafted(model, config(prompt_lookup_num_tokens=4), prompts=many)
    assert tokens == plain(base, config(), prompts=many) and loaded.drafted == 0


# ---------------------------------------------------------------------------------------------------------------------
# settings and refusals
# ---------------------------------------------------------------------------------------------------------------------
def test_stored_draft_settings_turn_drafts_on(base_dirs, drafts_pay):
    base, model = base_dirs["llama"][1], ee_model(base_dirs)
    model.generation_config.update(prompt_lookup_num_tokens=3, max_new_tokens=NEW, eos_token_id=-1, do_sample=False)
    with record_paged_drafts(model) as trace:
        out = model.generate_batch(PROMPTS, continuous_batching_config=CB)
    assert tokens_of(out) == plain(base, config()) and trace.accepted > 0


def test_table_drafts_fill_in_where_the_text_has_no_match(base_dirs, drafts_pay, monkeypatch):
    """`speculative_table_drafts=True`: requests whose own text offers no match draft from the stored table."""
    base, model = base_dirs["llama"][1], ee_model(base_dirs)
    want = plain(base, config())
    model.set_draft_table([p + w for p, w in zip(PROMPTS, want)], min_count=1)
    observe, sources = model.drafter.observe, Counter()

    def record(chain, accepted, drafted=None):
        sources[chain.source] += accepted
        observe(chain, accepted, drafted=drafted)

    monkeypatch.setattr(model.drafter, "observe", record)
    gc = config(prompt_lookup_num_tokens=3, speculative_table_drafts=True, speculative_history_tokens=0)
    tokens, trace = drafted(model, gc)
    assert tokens == want and sources["table"] > 0 and "history" not in sources, sources


def test_a_table_is_needed_for_table_drafts(base_dirs):
    with pytest.raises(ValueError, match="speculative_table_drafts"):
        drafted(ee_model(base_dirs), config(prompt_lookup_num_tokens=3, speculative_table_drafts=True))


def test_confident_exits_in_the_call_turn_stored_drafts_off(base_dirs, drafts_pay):
    model = ee_model(base_dirs)
    model.generation_config.update(prompt_lookup_num_tokens=3)
    _, trace = drafted(model, config(exit_criterion="max_prob", exit_threshold=0.0, exit_check_layers=[0]))
    assert trace.drafted == 0
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        drafted(model, config(prompt_lookup_num_tokens=2, exit_criterion="max_prob", exit_threshold=0.5))


@pytest.mark.parametrize(
    "settings, cb, named",
    [
        (dict(prompt_lookup_num_tokens=0), CB, "prompt_lookup_num_tokens"),
        (dict(prompt_lookup_num_tokens=2.5), CB, "prompt_lookup_num_tokens"),
        (dict(prompt_lookup_num_tokens=2, max_matching_ngram_size=0), CB, "max_matching_ngram_size"),
        (dict(prompt_lookup_num_tokens=2, compile_config=CompileConfig()), CB, "compile"),
        (
            dict(prompt_lookup_num_tokens=2),
            ContinuousBatchingConfig(auto_switch_to_flash=False, use_cuda_graph=True, **SMALL),
            "use_cuda_graph",
        ),
        (
            dict(prompt_lookup_num_tokens=2),
            ContinuousBatchingConfig(auto_switch_to_flash=False, use_async_batching=True, **SMALL),
            "use_async_batching",
        ),
    ],
)
def test_what_drafts_in_continuous_batching_cannot_honour_raises(base_dirs, settings, cb, named):
    with pytest.raises(ValueError, match=named):
        ee_model(base_dirs).init_continuous_batching(
            generation_config=config(**settings), continuous_batching_config=cb
        )


def test_the_wrapped_transformers_internals_are_there(base_dirs, monkeypatch):
    """The paged drafts wrap transformers' batch processor as 5.19 to 5.24 have it (the same there): on the installed
    release the check passes; on one without what they wrap, turning drafts on refuses in one line naming the
    releases (re-read `input_outputs.py`, `continuous_api.py` and the cache allocators before widening the range)."""
    from ee_transformers.compat import OLDEST

    installed = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    assert tuple(int(p) for p in OLDEST.split(".")) <= installed < (5, 25), transformers.__version__
    check_batching_internals()
    model = ee_model(base_dirs)
    monkeypatch.delattr(ContinuousBatchProcessor, "update_batch")
    with pytest.raises(ImportError, match="update_batch") as refused:
        model.init_continuous_batching(
            generation_config=config(prompt_lookup_num_tokens=2), continuous_batching_config=CB
        )
    message = str(refused.value)
    assert "\n" not in message and "transformers 5.19 to 5.24" in message and "transformers>=5.19,<5.25" in message
    monkeypatch.undo()
    monkeypatch.setattr(ContinuousBatchProcessor, "update_batch", lambda self, extra: None)  # another signature
    with pytest.raises(ImportError, match=r"ContinuousBatchProcessor.update_batch\(\)"):
        check_batching_internals()
    assert paged_speculative.DRAFT_FIELD == "prompt_lookup_num_tokens"


def test_a_lean_model_refuses_drafts(base_dirs):
    model = ee_model(base_dirs)
    model.set_exit_max_layer(1)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens.*set_exit_max_layer"):
        model.init_continuous_batching(
            generation_config=config(prompt_lookup_num_tokens=2), continuous_batching_config=CB
        )


# ---------------------------------------------------------------------------------------------------------------------
# serving
# ---------------------------------------------------------------------------------------------------------------------
SERVED = ["w5 w6 w7 w5 w6 w7 w5", "w12 w13 w12 w13", "w20 w21 w22 w23", "w40 w41 w40 w41 w40"]


def test_serve_continuous_batching_verifies_a_folders_stored_drafts(tmp_path):
    """`ee-transformers serve FOLDER --continuous-batching` on a folder whose stored lossless mode is context drafts:
    concurrent requests from the openai client get the full model's greedy text, and nothing breaks in the log."""
    pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from helpers import numbered_tokenizer, served_folders

    import ee_transformers as eet
    from ee_transformers.tools.bench.serve import ServerProcess, openai_client

    base_folder, _ = served_folders(tmp_path)
    model = eet.from_base(base_folder, exit_layers=[0, 1, 2]).eval()
    model.generation_config.update(prompt_lookup_num_tokens=3, speculative_gate=False, eos_token_id=-1, do_sample=False)
    model.save_pretrained(tmp_path / "drafts")
    tok = numbered_tokenizer()
    tok.save_pretrained(tmp_path / "drafts")
    flags = ["--continuous-batching", "--cb-num-blocks", "64", "--cb-block-size", "16", "--cb-max-batch-tokens", "64"]
    argv = [sys.executable, "-m", "ee_transformers.tools.cli", "serve", str(tmp_path / "drafts"), *flags]
    server = ServerProcess(argv, threads=1, log_path=tmp_path / "server.log")
    client = openai_client(server)
    folder = str(tmp_path / "drafts")
    ask = lambda p: client.completions.create(model=folder, prompt=p, max_tokens=10, temperature=0)  # noqa: E731
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            answers = [a.choices[0].text for a in pool.map(ask, SERVED)]
    finally:
        log = server.stop()
    for prompt, text in zip(SERVED, answers):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        want = model.generate(ids, max_new_tokens=10, prompt_lookup_num_tokens=None, do_sample=False, eos_token_id=-1)
        assert " ".join(text.split()) == " ".join(tok.decode(want[0, ids.shape[1] :]).split()), prompt
    assert "Traceback" not in log, log[-4000:]
    assert "Drafts in continuous batching" in log, "the server's batching manager verifies drafts"
