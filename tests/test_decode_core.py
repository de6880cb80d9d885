"""The one decode core: calibration's simulation (`training/calibrate.py:simulated_exits`, which `simulate` prices) and
the runtime's exit rule (`first_confident_exit`, which `prefill`, continuous batching's prompt ends, the pool's profiles
and `ee-transformers profile` run) decide the same exit layer for every position, fed the same scores."""

import pytest
import torch
from helpers import ee_model, scripted_heads

from ee_transformers.generation_early_exit import (
    Decided,
    ExitCriterion,
    ExitSettings,
    StepState,
    first_confident_exit,
)
from ee_transformers.training.calibrate import simulate, simulated_exits

torch.set_num_threads(1)
EXITS, NUM_LAYERS = [0, 1, 2], 4
FREE = {"head_cost": 0.0, "check_cost": 0.0, "backfill_cost": 0.0}


class RecordedScores(ExitCriterion):
    """The scores calibration recorded: row i's score at exit e is `scores[i, e]`."""

    name = "recorded"

    def __init__(self, scores):
        self.scores = scores

    def score(self, check):
        return self.scores[check.rows, check.exit_index]


def recorded_data(n=97, seed=0):
    """Scores `(n, exits)` in [0, 1], argmaxes drawn from 3 tokens (so stable-token runs occur), final tokens."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "scores": torch.rand(n, len(EXITS), generator=generator),
        "argmax": torch.randint(0, 3, (n, len(EXITS)), generator=generator),
        "final": torch.randint(0, 3, (n,), generator=generator),
    }


def runtime_exits(model, data, check, thresholds, patience=0, policy="row"):
    """The runtime's exit layers of the recorded positions, as one step of `n` rows, from `first_confident_exit`
    alone and through a `Decided` (what `prefill` returns). Exit head e's logits put row i's mass on
    `data["argmax"][i, e]` (the row index rides in its state's first channel)."""
    n = data["scores"].shape[0]

    def head(e):
        return lambda rows, vocab, hidden: torch.nn.functional.one_hot(
            data["argmax"][hidden[:, 0].long(), e], vocab
        ).float()

    scripted_heads(model, [head(e) for e in range(len(EXITS))])
    settings = ExitSettings(
        RecordedScores(data["scores"]),
        {EXITS[c]: float(t) for c, t in zip(check, thresholds)},
        policy=policy,
        patience=patience,
    )
    states = torch.zeros(n, model.config.hidden_size)
    states[:, 0] = torch.arange(n)
    at_exit = {EXITS[c]: (states, states) for c in check}
    alone = first_confident_exit(model, settings, at_exit, StepState(settings, n, "cpu", None), NUM_LAYERS)
    decided = Decided(n)
    state = StepState(settings, n, "cpu", None)
    recorded = first_confident_exit(model, settings, at_exit, state, NUM_LAYERS, decided, last=states)
    assert torch.equal(recorded, alone)
    assert torch.equal(decided.finish(model)[1], alone), "the Decided rows carry the exit layers the rule returns"
    return alone


CASES = {
    "every exit": ([0, 1, 2], [0.7, 0.5, 0.3], 0),
    "a subset": ([0, 2], [0.8, 0.6], 0),
    "one exit": ([1], [0.5], 0),
    "patience alone": ([0, 1, 2], [2.0, 2.0, 2.0], 2),
    "patience and thresholds": ([0, 1, 2], [0.9, 0.8, 0.95], 2),
    "patience 3": ([0, 1, 2], [0.95, 0.95, 0.95], 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_simulation_and_runtime_decide_the_same_exit_layers(base_dirs, case):
    check, thresholds, patience = CASES[case]
    model, data = ee_model(base_dirs, "llama", EXITS), recorded_data()
    rows, _, fired, simulated = simulated_exits(data, EXITS, NUM_LAYERS, check, thresholds, patience)
    assert torch.equal(rows.flatten(), torch.arange(len(data["final"])))
    exits = runtime_exits(model, data, check, thresholds, patience)
    assert torch.equal(exits, simulated)
    assert 0 < int(fired.sum()) < len(fired), "the case mixes exits and full depth, so it has power"
    summary = simulate(data, EXITS, NUM_LAYERS, check, thresholds, FREE, "max_prob", patience)
    assert summary["mean_exit_layer"] == pytest.approx(float(exits.double().mean()))
    assert summary["exit_rate"] == pytest.approx(float((exits < NUM_LAYERS - 1).double().mean()))


@pytest.mark.parametrize("patience", [0, 2])
def test_simulated_groups_exit_as_the_runtime_batch_policy_does(base_dirs, patience):
    check, thresholds = [0, 1, 2], [0.3, 0.2, 0.1]
    model, data = ee_model(base_dirs, "llama", EXITS), recorded_data()
    rows, _, _, simulated = simulated_exits(data, EXITS, NUM_LAYERS, check, thresholds, patience, group=4)
    for unit, layer in zip(rows, simulated):
        group = {name: values.index_select(0, unit) for name, values in data.items()}
        exits = runtime_exits(model, group, check, thresholds, patience, policy="batch")
        assert torch.equal(exits, torch.full_like(exits, int(layer)))
    assert len(set(simulated.tolist())) > 1, "groups exit at different layers, so the test has power"
