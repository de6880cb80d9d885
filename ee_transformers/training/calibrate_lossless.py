"""Lossless calibration: which draft sources and how many drafts, chosen by measured speed on this machine.

    ee-transformers calibrate my-ee-model --lossless --out my-ee-model-fast

Lossless modes never change the text (greedy output is token for token full depth's), so the only question is speed,
and speed is measured, not predicted (each candidate decodes with the gate on, as a user's call does: its rounds
draft only where they are expected to pay, from the row's text, the history of earlier generations and the table):
every candidate (context drafts `prompt_lookup_num_tokens=N` with
`max_matching_ngram_size=G`; with `exits`, exit-head drafts `assistant_early_exit` alone and with context drafts) is
timed against plain greedy generate, paired and interleaved on held-out prompts, at every batch size. The candidate
that beats full depth over the widest range of batch sizes from the smallest (the fastest at the smallest first) is
stored in `generation_config.json`, with `speculative_max_batch_size` when it paid below the largest size measured
only: a plain `generate` on the folder then uses it up to that batch size and decodes at full depth above it
(stored lossless settings take precedence over stored confident-exit settings, which do not combine with them). If
nothing beats full depth even at the smallest batch size, nothing is stored and the report says which candidate came
closest, with its measured figures.

Python use:
    report = calibrate_lossless(model, plain_twin(model), prompts, LosslessCalibrationConfig())
    apply_lossless_calibration(model, report)
"""

import itertools
from dataclasses import asdict, dataclass, field

import torch

from ee_transformers.measure.loading import make_batches
from ee_transformers.measure.lossless import measure_rows
from ee_transformers.measure.timing import greedy_generation_config, without_eos
from ee_transformers.request import MAX_BATCH_FIELD, TABLE_FIELD, VOCAB_FIELD, WIDTH_FIELD
from ee_transformers.utils.arguments import check_fields

__all__ = [
    "LosslessCalibrationConfig",
    "apply_lossless_calibration",
    "calibrate_lossless",
    "lossless_calibration_card",
    "lossless_candidates",
]

STORED_FIELDS = (
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "assistant_early_exit",
    "num_assistant_tokens",
    VOCAB_FIELD,
    WIDTH_FIELD,
    TABLE_FIELD,
)


@dataclass
class LosslessCalibrationConfig:
    """Settings of one lossless calibration; `__post_init__` raises `ValueError` naming a bad field."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 8], metadata={"help": "batch sizes timed", "min": 1})
    lookup_tokens: list[int] = field(
        default_factory=lambda: [4, 8],
        metadata={
            "help": "prompt_lookup_num_tokens candidates (the most drafts a row verifies in a round: the gate and each "
            "row's chain decide how many it does)",
            "min": 1,
        },
    )
    ngram_sizes: list[int] = field(
        default_factory=lambda: [3], metadata={"help": "max_matching_ngram_size candidates", "min": 1}
    )
    verify_widths: list[int] = field(
        default_factory=lambda: [0],
        metadata={
            "help": "speculative_verify_width candidates (0: none), each with every N whose rounds are narrower",
            "min": 0,
        },
    )
    table_drafts: bool = field(
        default=True,
        metadata={
            "help": "when the model stores a draft table, time every context-draft candidate with table drafts too "
            "(speculative_table_drafts)"
        },
    )
    exits: list[int] | None = field(
        default=None, metadata={"help": "assistant_early_exit candidates (default: context drafts only)", "min": 1}
    )
    num_assistant_tokens: int = field(default=4, metadata={"help": "exit-head drafts per round", "min": 1})
    draft_vocab_size: int = field(
        default=8192,
        metadata={
            "help": "exit-head drafts score only this many of the model's stored most frequent tokens, when it "
            "stores them (0: the full vocabulary)",
            "min": 0,
        },
    )
    num_prompts: int = field(default=8, metadata={"help": "held-out prompts timed", "min": 1})
    prompt_tokens: int = field(default=64, metadata={"help": "tokens per prompt", "min": 1})
    new_tokens: int = field(default=64, metadata={"help": "greedy tokens per timed run", "min": 2})
    rounds: int = field(default=1, metadata={"help": "rounds of every paired comparison", "min": 1})

    def __post_init__(self):
        check_fields(self)


def lossless_candidates(
    config: LosslessCalibrationConfig, stored_vocab: int = 0, stored_table: bool = False
) -> list[dict]:
    """generate() arguments of every candidate, context drafts first (each also with table drafts when
    `config.table_drafts` and the model stores a table); exit-head drafts from the first `config.draft_vocab_size` of
    the `stored_vocab` most frequent tokens the model stores (when both are > 0)."""
    vocab = min(config.draft_vocab_size, stored_vocab)
    context = [
        dict(prompt_lookup_num_tokens=n, max_matching_ngram_size=g, **({WIDTH_FIELD: w} if w else {}))
        for n, g, w in itertools.product(config.lookup_tokens, config.ngram_sizes, config.verify_widths)
        if not w or w > n + 1  # a width the drafts reach anyway changes nothing
    ]
    if config.table_drafts and stored_table:
        context += [{**c, TABLE_FIELD: True} for c in context]
    exits = []
    for e in config.exits or []:
        exit_draft = dict(assistant_early_exit=e, num_assistant_tokens=config.num_assistant_tokens)
        if vocab:
            exit_draft[VOCAB_FIELD] = vocab
        exits += [exit_draft] + [{**c, **exit_draft} for c in context]
    return context + exits


def _name(kwargs) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


def calibrate_lossless(model, plain, prompts, config: LosslessCalibrationConfig | None = None, log=print) -> dict:
    """Times every candidate at every batch size (paired, interleaved against `plain`, the model's plain twin);
    returns {"config", "candidates": [{"kwargs", "by_batch_size": {b: measured}, "worst", "pays_up_to"}], "chosen",
    "max_batch_size", "closest", "message"}.
    Raises `AssertionError` if a candidate's output differs from plain greedy (a lossless mode that is not)."""
    config = config or LosslessCalibrationConfig()
    kwargs = lossless_candidates(config, model.config.draft_vocab_size or 0, bool(model.config.draft_table_size))
    rows = [dict(name=_name(k), who="ours", kwargs=k, batch_1_only=False) for k in kwargs]
    by_batch = {}
    with without_eos(model, plain), torch.no_grad():
        generation_config = greedy_generation_config(plain, config.new_tokens, clear_exit_settings=True)
        for b in config.batch_sizes:
            batches = make_batches(prompts, b, max_batches=max(1, config.num_prompts // b), device=model.device)
            by_batch[b] = measure_rows(model, plain, batches, rows, generation_config, config.rounds, log)
    candidates = []
    for i, k in enumerate(kwargs):
        measured = {str(b): by_batch[b][i] for b in config.batch_sizes}
        wrong = [b for b, m in measured.items() if not m["identical"]]
        if wrong:
            raise AssertionError(f"{_name(k)} did not reproduce plain greedy output at batch sizes {wrong}.")
        candidates.append(
            dict(
                kwargs=k,
                by_batch_size=measured,
                worst=min(m["speedup"] for m in measured.values()),
                pays_up_to=_pays_up_to(measured, config.batch_sizes),
            )
        )
    return dict(config=asdict(config), candidates=candidates, **_choose(candidates, config.batch_sizes))


def _pays_up_to(measured, batch_sizes):
    """The largest measured batch size up to which (every measured size included) the setting beat full depth."""
    paying = None
    for b in sorted(batch_sizes):
        if measured[str(b)]["speedup"] <= 1.0:
            break
        paying = b
    return paying


def _choose(candidates, batch_sizes):
    """The setting that pays over the widest range of batch sizes from the smallest, the fastest there first; it is
    stored with `speculative_max_batch_size` when it pays below the largest size measured only."""
    smallest, largest = min(batch_sizes), max(batch_sizes)
    best = max(
        candidates, key=lambda c: (c["pays_up_to"] or 0, c["by_batch_size"][str(smallest)]["speedup"], c["worst"])
    )
    sizes = ", ".join(f"{m['speedup']:.2f}x at batch {b}" for b, m in best["by_batch_size"].items())
    limit = best["pays_up_to"]
    if limit is None:
        closest = _name(best["kwargs"])
        message = f"no lossless setting beat full depth at batch {smallest}; the closest, {closest}, measured {sizes}"
        return dict(chosen=None, max_batch_size=None, closest=best, message=message)
    scope = "at every batch size measured" if limit == largest else f"up to batch {limit} (full depth above it)"
    message = f"stored {_name(best['kwargs'])}, used {scope}: measured {sizes}"
    return dict(
        chosen=best["kwargs"], max_batch_size=None if limit == largest else limit, closest=best, message=message
    )


def apply_lossless_calibration(model, report: dict) -> None:
    """Stores the report's choice in `model.generation_config` (saved to `generation_config.json`), or clears the
    lossless settings when nothing was chosen."""
    chosen = report.get("chosen") or {}
    for name in STORED_FIELDS:
        setattr(model.generation_config, name, chosen.get(name))
    setattr(model.generation_config, MAX_BATCH_FIELD, report.get("max_batch_size") if chosen else None)
    model.generation_config._from_model_config = False  # saved as written, not regenerated from the model config


def lossless_calibration_card(report: dict) -> str:
    """The model card's section: what was measured, and what was stored."""
    sizes = list(report["config"]["batch_sizes"])
    lines = [
        f"Lossless calibration (greedy output identical to full depth, measured on this machine): {report['message']}.",
        "",
        "| setting | " + " | ".join(f"batch {b}" for b in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for c in sorted(report["candidates"], key=lambda c: -c["worst"]):
        cells = []
        for b in sizes:
            m = c["by_batch_size"][str(b)]
            cells.append(f"{m['speedup']:.2f}x ({m['low']:.2f}-{m['high']:.2f})")
        lines.append(f"| `{_name(c['kwargs'])}` | " + " | ".join(cells) + " |")
    if report.get("chosen") and report.get("max_batch_size"):
        lines += ["", f"A plain `model.generate(...)` on this folder uses the stored setting up to batch size "
                  f"{report['max_batch_size']} (`speculative_max_batch_size`) and full depth above it."]  # fmt: skip
    elif report.get("chosen"):
        lines += ["", "A plain `model.generate(...)` on this folder uses the stored setting."]
    else:
        closest = report["closest"]["kwargs"]
        lines += ["", f"Nothing is stored; to use the closest anyway: `model.generate(ids, {_name(closest)})`."]
    return "\n".join(lines)
