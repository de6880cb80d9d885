"""Issue 8: exit settings are generation settings, the decode loop is transformers' public seam, nothing is silent,
AutoModel gives the early-exit decoder."""

import copy
import json

import pytest
import torch
from conftest import padded_batch
from transformers import AutoModel, AutoModelForCausalLM, GenerationConfig, LlamaModel

import ee_transformers as eet

EXITS = [0, 1, 2]
ON = dict(exit_criterion="max_prob", exit_threshold=0.0)  # always confident: every token exits at the first check


def ee(base_dirs, family="llama", **kwargs):
    return eet.from_base(base_dirs[family][0], exit_layers=EXITS, **kwargs).eval()


def decode(model, generation_config=None, **kwargs):
    """4 greedy tokens of a padded batch; the decided exit layers. The greedy settings go where the call's other
    settings go: into a copy of a passed config (transformers 5.24 deprecates a config together with generation
    kwargs), else as kwargs."""
    ids, mask = padded_batch()
    greedy = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    if generation_config is not None:
        generation_config = copy.deepcopy(generation_config)
        generation_config.update(**greedy)
        greedy = {}
    out = model.generate(ids, attention_mask=mask, generation_config=generation_config, **greedy, **kwargs)
    return out.exit_layers[out.exit_layers >= 0]  # tokens a row decided (-1: after its EOS)


# -- where settings come from -----------------------------------------------------------------------------------------
def test_generation_config_argument_turns_exits_on(base_dirs):
    model = ee(base_dirs)
    assert (decode(model) == 3).all(), "no settings anywhere: full depth"
    assert (decode(model, generation_config=GenerationConfig(**ON)) == 0).all()


def test_model_generation_config_attributes_turn_exits_on(base_dirs):
    model = ee(base_dirs)
    model.generation_config.exit_criterion = "max_prob"
    model.generation_config.exit_threshold = 0.0
    assert (decode(model) == 0).all()


def test_precedence_kwargs_over_passed_config_over_model_config(base_dirs):
    model = ee(base_dirs)
    model.set_exit_defaults(**ON, exit_check_layers=[2])  # model.generation_config: exits at 2
    assert (decode(model) == 2).all()
    passed = GenerationConfig(exit_check_layers=[1])  # the passed config beats the model's ...
    assert (decode(model, generation_config=passed) == 1).all()
    assert (decode(model, generation_config=passed, exit_check_layers=[0]) == 0).all()  # ... and kwargs beat both
    # the user pattern transformers 5.24 deprecates (a config together with generation kwargs) still works, with
    # transformers' warning, blamed on the call that made it (this line), not on the runtime it passes through
    ids, mask = padded_batch()
    import logging

    logging.Logger.warning_once.cache_clear()
    with pytest.warns(FutureWarning, match="Passing `generation_config` together with generation-related") as caught:
        out = model.generate(ids, attention_mask=mask, generation_config=passed, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4  # the kwarg won
    assert [w.filename for w in caught if "generation-related" in str(w.message)] == [__file__]
    assert (decode(model, early_exit=False) == 3).all()


def test_hidden_stored_settings_are_only_this_threads(base_dirs):
    """A call that turns a stored draft setting off hides it from its own thread, not from concurrent calls on the same
    model, and leaves the stored config as it was."""
    from threading import Thread

    model = ee(base_dirs)
    model.generation_config.prompt_lookup_num_tokens = 3
    seen = {}
    with model.without_stored_settings(["prompt_lookup_num_tokens", "assistant_early_exit"]):
        seen["this thread"] = model.generation_config.prompt_lookup_num_tokens
        other = Thread(target=lambda: seen.update(other=model.generation_config.prompt_lookup_num_tokens))
        other.start()
        other.join()
    assert seen == {"this thread": None, "other": 3}
    assert model.generation_config.prompt_lookup_num_tokens == 3


def test_generation_config_json_round_trip(base_dirs, tmp_path):
    model = ee(base_dirs, **ON, exit_check_layers=[1])  # from_base sets generation defaults
    assert (decode(model) == 1).all()
    model.save_pretrained(tmp_path / "m")
    stored = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    assert stored["exit_criterion"] == "max_prob" and stored["exit_check_layers"] == [1]
    assert not stored.get("_from_model_config"), "a config marked as from the model config loses custom keys on load"
    for loaded in (
        eet.EarlyExitLlamaForCausalLM.from_pretrained(tmp_path / "m"),
        AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True),
    ):
        assert loaded.generation_config.exit_criterion == "max_prob"
        assert (decode(loaded.eval()) == 1).all()


def test_settings_put_on_a_loaded_models_generation_config_survive_save_and_reload(base_dirs, tmp_path):
    """A loaded model's generation config is marked `_from_model_config` (built from config.json); transformers reads
    a file so marked without its custom entries, so saving the mark with the settings would lose them on reload."""
    ee(base_dirs).save_pretrained(tmp_path / "plain")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", trust_remote_code=True)
    assert model.generation_config._from_model_config, "the case this test is about: a config built from config.json"
    model.generation_config.exit_criterion = "max_prob"  # as a transformers user sets generation settings
    model.generation_config.exit_threshold = 0.0  # every token exits at the first check
    model.save_pretrained(tmp_path / "m")
    stored = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    assert stored["exit_threshold"] == 0.0 and not stored.get("_from_model_config"), stored
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True).eval()
    assert (loaded.generation_config.exit_criterion, loaded.generation_config.exit_threshold) == ("max_prob", 0.0)
    assert (decode(loaded) == 0).all(), "the reloaded settings must really exit early"


def test_exit_settings_in_a_file_marked_from_the_model_config_are_read(base_dirs, tmp_path):
    """A folder written before the fix above holds its settings under the mark: they are read all the same."""
    ee(base_dirs).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "generation_config.json"
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "_from_model_config": True, **ON}))
    for loaded in (
        eet.EarlyExitLlamaForCausalLM.from_pretrained(tmp_path / "m"),
        AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True),
    ):
        assert (loaded.generation_config.exit_criterion, loaded.generation_config.exit_threshold) == ("max_prob", 0.0)
        assert (decode(loaded.eval()) == 0).all(), "the settings read must really exit early"
    passed = eet.EarlyExitLlamaForCausalLM.from_pretrained(tmp_path / "m", exit_threshold=1.0)
    assert passed.generation_config.exit_threshold == 1.0, "from_pretrained arguments still win over the file"
    given = eet.EarlyExitLlamaForCausalLM.from_pretrained(tmp_path / "m", generation_config=GenerationConfig())
    assert getattr(given.generation_config, "exit_criterion", None) is None, (
        "a generation_config passed to from_pretrained replaces the file"
    )


def test_from_pretrained_exit_settings_become_defaults(base_dirs, tmp_path):
    ee(base_dirs).save_pretrained(tmp_path / "m")
    model = eet.EarlyExitLlamaForCausalLM.from_pretrained(tmp_path / "m", **ON).eval()
    assert model.exit_defaults["exit_threshold"] == 0.0
    assert (decode(model) == 0).all()


def test_first_wave_config_settings_move_to_the_generation_config(base_dirs, tmp_path):
    ee(base_dirs).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    config = json.loads(path.read_text())
    config.update(
        exit_criterion="max_prob",
        exit_threshold=0.0,
        exit_check_layers=[2],
        exit_policy="batch",
        exit_patience=0,
        exit_kv="immediate",
    )  # as the first wave saved it
    path.write_text(json.dumps(config))
    (tmp_path / "m" / "generation_config.json").unlink()
    model = eet.EarlyExitLlamaForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert (decode(model) == 2).all()
    assert not hasattr(model.config, "exit_criterion")
    config.update(exit_criterion=None, exit_threshold=None, exit_check_layers=None)  # a first-wave folder, exits off
    path.write_text(json.dumps(config))
    assert (decode(eet.EarlyExitLlamaForCausalLM.from_pretrained(tmp_path / "m").eval()) == 3).all()


# -- validation ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, value, words",
    [
        ("exit_policy", "rows", "['batch', 'row']"),
        ("exit_kv", "lazy", "['immediate', 'deferred']"),
        ("exit_check_layers", [99], "subset of the exits [0, 1, 2]"),
        ("exit_check_layers", 3, "list of exit layer indices"),
        ("exit_criterion", "confidence", "max_prob"),
        ("exit_threshold", "high", "float"),
        ("exit_threshold", True, "float"),
        ("exit_patience", 1, ">= 2"),
        ("early_exit", "yes", "True, False"),
    ],
)
def test_every_bad_exit_argument_raises_alone(base_dirs, name, value, words):
    model = ee(base_dirs)
    with pytest.raises(ValueError, match=f"`{name}`") as error:  # alone: no criterion or threshold given
        decode(model, **{name: value})
    assert words in str(error.value)
    with pytest.raises(ValueError, match=f"`{name}`"):  # ... and in a GenerationConfig
        decode(model, generation_config=GenerationConfig(**{name: value}))


@pytest.mark.parametrize("name, value", [("exit_policy", "row"), ("exit_kv", "deferred"), ("exit_check_layers", [1])])
def test_valid_settings_without_a_criterion_are_not_silently_ignored(base_dirs, name, value):
    with pytest.raises(ValueError, match="no exit criterion is set"):
        decode(ee(base_dirs), **{name: value})


@pytest.mark.parametrize("bad", [dict(exit_threshold="x"), dict(exit_policy="rows"), dict(exit_kv="lazy")])
def test_bad_settings_at_load_time_fail_before_any_weight_is_read(base_dirs, tmp_path, bad):
    ee(base_dirs).save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not weights")  # reading them would fail differently
    with pytest.raises(ValueError, match=f"`{next(iter(bad))}`"):
        eet.EarlyExitLlamaForCausalLM.from_pretrained(tmp_path / "m", **bad)
    with pytest.raises(ValueError, match=f"`{next(iter(bad))}`"):
        eet.from_base(tmp_path / "m", **bad)


def test_set_exit_defaults_validates_the_combination(base_dirs):
    model = ee(base_dirs)
    with pytest.raises(ValueError, match="`exit_kv='deferred'`"):
        model.set_exit_defaults(**ON, exit_policy="row", exit_kv="deferred")
    with pytest.raises(ValueError, match="Unknown exit setting"):
        model.set_exit_defaults(exit_treshold=0.5)
    assert model.exit_defaults["exit_criterion"] is None, "a refused setting is not stored"


# -- nothing silent -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_per_layer_outputs_with_exits_raise(base_dirs, flag):
    model = ee(base_dirs)
    with pytest.raises(ValueError, match=f"`{flag}=True` is not available with early exit"):
        decode(model, **ON, **{flag: True})
    decode(model, early_exit=False, **{flag: True})  # at full depth they work as in transformers


def test_compile_config_with_exits_says_it_does_not_compile(base_dirs):
    from transformers import CompileConfig

    with pytest.raises(ValueError, match="`compile_config` is not available with early exit"):
        decode(ee(base_dirs), **ON, cache_implementation="static", compile_config=CompileConfig())


def test_the_loop_is_transformers_custom_generate_seam(base_dirs, monkeypatch):
    """The early-exit loop enters through `generate(custom_generate=...)`, not an override of `_sample`."""
    from transformers.generation.utils import GenerationMixin

    model = ee(base_dirs)
    assert "_sample" not in vars(type(model)) and "_sample" not in vars(eet.EarlyExitMixin)
    seen = {}
    original = GenerationMixin.generate

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    decode(model, **ON)
    assert seen["custom_generate"] is eet.generation_early_exit.early_exit_generate
    assert "exit_settings" in seen and "exit_criterion" not in seen


def test_a_registered_criterion_is_a_generation_setting(base_dirs):
    class Never(eet.ExitCriterion):
        def score(self, check):
            return torch.zeros(check.rows.shape[0])

    eet.register_exit_criterion("never", Never())
    try:
        assert (decode(ee(base_dirs), exit_criterion="never", exit_threshold=0.5) == 3).all()
    finally:
        del eet.EXIT_CRITERIA["never"]


# -- AutoModel ----------------------------------------------------------------------------------------------------
def test_automodel_gives_the_early_exit_decoder(base_dirs, tmp_path, family):
    folder, base = base_dirs[family]
    model = eet.from_base(folder, exit_layers=EXITS)
    model.save_pretrained(tmp_path / "m")
    decoder = AutoModel.from_pretrained(tmp_path / "m", trust_remote_code=True).eval()
    assert not hasattr(decoder, "lm_head")
    ids, mask = padded_batch()
    plain = type(base.get_decoder())(base.config).eval()  # the family's own decoder, e.g. LlamaModel
    plain.load_state_dict(base.get_decoder().state_dict())
    out = decoder(ids, attention_mask=mask, output_exit_hidden_states=True)
    assert torch.equal(out.last_hidden_state, plain(ids, attention_mask=mask).last_hidden_state)
    assert len(out.exit_hidden_states) == len(EXITS)
    expected = model.exit_heads[1](base(ids, attention_mask=mask, output_hidden_states=True).hidden_states[2])
    torch.testing.assert_close(out.exit_hidden_states[1], expected)
    assert isinstance(decoder, LlamaModel) == (family == "llama")
