"""Issue 2: the model classes, conversion, saving and remote-code loading."""

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

import ee_transformers as eet
from conftest import FAMILIES, padded_batch

EXPECTED = {
    "llama": ("EarlyExitLlamaForCausalLM", "early_exit_llama"),
    "mistral": ("EarlyExitMistralForCausalLM", "early_exit_mistral"),
    "qwen2": ("EarlyExitQwen2ForCausalLM", "early_exit_qwen2"),
    "qwen3": ("EarlyExitQwen3ForCausalLM", "early_exit_qwen3"),
}


def test_from_base_picks_family_class(base_dirs, family):
    folder, _ = base_dirs[family]
    model = eet.from_base(folder, exit_layers=[0, 2])
    cls_name, model_type = EXPECTED[family]
    assert type(model).__name__ == cls_name
    assert model.config.model_type == model_type
    assert model.config.exit_layers == [0, 2]
    assert isinstance(model.config, type(model).config_class)
    # the per-family class loads the same way
    direct = getattr(eet, cls_name).from_pretrained(folder, exit_layers=[1])
    assert direct.config.exit_layers == [1]


def test_lm_head_is_shared_not_copied(base_dirs):
    model = eet.from_base(base_dirs["llama"][0], exit_layers=[0, 1, 2])
    names = [name for name, _ in model.named_parameters()]
    assert sum("lm_head" in name for name in names) <= 1
    assert not any("lm_head" in name for name in names if name.startswith("exit_heads"))


def test_forward_is_bit_identical_to_base(base_dirs, family):
    folder, base = base_dirs[family]
    model = eet.from_base(folder, exit_layers=[0, 1, 2]).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = base(ids, attention_mask=mask).logits
        out = model(ids, attention_mask=mask, output_exit_logits=True)
    assert torch.equal(out.logits, expected)
    assert len(out.exit_logits) == 3
    assert all(t.shape == expected.shape for t in out.exit_logits)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_generate_is_bit_identical_to_base(base_dirs, family, cache_implementation):
    folder, base = base_dirs[family]
    model = eet.from_base(folder, exit_layers=[0, 2]).eval()
    ids, mask = padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation=cache_implementation)
    expected = base.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, **kwargs), expected)
    out = model.generate(ids, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert (out.exit_layers == model.config.num_hidden_layers - 1).all()


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
        hidden = base(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        out = model(ids, attention_mask=mask, output_exit_logits=True)
        for i, layer in enumerate(model.config.exit_layers):
            head = model.exit_heads[i]
            x = head.norm(hidden[layer + 1])
            x = x + head.up(torch.nn.functional.silu(head.down(x)))
            torch.testing.assert_close(out.exit_logits[i], base.lm_head(x), rtol=0, atol=0)


def test_fresh_heads_equal_final_norm_and_adapter_starts_silent(base_dirs):
    folder, base = base_dirs["llama"]
    with torch.no_grad():
        base_norm = base.model.norm.weight.clone()
    norm_model = eet.from_base(folder, exit_layers=[1, 2])
    adapter_model = eet.from_base(folder, exit_layers=[1, 2], exit_head="adapter", exit_adapter_rank=4)
    ids, mask = padded_batch()
    for model in (norm_model, adapter_model):
        for head in model.exit_heads:
            assert torch.equal(head.norm.weight, base_norm)
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
    GPT2Config(n_layer=2, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt2") as info:
        eet.from_base(tmp_path, exit_layers=[0])
    for name in FAMILIES:
        assert name in str(info.value)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 98)}, "</s>": 98}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


REMOTE_SCRIPT = textwrap.dedent("""
    import importlib.abc, json, socket, sys
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
    from transformers import AutoConfig, AutoModelForCausalLM
    folder, ids_file = sys.argv[1], sys.argv[2]
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    ids = torch.tensor(json.load(open(ids_file)))
    with torch.no_grad():
        logits = model(ids, output_exit_logits=True)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, exit_criterion="max_prob", exit_threshold=0.0,
                         return_dict_in_generate=True)
    print(json.dumps({"class": type(model).__name__, "model_type": config.model_type,
                      "exit_layers": config.exit_layers, "logits_sum": float(logits.logits.double().sum()),
                      "exit_sum": float(logits.exit_logits[0].double().sum()),
                      "tokens": out.sequences.tolist(), "exits": out.exit_layers.tolist(),
                      "package_loaded": "ee_transformers" in sys.modules}))
""")


def test_saved_folder_is_hub_ready_and_loads_without_the_package(base_dirs, family, tmp_path):
    folder, _ = base_dirs[family]
    model = eet.from_base(folder, exit_layers=[0, 2], exit_head="adapter", exit_adapter_rank=4).eval()
    with torch.no_grad():
        model.exit_heads[0].up.weight.normal_(std=0.1)  # saved heads must come back as they are
    model.tokenizer = _tiny_tokenizer()
    out_dir = tmp_path / "ee"
    model.save_pretrained(out_dir)

    files = set(os.listdir(out_dir))
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json", "modeling_early_exit.py",
            "configuration_early_exit.py"} <= files
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in files)
    config = json.loads((out_dir / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == f"modeling_early_exit.{EXPECTED[family][0]}"
    assert config["exit_layers"] == [0, 2]
    card = (out_dir / "README.md").read_text()
    front = card.split("---")[1]
    for line in ("library_name: transformers", "pipeline_tag: text-generation", "base_model:",
                 "tags: [early-exit, custom_code]", "exit_layers: [0, 2]"):
        assert line in front
    assert "trust_remote_code=True" in card

    ids = [[5, 6, 7, 8], [9, 10, 11, 12]]
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([sys.executable, "-c", REMOTE_SCRIPT, str(out_dir), str(tmp_path / "ids.json")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stdout[-2000:] + result.stderr[-2000:]
    remote = json.loads(lines[-1])
    assert remote["class"] == EXPECTED[family][0] and remote["model_type"] == EXPECTED[family][1]
    assert remote["package_loaded"] is False
    with torch.no_grad():
        local = model(torch.tensor(ids), output_exit_logits=True)
    assert remote["logits_sum"] == pytest.approx(float(local.logits.double().sum()), rel=1e-6)
    assert remote["exit_sum"] == pytest.approx(float(local.exit_logits[0].double().sum()), rel=1e-6)
    assert all(layer == 0 for row in remote["exits"] for layer in row)

    again = eet.from_base(out_dir)  # and back through our own loader, tokenizer included
    assert again.tokenizer is not None
    assert torch.equal(again.exit_heads[0].up.weight, model.exit_heads[0].up.weight)


def test_auto_class_loads_in_process_with_package(base_dirs, tmp_path):
    model = eet.from_base(base_dirs["qwen3"][0], exit_layers=[1])
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    assert loaded.config.model_type == "early_exit_qwen3"
    assert loaded.config.exit_layers == [1]


def test_convert_cli(base_dirs, tmp_path):
    from ee_transformers.tools.cli import main

    out = tmp_path / "converted"
    assert main(["convert", str(base_dirs["mistral"][0]), str(out), "--exit-layers", "0,2",
                 "--exit-head", "adapter", "--exit-adapter-rank", "4"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["exit_layers"] == [0, 2] and config["exit_head"] == "adapter"
    with pytest.raises(SystemExit):
        main(["convert", str(base_dirs["mistral"][0]), str(tmp_path / "bad"), "--exit-layers", "3"])
    assert not (tmp_path / "bad").exists()
