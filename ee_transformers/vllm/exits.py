"""The seed's iteration-level exits inside a vLLM step, on the package's exit rule and K/V fill.

In a step whose scheduled tokens are all decode tokens, the exit head of each checked exit layer scores every row
with `decode_core.check_exit` (the one exit rule, here under the batch policy: the step stops only when every row is
confident). When it holds, `ExitTaken` unwinds the layer loop of vLLM's own model (compiled or eager), the skipped
layers' K/V of the step's tokens are written into vLLM's paged cache from the exit state by each layer's own
attention module (the fill `generate`'s backfilling cache does: the skipped layer's own norm and projections of the
exit state), and the step's logits are the exit's.

The check runs as a custom op (`ee_transformers::exit_check`) from a forward hook on each checked layer, so that
vLLM's compiled graph keeps it in place: an opaque call between two layers, which raises out of the graph when the
step exits. Prefill and mixed steps, and vLLM's own dummy runs, pass straight through it.
"""

import torch

from ..decode_core import StepState, check_exit


class ExitTaken(Exception):
    """Raised by the exit check when every row of the step is confident at `layer`."""

    def __init__(self, layer):
        super().__init__(layer)
        self.layer = layer


class ExitStep:
    """One step of the model through which the exit rule runs: the rows it scores (the step's sampled tokens), its
    positions, the rule's per-step state, and where it decided.

    stop: a decode step, which stops at the exit (`ExitTaken`); else a prefill step, whose every layer runs (the
    prompt's K/V must be complete) and whose sampled tokens come from the first confident exit, as in `generate`'s
    prefill. After a decision: layer, stream `(n, D)` (the residual stream leaving the exit layer at the rows) and
    logits `(n, V)` (what the check computed there; None when the criterion decided without the LM head)."""

    def __init__(self, model, settings, positions, rows, stop):
        self.model, self.settings, self.positions, self.rows, self.stop = model, settings, positions, rows, stop
        self.n = rows.numel()
        self.state = StepState(settings, self.n, positions.device, None)
        self.layer = self.stream = self.logits = None

    def check(self, layer, h_out, h_in):
        if self.layer is not None:  # decided at an earlier exit (a prefill step goes on to the last layer)
            return
        if not self.stop:
            h_out, h_in = h_out.index_select(0, self.rows), h_in.index_select(0, self.rows)
        every = torch.arange(self.n, device=h_out.device)
        confident, logits, _ = check_exit(self.model, self.settings, layer, h_out, h_in, every, self.state)
        if bool(confident[0]):  # the batch policy: every row or none; the one host sync of this check
            self.layer, self.stream, self.logits = layer, h_out, logits
            if self.stop:
                raise ExitTaken(layer)


class KeysValues(Exception):
    """Raised by the attention module of a layer being filled, as it is handed the layer's keys and values."""

    def __init__(self, key, value):
        super().__init__()
        self.key, self.value = key, value


_FILLING = set()  # ids of the attention modules whose call is the K/V fill (their kernel does not run)


def capture_keys_values(module, args, kwargs):
    """Forward pre-hook on a layer's attention kernel module (vLLM's `Attention`): during the fill, stop there with the
    keys and values the layer's own projections, norms and rotary made. Elsewhere (every real forward, compiled or
    not) it does nothing."""
    if id(module) in _FILLING:
        given = list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args) :]]
        raise KeysValues(given[1], given[2])


def fill_layer(attention, kernel, call):
    """Writes one skipped layer's K/V of the step's tokens into the paged cache: `call()` runs the layer's attention
    module on the exit state up to its kernel `kernel`, which hands over its keys and values (`capture_keys_values`)
    instead of attending; they are written as the kernel would write them (`unified_kv_cache_update`)."""
    from vllm.model_executor.layers.attention.attention import unified_kv_cache_update

    _FILLING.add(id(kernel))
    try:
        call()
    except KeysValues as kv:
        key = kv.key.view(-1, kernel.num_kv_heads, kernel.head_size)
        value = kv.value.view(-1, kernel.num_kv_heads, kernel.head_size_v)
        unified_kv_cache_update(key, value, kernel.layer_name)
        return
    finally:
        _FILLING.discard(id(kernel))
    raise RuntimeError(f"the attention module {type(attention).__name__} never called its kernel: nothing to fill")


# model key -> the step now running through that model (set by the model's forward, read by the op)
_STEPS: dict[int, ExitStep] = {}


def _stream(hidden, residual):
    """The residual stream from a layer's (hidden, residual) pair: vLLM's layers leave the last add to the next
    layer's fused norm (families without the pair pass residual None)."""
    return hidden if residual is None else hidden + residual


@torch.library.custom_op("ee_transformers::exit_check", mutates_args=())
def exit_check(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    hidden_in: torch.Tensor,
    residual_in: torch.Tensor | None,
    model_key: int,
    layer: int,
) -> torch.Tensor:
    """The exit rule at `layer` for the step now running through model `model_key`. hidden / residual: `(n, D)` what
    the layer returned; hidden_in / residual_in: what it was given. Returns hidden (a copy: an op's output must not
    alias its input), so the layer loop goes on unchanged; raises `ExitTaken` when the step stops here."""
    step = _STEPS.get(model_key)
    if step is not None:
        step.check(layer, _stream(hidden, residual), _stream(hidden_in, residual_in))
    return hidden.clone()


@exit_check.register_fake
def _(hidden, residual, hidden_in, residual_in, model_key, layer):
    return torch.empty_like(hidden)


def step_rows(num_tokens: int):
    """(stop, rows) of the step now running, from the attention metadata vLLM's runner set for it: every request
    schedules one token -> (True, all tokens): a decode step, which may stop at an exit; every request schedules more
    than one (prompt chunks) -> (False, the last token of each): a prefill step; else (mixed steps, vLLM's dummy and
    profiling runs, micro-batches) None: full depth, the final layer's logits. A prompt whose other tokens all came
    from the prefix cache schedules one token, and counts as decoding."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = next(iter(metadata.values()), None)
    starts = getattr(metadata, "query_start_loc", None)
    if starts is None or getattr(metadata, "num_actual_tokens", None) != num_tokens:
        return None
    lengths = starts[1:] - starts[:-1]
    if getattr(metadata, "max_query_len", None) == 1:
        return True, torch.arange(num_tokens, device=starts.device)
    if bool((lengths > 1).all()):
        return False, starts[1:] - 1
    return None


__all__ = ["ExitStep", "ExitTaken", "capture_keys_values", "exit_check", "fill_layer", "step_rows"]
