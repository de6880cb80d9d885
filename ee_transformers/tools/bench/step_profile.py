"""Where one decoding step's time goes: exclusive time of decoder layers, head checks, exit heads, backfill and the
final head, read from `torch.profiler` events carrying the runtime's `record_function` labels."""

import math
from collections import defaultdict

import torch

from ee_transformers.measure.timing import _decode_ms, _timed_generate
from ee_transformers.modeling_early_exit import EarlyExitMixin

PROFILE_LABELS = {
    "ee::layer": "layers",
    "ee::head_check": "head_checks",
    "ee::exit_heads": "exit_heads",
    "ee::backfill": "backfill",
    "ee::final_head": "final_head",
}


class _PlainLabels:
    """Gives a plain model the runtime's `record_function` labels (decoder layers, the LM head), through module
    hooks, so one profile reads both; the early-exit runtime carries its labels itself."""

    def __init__(self, model):
        self.model, self.handles, self.open = model, [], []

    def _pre(self, label):
        def hook(*args):
            scope = torch.profiler.record_function(label)
            scope.__enter__()
            self.open.append(scope)

        return hook

    def _post(self, *args):
        self.open.pop().__exit__(None, None, None)

    def __enter__(self):
        if not isinstance(self.model, EarlyExitMixin):
            for module, label in [(layer, "ee::layer") for layer in self.model.model.layers] + [
                (self.model.lm_head, "ee::final_head")
            ]:
                self.handles += [
                    module.register_forward_pre_hook(self._pre(label)),
                    module.register_forward_hook(self._post),
                ]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def profile_step(model, batch, new_tokens, exit_kwargs=None, name=None):
    """Where the time of one decoding step goes: ms per step in layers, head checks, exit heads, backfill, final
    head, and other (Python: the decoding loop, masks, sampling). Read from `torch.profiler` events carrying the
    runtime's `record_function` labels (`PROFILE_LABELS`); the prefill is left out. Profiling adds overhead, so the
    total is a bit above an unprofiled step. Works on the plain model too (`exit_kwargs` None)."""
    kwargs = dict(exit_kwargs or {})
    with _PlainLabels(model), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        seconds, prefill, steps, _ = _timed_generate(model, batch, new_tokens, kwargs)
    # the prefill ends where the second forward starts: the second time a step embeds its input
    starts = sorted(e.time_range.start for e in prof.events() if e.name == "aten::embedding")
    decode_from = starts[1] if len(starts) > 1 else math.inf
    labeled = sorted(
        (e for e in prof.events() if e.name in PROFILE_LABELS and e.time_range.start >= decode_from),
        key=lambda e: e.time_range.start,
    )
    totals, stack = defaultdict(float), []  # exclusive time: a labeled event inside another is the inner one's
    for event in labeled:
        while stack and stack[-1].time_range.end <= event.time_range.start:
            stack.pop()
        ms = event.time_range.elapsed_us() / 1e3
        totals[PROFILE_LABELS[event.name]] += ms
        if stack:
            totals[PROFILE_LABELS[stack[-1].name]] -= ms
        stack.append(event)
    decode_steps = max(steps - 1, 1)
    step_ms = _decode_ms(seconds, prefill, steps)
    parts = {k: totals.get(k, 0.0) / decode_steps for k in PROFILE_LABELS.values()}
    parts["other"] = step_ms - sum(parts.values())
    return {
        "name": name or ("plain" if not isinstance(model, EarlyExitMixin) else "early exit"),
        "batch_size": batch[0].shape[0],
        "ms_per_step": step_ms,
        "parts_ms": parts,
        "shares": {k: v / step_ms for k, v in parts.items()},
    }
