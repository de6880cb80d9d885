"""What a measurement runs on: the plain twin sharing the early-exit model's modules, prompts, batches.

(Held-out prompts from the fetched text assets: `ee_transformers.tools.bench.loading.heldout_prompts`.)
"""

import copy
import math

import torch
import transformers

from ee_transformers.modeling_early_exit import EarlyExitMixin
from ee_transformers.speculative_early_exit import DRAFT_SOURCES


def plain_twin(ee_model):
    """The family's plain `...ForCausalLM` running on the very same modules (no copy): plain transformers generate
    on the same weights. Exit heads are not part of it; its generation config is a copy of the early-exit model's
    without stored draft settings (`prompt_lookup_num_tokens`, `assistant_early_exit`)."""
    plain_cls = next(
        c
        for c in type(ee_model).__mro__[1:]
        if not issubclass(c, EarlyExitMixin) and issubclass(c, transformers.PreTrainedModel)
    )
    fields = {
        k: v
        for k, v in ee_model.config.to_dict().items()
        if not k.startswith("exit_") and k not in ("model_type", "architectures", "auto_map", "transformers_version")
    }
    config = plain_cls.config_class(**fields)
    config._attn_implementation = ee_model.config._attn_implementation
    with torch.device("meta"):  # no second copy of the weights: the modules are shared below
        plain = plain_cls(config)
    plain.model = ee_model.model
    plain.lm_head = ee_model.lm_head
    plain.generation_config = copy.deepcopy(ee_model.generation_config)
    for name in DRAFT_SOURCES:  # the greedy reference: stored draft settings would make its generate assisted
        setattr(plain.generation_config, name, None)
    return plain.eval()


def load_models(path, exit_layers=None, exit_head=None, dtype=torch.float32, device="cpu"):
    """(early-exit model, plain twin) from an early-exit folder, or from a plain folder converted on the fly."""
    from ee_transformers.convert import from_base

    ee = from_base(path, exit_layers=exit_layers, exit_head=exit_head, dtype=dtype).to(device).eval()
    if not ee.config.exit_layers:
        raise ValueError(f"`{path}` has no exit layers: pass `exit_layers` (--exit-layers) to convert it.")
    return ee, plain_twin(ee)


def random_prompts(vocab_size, num_prompts, window=64, seed=0):
    """Random token windows (for random-weight models: no tokenizer, no text)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (num_prompts, window), generator=generator)
    return [{"domain": "random", "ids": row.tolist()} for row in ids]


def make_batches(prompts, batch_size, max_batches=2, device="cpu"):
    """Up to `max_batches` batches of `batch_size` consecutive prompts (prompts alternate domains, so a batch mixes
    them); prompts recycle when there are too few. Returns `[(input_ids, attention_mask, domains)]`."""
    batches = []
    count = max(1, min(max_batches, math.ceil(len(prompts) / batch_size)))
    for b in range(count):
        rows = [prompts[(b * batch_size + i) % len(prompts)] for i in range(batch_size)]
        length = max(len(r["ids"]) for r in rows)
        ids = torch.zeros(batch_size, length, dtype=torch.long)
        mask = torch.zeros(batch_size, length, dtype=torch.long)
        for i, r in enumerate(rows):  # left padding (windows have equal length, so usually none)
            ids[i, length - len(r["ids"]) :] = torch.tensor(r["ids"])
            mask[i, length - len(r["ids"]) :] = 1
        batches.append((ids.to(device), mask.to(device), [r["domain"] for r in rows]))
    return batches
