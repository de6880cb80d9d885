"""Where one decoding step's time goes: exclusive wall time of decoder layers, head checks, exit heads, backfill and
the final head, measured with hooks during a generate."""

import functools
import time
from collections import defaultdict

import torch

from ee_transformers.modeling_early_exit import EarlyExitMixin
from ee_transformers.tools.bench.timing import _decode_ms, _sync, _timed_generate

class _StepProfiler:
    """Exclusive wall time per category during a generate: decoder layers, head checks, exit heads, backfill, the
    final head; the rest of a step is "other" (the decoding loop, masks, sampling: Python overhead). The prefill
    (first forward) is left out."""

    def __init__(self, model):
        self.model, self.device = model, model.device
        self.totals = defaultdict(float)
        self.stack = []
        self.forward_calls = 0
        self.handles, self.patched = [], []

    def _now(self):
        _sync(self.device)
        return time.perf_counter()

    def enter(self, category):
        self.stack.append([category, self._now(), 0.0])

    def exit(self):
        category, start, children = self.stack.pop()
        duration = self._now() - start
        if self.forward_calls > 1:  # decode steps only
            self.totals[category] += duration - children
        if self.stack:
            self.stack[-1][2] += duration

    def _wrap(self, name, category):
        original = getattr(self.model, name)

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            self.enter(category)
            try:
                return original(*args, **kwargs)
            finally:
                self.exit()

        setattr(self.model, name, wrapped)  # instance attribute shadows the method; removed in close()
        self.patched.append(name)

    def __enter__(self):
        model = self.model
        original_forward = model.forward

        @functools.wraps(original_forward)  # generate() validates its kwargs against forward's signature
        def forward(*args, **kwargs):
            self.forward_calls += 1  # call 1 is the prefill: not counted
            return original_forward(*args, **kwargs)

        model.forward = forward
        self.patched.append("forward")
        for layer in model.model.layers:
            self.handles.append(layer.register_forward_pre_hook(lambda *a: self.enter("layers")))
            self.handles.append(layer.register_forward_hook(lambda *a: self.exit()))

        def head_pre(*a):  # the LM head inside a check or an exit head belongs to that; alone, it is the final head
            self.stack.append(["final_head" if not self.stack else None, self._now() if not self.stack else 0.0, 0.0])

        def head_post(*a):
            if self.stack[-1][0] is None:
                self.stack.pop()
            else:
                self.exit()

        self.handles.append(model.lm_head.register_forward_pre_hook(head_pre))
        self.handles.append(model.lm_head.register_forward_hook(head_post))
        if isinstance(model, EarlyExitMixin):
            self._wrap("_check", "head_checks")
            self._wrap("_decide", "exit_heads")  # exit heads (norm/adapter); the LM head of the step is "final_head"
            self._wrap("_backfill_kv", "backfill")
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        for name in self.patched:
            delattr(self.model, name)


@torch.no_grad()
def profile_step(model, batch, new_tokens, exit_kwargs=None, name=None):
    """Where the time of one decoding step goes: ms per step in layers, head checks, exit heads, backfill, final
    head, and other (Python: the decoding loop, masks, sampling). Instrumented with hooks and synchronising on
    GPU, so the total is a bit above an uninstrumented step. Works on the plain model too (`exit_kwargs` None)."""
    kwargs = dict(exit_kwargs or {})
    with _StepProfiler(model) as prof:
        seconds, prefill, steps, _ = _timed_generate(model, batch, new_tokens, kwargs)
    decode_steps = max(steps - 1, 1)
    step_ms = _decode_ms(seconds, prefill, steps)
    parts = {k: 1e3 * v / decode_steps for k, v in prof.totals.items()}
    for k in ("layers", "head_checks", "exit_heads", "backfill", "final_head"):
        parts.setdefault(k, 0.0)
    parts["other"] = step_ms - sum(parts.values())
    return {"name": name or ("plain" if not isinstance(model, EarlyExitMixin) else "early exit"),
            "batch_size": batch[0].shape[0], "ms_per_step": step_ms, "parts_ms": parts,
            "shares": {k: v / step_ms for k, v in parts.items()}}
