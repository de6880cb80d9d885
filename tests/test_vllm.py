"""vLLM serves early-exit folders (`ee_transformers/vllm/`): exits off it answers what vLLM answers for the base
checkpoint and what `generate` answers; with exits it answers what `generate` answers with the same exits, the
skipped layers' K/V filled in its paged cache and read by later full-depth tokens; layers above an exit do not run.

These tests need vLLM (the environment `scripts/setup.sh --vllm` builds); where it is missing they fail, they are never
skipped (vLLM is imported in the tests, so that the environment without it collects this file and deselects them
with `-m "not vllm"`). They run the engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the one-process executor), on tiny
random folders whose head size the CPU attention kernels accept (32), fp32, greedy.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: the tests can read its model
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import gc  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import ee_transformers as eet  # noqa: E402
from ee_transformers.measure.forced import ForcedExits, forced_profile  # noqa: E402
from ee_transformers.training.tiny import save_tiny_base  # noqa: E402

pytestmark = pytest.mark.vllm

# tiny shapes vLLM's CPU attention accepts: head size 32 (it takes 32, 64, 80, ...), six layers, exits at 2 and 4
SHAPE = dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)
EXTRA = {  # Gemma 3: untied embeddings (a tiny tied Gemma repeats one token); vLLM's Gemma 2 always ties its LM head
    "qwen3": {"head_dim": 32},
    "gemma3": {"head_dim": 32, "query_pre_attn_scalar": 32, "tie_word_embeddings": False},
    "gemma2": {"head_dim": 32, "query_pre_attn_scalar": 32},
}
SERVED = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma2", "phi3", "gpt2"]
EXITS = [2, 4]
PROMPTS = [[1, 5, 9, 13, 20], [1, 40, 41], [1, 7, 7, 30, 62, 11, 90]]
NEW_TOKENS = 16
HALF = {0.5: 0.5, 1.0: 0.5}  # half the steps at the exit nearest half depth (layer 2 of 0..5), half at full depth


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (base folder, early-exit folder)}, built once."""
    out = {}
    for family in SERVED + ["olmo2"]:
        root = tmp_path_factory.mktemp(f"vllm-{family}")
        base = save_tiny_base(root / "base", family=family, **SHAPE, **EXTRA.get(family, {}))
        model = eet.from_base(base, exit_layers=EXITS, exit_head="adapter")
        with torch.no_grad():  # a trained-looking adapter, so that the exit heads are not the final norm
            for head in model.exit_heads:
                head.up.weight.normal_(0, 0.2)
        model.save_pretrained(root / "ee")
        out[family] = (base, str(root / "ee"))
    return out


PROPOSER = {"method": "custom_class", "model": "ee_transformers.vllm.proposer.EarlyExitProposer"}


def engine(folder, compiled=False, drafts=None, **settings):
    """vLLM on `folder` in this process; `settings`: `override_generation_config` (exit settings); drafts: K, the
    package's proposer with up to K drafts per request."""
    from vllm import LLM  # a missing vLLM fails here

    spec = None if drafts is None else {**PROPOSER, "num_speculative_tokens": drafts}
    return LLM(
        folder,
        dtype="float32",
        enforce_eager=not compiled,
        max_model_len=128,
        max_num_seqs=8,
        seed=0,
        enable_prefix_caching=False,  # a prompt served twice would be a one-token step, which counts as decoding
        distributed_executor_backend="uni",
        override_generation_config=settings,
        speculative_config=spec,
    )


def vllm_tokens(llm, prompts=PROMPTS, together=True):
    """Greedy new tokens per prompt: all prompts submitted together (one prefill step, then decode steps of all of
    them), or one request at a time."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
    batches = [prompts] if together else [[p] for p in prompts]
    out = []
    for batch in batches:
        answers = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        out += [list(a.outputs[0].token_ids) for a in answers]
    return out


def close(llm):
    """Shut the engine down now (idempotent): left to garbage collection, an engine the test still holds would tear
    down the process-wide parallel groups after the next engine set them up."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def generate_tokens(folder, prompts=PROMPTS, forced=None, **settings):
    """`generate`'s greedy new tokens, one prompt at a time; forced: a profile, drawn afresh for each prompt (as the
    engine draws it afresh for each one-request run below)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        kwargs = dict(settings)
        if forced is not None:
            profile = forced_profile(forced, model, per_row=False, seed=0)
            kwargs.update(exit_criterion=ForcedExits(profile), exit_check_layers=profile.check_layers)
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


def stats(llm):
    """{decode: {exit layer: steps}, prefill: {...}} of the engine's model."""
    (counts,) = llm.apply_model(lambda model: (dict(model.exit_stats.decode), dict(model.exit_stats.prefill)))
    return {"decode": counts[0], "prefill": counts[1]}


def test_the_plugin_is_installed_and_registers_every_family():
    from importlib.metadata import entry_points

    assert "ee_transformers" in {p.name for p in entry_points(group="vllm.general_plugins")}
    from vllm import ModelRegistry

    from ee_transformers.vllm import register

    register()
    archs = set(ModelRegistry.get_supported_archs())
    assert {cls.__name__ for cls in eet.FAMILIES.values()} <= archs


@pytest.mark.parametrize("family", SERVED)
def test_exits_off_equal_vllm_on_the_base_and_generate(folders, family):
    base, folder = folders[family]
    llm = engine(base)
    plain = vllm_tokens(llm)
    close(llm)
    llm = engine(folder)
    ours = vllm_tokens(llm)
    assert stats(llm) == {"decode": {}, "prefill": {}}
    close(llm)
    assert ours == plain, "exits off, the folder must answer what vLLM answers for its base checkpoint"
    assert ours == generate_tokens(base), "vLLM's greedy tokens must be plain generate's (fp32)"


@pytest.mark.parametrize("family", SERVED)
def test_forced_exits_equal_generate_with_the_same_exits(folders, family):
    _, folder = folders[family]
    prompts = PROMPTS[-1:]  # one request per engine, which draws the profile from its start, as generate does
    llm = engine(folder, ee_forced_profile={str(k): v for k, v in HALF.items()})
    ours = vllm_tokens(llm, prompts)
    counted = stats(llm)
    close(llm)
    assert counted["decode"].get(2, 0) > 0, f"no decode step stopped at the exit: {counted}"
    assert ours == generate_tokens(folder, prompts, forced=HALF)
    assert ours != generate_tokens(folder, prompts), "the forced exits must change the text, or it shows nothing"


def test_a_later_full_depth_token_reads_the_filled_kv(folders, monkeypatch):
    """With the fill skipped the deep layers' cache holds nothing for the exited tokens, and the text changes."""
    _, folder = folders["llama"]
    expected = generate_tokens(folder, PROMPTS[:1], forced=HALF)
    llm = engine(folder, ee_forced_profile={"0.5": 0.5, "1.0": 0.5})
    assert vllm_tokens(llm, PROMPTS[:1]) == expected
    close(llm)
    monkeypatch.setenv("EE_TRANSFORMERS_VLLM_SKIP_FILL", "1")
    llm = engine(folder, ee_forced_profile={"0.5": 0.5, "1.0": 0.5})
    assert vllm_tokens(llm, PROMPTS[:1]) != expected
    close(llm)


def test_layers_above_the_exit_do_not_run(folders):
    """Every step forced to the exit at layer 2: layers 3-5 run for the prompt's prefill only, and of them only the
    attention runs for each decode token (the fill), the MLP never."""
    _, folder = folders["llama"]
    llm = engine(folder, ee_forced_profile={"0.5": 1.0})

    def count_calls(model):
        model._calls = {}
        for j, layer in enumerate(model.model.layers):
            for name, module in (("layer", layer), ("attn", layer.self_attn), ("mlp", layer.mlp)):
                module.register_forward_pre_hook(
                    lambda *_, key=(j, name): model._calls.__setitem__(key, model._calls.get(key, 0) + 1)
                )

    llm.apply_model(count_calls)
    vllm_tokens(llm, PROMPTS[:1])
    (calls,) = llm.apply_model(lambda model: dict(model._calls))
    counted = stats(llm)
    close(llm)
    steps = NEW_TOKENS - 1  # the first token comes from the prefill step
    assert counted == {"decode": {2: steps}, "prefill": {2: 1}}, counted
    for j in (0, 1, 2):
        assert calls[(j, "layer")] == calls[(j, "mlp")] == 1 + steps, calls
    for j in (3, 4, 5):
        assert calls[(j, "layer")] == 1 and calls[(j, "mlp")] == 1, calls  # the prefill only
        assert calls[(j, "attn")] == 1 + steps, calls  # the prefill, then the fill of each exited token


def test_stored_settings_exit_as_generate_does(folders):
    """A folder with stored exit settings (what calibration writes) exits in vLLM on its own criterion, token for
    token as `generate` with the same stored settings, several requests in one batch; `{"early_exit": false}` from
    the server turns them off."""
    _, folder = folders["llama"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.set_exit_defaults(exit_criterion="max_prob", exit_threshold=0.3)
    stored = folder + "-stored"
    model.save_pretrained(stored)
    expected = generate_tokens(stored)
    full = generate_tokens(folder)
    assert expected != full, "the threshold must let some tokens exit, or the test shows nothing"
    llm = engine(stored)
    assert vllm_tokens(llm, together=False) == expected
    assert sum(stats(llm)["decode"].values()) > 0
    close(llm)
    llm = engine(stored, early_exit=False)
    assert vllm_tokens(llm) == full
    close(llm)


def test_exits_in_vllms_compiled_mode(folders):
    """vLLM's default mode compiles the model; the exit check stays an opaque call in the graph and the step stops
    there all the same."""
    _, folder = folders["llama"]
    llm = engine(folder, compiled=True, ee_forced_profile={"0.5": 0.5, "1.0": 0.5})
    ours = vllm_tokens(llm, PROMPTS[:1])
    assert stats(llm)["decode"].get(2, 0) > 0
    close(llm)
    assert ours == generate_tokens(folder, PROMPTS[:1], forced=HALF)


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"exit_policy": "row", "exit_criterion": "max_prob", "exit_threshold": 0.5}, "exit_policy"),
        ({"exit_kv": "deferred", "exit_criterion": "max_prob", "exit_threshold": 0.5}, "exit_kv"),
        ({"exit_criterion": "sure", "exit_threshold": 0.5}, "exit_criterion"),
        ({"exit_criterion": "max_prob", "exit_threshold": "high"}, "exit_threshold"),
        ({"exit_criterion": "max_prob", "exit_threshold": 0.5, "exit_check_layers": [3]}, "exit_check_layers"),
        ({"ee_forced_profile": {"half": 1.0}}, "ee_forced_profile"),
    ],
)
def test_a_bad_exit_setting_stops_start_up_naming_it(folders, settings, field):
    _, folder = folders["llama"]
    with pytest.raises(Exception, match=f"`{field}`") as error:
        engine(folder, **settings)
    assert f"`{field}`" in str(error.value).splitlines()[-1] or f"`{field}`" in str(error.value)


def test_olmo2_is_refused_in_one_line(folders):
    _, folder = folders["olmo2"]
    with pytest.raises(Exception, match="OLMo 2") as error:
        engine(folder)
    assert "transformers backend" in str(error.value)


# the package's drafter as vLLM's proposer --------------------------------------------------------------------------
def drafter(llm):
    """The engine's proposer (it lives beside the model, in the engine's runner, in this process)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter


def drafter_stats(llm):
    """The proposer's counts."""
    return drafter(llm).stats()


def answers(llm, prompts, lengths):
    """Greedy new tokens of `prompts` submitted together, request i stopping after lengths[i] tokens (EOS honoured)."""
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0) for n in lengths]
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(a.outputs[0].token_ids) for a in out]


def test_our_proposer_answers_what_plain_vllm_answers(folders):
    """Our drafter as vLLM's proposer: greedy fp32 text equal to plain vLLM on the base checkpoint, with requests of
    different lengths leaving the batch. The second round repeats the prompts, so the history index of the first
    round's generations drafts their whole continuations: drafts are accepted, and a `max_tokens` that falls inside
    an accepted run (7, 10, 13 against up to 4 drafts a step) is honoured exactly."""
    base, folder = folders["llama"]
    first, second = [NEW_TOKENS + 4, NEW_TOKENS, NEW_TOKENS - 4], [7, 10, 13]
    llm = engine(base)
    plain = answers(llm, PROMPTS, first), answers(llm, PROMPTS, second)
    close(llm)
    llm = engine(folder, drafts=4)
    ours = answers(llm, PROMPTS, first), answers(llm, PROMPTS, second)
    counted = drafter_stats(llm)
    timed = list(drafter(llm).drafter.packed.samples)
    close(llm)
    assert ours == plain
    # the gate's step costs: timed steps, each its seconds (the fit's target) and 0 / 1 for "verifies drafts"
    assert timed and all(0 < seconds < 5 and features[-1] in (0.0, 1.0) for features, seconds in timed), timed
    assert [len(t) for t in ours[1]] == [len(t) for t in plain[1]]
    assert counted["accepted"] > 0, f"the repeated prompts must accept drafts from the history: {counted}"
    assert counted["requests"] >= len(PROMPTS) and counted["history_tokens"] > 0, counted


def test_exits_are_off_under_speculative_decoding(folders):
    """Drafts are verified at full depth: a folder whose stored settings exit serves full-depth text with our
    proposer, and no step stops at an exit."""
    _, folder = folders["llama"]
    full = generate_tokens(folder)
    llm = engine(folder, drafts=3, exit_criterion="max_prob", exit_threshold=0.3)
    assert vllm_tokens(llm) == full
    assert stats(llm) == {"decode": {}, "prefill": {}}
    close(llm)


def test_a_bad_draft_setting_stops_start_up_naming_it(folders):
    _, folder = folders["llama"]
    with pytest.raises(Exception, match="`speculative_history_tokens`"):
        engine(folder, drafts=3, speculative_history_tokens=-1)


def test_a_stored_lossless_mode_serves_with_our_proposer(folders, tmp_path):
    """A folder whose stored settings hold a lossless mode (`prompt_lookup_num_tokens`, as calibration writes it)
    starts with our proposer and that many drafts, and answers what plain vLLM answers; the user's
    `speculative_config` wins, and `prompt_lookup_num_tokens: 0` serves without drafts."""
    import json
    import shutil

    base, folder = folders["llama"]
    stored = shutil.copytree(folder, tmp_path / "lossless")
    config = json.loads((stored / "generation_config.json").read_text())
    (stored / "generation_config.json").write_text(json.dumps({**config, "prompt_lookup_num_tokens": 3}))
    llm = engine(base)
    plain = answers(llm, PROMPTS, [NEW_TOKENS] * 3)
    close(llm)

    llm = engine(str(stored))
    spec = llm.llm_engine.vllm_config.speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == (PROPOSER["method"], PROPOSER["model"], 3)
    assert answers(llm, PROMPTS, [NEW_TOKENS] * 3) == plain
    assert drafter_stats(llm)["steps"] > 0, "our proposer must have been called"
    close(llm)

    llm = engine(str(stored), drafts=2)  # the user's own speculative config
    assert llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens == 2
    close(llm)
    llm = engine(str(stored), prompt_lookup_num_tokens=0)
    assert llm.llm_engine.vllm_config.speculative_config is None
    assert answers(llm, PROMPTS, [NEW_TOKENS] * 3) == plain
    close(llm)
