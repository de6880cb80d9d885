"""What a benchmark runs on: the library\'s `ee_transformers.measure.loading` (the plain twin, models, batches) and
held-out prompts, by default from the texts `ee-transformers fetch-assets` caches."""

import random
import re
from pathlib import Path

from ee_transformers.measure.loading import load_models, make_batches, plain_twin, random_prompts

__all__ = [
    "HELDOUT_REGIONS",
    "default_text_files",
    "heldout_prompts",
    "load_models",
    "make_batches",
    "plain_twin",
    "random_prompts",
]

# The held-out regions of the fetched texts: the parts of the texts that neither fitting
# nor calibration should see. Calibration may use the front of the held-out novel and of the manual, so the
# benchmark takes its prompts from their tails: the second half of Sense and Sensibility, and the last tenth of the
# Python manual's body (its index starts at about 0.89 of the file and is not prose).
HELDOUT_REGIONS = {"austen": (0.5, 1.0), "python": (0.8, 0.88)}


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
