"""What a benchmark runs on: the plain twin sharing the early-exit model's modules, held-out prompts, batches."""

import copy
import math
import random
import re
from pathlib import Path

import torch
import transformers

from ee_transformers.modeling_early_exit import EarlyExitMixin
from ee_transformers.speculative_early_exit import DRAFT_SOURCES

# nor calibration should see. Calibration may use the front of the held-out novel and of the manual, so the
# benchmark takes its prompts from their tails: the second half of Sense and Sensibility, and the last tenth of the
# Python manual's body (its index starts at about 0.89 of the file and is not prose).
HELDOUT_REGIONS = {"austen": (0.5, 1.0), "python": (0.8, 0.88)}


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


def default_text_files():
    """{domain: (path, region)}: the held-out regions of `assets.fetch_text()` (fetched once, then cached)."""
    from ee_transformers.tools import assets

    text = assets.fetch_text()
    novel = next(p for p in text["austen"] if Path(p).stem == assets.AUSTEN_HELDOUT)
    return {"austen": (novel, HELDOUT_REGIONS["austen"]), "python": (text["python"][0], HELDOUT_REGIONS["python"])}


def heldout_prompts(tokenizer, files=None, num_prompts=16, window=64, seed=0, texts=None):
    """`num_prompts` windows of `window` tokens, alternating between domains, from held-out text.

    files: None (the default held-out regions of `assets.fetch_text()`), or paths of text files (domain = file name,
    the whole file is used); texts: `{domain: text}` instead of files. Windows start at evenly spaced points of each
    region (shifted by `seed`), at a word boundary. Returns a list of `{"domain": str, "ids": [int] * window}`.
    """
    if texts is not None:
        sources = {domain: (None, (0.0, 1.0)) for domain in texts}
    elif files is None:
        sources = default_text_files()
    else:
        sources = {Path(f).stem: (f, (0.0, 1.0)) for f in files}
    rng = random.Random(seed)
    per_domain = {}
    domains = list(sources)
    counts = [num_prompts // len(domains) + (i < num_prompts % len(domains)) for i in range(len(domains))]
    for (domain, (path, (lo, hi))), count in zip(sources.items(), counts):
        if count == 0:  # more files than prompts asked for
            continue
        text = texts[domain] if texts is not None else Path(path).read_text(encoding="utf-8", errors="replace")
        start, stop = int(lo * len(text)), int(hi * len(text))
        chunk = 12 * window  # characters: comfortably more than `window` tokens of English
        span = max(stop - start - chunk, 1)
        offset = rng.randrange(max(span // max(count, 1), 1))
        windows = []
        for k in range(count):
            at = start + offset + k * span // max(count, 1)
            piece = text[at : at + chunk]
            cut = re.search(r"\s\S", piece[:80])  # start at a word
            piece = piece[cut.start() + 1 :] if cut else piece
            ids = tokenizer(piece, add_special_tokens=False)["input_ids"][:window]
            if len(ids) == window:
                windows.append(ids)
        if not windows:
            raise ValueError(f"No {window}-token window found in `{path or domain}`.")
        per_domain[domain] = windows
    prompts = []
    for k in range(max(len(w) for w in per_domain.values())):
        prompts += [{"domain": d, "ids": w[k]} for d, w in per_domain.items() if k < len(w)]
    return prompts[:num_prompts]


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
