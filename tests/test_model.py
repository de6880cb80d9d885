"""Issue 2: the model classes, conversion, saving and remote-code loading, over the family matrix."""

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import FAMILIES, cut_at_exit, decoder_names, padded_batch
from helpers import numbered_tokenizer
from transformers import AutoModel, AutoModelForCausalLM, BertConfig

import ee_transformers as eet

# plain model_type -> (early-exit causal LM, early-exit model_type)
EXPECTED = {
    "llama": ("EarlyExitLlamaForCausalLM", "early_exit_llama"),
    "mistral": ("EarlyExitMistralForCausalLM", "early_exit_mistral"),
    "qwen2": ("EarlyExitQwen2ForCausalLM", "early_exit_qwen2"),
    "qwen3": ("EarlyExitQwen3ForCausalLM", "early_exit_qwen3"),
    "gemma3_text": ("EarlyExitGemma3ForCausalLM", "early_exit_gemma3"),
    "gemma2": ("EarlyExitGemma2ForCausalLM", "early_exit_gemma2"),
    "phi3": ("EarlyExitPhi3ForCausalLM", "early_exit_phi3"),
    "olmo2": ("EarlyExitOlmo2ForCausalLM", "early_exit_olmo2"),
    "gpt2": ("EarlyExitGPT2ForCausalLM", "early_exit_gpt2"),
}


def expected(base):
    return EXPECTED[base.config.model_type]


def test_from_base_picks_the_family_class(base_dirs, family):
    folder, base = base_dirs[family]
    model = eet.from_base(folder, exit_layers=[0, 2])
    cls_name, model_type = expected(base)
    assert type(model).__name__ == cls_name
    assert model.config.model_type == model_type
    assert model.config.exit_layers == [0, 2]
    assert isinstance(model.config, type(model).config_class)
    assert isinstance(model, type(base))  # the family's own class underneath: same modules, same weight names
    # the per-family class loads the same way
    direct = type(model).from_pretrained(folder, exit_layers=[1])
    assert direct.config.exit_layers == [1]


def test_lm_head_is_shared_not_copied(base_dirs, family):
    model = eet.from_base(base_dirs[family][0], exit_layers=[0, 1, 2])
    names = [name for name, _ in model.named_parameters()]
    assert sum("lm_head" in name for name in names) <= 1
    assert not any("lm_head" in name for name in names if name.startswith("exit_heads"))


def test_exits_disabled_forward_is_bit_identical_to_base(base_dirs, family):
    folder, base = base_dirs[family]
    model = eet.from_base(folder, exit_layers=[0, 1, 2]).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        expected_logits = base(ids, attention_mask=mask).logits
        out = model(ids, attention_mask=mask, output_exit_logits=True)
    assert torch.equal(out.logits, expected_logits)
    assert len(out.exit_logits) == 3
    assert all(t.shape == expected_logits.shape for t in out.exit_logits)


def test_exit_logits_equal_base_cut_at_exit_plus_head(base_dirs, family):
    folder, base = base_dirs[family]
    model = eet.from_base(folder, exit_layers=[0, 2], exit_head="adapter", exit_adapter_rank=4).eval()
    torch.manual_seed(3)
    with torch.no_grad():  # make the heads non-trivial so the check can fail
        for head in model.exit_heads:
            head.norm.weight.mul_(torch.rand_like(head.norm.weight) + 0.5)
            head.up.weight.normal_(std=0.1)
    ids, mask = padded_batch()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_exit_logits=True)
        for i in range(len(model.config.exit_layers)):
            # the family's own forward, cut after the exit layer, with the exit head as its final norm (and the
            # family's own LM head and final logit soft-cap after it)
            reference = cut_at_exit(base, model, i)(ids, attention_mask=mask).logits
            torch.testing.assert_close(out.exit_logits[i], reference, rtol=0, atol=0)


def test_fresh_exit_heads_are_the_final_norm_and_adapters_start_silent(base_dirs, family):
    folder, base = base_dirs[family]
    decoder, _, norm = decoder_names(base)
    final_norm = getattr(getattr(base, decoder), norm)
    norm_model = eet.from_base(folder, exit_layers=[1, 2])
    adapter_model = eet.from_base(folder, exit_layers=[1, 2], exit_head="adapter", exit_adapter_rank=4)
    ids, mask = padded_batch()
    for model in (norm_model, adapter_model):
        for head in model.exit_heads:
            # the final norm's own type (GPT-2: LayerNorm with bias; Gemma: weights stored as w for a 1 + w scale),
            # and its parameters: a fresh head is exactly "apply the final norm early"
            assert type(head.norm) is type(final_norm)
            assert head.norm.state_dict().keys() == final_norm.state_dict().keys()
            for name, value in final_norm.state_dict().items():
                assert torch.equal(head.norm.state_dict()[name], value), name
            x = torch.randn(2, 3, base.config.hidden_size)
            assert torch.equal(head.norm(x), final_norm(x))  # same eps, same convention
    assert all((head.up.weight == 0).all() for head in adapter_model.exit_heads)
    with torch.no_grad():
        a = norm_model(ids, attention_mask=mask, output_exit_logits=True).exit_logits
        b = adapter_model(ids, attention_mask=mask, output_exit_logits=True).exit_logits
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_missing_heads_are_reported_once_by_name(base_dirs, caplog):
    folder, _ = base_dirs["llama"]
    with caplog.at_level(logging.WARNING):
        eet.from_base(folder, exit_layers=[0, 2])
    text = caplog.text
    assert "exit_heads.0" in text and "exit_heads.1" in text
    assert text.count("exit_heads.0") == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(exit_layers=[5]), "out of range"),
        (dict(exit_layers=[3]), "last layer"),
        (dict(exit_layers=[-1]), "out of range"),
        (dict(exit_layers=[1, 1]), "duplicates"),
        (dict(exit_layers=[2, 1]), "sorted"),
        (dict(exit_layers=[1], exit_head="mlp"), "exit_head"),
        (dict(exit_layers=[1], exit_head="adapter", exit_adapter_rank=0), "exit_adapter_rank"),
    ],
)
def test_bad_arguments_fail_before_weights_load(base_dirs, tmp_path, kwargs, match):
    # a folder whose weights are unreadable: a ValueError proves validation ran before loading
    shutil.copy(os.path.join(base_dirs["llama"][0], "config.json"), tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=match) as info:
        eet.from_base(tmp_path, **kwargs)
    assert "exit_" in str(info.value)


def test_unsupported_family_names_the_supported_ones(tmp_path):
    BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="bert") as info:
        eet.from_base(tmp_path, exit_layers=[0])
    for name in eet.FAMILIES:
        assert repr(name) in str(info.value)


@pytest.mark.parametrize(
    "family, overrides, field",
    [
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),  # EmbeddingGemma
        ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),  # GPT-2 inside an encoder-decoder
    ],
)
def test_variants_that_are_not_causal_lms_are_refused_by_name(tmp_path, family, overrides, field):
    from conftest import make_base

    make_base(family, **overrides).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"`{field}=True`.*allowed value is False"):
        eet.from_base(tmp_path, exit_layers=[0])


REMOTE_SCRIPT = textwrap.dedent("""
    import importlib.abc, json, socket, sys, traceback
    class NoPackage(importlib.abc.MetaPathFinder):  # ee_transformers must not be importable
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "ee_transformers":
                raise ImportError("ee_transformers is blocked in this test")
    sys.meta_path.insert(0, NoPackage())
    def no_network(*args, **kwargs):
        raise RuntimeError("the remote code used the network")
    socket.socket.connect = no_network
    import pickle
    def no_pickle(*args, **kwargs):
        raise RuntimeError("the remote code unpickled something")
    pickle.load = pickle.loads = no_pickle
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    folders, ids = json.load(open(sys.argv[1]))
    ids = torch.tensor(ids)
    for family, folder in folders.items():  # one process for every family: importing transformers is the slow part
        try:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            decoder = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
            with torch.no_grad():
                logits = model(ids, output_exit_logits=True)
                hidden = decoder(ids, output_exit_hidden_states=True)
            out = model.generate(ids, max_new_tokens=4, do_sample=False, exit_criterion="max_prob",
                                 exit_threshold=0.0, return_dict_in_generate=True)
            result = {"class": type(model).__name__, "decoder_class": type(decoder).__name__,
                      "model_type": config.model_type, "exit_layers": config.exit_layers,
                      "logits_sum": float(logits.logits.double().sum()),
                      "exit_sum": float(logits.exit_logits[0].double().sum()),
                      "hidden_sum": float(hidden.last_hidden_state.double().sum()),
                      "exit_hidden_sum": float(hidden.exit_hidden_states[0].double().sum()),
                      "tokens": out.sequences.tolist(), "exits": out.exit_layers.tolist(),
                      "package_loaded": "ee_transformers" in sys.modules}
        except Exception:
            result = {"error": traceback.format_exc()}
        print(json.dumps({"family": family, **result}), flush=True)
""")
REMOTE_IDS = [[5, 6, 7, 8], [9, 10, 11, 12]]


@pytest.fixture(scope="module")
def saved_folders(base_dirs, tmp_path_factory):
    """Every family converted (adapter heads, non-trivial), saved with a tokenizer, and loaded back in ONE fresh
    process where `ee_transformers` cannot be imported: {family: (model, folder, what the process saw)}."""
    root = tmp_path_factory.mktemp("saved")
    models, folders = {}, {}
    for family in FAMILIES:
        model = eet.from_base(base_dirs[family][0], exit_layers=[0, 2], exit_head="adapter", exit_adapter_rank=4).eval()
        torch.manual_seed(5)
        with torch.no_grad():
            model.exit_heads[0].up.weight.normal_(std=0.1)  # saved heads must come back as they are
        model.tokenizer = numbered_tokenizer()
        model.save_pretrained(root / family)
        models[family], folders[family] = model, str(root / family)
    (root / "inputs.json").write_text(json.dumps([folders, REMOTE_IDS]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(root / "hf")}
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(root / "inputs.json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=600,
    )
    seen = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            seen[entry.pop("family")] = entry
    log = f"exit code {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return {family: (models[family], root / family, seen.get(family, {"error": log})) for family in FAMILIES}


def test_saved_folder_is_hub_ready_and_loads_without_the_package(saved_folders, base_dirs, family):
    model, out_dir, remote = saved_folders[family]
    cls_name, model_type = expected(base_dirs[family][1])
    files = set(os.listdir(out_dir))
    assert {
        "model.safetensors",
        "config.json",
        "README.md",
        "tokenizer.json",
        "modeling_early_exit.py",
        "configuration_early_exit.py",
    } <= files
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in files)
    config = json.loads((out_dir / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == f"modeling_early_exit.{cls_name}"
    assert config["auto_map"]["AutoModel"] == f"modeling_early_exit.{model.base_model_class.__name__}"
    assert config["exit_layers"] == [0, 2]
    card = (out_dir / "README.md").read_text()
    front = card.split("---")[1]
    for line in (
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "base_model:",
        "tags: [early-exit, custom_code]",
        "exit_layers: [0, 2]",
    ):
        assert line in front
    assert "trust_remote_code=True" in card

    assert "error" not in remote, remote["error"]
    assert remote["class"] == cls_name and remote["model_type"] == model_type
    assert remote["decoder_class"] == model.base_model_class.__name__
    assert remote["package_loaded"] is False
    ids = torch.tensor(REMOTE_IDS)
    with torch.no_grad():
        local = model(ids, output_exit_logits=True)
        hidden = model.get_decoder()(ids).last_hidden_state
    assert remote["logits_sum"] == pytest.approx(float(local.logits.double().sum()), rel=1e-6)
    assert remote["exit_sum"] == pytest.approx(float(local.exit_logits[0].double().sum()), rel=1e-6)
    assert remote["hidden_sum"] == pytest.approx(float(hidden.double().sum()), rel=1e-6)
    assert all(layer == 0 for row in remote["exits"] for layer in row)
    local_tokens = model.generate(ids, max_new_tokens=4, do_sample=False, exit_criterion="max_prob", exit_threshold=0.0)
    assert remote["tokens"] == local_tokens.tolist()

    again = eet.from_base(out_dir)  # and back through our own loader, tokenizer included
    assert again.tokenizer is not None
    assert torch.equal(again.exit_heads[0].up.weight, model.exit_heads[0].up.weight)


def test_auto_model_is_the_family_decoder_plus_exit_features(saved_folders, base_dirs, family):
    model, out_dir, _ = saved_folders[family]
    base = base_dirs[family][1]
    decoder = AutoModel.from_pretrained(out_dir, trust_remote_code=True).eval()
    assert type(decoder).__name__ == model.base_model_class.__name__
    assert isinstance(decoder, type(base.get_decoder()))
    ids, mask = padded_batch()
    with torch.no_grad():
        out = decoder(ids, attention_mask=mask, output_exit_hidden_states=True)
        want = base.get_decoder()(ids, attention_mask=mask, output_hidden_states=True)
    assert torch.equal(out.last_hidden_state, want.last_hidden_state)
    for i, layer in enumerate(model.config.exit_layers):
        with torch.no_grad():
            head = model.exit_heads[i](want.hidden_states[layer + 1])
        assert torch.equal(out.exit_hidden_states[i], head)


def test_auto_class_loads_in_process_with_package(base_dirs, tmp_path):
    model = eet.from_base(base_dirs["qwen3"][0], exit_layers=[1])
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    assert loaded.config.model_type == "early_exit_qwen3"
    assert loaded.config.exit_layers == [1]


def test_convert_cli(base_dirs, tmp_path):
    from ee_transformers.tools.cli import main

    out = tmp_path / "converted"
    assert (
        main(
            [
                "convert",
                str(base_dirs["mistral"][0]),
                str(out),
                "--exit-layers",
                "0,2",
                "--exit-head",
                "adapter",
                "--exit-adapter-rank",
                "4",
            ]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["exit_layers"] == [0, 2] and config["exit_head"] == "adapter"
    with pytest.raises(SystemExit):
        main(["convert", str(base_dirs["mistral"][0]), str(tmp_path / "bad"), "--exit-layers", "3"])
    assert not (tmp_path / "bad").exists()
