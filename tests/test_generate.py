"""Issue 3: early-exit decoding inside generate: backfilling cache, policies, criteria, stable-token exits.

The invariants run over the whole family matrix (`family` fixture, conftest.FAMILIES): exits off == the base model;
a forced exit at e == the base model cut after e plus that exit's head; backfilled K/V == the skipped layers' own
projections of the exit state; deferred K/V == full-depth K/V once a deep token has run; rows above their exit
never run; a batch row == its prompt alone.
"""

import pytest
import torch
from conftest import LayerCalls, cached, cut_at_exit, own_kv, padded_batch
from helpers import Collect, ee_model, numbered_tokenizer, scripted_heads

import ee_transformers as eet
from ee_transformers.compat import cache_of
from ee_transformers.tools.bench import ForcedExits

LAYERS = 4  # tiny models: 4 decoder layers, exits after 0, 1, 2, final = 3


LayerCounter = LayerCalls  # calls and rows run per decoder layer (conftest)


def peaked(token, height):
    def fn(n, vocab, hidden):
        logits = torch.zeros(n, vocab, dtype=hidden.dtype)
        logits[:, token] = height
        return logits

    return fn


def assert_decided_at(exit_layers, layer):
    """Every token decided at `layer`; -1 only after a row's EOS (a random tiny model may draw it)."""
    assert (exit_layers[:, 0] == layer).all(), exit_layers
    assert ((exit_layers == layer) | (exit_layers == -1)).all(), exit_layers
    assert ((exit_layers[:, 1:] == -1) >= (exit_layers[:, :-1] == -1)).all(), exit_layers  # -1 to the end


def extended_mask(mask, length):
    """The prompt's mask extended with ones to `length` positions."""
    return torch.cat([mask, torch.ones(mask.shape[0], length - mask.shape[1], dtype=mask.dtype)], 1)


def forced_schedule(targets):
    """Targets for ForcedExits: decoding step s (0 = prefill) exits at targets[s] for every row."""
    step = {"n": 0}

    def fn(batch_size, device):
        target = targets[min(step["n"], len(targets) - 1)]
        step["n"] += 1
        return torch.full((batch_size,), target, dtype=torch.long, device=device)

    return fn


# --- the invariants, over the family matrix --------------------------------------------------------------------------


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_exits_disabled_generate_equals_base(base_dirs, family, cache_implementation):
    folder, base = base_dirs[family]
    model = ee_model(base_dirs, family)
    ids, mask = padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation=cache_implementation)
    expected = base.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, **kwargs), expected)
    out = model.generate(ids, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert_decided_at(out.exit_layers, LAYERS - 1)
    model.set_exit_defaults(exit_criterion="max_prob", exit_threshold=0.0)  # stored settings switch exits on ...
    assert not torch.equal(model.generate(ids, **kwargs), expected)
    assert torch.equal(model.generate(ids, early_exit=False, **kwargs), expected)  # ... and early_exit=False off


@pytest.mark.parametrize("policy, kv", [("batch", "immediate"), ("batch", "deferred"), ("row", "immediate")])
@pytest.mark.parametrize("exit_index", [0, 1])
def test_forced_exit_equals_base_cut_at_exit_plus_head(base_dirs, family, policy, kv, exit_index):
    folder, base = base_dirs[family]
    model = ee_model(base_dirs, family)
    layer = model.config.exit_layers[exit_index]
    ids, mask = padded_batch()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=0.0,
        exit_policy=policy,
        exit_kv=kv,
        exit_check_layers=model.config.exit_layers[exit_index:],
        return_dict_in_generate=True,
    )
    assert_decided_at(out.exit_layers, layer)
    expected = cut_at_exit(base, model, exit_index).generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=False
    )
    assert torch.equal(out.sequences, expected)


def test_forced_exit_with_static_cache_and_sampling_equals_base_cut(base_dirs, family):
    folder, base = base_dirs[family]
    model = ee_model(base_dirs, family)
    ids, mask = padded_batch()
    sampling = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3)
    cut = cut_at_exit(base, model, 0)  # built before seeding: building it draws random numbers
    torch.manual_seed(11)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        exit_criterion="margin",
        exit_threshold=0.0,
        cache_implementation="static",
        **sampling,
    )
    torch.manual_seed(11)
    expected = cut.generate(ids, attention_mask=mask, max_new_tokens=6, cache_implementation="static", **sampling)
    assert torch.equal(out, expected)


def _states_leaving(base, sequences, mask, layer):
    """Residual stream leaving `layer` for every position, from a full forward of the base model."""
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = base(sequences, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    return out.hidden_states[layer + 1], positions


def test_backfilled_kv_equals_skipped_layers_own_projections(base_dirs, family):
    folder, base = base_dirs[family]
    model = ee_model(base_dirs, family)
    ids, mask = padded_batch()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=0.0,
        exit_check_layers=[1],
        min_new_tokens=5,
        return_dict_in_generate=True,
    )
    assert (out.exit_layers == 1).all()
    cached_ids = out.sequences[:, :-1]  # the last token was never fed back
    length = cached_ids.shape[1]
    full_mask = extended_mask(mask, length)
    exit_states, positions = _states_leaving(base, cached_ids, full_mask, layer=1)
    new = length - ids.shape[1]  # positions a decoding step ran (the first generated token onwards)
    for j in (2, 3):  # the skipped layers
        reference = own_kv(base, j, exit_states, full_mask, positions)  # the layer's own code on the exit states
        for kind in ("keys", "values"):
            got, want = cached(cache_of(out).layers[j], kind), cached(reference, kind)
            tail = min(new, got.shape[2])  # a sliding layer keeps only its window
            torch.testing.assert_close(
                got[:, :, -tail:], want[:, :, -tail:], rtol=1e-5, atol=1e-5, msg=lambda m: f"layer {j} {kind}: {m}"
            )
    for j in range(LAYERS):  # every layer holds every position
        assert cache_of(out).layers[j].get_seq_length() == length


def test_kv_modules_are_the_modules_a_backfill_calls(base_dirs, family):
    """The pool's cost model counts `family.kv_modules(layer)` as what a backfill reads: exactly the parametrised
    modules `key_value` calls."""
    model = ee_model(base_dirs, family)
    layer = model.family.layers(model)[2]
    called = []
    hooks = [
        m.register_forward_hook(lambda m, *_: called.append(m))
        for m in layer.modules()
        if any(True for _ in m.parameters(recurse=False))
    ]
    states = torch.randn(2, 3, model.config.hidden_size)
    positions = torch.arange(3).expand(2, 3)
    inputs = model.family.layer_inputs(model, states, torch.ones(2, 3, dtype=torch.long), None, positions)
    model.family.key_value(model, 2, states, inputs)
    for hook in hooks:
        hook.remove()
    assert {id(m) for m in called} == {id(m) for m in model.family.kv_modules(layer)}


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_deferred_kv_equals_full_depth_kv_after_a_deep_token(base_dirs, family, cache_implementation):
    folder, base = base_dirs[family]
    model = ee_model(base_dirs, family)
    ids, mask = padded_batch()
    # prefill full, two tokens exit after layer 0 / 1, then one full-depth token
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        exit_kv="deferred",
        exit_criterion=ForcedExits(forced_schedule([3, 0, 1, 3])),
        cache_implementation=cache_implementation,
        return_dict_in_generate=True,
    )
    assert out.exit_layers.tolist() == [[3, 0, 1, 3]] * ids.shape[0]
    assert cache_of(out).num_pending == 0
    cached_ids = out.sequences[:, :-1]
    full_mask = extended_mask(mask, cached_ids.shape[1])
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        reference = cache_of(base(cached_ids, attention_mask=full_mask, position_ids=positions, use_cache=True))
    for j in range(LAYERS):
        for kind in ("keys", "values"):
            got, want = cached(cache_of(out).layers[j], kind), cached(reference.layers[j], kind)
            tail = min(got.shape[2], want.shape[2])  # sliding layers: their window; full layers: every position
            valid = full_mask[:, -tail:].bool()[:, None, :, None]
            torch.testing.assert_close(
                got[:, :, -tail:] * valid,
                want[:, :, -tail:] * valid,
                rtol=1e-4,  # fp32 sums in another order (Gemma 3 on transformers 5.19: 2 of 480 elements off by 2e-5)
                atol=1e-4,
                msg=lambda m: f"layer {j} {kind}: {m}",
            )

    # while tokens are pending, the deep layers do not hold them yet
    partial = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=3,
        min_new_tokens=3,
        do_sample=False,
        exit_kv="deferred",
        exit_criterion=ForcedExits(forced_schedule([3, 0, 1])),
        cache_implementation=cache_implementation,
        return_dict_in_generate=True,
    )
    assert cache_of(partial).num_pending == 2
    assert cache_of(partial).layers[0].get_seq_length() == cache_of(partial).layers[3].get_seq_length() + 2


def _prompts_for_eos_test(model, scripted_token):
    """A 2-row padded batch whose rows' full-depth first tokens differ from each other and from `scripted_token`
    (row 1's first token becomes the EOS below, which row 0 must not produce)."""
    for seed in range(1, 20):
        ids, mask = padded_batch(batch=2, seed=seed)
        first = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, early_exit=False)
        if first[0, -1] != first[1, -1] and first[1, -1] != scripted_token:
            return ids, mask
    raise AssertionError("no seed gave two rows with different first tokens")


def test_batch_policy_unconfident_row_keeps_batch_going_finished_row_does_not(base_dirs, family):
    model = ee_model(base_dirs, family)
    ids, mask = _prompts_for_eos_test(model, scripted_token=5)

    def confident_row0(n, vocab, hidden):  # batch policy: all rows run together, so local row i is batch row i
        logits = torch.zeros(n, vocab, dtype=hidden.dtype)
        logits[0, 5] = 50.0
        return logits

    scripted_heads(model, [confident_row0] * 3)
    counter = LayerCounter(model)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=0.9,
        exit_policy="batch",
        return_dict_in_generate=True,
    )
    counter.remove()
    assert (out.exit_layers == 3).all()  # row 1 is never confident: the whole batch runs every layer
    assert counter.calls == [4] * LAYERS

    # now row 1 finishes at its first token (its first token is made the EOS): it must not hold the batch back
    eos = int(out.sequences[1, ids.shape[1]])
    counter = LayerCounter(model)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=0.9,
        exit_policy="batch",
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    counter.remove()
    assert out.exit_layers[1].tolist() == [3, -1, -1, -1]
    assert out.exit_layers[0, 1:].tolist() == [0, 0, 0]
    assert counter.calls == [4, 1, 1, 1]  # prefill runs all layers; then the batch stops after layer 0


def test_row_policy_runs_deep_layers_only_for_unconfident_rows(base_dirs, family):
    model = ee_model(base_dirs, family)
    ids, mask = padded_batch(batch=3)
    # exit 0 is confident for every row, exits 1-2 never: with exit_check_layers [0] rows stop at layer 0 ...
    counter = LayerCounter(model)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=0.0,
        exit_policy="row",
        return_dict_in_generate=True,
    )
    counter.remove()
    assert (out.exit_layers == 0).all()
    assert counter.rows == [3 * 4, 3, 3, 3]  # decode steps run layer 0 only
    # ... and a mixed batch: rows 0 and 2 exit at layer 0, row 1 at full depth (forced exits use the same
    # per-row decision path as the criteria)
    targets = torch.tensor([0, 3, 0])
    counter = LayerCounter(model)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        exit_policy="row",
        exit_criterion=ForcedExits(lambda b, d: targets.to(d)),
        return_dict_in_generate=True,
    )
    counter.remove()
    assert out.exit_layers.tolist() == [[0] * 4, [3] * 4, [0] * 4]
    assert counter.rows == [3 * 4, 3 + 3, 3 + 3, 3 + 3]  # layers 1-3: prefill 3 rows, then 1 row per step
    for j in range(LAYERS):
        assert cache_of(out).layers[j].get_seq_length() == out.sequences.shape[1] - 1


def test_row_policy_batch_row_equals_prompt_alone(base_dirs, family):
    model = ee_model(base_dirs, family)
    ids, mask = padded_batch(batch=3)
    # a threshold at the median of the heads' confidence gives a mix of exits
    with torch.no_grad():
        probs = torch.cat(
            [
                t[:, -1].softmax(-1).max(-1).values
                for t in model(ids, attention_mask=mask, output_exit_logits=True).exit_logits
            ]
        )
    threshold = float(probs.median())
    kwargs = dict(
        max_new_tokens=6,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=threshold,
        exit_policy="row",
        return_dict_in_generate=True,
    )
    batch = model.generate(ids, attention_mask=mask, **kwargs)
    layers = batch.exit_layers.unique().tolist()
    assert len(layers) > 1, f"expected a mix of exits, got {layers}"
    for row in range(ids.shape[0]):
        keep = mask[row].bool()
        alone = model.generate(ids[row : row + 1, keep], **kwargs)
        assert torch.equal(alone.sequences[0], batch.sequences[row, ~torch.cat([~keep, torch.zeros(6, dtype=bool)])])
        assert torch.equal(alone.exit_layers[0], batch.exit_layers[row])


# --- decoding features (one family) ----------------------------------------------------------------------------------


def test_stable_token_exit_with_patience(base_dirs):
    model = ee_model(base_dirs)
    # argmaxes 5, 5, 9 at exits 0, 1, 2, all far below the threshold: patience 2 exits at the second exit
    scripted_heads(model, [peaked(5, 1.0), peaked(5, 1.0), peaked(9, 1.0)])
    ids, mask = padded_batch(batch=2)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=3,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=0.99,
        exit_patience=2,
        return_dict_in_generate=True,
    )
    assert (out.exit_layers == 1).all()
    assert (out.sequences[:, ids.shape[1] :] == 5).all()
    # patience 3 needs three equal argmaxes: 5, 5, 9 never gets there
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=3,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=0.99,
        exit_patience=3,
        return_dict_in_generate=True,
    )
    assert (out.exit_layers == 3).all()


@pytest.mark.parametrize("exits_on", [False, True])
def test_exit_layers_minus_one_exactly_after_eos(base_dirs, exits_on):
    model = ee_model(base_dirs)
    ids, mask = padded_batch(batch=3)
    exit_kwargs = dict(exit_criterion="max_prob", exit_threshold=0.0, exit_check_layers=[1]) if exits_on else {}
    first = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **exit_kwargs)
    eos = int(first[0, ids.shape[1] + 1])  # row 0's second token becomes the EOS
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        **exit_kwargs,
    )
    new = out.sequences[:, ids.shape[1] :]
    decided = 1 if exits_on else LAYERS - 1
    for row in range(ids.shape[0]):
        hits = (new[row] == eos).nonzero()
        end = int(hits[0]) + 1 if hits.numel() else new.shape[1]
        assert (out.exit_layers[row, :end] == decided).all()
        assert (out.exit_layers[row, end:] == -1).all()
    assert (out.exit_layers[0, 2:] == -1).all()


def test_streamer_receives_exactly_the_generated_tokens(base_dirs):
    model = ee_model(base_dirs)
    ids = torch.tensor([[3, 4, 5, 6]])
    streamer = Collect()
    out = model.generate(
        ids, max_new_tokens=5, do_sample=False, exit_criterion="entropy", exit_threshold=0.0, streamer=streamer
    )
    assert streamer.ended
    assert torch.equal(streamer.chunks[0].flatten(), ids[0])  # generate streams the prompt first
    assert torch.cat([c.flatten() for c in streamer.chunks[1:]]).tolist() == out[0, 4:].tolist()


def test_text_iterator_streamer_and_num_return_sequences(base_dirs):
    from threading import Thread

    from transformers import TextIteratorStreamer

    model = ee_model(base_dirs)
    tokenizer = numbered_tokenizer()
    ids = torch.tensor([[3, 4, 5, 6]])
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    kwargs = dict(max_new_tokens=5, do_sample=False, exit_criterion="cosine", exit_threshold=-1.0, streamer=streamer)
    thread = Thread(target=lambda: kwargs.update(result=model.generate(ids, **kwargs)))
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert text.split() == tokenizer.decode(kwargs["result"][0, 4:]).split()
    out = model.generate(
        ids,
        max_new_tokens=3,
        do_sample=True,
        num_return_sequences=3,
        exit_criterion="cosine",
        exit_threshold=-1.0,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == (3, 7) and out.exit_layers.shape == (3, 3)


def test_learned_criterion_uses_confidence_heads(base_dirs):
    model = ee_model(base_dirs)
    ids, mask = padded_batch(batch=2)
    with pytest.raises(ValueError, match="confidence heads"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, exit_criterion="learned", exit_threshold=0.5)
    model.add_confidence_heads()
    with torch.no_grad():
        model.confidence_heads[1].proj.bias.fill_(10.0)  # exit 1 (layer 1) is sure; exit 0 says 0.5
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=3,
        do_sample=False,
        exit_criterion="learned",
        exit_threshold=0.9,
        return_dict_in_generate=True,
    )
    assert (out.exit_layers == 1).all()


def test_exit_stats(base_dirs):
    model = ee_model(base_dirs)
    ids, mask = padded_batch(batch=2)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=0.0,
        exit_check_layers=[1],
        return_dict_in_generate=True,
    )
    stats = eet.ExitStats.from_generate(out, model)
    assert stats.num_tokens == 8 and stats.mean_exit_layer == 1.0
    assert stats.histogram == {1: 8}
    assert stats.compute_saved == pytest.approx(0.5)
    assert "mean exit layer 1.00" in str(stats)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(exit_criterion="loss", exit_threshold=0.5), "exit_criterion.*max_prob"),
        (dict(exit_policy="token", exit_threshold=0.5), "exit_policy.*batch"),
        (dict(exit_kv="lazy", exit_threshold=0.5), "exit_kv.*immediate"),
        (dict(exit_criterion="max_prob", exit_threshold=1.5), "exit_threshold.*1.5"),
        (dict(exit_criterion="cosine", exit_threshold=-2.0), "exit_threshold"),
        (dict(exit_threshold=0.5, exit_patience=-1), "exit_patience"),
        (dict(exit_threshold=0.5, exit_patience=1), "exit_patience"),
        (dict(exit_threshold=0.5, exit_check_layers=[3]), "exit_check_layers"),
        (dict(exit_threshold=[0.5, 0.6]), "exit_threshold"),
        (dict(exit_threshold=0.5, exit_policy="row", exit_kv="deferred"), "deferred"),
        (dict(exit_criterion="max_prob"), "exit_threshold"),
        (dict(exit_threshold=0.5, num_beams=2), "beam"),
    ],
)
def test_bad_exit_arguments(base_dirs, kwargs, match):
    model = ee_model(base_dirs)
    with pytest.raises(ValueError, match=match):
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=2, **kwargs)


def test_exit_arguments_on_a_model_without_exit_heads(base_dirs):
    model = eet.from_base(base_dirs["llama"][0], exit_layers=[])
    ids = torch.tensor([[3, 4]])
    with pytest.raises(ValueError, match="exit_threshold.*no exit heads"):
        model.generate(ids, max_new_tokens=2, exit_threshold=0.5)
    assert model.generate(ids, max_new_tokens=2).shape == (1, 4)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_phi3_cache_restart_at_original_max_positions_equals_base_cut(tmp_path, cache_implementation):
    """Phi-3's `prepare_inputs_for_generation` drops the cache once a sequence outgrows
    `original_max_position_embeddings` (its long rotary factors take over) and recomputes from the whole sequence
    (from transformers 5.20 on; 5.19 feeds only the last token to the emptied cache, at every later step too);
    early-exit decoding must restart the same way as the family's own generate, not append the sequence to the old
    cache."""
    from conftest import make_base

    base = make_base("phi3", original_max_position_embeddings=9)
    base.save_pretrained(tmp_path)
    model = eet.from_base(tmp_path, exit_layers=[0, 1, 2]).eval()
    ids, mask = padded_batch()  # 7 positions + 6 new: the cache restarts when the sequence reaches 10
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        cache_implementation=cache_implementation,
    )
    out = model.generate(
        ids,
        exit_criterion="max_prob",
        exit_threshold=0.0,
        exit_check_layers=[1],
        return_dict_in_generate=True,
        **kwargs,
    )
    expected = cut_at_exit(base, model, 1).generate(ids, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    # what the restart kept (5.20 on: every position but the last token's)
    assert cache_of(out).get_seq_length() == cache_of(expected).get_seq_length()


@pytest.mark.parametrize(
    "family_name, targets", [("phi3", ["qkv_proj"]), ("gpt2", ["c_attn"]), ("llama", ["k_proj", "v_proj"])]
)
def test_backfill_goes_through_lora_wrapped_projections(base_dirs, family_name, targets):
    """Backfill calls the projection modules (a fused one whole, its K/V part sliced after the call), so a LoRA
    adapter on them takes part: the backfilled K/V equal the merged model's own."""
    import copy

    from peft import LoraConfig, get_peft_model

    folder, base = base_dirs[family_name]
    peft_model = get_peft_model(ee_model(base_dirs, family_name), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    torch.manual_seed(2)
    with torch.no_grad():  # a LoRA delta that matters (lora_B starts at zero)
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    ids, mask = padded_batch()
    out = peft_model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=0.0,
        exit_check_layers=[1],
        return_dict_in_generate=True,
    )
    assert (out.exit_layers == 1).all()
    merged = copy.deepcopy(base)  # the plain model with the LoRA deltas merged into its weights
    state = peft_model.merge_and_unload().state_dict()
    merged.load_state_dict({k: v for k, v in state.items() if not k.startswith("exit_heads.")})
    cached_ids = out.sequences[:, :-1]
    full_mask = extended_mask(mask, cached_ids.shape[1])
    exit_states, positions = _states_leaving(merged, cached_ids, full_mask, layer=1)
    new = cached_ids.shape[1] - ids.shape[1]
    for j in (2, 3):
        reference = own_kv(merged, j, exit_states, full_mask, positions)
        for kind in ("keys", "values"):
            got, want = cached(cache_of(out).layers[j], kind), cached(reference, kind)
            torch.testing.assert_close(
                got[:, :, -new:], want[:, :, -new:], rtol=1e-4, atol=1e-4, msg=lambda m: f"layer {j} {kind}: {m}"
            )
        without_lora = cached(own_kv(base, j, exit_states, full_mask, positions), "values")
        assert not torch.allclose(without_lora[:, :, -new:], want[:, :, -new:], atol=1e-3)  # the delta shows
