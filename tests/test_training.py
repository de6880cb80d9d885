"""Tests for training/: data reading and packing, the exit-head fitter (frozen backbone, LoRA, quantized backbone,
confidence heads), resumable checkpoints and the `fit` command. Tiny random models only."""

import json
import os

import pytest
import torch

import ee_transformers as eet
from ee_transformers.tools.fit import main
from ee_transformers.training.checkpoint import list_checkpoints
from ee_transformers.training.data import (
    check_block_size,
    load_blocks,
    pack_token_ids,
    read_texts,
    split_blocks,
    tokenize_blocks,
)
from ee_transformers.training.fit_exit_heads import FitConfig, evaluate_exits, fit_exit_heads, save_model_folder
from ee_transformers.training.tiny import save_tiny_base, tiny_texts, tiny_tokenizer, write_texts

torch.set_num_threads(1)
QUIET = dict(progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base folder, data files, train blocks, held-out blocks) for a tiny Llama."""
    root = tmp_path_factory.mktemp("tiny")
    base = save_tiny_base(root / "base")
    files = write_texts(root / "text", tiny_texts())
    splits = load_blocks(files, tiny_tokenizer(), 32, heldout_fraction=0.2)
    return base, files, splits.train, splits.heldout


def load(base, **kwargs):
    torch.manual_seed(1234)  # the exit adapters' random down-projections
    return eet.from_base(base, exit_layers=[1, 2], exit_head="adapter", exit_adapter_rank=8, **kwargs)


def heads_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("exit_heads.")}


# ------------------------------------------------------------------------------------------------------------ data
def test_read_texts_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("w1 w2 w3")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "w4 w5"}) + "\n\n" + json.dumps({"text": "w6"}) + "\n")
    texts = read_texts([str(tmp_path / "*.txt"), str(tmp_path / "b.jsonl")])
    assert texts == ["w1 w2 w3", "w4 w5", "w6"]


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "matches no file"),
        (lambda d: (d / "x.txt").write_text("   \n"), "every file is empty"),
        (lambda d: (d / "x.txt").write_bytes(b"\xff\xfe\x00\x81binary"), "not UTF-8"),
        (lambda d: (d / "x.jsonl").write_text('{"body": "w1"}\n'), "no string field `text`"),
        (lambda d: (d / "x.jsonl").write_text('{"text": "w1"\n'), "not valid JSON"),
    ],
)
def test_read_texts_errors_name_the_problem(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(ValueError, match=message):
        read_texts([str(tmp_path / "x.*")])


def test_pack_and_split():
    blocks = pack_token_ids([[5, 6, 7], [8, 9]], block_size=3, separator=98)
    assert blocks.tolist() == [[5, 6, 7], [98, 8, 9]], "documents are concatenated with EOS between them, tail dropped"
    with pytest.raises(ValueError, match="fewer than one block"):
        pack_token_ids([[1, 2]], block_size=8)
    splits = split_blocks(torch.arange(40).view(10, 4), heldout_fraction=0.2, seed=0)
    assert splits.train.shape == (8, 4) and splits.heldout.shape == (2, 4)
    assert not set(splits.train[:, 0].tolist()) & set(splits.heldout[:, 0].tolist()), "train and held-out overlap"
    blocks = tokenize_blocks(["w1 w2 w3 w4", "w5 w6"], tiny_tokenizer(), 3)
    assert blocks.tolist() == [[4, 5, 6], [7, 98, 8]]


def test_block_size_beyond_positions():
    class Config:
        max_position_embeddings = 64

    check_block_size(64, Config)
    with pytest.raises(ValueError, match="beyond the model's positions"):
        check_block_size(65, Config)


def test_fit_config_validates():
    with pytest.raises(ValueError, match="`steps`"):
        FitConfig(steps=0)
    with pytest.raises(ValueError, match="`layer_dropout` needs `lora_rank`"):
        FitConfig(layer_dropout=0.1)


# ---------------------------------------------------------------------------------------------------- the fitter
def test_frozen_backbone_is_bit_identical_and_heads_learn(tiny):
    base, _, train, heldout = tiny
    model = load(base)
    backbone = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("exit_heads.")}
    heads = heads_of(model)
    result = fit_exit_heads(model, train, heldout, FitConfig(steps=12, batch_size=4, lr=1e-2, **QUIET))
    after = model.state_dict()
    changed = [k for k, v in backbone.items() if not torch.equal(v, after[k])]
    assert not changed, f"the frozen backbone changed: {changed}"
    assert all(not torch.equal(v, after[k]) for k, v in heads.items()), "every exit-head tensor should have trained"
    assert result.kl_after[1] < result.kl_before[1], (
        f"distillation should lower the KL: {result.kl_before} -> {result.kl_after}"
    )
    assert len(result.history) == 12 and len(result.history[-1]["agreement"]) == 2


def test_bf16_mixed_precision_after_fp32_runs(tiny):
    base, _, train, heldout = tiny
    fit_exit_heads(load(base), train, None, FitConfig(steps=1, batch_size=2, **QUIET))
    model = load(base)
    heads = heads_of(model)
    fit_exit_heads(model, train, None, FitConfig(steps=2, batch_size=2, lr=1e-2, mixed_precision="bf16", **QUIET))
    assert all(v.dtype == torch.float32 for v in heads_of(model).values()), "master weights stay fp32 under autocast"
    assert any(not torch.equal(v, heads_of(model)[k]) for k, v in heads.items())
    fit_exit_heads(load(base), train, None, FitConfig(steps=1, batch_size=2, **QUIET))  # and back


def test_evaluate_exits_matches_exit_logits(tiny):
    base, _, _, heldout = tiny
    model = load(base).eval()
    ids = heldout[:2]
    with torch.no_grad():
        out = model(ids, output_exit_logits=True)
    expected = [float((e.argmax(-1) == out.logits.argmax(-1)).double().mean()) for e in out.exit_logits]
    got = evaluate_exits(model, ids)["agreement"]
    assert got == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("lora", [0, 2], ids=["frozen", "lora"])
def test_resume_equals_uninterrupted(tiny, tmp_path, lora):
    base, _, train, heldout = tiny
    extra = dict(lora_rank=lora, lora_lr=1e-2, layer_dropout=0.3) if lora else {}
    config = FitConfig(
        steps=6, batch_size=2, grad_accum=2, lr=1e-2, warmup_steps=2, checkpoint_every=3, **extra, **QUIET
    )
    full = fit_exit_heads(load(base), train, heldout, config, checkpoint_dir=tmp_path / "a").model

    class Killed(Exception):
        pass

    def kill_at_3(step, metrics):
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        fit_exit_heads(load(base), train, heldout, config, checkpoint_dir=tmp_path / "b", on_step=kill_at_3)
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path / "b")] == ["step-0000003"]
    torch.manual_seed(999)  # a fresh process: other global RNG state, other initial heads
    resumed = eet.from_base(base, exit_layers=[1, 2], exit_head="adapter", exit_adapter_rank=8)
    result = fit_exit_heads(resumed, train, heldout, config, checkpoint_dir=tmp_path / "b", resume="auto")
    a, b = full.state_dict(), result.model.state_dict()  # heads (and, with LoRA, the merged backbone)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "a resumed run must end with exactly the uninterrupted weights"
    if lora:
        assert any(
            not torch.equal(v, eet.from_base(base).state_dict()[k])
            for k, v in b.items()
            if k.startswith("model.layers.")
        ), "LoRA should have moved the merged backbone"
    assert len(result.history) == 6
    files = sorted(os.listdir(list_checkpoints(tmp_path / "b")[-1]))
    assert files == ["optimizer.safetensors", "rng.safetensors", "state.json", "trainable.safetensors"]


def test_resume_with_other_exit_layers_is_refused(tiny, tmp_path):
    base, _, train, _ = tiny
    config = FitConfig(steps=2, batch_size=2, checkpoint_every=1, **QUIET)
    fit_exit_heads(load(base), train, None, config, checkpoint_dir=tmp_path)
    other = eet.from_base(base, exit_layers=[0, 2], exit_head="adapter", exit_adapter_rank=8)
    with pytest.raises(ValueError, match="exit_layers"):
        fit_exit_heads(other, train, None, config, checkpoint_dir=tmp_path, resume="auto")


def test_lora_fit_merge_save_reload_generate(tiny, tmp_path):
    base, _, train, heldout = tiny
    model = load(base)
    original = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("model.layers.")}
    config = FitConfig(steps=4, batch_size=2, lr=1e-2, lora_rank=4, lora_lr=1e-2, layer_dropout=0.2, **QUIET)
    result = fit_exit_heads(model, train, heldout, config)
    merged = result.model
    assert type(merged).__name__ == "EarlyExitLlamaForCausalLM", "LoRA must be merged back into the plain class"
    assert not any("lora_" in k for k in merged.state_dict()), "merged weights hold no adapter tensors"
    assert any(not torch.equal(v, merged.state_dict()[k]) for k, v in original.items()), "LoRA moved no weight"
    assert result.final_agreement is not None and 0.0 <= result.final_agreement <= 1.0
    out = save_model_folder(merged, tmp_path / "ee", tiny_tokenizer())
    reloaded = eet.from_base(out)
    prompt = heldout[:1, :6]
    a = merged.generate(prompt, max_new_tokens=5, do_sample=False, early_exit=False)
    b = reloaded.generate(prompt, max_new_tokens=5, do_sample=False, early_exit=False)
    assert torch.equal(a, b), "the saved LoRA-merged model must generate exactly like the in-memory one"
    ee_out = reloaded.generate(
        prompt, max_new_tokens=5, exit_criterion="max_prob", exit_threshold=0.0, return_dict_in_generate=True
    )
    assert ee_out.exit_layers.min().item() == 1, "threshold 0 exits every token at the first exit"


def test_confidence_heads_stage(tiny):
    base, _, train, heldout = tiny
    model = load(base)
    result = fit_exit_heads(model, train, heldout, FitConfig(steps=2, batch_size=2, confidence_steps=20, **QUIET))
    assert model.config.exit_confidence_heads and model.confidence_heads is not None
    assert any(float(h.proj.weight.abs().sum()) > 0 for h in model.confidence_heads), "confidence heads untrained"
    assert len(result.confidence["accuracy"]) == 2
    out = model.generate(
        heldout[:1, :6], max_new_tokens=4, exit_criterion="learned", exit_threshold=0.0, return_dict_in_generate=True
    )
    assert out.exit_layers.min().item() == 1


# ----------------------------------------------------------------------------------------------------------- cli
def fit_args(base, files, out, *extra):
    return [
        "--model",
        base,
        "--exit-layers",
        "1,2",
        "--exit-adapter-rank",
        "8",
        "--data",
        *files,
        "--block-size",
        "32",
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]


def test_cli_fit_writes_hub_ready_folder(tiny, tmp_path):
    base, files, _, _ = tiny
    out = tmp_path / "my-ee"
    assert main(fit_args(base, files, out, "--checkpoint-every", "2")) == 0
    names = set(os.listdir(out))
    assert {
        "config.json",
        "model.safetensors",
        "README.md",
        "fit_report.json",
        "tokenizer.json",
        "modeling_early_exit.py",
    } <= names, names
    config = json.loads((out / "config.json").read_text())
    assert config["exit_layers"] == [1, 2] and "AutoModelForCausalLM" in config["auto_map"]
    card = (out / "README.md").read_text()
    assert "before fitting" in card and "after fitting" in card and "frozen (bit-identical" in card
    assert not [n for n in os.listdir(tmp_path) if ".partial" in n], "a temporary folder was left behind"
    assert list_checkpoints(str(out) + ".checkpoints"), "checkpoints go next to, not into, the model folder"
    model = eet.from_base(out)
    base_model = eet.from_base(base)
    for k, v in base_model.model.state_dict().items():
        assert torch.equal(v, model.model.state_dict()[k]), f"saved backbone differs from the base at {k}"
    assert model.tokenizer is not None


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--block-size", "4096"], "beyond the model's positions"),
        (["--exit-layers", "1,9"], "out of range"),
        (["--resume", "nowhere-such"], "no checkpoint"),
    ],
)
def test_cli_fit_bad_input_fails_before_work(tiny, tmp_path, capsys, extra, message):
    base, files, _, _ = tiny
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        main(fit_args(base, files, out) + extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists(), "a failed run must not leave an output folder"


def test_cli_fit_unreadable_data(tiny, tmp_path, capsys):
    base, _, _, _ = tiny
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\x80\x81\x82")
    with pytest.raises(SystemExit):
        main(fit_args(base, [str(bad)], tmp_path / "never"))
    assert "bad.txt: not UTF-8" in capsys.readouterr().err


def test_cli_resume_with_other_exit_layers(tiny, tmp_path, capsys):
    base, files, _, _ = tiny
    out = tmp_path / "run"
    main(fit_args(base, files, out, "--checkpoint-every", "1"))
    with pytest.raises(SystemExit):
        main(
            fit_args(
                base,
                files,
                tmp_path / "run2",
                "--checkpoint-dir",
                str(out) + ".checkpoints",
                "--resume",
                "auto",
                "--exit-layers",
                "0,2",
            )
        )
    assert "disagree with the checkpoint" in capsys.readouterr().err


def test_cli_fit_4bit_qwen3_lora_kept(tmp_path):
    """Second family, quantized frozen backbone (bitsandbytes works on this CPU), LoRA adapters kept unmerged: the
    folder holds the original full-precision backbone plus the adapter, and loads without bitsandbytes."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    # bitsandbytes >= 0.50 packs CPU 4-bit weights in blocks of 64 input features: a real model's widths are
    # multiples of that (outputs too), the tiny defaults are not
    base = save_tiny_base(
        tmp_path / "qwen3", family="qwen3", hidden_size=64, intermediate_size=128, head_dim=16, num_key_value_heads=4
    )
    files = write_texts(tmp_path / "text", tiny_texts(n_docs=3), kind="jsonl")
    out = tmp_path / "q"
    assert main(fit_args(base, files, out, "--load-in-4bit", "--lora-rank", "4", "--keep-adapters")) == 0
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config, "the saved folder must not need bitsandbytes"
    assert (out / "lora_adapter" / "adapter_config.json").exists()
    from peft import PeftModel

    model = eet.from_base(out)
    plain = eet.from_base(base)
    for k, v in plain.model.state_dict().items():
        assert torch.equal(v, model.model.state_dict()[k]), "kept adapters: the stored backbone is the original"
    peft_model = PeftModel.from_pretrained(model, str(out / "lora_adapter"))
    ids = torch.tensor([[5, 6, 7, 8]])
    assert peft_model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, early_exit=False).shape == (1, 7)
    report = json.loads((out / "fit_report.json").read_text())
    assert report["final_agreement"] is not None
    assert "loaded in 4-bit" in (out / "README.md").read_text()


@pytest.mark.parametrize("family", ["gpt2", "gemma2", "phi3"])
def test_fit_and_calibration_scores_go_through_the_family_adapter(tmp_path, family):
    """GPT-2 keeps its decoder in `transformer`, Gemma 2 soft-caps its logits: training and calibration must see the
    model as the runtime does (exit logits equal the runtime's own, soft-cap included)."""
    from ee_transformers.training.calibrate import collect_exit_scores

    base = save_tiny_base(tmp_path / family, family=family)
    model = eet.from_base(base, exit_layers=[0, 1, 2])
    blocks = tokenize_blocks(tiny_texts(n_docs=3), tiny_tokenizer(), 16)[:4]
    result = fit_exit_heads(model, blocks, blocks[:2], FitConfig(steps=2, batch_size=2, progress=False))
    assert len(result.agreement_after) == 3
    data = collect_exit_scores(model.eval(), blocks[:2], "max_prob")
    with torch.no_grad():
        exit_logits = model(blocks[:2], output_exit_logits=True).exit_logits
    expected = torch.stack([e.argmax(-1).flatten() for e in exit_logits], 1)
    assert torch.equal(data["argmax"], expected)
