"""`ee-transformers bench-lossless`: lossless decoding modes against plain greedy generate, on the same prompts.

Everything runs in one process on the very same weights. Rows:

* plain: the family's own `...ForCausalLM.generate`, greedy, full depth;
* transformers' prompt lookup (`prompt_lookup_num_tokens=N`, `max_matching_ngram_size=G`) on that plain model, batch 1
  only (it refuses more);
* transformers' `assistant_early_exit=E + 1` on that plain model (batch 1 only), when `--exits` names exits;
* ours: the early-exit class's `generate` with the same arguments, at every batch size: context drafts
  (`prompt_lookup_num_tokens`), exit-head drafts (`assistant_early_exit`) and both together.

Timing is paired and interleaved: for every round and every batch the runs go plain, c1, plain, c2, ..., and each
configuration is timed against the mean of its two neighbouring plain runs (end to end, prefill included, the same in
both), so drift of a shared machine cancels. A row reports the ratio of summed times over every batch and round
(`speed-up`) and the median (min-max) of the per-batch ratios; tokens per full-depth forward; and whether every output
was token for token the plain greedy output (asserted after the report is written).

    ee-transformers bench-lossless --model ~/.cache/ee-transformers/smollm2-135m-instruct --out bench-lossless

Python API: `LosslessConfig`, `lossless_rows`, `measure_rows`, `run_lossless`, `format_lossless`, `main`.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ee_transformers.compat import layer_skip_failure
from ee_transformers.measure.lossless import measure_rows, measure_workload
from ee_transformers.speculative_early_exit import GATE_FIELD, TABLE_FIELD, WIDTH_FIELD
from ee_transformers.tools.arguments import (
    ArgumentParser,
    InputError,
    add_config_arguments,
    check_fields,
    config_from_args,
    run_command,
)
from ee_transformers.tools.assets.text import text_slice
from ee_transformers.tools.bench.loading import default_text_files, heldout_prompts, load_models, make_batches
from ee_transformers.tools.bench.timing import greedy_generation_config, without_eos

__all__ = [
    "LosslessConfig",
    "format_lossless",
    "lossless_rows",
    "main",
    "measure_rows",
    "run_lossless",
    "store_table_from",
]


@dataclass
class LosslessConfig:
    """Settings of one `bench-lossless` run; `__post_init__` raises `ValueError` naming a bad field."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 8], metadata={"help": "batch sizes measured", "min": 1})
    num_prompts: int = field(default=8, metadata={"help": "held-out prompts (windows of text)", "min": 1})
    prompt_tokens: int = field(default=64, metadata={"help": "tokens per prompt", "min": 1})
    new_tokens: int = field(default=64, metadata={"help": "greedy tokens generated per run", "min": 1})
    rounds: int = field(default=2, metadata={"help": "rounds of every paired comparison", "min": 1})
    lookup: list[str] = field(
        default_factory=lambda: ["10:2", "4:3", "6:3"],
        metadata={
            "help": "context-draft settings N:G (prompt_lookup_num_tokens:max_matching_ngram_size), or N:G:W with "
            "speculative_verify_width W"
        },
    )
    exits: list[int] | None = field(
        default=None,
        metadata={"help": "assistant_early_exit values (layers that draft) for exit-head rows (default: none)"},
    )
    num_assistant_tokens: int = field(default=4, metadata={"help": "exit-head drafts per round", "min": 1})
    vocab_sizes: list[int] | None = field(
        default=None,
        metadata={
            "help": "assistant_vocab_size values of our exit-head rows, each next to the full vocabulary (needs the "
            "folder's stored draft vocabulary, see `fit --draft-vocab-size`)",
            "min": 1,
        },
    )
    table_drafts: bool = field(
        default=False,
        metadata={
            "help": "also time each of our context-draft rows with table drafts (speculative_table_drafts: rows "
            "without a context match draft from the folder's stored table, or the one --table-from builds)"
        },
    )
    table_from: str | None = field(
        default=None,
        metadata={
            "help": "build the draft table before timing (not saved) from 'training' (the main job's fitting text: "
            "the five training novels, the first half of the Python manual), 'austen' (the five novels alone), "
            "'python' (the manual's half alone) or a text file"
        },
    )
    domain: str | None = field(
        default=None,
        metadata={
            "help": "take every prompt from one held-out domain, 'austen' or 'python' (default: both, alternating); "
            "with --table-from the other domain, drafts are measured on text the table was not built from"
        },
    )
    workload: str = field(
        default="heldout",
        metadata={
            "help": "'heldout': windows of held-out text, every run from an empty history; 'repeated': several "
            "requests over one document (each held-out window asked --requests times, with different copy-edit "
            "instructions), timed as whole passes in order, the history kept within a pass (emptied before it)"
        },
    )
    requests: int = field(default=4, metadata={"help": "requests per document of the repeated workload", "min": 1})
    gate_ablation: bool = field(
        default=False,
        metadata={"help": "also time each of our context-draft rows with speculative_gate=False (every round drafts)"},
    )
    heuristic_schedule: bool = field(
        default=False,
        metadata={
            "help": "also time each of our context-draft rows with num_assistant_tokens_schedule='heuristic' (each "
            "row's draft budget +2 after a round that kept every draft, else -1)"
        },
    )
    threads: int = field(default=2, metadata={"help": "torch threads", "min": 1})
    seed: int = field(default=0, metadata={"help": "seed of the prompts"})

    def __post_init__(self):
        check_fields(self)
        if self.workload not in ("heldout", "repeated"):
            raise ValueError(f"`workload` must be 'heldout' or 'repeated', got {self.workload!r}.")
        if self.domain not in (None, "austen", "python"):
            raise ValueError(f"`domain` must be 'austen' or 'python', got {self.domain!r}.")
        for value in self.lookup:
            parts = value.split(":")
            if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(
                    f"`lookup` takes N:G pairs (or N:G:W triples) of positive integers, e.g. 10:2, got {value!r}."
                )

    def lookup_settings(self) -> list[dict]:
        settings = []
        for value in self.lookup:
            n, g, *w = (int(p) for p in value.split(":"))
            settings.append(
                dict(prompt_lookup_num_tokens=n, max_matching_ngram_size=g, **{WIDTH_FIELD: w[0]} if w else {})
            )
        return settings


def lossless_rows(config: LosslessConfig) -> list[dict]:
    """[{"name", "who" ("transformers" / "ours"), "kwargs", "batch_1_only"}] in the order they are timed."""
    rows = []
    for setting in config.lookup_settings():
        n, g, w = setting["prompt_lookup_num_tokens"], setting["max_matching_ngram_size"], setting.get(WIDTH_FIELD)
        name = f"prompt lookup N={n} G={g}"
        if w is None:  # transformers' own has no verification width
            rows.append(dict(name=name, who="transformers", kwargs=setting, batch_1_only=True))
        else:
            name += f", verify width {w}"
        variants = [("", setting)] + (
            [(", table drafts", {**setting, TABLE_FIELD: True})] if config.table_drafts else []
        )
        for tag, kwargs in variants:
            rows.append(dict(name=name + tag, who="ours", kwargs=kwargs, batch_1_only=False))
            if config.gate_ablation:
                ungated = {**kwargs, GATE_FIELD: False}
                rows.append(dict(name=name + tag + ", no gate", who="ours", kwargs=ungated, batch_1_only=False))
            if config.heuristic_schedule:
                heuristic = {**kwargs, "num_assistant_tokens_schedule": "heuristic"}
                rows.append(dict(name=name + tag + ", heuristic", who="ours", kwargs=heuristic, batch_1_only=False))
    for e in config.exits or []:
        exit_draft = dict(assistant_early_exit=e, num_assistant_tokens=config.num_assistant_tokens)
        if layer_skip_failure() is None:  # transformers' own, where the installed release can run it
            rows.append(dict(name=f"exit drafts @{e}", who="transformers", kwargs=exit_draft, batch_1_only=True))
        for vocab in [None] + list(config.vocab_sizes or []):
            ours = exit_draft if vocab is None else {**exit_draft, "assistant_vocab_size": vocab}
            tag = "" if vocab is None else f", top-{vocab} draft vocabulary"
            rows.append(dict(name=f"exit drafts @{e}{tag}", who="ours", kwargs=ours, batch_1_only=False))
            both = {**config.lookup_settings()[0], **ours}
            rows.append(dict(name=f"context + exit drafts @{e}{tag}", who="ours", kwargs=both, batch_1_only=False))
    return rows


EDITS = (
    "Copy this text exactly.",
    "Fix the spelling mistakes in this text, if any.",
    "Repeat the text below, word for word.",
    "Rewrite this text with its typos corrected.",
)


def repeated_prompts(tokenizer, prompts, requests) -> list[dict]:
    """Each of `prompts` (held-out windows) asked `requests` times, one copy-edit instruction (`EDITS`) each, in the
    chat template when the tokenizer has one: document 0's requests first, then document 1's, ..."""
    out = []
    for prompt in prompts:
        text = tokenizer.decode(prompt["ids"])
        for k in range(requests):
            message = f"{EDITS[k % len(EDITS)]}\n\n{text}"
            if getattr(tokenizer, "chat_template", None):
                ids = tokenizer.apply_chat_template(
                    [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
                )
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tokenizer(message + "\n\n", add_special_tokens=False)["input_ids"]
            out.append({"domain": prompt["domain"], "ids": list(ids)})
    return out


def run_lossless(ee, plain, prompts, config: LosslessConfig, log=print) -> dict:
    """Times every row against plain on the same batches of `prompts` (`[{"ids": [int]}]`, e.g. `heldout_prompts`);
    returns {"config", "results": [...]}."""
    torch.set_num_threads(config.threads)
    results = []
    with without_eos(ee, plain):
        generation_config = greedy_generation_config(plain, config.new_tokens, clear_exit_settings=True)
        for batch_size in config.batch_sizes:
            rows = [r for r in lossless_rows(config) if batch_size == 1 or not r["batch_1_only"]]
            if config.workload == "repeated":  # every request, in order, in batches of consecutive requests
                batches = make_batches(prompts, batch_size, -(-len(prompts) // batch_size), ee.device)
                results += measure_workload(ee, plain, batches, rows, generation_config, config.rounds, log)
                continue
            batches = make_batches(prompts, batch_size, max(1, config.num_prompts // batch_size), ee.device)
            results += measure_rows(ee, plain, batches, rows, generation_config, config.rounds, log)
    report = {"config": asdict(config), "results": results}
    if config.exits and layer_skip_failure() is not None:
        report["not_run"] = {"transformers exit drafts": layer_skip_failure()}
        log(f"[bench-lossless] transformers' exit drafts: {layer_skip_failure()}")
    return report


def format_lossless(report: dict) -> str:
    def per_forward(r):  # transformers' assisted loop does not report its rounds
        return f"{r['tokens_per_forward']:.2f}" if r["who"] == "ours" else "-"

    lines = [
        "| batch | mode | who | speed-up (sum) | median (min-max) | tokens / full forward | drafts kept | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['batch_size']} | {r['name']} | {r['who']} | **{r['speedup']:.2f}x** | {r['median']:.2f}x "
            f"({r['low']:.2f}-{r['high']:.2f}) | {per_forward(r)} | {_kept(r)} | {'yes' if r['identical'] else 'NO'} |"
        )
    plain = {r["batch_size"]: r["plain_ms_per_token"] for r in report["results"]}
    lines.append("")
    lines.append("plain: " + ", ".join(f"batch {b}: {ms:.1f} ms per step" for b, ms in plain.items()))
    lines += [f"{name}: {why}" for name, why in report.get("not_run", {}).items()]
    return "\n".join(lines)


def _kept(r):
    if r["who"] != "ours" or "drafted" not in r:
        return "-"
    return f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "0 (plain)"


def store_table_from(model, tokenizer, source: str, max_chars: int | None = None) -> tuple[int, int]:
    """Stores in `model` the draft table of `source` ('training': the main job's fitting text, at most `max_chars`
    of each source; 'austen' / 'python': its novels / its manual half alone; else a text file); returns (its
    entries, the tokens it was counted on)."""
    from ee_transformers.tools.assets import token_sequences, training_texts

    if source in ("training", "austen", "python"):
        texts = training_texts(max_chars)
        texts = {"training": texts, "austen": texts[:-1], "python": texts[-1:]}[source]
    elif Path(source).is_file():
        texts = [Path(source).read_text(encoding="utf-8", errors="replace")]
    else:
        raise InputError(
            f"`--table-from` must be 'training', 'austen', 'python' or a text file, got {source!r} (no such file)."
        )
    sequences = token_sequences(texts, tokenizer)
    return model.set_draft_table(sequences), sum(map(len, sequences))


def _run(args):
    from transformers import AutoTokenizer

    from ee_transformers.convert import check_weights, read_config

    config = config_from_args(LosslessConfig, args)
    read_config(args.model, "--model")
    check_weights(args.model, "--model")
    wanted = sorted({e - 1 for e in config.exits or []})
    stored = read_config(args.model).get("exit_layers") or []
    if stored and not set(wanted) <= set(stored):  # fitted heads belong to their layers: never re-assigned
        raise InputError(
            f"`--exits` must name exits of the folder's model: allowed values are {[e + 1 for e in stored]}, got "
            f"{config.exits}."
        )
    ee, plain = load_models(args.model, exit_layers=None if stored else (wanted or [0]))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if config.table_from:
        entries, tokens = store_table_from(ee, tokenizer, config.table_from)
        print(f"draft table from {config.table_from}: {entries} entries from {tokens} tokens")
    elif config.table_drafts and not ee.config.draft_table_size:
        raise InputError(
            f"`--table-drafts` needs a draft table: the folder {args.model} stores none; pass `--table-from training` "
            "or a text file."
        )
    texts = None
    if config.domain:
        path, region = default_text_files()[config.domain]
        texts = {config.domain: text_slice(path, region, 10**9)}
    prompts = heldout_prompts(
        tokenizer, num_prompts=config.num_prompts, window=config.prompt_tokens, seed=config.seed, texts=texts
    )
    if config.workload == "repeated":
        prompts = repeated_prompts(tokenizer, prompts, config.requests)
    report = run_lossless(ee, plain, prompts, config)
    table = format_lossless(report)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "lossless.json").write_text(json.dumps(report, indent=2))
        (out / "lossless.md").write_text(table + "\n")
    wrong = [f"{r['who']} {r['name']} at batch {r['batch_size']}" for r in report["results"] if not r["identical"]]
    if wrong:
        raise AssertionError("not identical to plain greedy: " + "; ".join(wrong))


def main(argv=None):
    parser = ArgumentParser(
        prog="ee-transformers bench-lossless",
        description="Lossless decoding (context drafts, exit-head drafts) against plain greedy generate and "
        "transformers' prompt lookup, on the same prompts.",
    )
    parser.add_argument("--model", required=True, help="a plain or early-exit model folder")
    parser.add_argument("--out", default=None, help="folder for lossless.json and lossless.md")
    add_config_arguments(parser, LosslessConfig)
    return run_command(parser, _run, argv)
