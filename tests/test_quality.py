"""Issue 14: one definition per quality measure (ee_transformers.measure.quality), as calibrate, bench and the demo use
them."""

import torch
from conftest import padded_batch

import ee_transformers as eet
from ee_transformers.measure.quality import full_model_view, identical_share, perplexity
from ee_transformers.tools import bench


def test_full_depth_greedy_text_agrees_with_itself_everywhere(base_dirs):
    folder, base = base_dirs["llama"]
    ids, mask = padded_batch()
    out = base.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    view = full_model_view(base, out, ids.shape[1], mask)
    assert view["tokens"] == 15 and view["agree"] == 15, "greedy tokens are the full model's argmax by construction"
    assert all(r["matches"] == 5 and r["first_divergence"] == 5 for r in identical_share(out[:, 7:], out[:, 7:]))


def test_one_early_difference_keeps_per_token_agreement_but_not_identical_share(base_dirs):
    folder, base = base_dirs["llama"]
    ids = torch.tensor([[5, 6, 7, 8]])
    full = base.generate(ids, max_new_tokens=6, do_sample=False)
    first = (int(full[0, 4]) + 1) % 90 + 2  # another first token, then the full model's greedy continuation of it
    other = base.generate(torch.cat([ids, torch.tensor([[first]])], 1), max_new_tokens=5, do_sample=False)
    view = full_model_view(base, other, 4)
    assert view["agree"] == 5 and view["tokens"] == 6, "only the changed token disagrees given its own prefix"
    share = identical_share(full[:, 4:], other[:, 4:])[0]
    assert share["first_divergence"] == 0 and share["matches"] < 6
    own = full_model_view(base, full, 4)
    assert perplexity(own["nll"], own["tokens"]) < perplexity(view["nll"], view["tokens"])


def test_bench_reports_every_measure(base_dirs):
    model = eet.from_base(base_dirs["llama"][0], exit_layers=[0, 1, 2]).eval()
    plain = bench.plain_twin(model)
    prompts = bench.random_prompts(99, 2, window=6)
    config = bench.BenchConfig(new_tokens=4, repeats=1, max_batches=[1], warmup=False)
    off = bench.compare(model, plain, prompts, {"early_exit": False}, config=config, batch_size=2)
    assert off["quality"]["per_token_agreement"] == 1.0 and off["agreement"]["share"] == 1.0
    assert abs(off["quality"]["continuation_ppl"] - off["quality"]["full_depth_ppl"]) < 1e-9
    on = bench.compare(
        model, plain, prompts, {"exit_criterion": "max_prob", "exit_threshold": 0.0}, config=config, batch_size=2
    )
    assert 0.0 <= on["quality"]["per_token_agreement"] <= 1.0 and on["exits"]["mean_exit_layer"] == 0


def test_card_snippet_uses_the_stored_settings(base_dirs, tmp_path):
    from ee_transformers.utils.model_card import render_model_card

    model = eet.from_base(base_dirs["llama"][0], exit_layers=[0, 1, 2])
    bare = render_model_card(model)
    assert 'exit_criterion="max_prob", exit_threshold=0.9' in bare and "No exit settings are stored" in bare
    assert "calibrate the folder" in bare
    turned_down = render_model_card(model, {"calibration": "**Early exit is off by default** (...)"})
    assert "calibration kept none" in turned_down and "calibrate the folder" not in turned_down
    model.set_exit_defaults(exit_criterion="entropy", exit_threshold=0.7)
    card = render_model_card(model)
    assert "exit_threshold=0.9" not in card, "no hand-written settings once some are stored"
    assert "stored (calibrated) exit settings apply" in card and "criterion `entropy`, threshold `0.7`" in card
