"""Issue 9 (HELIOS part 1): lean models hold decoder layers 0..exit_max_layer only, exit greedily there, deepen when
greedy exits pile up; the exit profile that picks the depth."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers.modeling_utils
from conftest import cut_at_exit, padded_batch
from helpers import NEVER, numbered_tokenizer, scripted_heads

import ee_transformers as eet
from ee_transformers.compat import cache_of
from ee_transformers.generation_early_exit import EXIT_CRITERIA, ExitCriterion
from ee_transformers.lean_early_exit import ShedLayer, kv_bytes_per_token, memory_report, resident_parameter_bytes

EXITS = [0, 1, 2]  # tiny models: 4 decoder layers, the last (3) is the final exit


def perturb_heads(model, seed=7):
    """Exit heads that differ from the final norm, so a wrong head would show."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for head in model.exit_heads:
            head.norm.weight.mul_(torch.rand_like(head.norm.weight) + 0.5)
    return model


def full_and_lean(base_dirs, family, exit_max_layer, **kwargs):
    folder = base_dirs[family][0]
    full = perturb_heads(eet.from_base(folder, exit_layers=EXITS, **kwargs))
    lean = eet.from_base(folder, exit_layers=EXITS, exit_max_layer=exit_max_layer, **kwargs)
    lean.exit_heads.load_state_dict(full.exit_heads.state_dict())
    return full, lean


class ForcedAt(ExitCriterion):
    """`inner`'s decisions, plus an exit at `layer` for every row still running there: what a lean model with
    `exit_max_layer=layer` must reproduce on the fully loaded model."""

    def __init__(self, inner, layer):
        self.inner, self.layer = inner, layer
        self.name, self.needs_logits = inner.name, inner.needs_logits
        self.needs_head_output, self.score_range = inner.needs_head_output, inner.score_range
        self.default_threshold = inner.default_threshold

    def begin_step(self, batch_size, device):
        return self.inner.begin_step(batch_size, device)

    def score(self, check):
        score = self.inner.score(check)
        return score if check.layer != self.layer else torch.full_like(score, self.score_range[1])


class ForcedExits(ExitCriterion):
    """Ignores confidence: `targets(batch_size, device)` gives each row's exit layer once per step `(batch,)`; a row
    exits at the first checked exit at or above its target."""

    name, default_threshold = "forced", 1.0

    def __init__(self, targets):
        self.targets = targets

    def begin_step(self, batch_size, device):
        return self.targets(batch_size, device)

    def score(self, check):
        return (check.step.index_select(0, check.rows) <= check.layer).float()


class RecordingSlices:
    """Wraps transformers' `safe_open` to record which checkpoint tensors are actually read (sliced)."""

    def __init__(self, monkeypatch):
        self.read, real = [], transformers.modeling_utils.safe_open
        recorder = self

        class Slice:
            def __init__(self, key, inner):
                self.key, self.inner = key, inner

            def __getitem__(self, index):
                recorder.read.append(self.key)
                return self.inner[index]

            def __getattr__(self, name):
                return getattr(self.inner, name)

        class File:
            def __init__(self, *args, **kwargs):
                self.inner = real(*args, **kwargs)

            def get_slice(self, key):
                return Slice(key, self.inner.get_slice(key))

            def __getattr__(self, name):
                return getattr(self.inner, name)

        monkeypatch.setattr(transformers.modeling_utils, "safe_open", File)


def layer_bytes(model, j):
    return sum(p.nelement() * p.element_size() for p in model.model.layers[j].parameters())


# --- lean == fully loaded with a forced exit at exit_max_layer ----------------------------------------------------

SCHEDULE = [3, 0, 1, 3, 0, 0, 3, 1]  # forced targets per step: 3 = undecided at the loaded exits (greedy at 1)


def schedule():
    steps = iter(SCHEDULE)
    return ForcedExits(lambda b, d: torch.full((b,), next(steps), device=d))


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("policy, kv", [("batch", "immediate"), ("batch", "deferred"), ("row", "immediate")])
@pytest.mark.parametrize("criterion", ["max_prob", "schedule"])
def test_lean_equals_full_model_with_a_forced_exit_at_max_layer(
    base_dirs, family, criterion, policy, kv, cache_implementation
):
    full, lean = full_and_lean(base_dirs, family, exit_max_layer=1)
    ids, mask = padded_batch(batch=4)
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        exit_policy=policy,
        exit_kv=kv,
        cache_implementation=cache_implementation,
        return_dict_in_generate=True,
    )
    if criterion == "max_prob":  # a threshold at the median confidence of the first exit: row policy mixes exits
        with torch.no_grad():
            logits = full(ids, attention_mask=mask, output_exit_logits=True).exit_logits[0][:, -1]
        kwargs["exit_threshold"] = float(logits.softmax(-1).max(-1).values.median())
        got = lean.generate(ids, exit_criterion="max_prob", **kwargs)
        want = full.generate(ids, exit_criterion=ForcedAt(EXIT_CRITERIA["max_prob"], 1), **kwargs)
    else:  # exits at 0 and 1 and greedy exits at 1, whatever the policy (deferred K/V: pending states at layer 1)
        got = lean.generate(ids, exit_criterion=schedule(), **kwargs)
        want = full.generate(ids, exit_criterion=ForcedAt(schedule(), 1), **kwargs)
        assert got.exit_layers[0].tolist() == [min(t, 1) for t in SCHEDULE]
        assert got.greedy_exits[0].tolist() == [t == 3 for t in SCHEDULE]
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.exit_layers, want.exit_layers)
    assert got.exit_layers.max() == 1 and got.greedy_exits.any() and not want.greedy_exits.any()
    assert (got.exit_layers[got.greedy_exits] == 1).all()  # greedy exits happen at the deepest loaded layer only


def test_lean_without_exit_settings_equals_base_cut_at_max_layer(base_dirs, family):
    base = base_dirs[family][1]
    full, lean = full_and_lean(base_dirs, family, exit_max_layer=1)
    ids, mask = padded_batch()
    out = lean.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    decided = out.exit_layers >= 0  # (-1: after a row's EOS)
    assert (out.exit_layers[decided] == 1).all() and out.greedy_exits[decided].all()
    expected = cut_at_exit(base, full, exit_index=1).generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=False
    )
    assert torch.equal(out.sequences, expected)


def test_greedy_exits_are_the_tokens_that_reached_the_max_layer_undecided(base_dirs):
    full, lean = full_and_lean(base_dirs, "llama", exit_max_layer=1)
    vocab = lean.config.vocab_size

    def confident_row0(n, v, hidden):  # row policy: exit 1 sees every row still running, batch order
        logits = torch.zeros(n, vocab, dtype=hidden.dtype)
        logits[0, 5] = 50.0
        return logits

    scripted_heads(lean, [lambda n, v, hidden: torch.zeros(n, vocab), confident_row0, None])
    ids, mask = padded_batch(batch=3)
    out = lean.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=0.9,
        exit_policy="row",
        return_dict_in_generate=True,
    )
    assert (out.exit_layers == 1).all()
    assert out.greedy_exits.tolist() == [[False] * 4, [True] * 4, [True] * 4]
    stats = eet.ExitStats.from_generate(out, lean)
    assert stats.greedy_exits == 8 and stats.greedy_rate == pytest.approx(8 / 12)
    assert "8 greedy exits" in str(stats)
    running = eet.ExitStats.from_generate(out, lean, last=1)  # the running distribution: the last step only
    assert running.num_tokens == 3 and running.greedy_exits == 2


@pytest.mark.parametrize("policy", ["batch", "row"])
def test_a_greedy_exit_reuses_the_check_at_the_max_layer(base_dirs, policy):
    full, lean = full_and_lean(base_dirs, "llama", exit_max_layer=1)
    calls = []
    lean.lm_head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    ids, mask = padded_batch(batch=3)
    out = lean.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        **NEVER,
        exit_policy=policy,
        return_dict_in_generate=True,
    )
    assert out.greedy_exits.all()
    assert calls == [3, 3] * 4  # the checks at exits 0 and 1, for every row, each step; no third head call


# --- deep layers are never materialised --------------------------------------------------------------------------


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_shed_layers_are_never_read_hold_no_memory_and_get_no_kv(base_dirs, monkeypatch, cache_implementation):
    folder = base_dirs["llama"][0]
    full = eet.from_base(folder, exit_layers=EXITS)
    recorder = RecordingSlices(monkeypatch)
    lean = eet.from_base(folder, exit_layers=EXITS, exit_max_layer=1)
    read_layers = {int(k.split(".")[2]) for k in recorder.read if k.startswith("model.layers.")}
    assert read_layers == {0, 1}, f"read tensors of layers {sorted(read_layers)}"
    for j in (2, 3):
        assert isinstance(lean.model.layers[j], ShedLayer)
        assert not list(lean.model.layers[j].parameters()) and not list(lean.model.layers[j].buffers())
    assert not any(name.startswith(("model.layers.2.", "model.layers.3.")) for name, _ in lean.named_parameters())
    assert all(p.device.type == "cpu" for p in lean.parameters())
    shed = layer_bytes(full, 2) + layer_bytes(full, 3)
    assert shed > 0
    assert lean.get_memory_footprint() == full.get_memory_footprint() - shed
    assert resident_parameter_bytes(lean) == resident_parameter_bytes(full) - shed

    ids, mask = padded_batch()
    out = lean.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=0.5,
        cache_implementation=cache_implementation,
        return_dict_in_generate=True,
    )
    for j in (2, 3):
        assert getattr(cache_of(out).layers[j], "keys", None) is None or cache_of(out).layers[j].keys.numel() == 0
    kv = kv_bytes_per_token(cache_of(out))
    per_layer = 2 * lean.config.num_key_value_heads * (lean.config.hidden_size // lean.config.num_attention_heads) * 4
    assert kv["layers"] == 2 and kv["bytes_per_token"] == 2 * per_layer
    assert kv["kept_bytes_per_token"] == 0  # no guard: nothing kept for deepening
    report = memory_report(lean, cache_of(out))
    assert report["loaded_layers"] == 2 and report["kv_bytes_per_token"] == 2 * per_layer


def test_set_exit_max_layer_sheds_and_reloads_exactly(base_dirs):
    folder = base_dirs["qwen2"][0]
    model = perturb_heads(eet.from_base(folder, exit_layers=EXITS))
    ids, mask = padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    before, footprint = model.generate(ids, **kwargs), model.get_memory_footprint()
    shed = layer_bytes(model, 3)
    model.set_exit_max_layer(2)
    assert isinstance(model.model.layers[3], ShedLayer) and model.exit_max_layer == 2
    assert model.get_memory_footprint() == footprint - shed
    with pytest.raises(ValueError, match="exit_max_layer"):  # a lean model must not write a checkpoint without layers
        model.save_pretrained(folder / "never")
    with pytest.raises(RuntimeError, match="not loaded"):  # the plain forward would need layer 3
        model(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="early_exit=False"):  # full depth is not there to give
        model.generate(ids, early_exit=False, **kwargs)
    model.set_exit_max_layer(3)  # read back from the folder
    assert model.get_memory_footprint() == footprint
    assert torch.equal(model.generate(ids, **kwargs), before)


LEAN_REMOTE = textwrap.dedent("""
    import importlib.abc, json, sys
    class NoPackage(importlib.abc.MetaPathFinder):  # the folder's own copy of the runtime must do it all
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "ee_transformers":
                raise ImportError("ee_transformers is blocked in this test")
    sys.meta_path.insert(0, NoPackage())
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, exit_max_layer=1)
    shed = [type(layer).__name__ for layer in model.model.layers]
    out = model.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                         exit_criterion="max_prob", exit_threshold=1.0, exit_breach_limit=0.5, exit_breach_window=2,
                         return_dict_in_generate=True)
    print(json.dumps({"shed": shed, "tokens": out.sequences.tolist(), "exits": out.exit_layers.tolist(),
                      "generation_config": model.generation_config.to_diff_dict()}))
""")


def test_a_saved_folder_loads_lean_without_the_package(base_dirs, tmp_path):
    full, lean = full_and_lean(base_dirs, "qwen2", exit_max_layer=1)
    full.save_pretrained(tmp_path / "ee")
    assert "lean_early_exit.py" in os.listdir(tmp_path / "ee")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", LEAN_REMOTE, str(tmp_path / "ee")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["shed"] == ["Qwen2DecoderLayer"] * 2 + ["ShedLayer"] * 2
    assert "exit_max_layer" not in got["generation_config"]  # a load argument, not a generation setting
    want = lean.generate(
        torch.tensor([[3, 4, 5, 6]]),
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        exit_criterion="max_prob",
        exit_threshold=1.0,
        exit_breach_limit=0.5,
        exit_breach_window=2,
        return_dict_in_generate=True,
    )
    assert got["exits"] == want.exit_layers.tolist() == [[1, 1, 2, 2, 3, 3]]
    assert got["tokens"] == want.sequences.tolist()


# --- deepening ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("policy, kv", [("batch", "immediate"), ("batch", "deferred"), ("row", "immediate")])
def test_deepening_mid_generation_equals_a_full_depth_continuation(base_dirs, policy, kv, cache_implementation):
    base = base_dirs["llama"][1]
    full, lean = full_and_lean(base_dirs, "llama", exit_max_layer=2)
    ids, mask = padded_batch(batch=3)
    # 3 rows, every token greedy: more than 0.5 of the last 12 decided tokens are greedy after 3 steps -> deepen
    out = lean.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        **NEVER,
        exit_breach_limit=0.5,
        exit_breach_window=12,
        exit_policy=policy,
        exit_kv=kv,
        cache_implementation=cache_implementation,
        return_dict_in_generate=True,
    )
    assert out.deepenings == [(3, 2, 3)]
    assert out.exit_layers.tolist() == [[2] * 3 + [3] * 5] * 3  # visible: exit layers beyond the old exit_max_layer
    assert out.greedy_exits.tolist() == [[True] * 3 + [False] * 5] * 3
    assert lean.exit_max_layer == 3 and not any(isinstance(m, ShedLayer) for m in lean.model.layers)
    # after deepening every token runs full depth: plain full-depth generation continuing the same prefix
    prefix = out.sequences[:, : ids.shape[1] + 3]
    prefix_mask = torch.cat([mask, torch.ones(mask.shape[0], 3, dtype=mask.dtype)], dim=1)
    expected = base.generate(prefix, attention_mask=prefix_mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert torch.equal(out.sequences, expected)


@pytest.mark.parametrize("kv", ["immediate", "deferred"])
def test_deepening_through_every_exit_equals_full_model_with_the_same_decisions_and_deferred_kv(base_dirs, kv):
    full, lean = full_and_lean(base_dirs, "qwen3", exit_max_layer=0)
    ids, mask = padded_batch(batch=2)
    out = lean.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=False,
        **NEVER,
        exit_breach_limit=0.5,
        exit_breach_window=4,
        exit_kv=kv,
        return_dict_in_generate=True,
    )
    assert [(old, new) for _, old, new in out.deepenings] == [(0, 1), (1, 2), (2, 3)]
    schedule = out.exit_layers[0].tolist()  # the same decisions, made on the fully loaded model with deferred K/V
    assert schedule == [0] * 2 + [1] * 2 + [2] * 2 + [3] * 4
    steps = iter(schedule)
    want = full.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=False,
        exit_criterion=ForcedExits(lambda b, d: torch.full((b,), next(steps), device=d)),
        exit_kv="deferred",
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, want.sequences)
    assert torch.equal(out.exit_layers, want.exit_layers)
    valid = torch.cat([mask, torch.ones(2, 9, dtype=mask.dtype)], dim=1).bool()[:, None, :, None]
    for j in range(4):  # deep K/V exact: what the fully loaded model's deferred K/V hold, at every real position
        for got, ref in (
            (cache_of(out).layers[j].keys, cache_of(want).layers[j].keys),
            (cache_of(out).layers[j].values, cache_of(want).layers[j].values),
        ):
            torch.testing.assert_close(got * valid, ref * valid, rtol=1e-5, atol=1e-5)


def test_kept_states_follow_each_row_under_the_row_policy(base_dirs):
    base = base_dirs["llama"][1]
    full, lean = full_and_lean(base_dirs, "llama", exit_max_layer=1)
    ids, mask = padded_batch(batch=3)
    kept = {}
    for name, targets in (("row 1 exits at 0", [3, 0, 3]), ("all greedy", [3, 3, 3])):
        out = lean.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            exit_policy="row",
            exit_criterion=ForcedExits(lambda b, d: torch.tensor(targets, device=d)),
            exit_breach_limit=1.0,
            exit_breach_window=4,
            return_dict_in_generate=True,
        )
        kept[name] = (out.sequences, cache_of(out).pending[0].states)
    # rows 0 and 2 ran to layer 1 both times: their kept states do not depend on row 1 (up to fp32 rounding: after
    # row 1 exits they run in a 2-row batch instead of 3, and the CPU's matrix kernels block 2 and 3 rows differently;
    # seen here: 4e-9 apart)
    for row in (0, 2):
        torch.testing.assert_close(kept["row 1 exits at 0"][1][row], kept["all greedy"][1][row], rtol=1e-5, atol=1e-6)
    # row 1 exited at layer 0 from its second token on: its kept states there are the stream leaving layer 0
    sequences = kept["row 1 exits at 0"][0][1:2, :-1]
    row_mask = torch.cat([mask[1:2], torch.ones(1, 3, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        states = base(
            sequences,
            attention_mask=row_mask,
            position_ids=(row_mask.cumsum(-1) - 1).clamp_min(0),
            output_hidden_states=True,
        ).hidden_states[1]
    decoded = slice(ids.shape[1], sequences.shape[1])
    torch.testing.assert_close(kept["row 1 exits at 0"][1][1, decoded], states[0, decoded], rtol=1e-5, atol=1e-5)


def test_guard_on_keeps_the_states_leaving_the_max_layer_and_limit_one_never_deepens(base_dirs):
    full, lean = full_and_lean(base_dirs, "mistral", exit_max_layer=1)
    ids, mask = padded_batch(batch=2)
    out = lean.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        **NEVER,
        exit_breach_limit=1.0,
        exit_breach_window=2,
        return_dict_in_generate=True,
    )
    assert out.deepenings == [] and out.greedy_exits.all() and lean.exit_max_layer == 1
    kept = cache_of(out).pending[0]  # every position fed so far (prompt + 3 tokens), the stream leaving layer 1
    assert kept.depth == 2 and kept.states.shape == (2, ids.shape[1] + 3, lean.config.hidden_size)
    assert kv_bytes_per_token(cache_of(out))["kept_bytes_per_token"] == lean.config.hidden_size * 4


# --- bad input -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exit_layers, value", [(EXITS, 4), (EXITS, 7), (EXITS, -1), (EXITS, "1"), (EXITS, 1.0), (EXITS, True), ([0, 2], 1)]
)
def test_bad_exit_max_layer_raises_before_any_weight_is_read(base_dirs, monkeypatch, exit_layers, value):
    folder = base_dirs["llama"][0]
    recorder = RecordingSlices(monkeypatch)
    allowed = str(exit_layers + [3]).replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ValueError, match=rf"`exit_max_layer`.*allowed values are {allowed}"):
        eet.from_base(folder, exit_layers=exit_layers, exit_max_layer=value)
    assert recorder.read == []
    model = eet.from_base(folder, exit_layers=exit_layers)
    with pytest.raises(ValueError, match="`exit_max_layer`"):
        model.set_exit_max_layer(value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(exit_breach_limit=1.5, exit_breach_window=8), r"`exit_breach_limit`.*0 <= exit_breach_limit <= 1"),
        (dict(exit_breach_limit=-0.1, exit_breach_window=8), "`exit_breach_limit`"),
        (dict(exit_breach_limit=math.nan, exit_breach_window=8), "`exit_breach_limit`"),
        (dict(exit_breach_limit=True, exit_breach_window=8), "`exit_breach_limit`"),
        (dict(exit_breach_limit=0.2, exit_breach_window=0), r"`exit_breach_window`.*>= 1"),
        (dict(exit_breach_limit=0.2, exit_breach_window=2.5), "`exit_breach_window`"),
        (dict(exit_breach_limit=0.2), r"`exit_breach_window` is required"),
        (dict(exit_breach_window=8), r"`exit_breach_limit` is required"),
    ],
)
def test_bad_guard_settings(base_dirs, monkeypatch, kwargs, match):
    folder = base_dirs["llama"][0]
    lean = eet.from_base(folder, exit_layers=EXITS, exit_max_layer=1)
    with pytest.raises(ValueError, match=match):
        lean.generate(torch.tensor([[3, 4]]), max_new_tokens=2, exit_criterion="max_prob", exit_threshold=0.5, **kwargs)
    if len(kwargs) == 2:  # a bad value given at load time is refused before any weight is read
        recorder = RecordingSlices(monkeypatch)
        with pytest.raises(ValueError, match=match):
            eet.from_base(
                folder, exit_layers=EXITS, exit_max_layer=1, exit_criterion="max_prob", exit_threshold=0.5, **kwargs
            )
        assert recorder.read == []


# --- the exit profile ----------------------------------------------------------------------------------------------


def _texts(lengths, seed=3):
    generator = torch.Generator().manual_seed(seed)
    return [" ".join(f"w{int(i)}" for i in torch.randint(2, 98, (n,), generator=generator)) for n in lengths]


def test_profile_decides_each_position_as_decoding_would(base_dirs):
    import dataclasses

    from ee_transformers.generation_early_exit import merged_exit_values, resolve_exit_settings
    from ee_transformers.tools.profile import decide_positions

    full = perturb_heads(eet.from_base(base_dirs["llama"][0], exit_layers=EXITS))
    ids = torch.tensor([[5, 17, 42, 8, 91, 33, 60, 2, 71, 12]])
    with torch.no_grad():
        confidence = full(ids, output_exit_logits=True).exit_logits[1][0].softmax(-1).max(-1).values
    settings = dict(exit_criterion="max_prob", exit_threshold=float(confidence.median()), exit_patience=2)
    resolved = dataclasses.replace(
        resolve_exit_settings(full.config, merged_exit_values(full, None, dict(settings))), policy="row"
    )
    with torch.no_grad():
        hidden = [h[0] for h in full(ids, output_hidden_states=True).hidden_states]
    profiled = decide_positions(full, resolved, hidden, chunk=4)
    decoded = [
        int(
            full.generate(
                ids[:, : k + 1],
                max_new_tokens=1,
                do_sample=False,
                exit_policy="row",
                return_dict_in_generate=True,
                **settings,
            ).exit_layers[0, 0]
        )
        for k in range(10)
    ]
    assert profiled.tolist() == decoded
    assert len(set(decoded)) > 1, f"expected a mix of deciding layers, got {decoded}"


def test_profile_histogram_sums_to_the_decided_tokens_and_writes_next_to_the_model(base_dirs, tmp_path, capsys):
    from ee_transformers.tools.profile import ExitProfile, main, profile_exits

    model = perturb_heads(eet.from_base(base_dirs["llama"][0], exit_layers=EXITS))
    model.tokenizer = numbered_tokenizer()
    model.set_exit_defaults(exit_criterion="max_prob", exit_threshold=0.0138)  # about the median confidence
    folder = tmp_path / "ee"
    model.save_pretrained(folder)
    model = eet.from_base(folder)
    texts = _texts([30, 7, 1, 12])  # windows of 8: 4 + 1 + 0 (too short) + 2 -> 30 + 7 + 12 tokens
    profile = profile_exits(model, model.tokenizer, texts, batch_size=3, window=8, progress=False)
    assert profile.num_tokens == sum(profile.histogram.values()) == 30 + 7 + 12
    assert set(profile.histogram) <= {0, 1, 2, 3} and len(profile.histogram) > 1
    coverage = list(profile.coverage.values())
    assert coverage == sorted(coverage) and coverage[-1] == pytest.approx(1.0)
    assert sum(profile.rates.values()) == pytest.approx(1.0)
    for target in (0.2, 0.5, 0.9, 1.0):
        depth = profile.recommend(target)
        assert profile.coverage[depth] >= target - 1e-9
        assert all(profile.coverage[d] < target for d in profile.depths if d < depth)
    assert profile.recommend(1.0) <= 3
    assert all(0 <= a <= 1 for a in profile.agreement.values()) and set(profile.agreement) == set(profile.depths)
    assert ExitProfile.load(folder) == profile  # written next to the model
    first = profile_exits(model, model.tokenizer, texts, window=8, max_tokens=9, write=False, progress=False)
    assert first.num_tokens == 16  # the first windows holding at least 9 tokens: 8 + 8
    assert (folder / "exit_profile.png").stat().st_size > 0
    with pytest.raises(ValueError, match="coverage"):
        profile.recommend(1.5)
    model.set_exit_max_layer(1)
    with pytest.raises(ValueError, match="fully loaded"):
        profile_exits(model, model.tokenizer, texts, progress=False)

    (tmp_path / "data.txt").write_text(texts[0])
    assert (
        main(
            [
                str(folder),
                "--data",
                str(tmp_path / "data.txt"),
                "--window",
                "8",
                "--exit-threshold",
                "0.9",
                "--out",
                str(tmp_path / "cli"),
            ]
        )
        == 0
    )
    cli = ExitProfile.load(tmp_path / "cli")
    assert cli.num_tokens == 30 and cli.settings["thresholds"] == {"0": 0.9, "1": 0.9, "2": 0.9}
    assert "exit_max_layer for 95% coverage" in capsys.readouterr().out


def test_profile_takes_its_config_or_the_same_keywords_and_generates_its_flags_from_it(base_dirs, capsys):
    from ee_transformers.tools.profile import ProfileConfig, main, profile_exits

    model = perturb_heads(eet.from_base(base_dirs["llama"][0], exit_layers=EXITS))
    texts = _texts([30, 7, 12])
    common = dict(write=False, exit_criterion="max_prob", exit_threshold=0.0138)
    config = ProfileConfig(batch_size=3, window=8, max_tokens=20, progress=False)
    by_config = profile_exits(model, numbered_tokenizer(), texts, config, **common)
    by_keywords = profile_exits(
        model, numbered_tokenizer(), texts, batch_size=3, window=8, max_tokens=20, progress=False, **common
    )
    assert by_config == by_keywords and by_config.window == 8 and by_config.num_tokens == 24
    over = profile_exits(model, numbered_tokenizer(), texts, config, max_tokens=None, **common)  # keywords win
    assert over.num_tokens == 30 + 7 + 12
    with pytest.raises(ValueError, match="`window`"):
        ProfileConfig(window=0)
    with pytest.raises(ValueError, match="Unknown exit setting"):
        profile_exits(model, numbered_tokenizer(), texts, config, windows=8)
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    assert all(flag in shown for flag in ("--batch-size", "--window", "--max-tokens", "--no-progress", "--coverage"))


# --- the memory-budget benchmark's measurements --------------------------------------------------------------------


def test_peak_memory_counts_live_storages_once():
    from ee_transformers.tools.bench.lean import PeakMemory

    x = torch.ones(1000)  # exists before: not counted
    with PeakMemory() as meter:
        a = x * 2  # 4000 bytes
        view, old_view = a[:10], x.t()  # views: no new storage (x's is not counted either)
        b = torch.empty(500, dtype=torch.float64)  # 4000 bytes
        del a, view, old_view
        c = x + 1  # a's 4000 bytes were freed: live 8000 again
        del b, c
    assert meter.peak == 8000 and meter.live == 0


def test_measured_memory_and_the_largest_batch_that_fits(base_dirs):
    from ee_transformers.tools.bench.lean import fit_batch, measure_memory, parse_bytes

    assert parse_bytes("1.5G") == 3 * 2**29 and parse_bytes("900M") == 900 * 2**20 and parse_bytes(4096) == 4096
    with pytest.raises(ValueError, match="memory-budget"):
        parse_bytes("-1M")
    full, lean = full_and_lean(base_dirs, "llama", exit_max_layer=1)
    prompts = [list(range(3, 3 + n)) for n in (12, 9, 12)]
    settings = dict(exit_criterion="max_prob", exit_threshold=1.0)
    memory = {name: measure_memory(model, prompts, 20, settings) for name, model in (("full", full), ("lean", lean))}
    per_layer = 2 * 2 * 8 * 4  # K and V, 2 KV heads of 8 dims, fp32
    assert (
        memory["full"]["kv_bytes_per_token"] == 4 * per_layer and memory["lean"]["kv_bytes_per_token"] == 2 * per_layer
    )
    assert memory["full"]["weights"] - memory["lean"]["weights"] == layer_bytes(full, 2) + layer_bytes(full, 3)
    for m in memory.values():  # each row's K/V for 12 + 20 - 1 positions is part of what a row costs
        assert m["per_row"] >= m["kv_bytes_per_token"] * 31 and m["peak"][2] > m["peak"][1]
    assert memory["lean"]["per_row"] < memory["full"]["per_row"]
    budget = int(memory["full"]["weights"] + memory["full"]["fixed"] + 10.5 * memory["full"]["per_row"])
    assert fit_batch(memory["full"], budget) == 10
    assert fit_batch(memory["lean"], budget) > 10
    assert fit_batch(memory["full"], memory["full"]["weights"]) == 0


def test_profile_agreement_is_each_depth_cut_against_full_depth(base_dirs):
    from ee_transformers.tools.profile import profile_exits

    model = perturb_heads(eet.from_base(base_dirs["qwen2"][0], exit_layers=EXITS))
    texts = _texts([40, 25], seed=5)
    # nothing exits: the last layer agrees with itself, a lean model at exit e is the base model cut at e + its head
    profile = profile_exits(model, numbered_tokenizer(), texts, window=16, progress=False, write=False, **NEVER)
    assert profile.histogram == {3: 65} and profile.agreement[3] == 1.0
    ids = numbered_tokenizer()(texts, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        outs = [
            model(torch.tensor([w[s : s + 16]]), output_exit_logits=True) for w in ids for s in range(0, len(w), 16)
        ]
    full = torch.cat([o.logits[0].argmax(-1) for o in outs])
    for i, e in enumerate(EXITS):
        cut = torch.cat([o.exit_logits[i][0].argmax(-1) for o in outs])
        assert profile.agreement[e] == pytest.approx(float((cut == full).double().mean()))


def test_profile_without_matplotlib_writes_the_json_and_says_how_to_get_the_plot(
    base_dirs, tmp_path, monkeypatch, caplog
):
    """The plot is an extra (`bench`); the profile is core API and must not need a plotting library."""
    from ee_transformers.tools.profile import PROFILE_FILE, ExitProfile, profile_exits

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.delitem(sys.modules, "matplotlib.pyplot", raising=False)
    model = eet.from_base(base_dirs["llama"][0], exit_layers=EXITS)
    with caplog.at_level("WARNING"):
        profile = profile_exits(
            model, numbered_tokenizer(), _texts([20]), window=8, out_dir=tmp_path, progress=False, **NEVER
        )
    assert ExitProfile.load(tmp_path) == profile, f"{PROFILE_FILE} must be written without matplotlib"
    assert not (tmp_path / "exit_profile.png").exists()
    warnings = [r.getMessage() for r in caplog.records if "matplotlib" in r.getMessage()]
    assert len(warnings) == 1 and "exit_profile.png" in warnings[0], warnings
    assert "pip install 'ee-transformers[bench]'" in warnings[0], warnings
