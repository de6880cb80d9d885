"""`bench-speculative`'s cost model: the measured milliseconds of a draft step, a verification and a plain step
(`measure_costs`), the ideal time per token they predict (`ideal_ms`), and the forced draft head that accepts a set
share of drafts (`forced_model`, `pass_through_above`), for the implementation-efficiency half."""

import copy
import statistics
import time

import torch
from torch import nn
from transformers import DynamicCache

from ee_transformers.compat import cache_kwargs


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pass_through_above(model, exit_layer):
    """A copy of `model` whose layers above `exit_layer` add nothing to the residual stream (zero output projections:
    they still compute, at full cost) and whose exit head there is the final norm: its draft head IS the full model,
    so every greedy draft is accepted."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for j, layer in enumerate(model.family.layers(model)):
            if j > exit_layer:
                for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    for param in module.parameters():
                        param.zero_()
        head = model.exit_heads[model.config.exit_layers.index(exit_layer)]
        head.norm.weight.copy_(model.family.final_norm(model).weight)
        if head.up is not None:
            head.up.weight.zero_()
    return model


class ForcedDraftHead(nn.Module):
    """Wraps an exit head so that each row's draft is right with probability `rate`: otherwise the head's output is
    negated, which turns the drafted argmax into the argmin (never the full model's token on a pass-through copy)."""

    def __init__(self, head, rate, seed=0):
        super().__init__()
        self.head, self.rate = head, rate
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, hidden_states):
        out = self.head(hidden_states)
        right = torch.rand(out.shape[0], generator=self.generator) < self.rate
        sign = torch.where(right, 1.0, -1.0).to(out.device, out.dtype)
        return out * sign.view(-1, *([1] * (out.dim() - 1)))


def forced_model(model, exit_layer, rate, seed=0):
    forced = pass_through_above(model, exit_layer)
    index = forced.config.exit_layers.index(exit_layer)
    if rate < 1.0:
        forced.exit_heads[index] = ForcedDraftHead(forced.exit_heads[index], rate, seed)
    return forced


def _median_ms(pieces, device, repeats, warmup=2):
    """Median ms of each piece, timed round-robin (one call of each per round: a slow spell hits all alike)."""
    times = {name: [] for name in pieces}
    for i in range(warmup + repeats):
        for name, (run, after) in pieces.items():
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            if i >= warmup:
                times[name].append(1e3 * (time.perf_counter() - start))
            if after is not None:
                after()
    return {name: statistics.median(values) for name, values in times.items()}


@torch.no_grad()
def measure_costs(model, batch_size, max_positions, prompt_length=64, context=96, repeats=15, seed=0):
    """ms of the pieces at `batch_size` rows: `layer` {q: one decoder layer step with q new positions per row at a
    `context`-token cache} for q = 1..max_positions, `draft_head` (exit head + LM head + softmax, one position),
    `final_head` {q: final norm + LM head at q positions}, `prefill` (a `prompt_length` prompt, full depth)."""
    config, fam, device = model.config, model.family, model.device
    generator = torch.Generator().manual_seed(seed)

    def ids(length):
        return torch.randint(3, config.vocab_size, (batch_size, length), generator=generator).to(device)

    cache = DynamicCache(config=config)
    fam.decoder(model)(input_ids=ids(context), **cache_kwargs(cache), use_cache=True)
    pieces, state = {}, {"j": -1}
    for q in range(1, max_positions + 1):
        position_ids = (torch.arange(q, device=device) + context).expand(batch_size, -1)
        h = fam.embed(model, ids(q), position_ids)
        inputs = fam.layer_inputs(model, h, None, cache, position_ids)

        def layer(h=h, inputs=inputs):  # layers in turn; the step's K/V are cropped off after, see `after`
            state["j"] = (state["j"] + 1) % config.num_hidden_layers
            fam.run_layer(model, state["j"], h, inputs, cache)

        pieces[f"layer_{q}"] = (layer, lambda q=q: cache.layers[state["j"]].crop(-q))
        pieces[f"final_head_{q}"] = (lambda h=h: fam.head_logits(model, fam.final_norm(model)(h)), None)
    last = fam.embed(model, ids(1), torch.full((batch_size, 1), context, device=device))[:, -1]
    pieces["draft_head"] = (lambda: model.exit_logits_from_hidden(0, last).float().softmax(-1).max(-1), None)
    ms = _median_ms(pieces, device, max(repeats, config.num_hidden_layers))  # every layer at least once
    prompt = ids(prompt_length)
    ms.update(
        _median_ms(
            {
                "prefill": (
                    lambda: fam.head_logits(
                        model,
                        fam.decoder(model)(
                            input_ids=prompt, **cache_kwargs(DynamicCache(config=config)), use_cache=True
                        ).last_hidden_state[:, -1],
                    ),
                    None,
                )
            },
            device,
            repeats=3,
            warmup=1,
        )
    )  # a whole forward: a few suffice
    return {
        "batch_size": batch_size,
        "context": context,
        "prompt_length": prompt_length,
        "layer": {q: ms[f"layer_{q}"] for q in range(1, max_positions + 1)},
        "final_head": {q: ms[f"final_head_{q}"] for q in range(1, max_positions + 1)},
        "draft_head": ms["draft_head"],
        "prefill": ms["prefill"],
    }


def ideal_ms(costs, num_layers, new_tokens, exit_layer=None, draft_lengths=()):
    """ms of a generate under the cost model: plain (`exit_layer` None: L layer steps + the final head per token after
    the first) or speculative (per round of k drafts: k + 1 draft steps through layers 0..E, k draft heads, one
    verification pass of L - E - 1 layers and the final head at k + 1 positions); the prefill in both."""
    layer, head = costs["layer"], costs["final_head"]
    if exit_layer is None:
        return costs["prefill"] + (new_tokens - 1) * (num_layers * layer[1] + head[1])
    total = costs["prefill"]
    for k in draft_lengths:
        total += (k + 1) * (exit_layer + 1) * layer[1] + k * costs["draft_head"]
        total += (num_layers - exit_layer - 1) * layer[k + 1] + head[k + 1]
    return total
