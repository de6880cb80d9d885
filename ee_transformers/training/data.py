"""Training text: read plain text / JSON lines / local `datasets` files, tokenise, pack into blocks, split.

Every failure here happens before any training work starts and names the file or argument at fault.
"""

import glob
import json
import os
from dataclasses import dataclass

import torch

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".info")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
DATASETS_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def expand_paths(patterns, argument: str = "--data") -> list[str]:
    """Expands globs (`books/*.txt`) and folders (their files, sorted). A pattern that matches nothing is an error
    naming `argument`."""
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    paths = []
    for pattern in patterns:
        pattern = str(pattern)
        if os.path.isdir(pattern):
            found = sorted(
                os.path.join(pattern, n) for n in os.listdir(pattern) if os.path.isfile(os.path.join(pattern, n))
            )
        elif os.path.exists(pattern):
            found = [pattern]
        else:
            found = sorted(glob.glob(pattern))
        if not found:
            raise ValueError(f"`{argument}` pattern {pattern!r} matches no file.")
        paths.extend(found)
    if not paths:
        raise ValueError(f"`{argument}` is empty: give at least one text, JSON lines or datasets file.")
    return paths


def _read_jsonl(path: str, text_field: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    stripped = raw.lstrip()
    if stripped.startswith("["):  # a JSON array of records
        try:
            records = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error.msg} at line {error.lineno}).") from None
    else:
        records = []
        for number, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}: line {number} is not valid JSON ({error.msg}).") from None
    texts = []
    for number, record in enumerate(records, 1):
        if isinstance(record, str):
            texts.append(record)
        elif isinstance(record, dict) and isinstance(record.get(text_field), str):
            texts.append(record[text_field])
        else:
            raise ValueError(f"{path}: record {number} has no string field `{text_field}` (set `--text-field`).")
    return texts


def _read_datasets_file(path: str, kind: str, text_field: str) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{path}: reading .{kind} files needs the `datasets` package (pip install datasets), or "
            "convert the file to text / JSON lines."
        ) from None
    table = datasets.load_dataset(kind, data_files=path, split="train")
    if text_field not in table.column_names:
        raise ValueError(f"{path}: no column `{text_field}` (columns: {table.column_names}); set `--text-field`.")
    return [t for t in table[text_field] if isinstance(t, str)]


def read_texts(patterns, text_field: str = "text", argument: str = "--data") -> list[str]:
    """The documents in `patterns`: one per text file, one per JSON-lines record, one per datasets row.

    Raises `ValueError` naming the file when a file is unreadable or not UTF-8, and when there is no text at all.
    """
    texts = []
    for path in expand_paths(patterns, argument):
        suffix = os.path.splitext(path)[1].lower()
        try:
            if suffix in JSONL_SUFFIXES:
                texts.extend(_read_jsonl(path, text_field))
            elif suffix in DATASETS_SUFFIXES:
                texts.extend(_read_datasets_file(path, DATASETS_SUFFIXES[suffix], text_field))
            else:  # anything else is read as plain UTF-8 text
                with open(path, encoding="utf-8") as f:
                    texts.append(f.read())
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text (is it a binary file?).") from None
        except OSError as error:
            raise ValueError(f"{path}: cannot be read ({error.strerror or error}).") from None
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(
            f"No text in {list(map(str, patterns if not isinstance(patterns, str) else [patterns]))}: "
            "every file is empty."
        )
    return texts


def pack_token_ids(documents: list[list[int]], block_size: int, separator: int | None = None) -> torch.LongTensor:
    """Concatenates token id lists (with `separator` between documents) and cuts them into `(n, block_size)` blocks;
    the incomplete tail is dropped."""
    stream = []
    for ids in documents:
        stream.extend(ids)
        if separator is not None:
            stream.append(separator)
    n = len(stream) // block_size
    if n == 0:
        raise ValueError(
            f"The text holds {len(stream)} tokens, fewer than one block of `block_size`={block_size}: "
            "give more text or a smaller block size."
        )
    return torch.tensor(stream[: n * block_size], dtype=torch.long).view(n, block_size)


def frequent_tokens(blocks: torch.LongTensor, n: int, vocab_size: int) -> torch.LongTensor:
    """The `n` most frequent token ids of `blocks`, most frequent first (ties: the lower id first; ids that never
    occur come last): the draft vocabulary of `EarlyExitMixin.set_draft_vocab`."""
    counts = torch.bincount(blocks.flatten().cpu(), minlength=vocab_size)
    return torch.sort(counts, descending=True, stable=True).indices[:n]


def check_block_size(block_size: int, config) -> None:
    """Raises if `block_size` exceeds the positions the model was built for."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"`block_size` must be an integer >= 2, got {block_size!r}.")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and block_size > limit:
        raise ValueError(
            f"`block_size`={block_size} is beyond the model's positions "
            f"(`max_position_embeddings`={limit}); use at most {limit}."
        )


def tokenize_blocks(texts: list[str], tokenizer, block_size: int) -> torch.LongTensor:
    """Tokenises `texts` (no special tokens inside a document, EOS between documents) and packs them."""
    separator = tokenizer.eos_token_id
    documents = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    return pack_token_ids(documents, block_size, separator)


@dataclass
class BlockSplits:
    """Packed blocks `(n, block_size)`: `train` for fitting, `heldout` for evaluation and calibration."""

    train: torch.LongTensor
    heldout: torch.LongTensor


def split_blocks(
    blocks: torch.LongTensor, heldout_fraction: float = 0.1, min_heldout: int = 1, seed: int = 0
) -> BlockSplits:
    """A seeded random split of blocks; at least `min_heldout` blocks are held out (when there are two or more)."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"`heldout_fraction` must be in [0, 1), got {heldout_fraction!r}.")
    n = blocks.shape[0]
    n_held = 0 if heldout_fraction == 0 else max(min_heldout, round(n * heldout_fraction))
    n_held = min(n_held, n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return BlockSplits(train=blocks[order[n_held:]], heldout=blocks[order[:n_held]])


def load_blocks(
    patterns,
    tokenizer,
    block_size: int,
    config=None,
    text_field: str = "text",
    heldout_fraction: float = 0.1,
    seed: int = 0,
) -> BlockSplits:
    """read_texts -> tokenize_blocks -> split_blocks, with the block size checked against `config` first."""
    if config is not None:
        check_block_size(block_size, config)
    blocks = tokenize_blocks(read_texts(patterns, text_field), tokenizer, block_size)
    return split_blocks(blocks, heldout_fraction, seed=seed)


__all__ = [
    "BlockSplits",
    "check_block_size",
    "expand_paths",
    "frequent_tokens",
    "load_blocks",
    "pack_token_ids",
    "read_texts",
    "split_blocks",
    "tokenize_blocks",
]
