"""Forced exit profiles: each token's exit layer drawn from a given profile and decoded through the ordinary early-exit
code path, so realised against ideal speed-up measures the implementation, not the criterion."""

from collections import defaultdict

import torch

from ee_transformers.generation_early_exit import ExitCriterion

# forced profiles: name -> {depth fraction (of the decoder) or 1.0 for full depth: share of tokens}
FORCED_PROFILES = {
    "25% at 1/4": {0.25: 0.25, 1.0: 0.75},
    "50% at 1/2": {0.5: 0.5, 1.0: 0.5},
    "75% at 3/4": {0.75: 0.75, 1.0: 0.25},
    "mixed": {0.25: 0.25, 0.5: 0.25, 0.75: 0.25, 1.0: 0.25},
}
# the full grid (--forced-grid full): every share at every depth
FORCED_GRID = {
    f"{int(share * 100)}% at {label}": {depth: share, 1.0: 1.0 - share}
    for depth, label in ((0.25, "1/4"), (0.5, "1/2"), (0.75, "3/4"))
    for share in (0.25, 0.5, 0.75)
}
FORCED_GRID["mixed"] = FORCED_PROFILES["mixed"]
# forced modes: (policy, kv). Deferred KV is batch-policy only.
FORCED_MODES = (("batch", "immediate"), ("batch", "deferred"), ("row", "immediate"))


def _profile_layers(spec, model):
    """{depth fraction: share} -> {decoder layer: share}: each depth goes to the nearest exit layer (1.0 = full)."""
    num_layers = model.config.num_hidden_layers
    exits = list(model.config.exit_layers)
    layers = defaultdict(float)
    for depth, share in spec.items():
        if depth >= 1.0:
            layers[num_layers - 1] += share
        else:
            want = depth * num_layers - 1  # layer index after which `depth` of the decoder has run
            layers[min(exits, key=lambda e: (abs(e - want), e))] += share
    return dict(sorted(layers.items()))


class ForcedExits(ExitCriterion):
    """An exit criterion that ignores confidence: `targets(batch_size, device)` gives, once per decoding step, each
    row's exit layer `(batch,)`, and a row exits at the first checked exit at or above its target. The benchmark's
    forced profiles measure the implementation apart from the heads with it; pass it as `exit_criterion=`."""

    name = "forced"
    default_threshold = 1.0

    def __init__(self, targets):
        self.targets = targets

    def begin_step(self, batch_size, device):
        return self.targets(batch_size, device).to(device)

    def score(self, check):
        return (check.step.index_select(0, check.rows) <= check.layer).float()


class ForcedProfile:
    """Targets for `ForcedExits`, drawing each token's exit layer from a profile, stratified: every block of `block`
    draws holds the profile's shares exactly (in a random order), so short runs follow the profile closely.

    per_row: a draw per row (row policy); otherwise one draw per step shared by the batch (batch policy, where a
    batch exits only when every row may).
    """

    def __init__(self, name, layers, per_row=True, seed=0, block=20):
        self.name, self.layers, self.per_row = name, dict(layers), per_row
        self.generator = torch.Generator().manual_seed(seed)
        counts = {layer: round(share * block) for layer, share in self.layers.items()}
        deepest = max(counts)
        counts[deepest] += block - sum(counts.values())
        self.block = [layer for layer, n in counts.items() for _ in range(n)]
        self.queue = []

    @property
    def check_layers(self):
        return [layer for layer in self.layers if layer != max(self.layers)] or [min(self.layers)]

    @property
    def mean_exit_layer(self):
        return sum(layer * share for layer, share in self.layers.items()) / sum(self.layers.values())

    def _draw(self, n):
        while len(self.queue) < n:
            order = torch.randperm(len(self.block), generator=self.generator).tolist()
            self.queue += [self.block[i] for i in order]
        out, self.queue = self.queue[:n], self.queue[n:]
        return out

    def __call__(self, batch_size, device):
        values = self._draw(batch_size) if self.per_row else self._draw(1) * batch_size
        return torch.tensor(values, dtype=torch.long, device=device)


def forced_profile(name, model, per_row=True, seed=0):
    """The targets for profile `name` (a key of `FORCED_PROFILES` / `FORCED_GRID`, or a dict {depth fraction: share})
    on `model`'s exits. Pass `exit_criterion=ForcedExits(profile)` with `exit_check_layers=profile.check_layers`."""
    spec = name if isinstance(name, dict) else {**FORCED_GRID, **FORCED_PROFILES}[name]
    label = name if isinstance(name, str) else "custom"
    return ForcedProfile(label, _profile_layers(spec, model), per_row=per_row, seed=seed)
