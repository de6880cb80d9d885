"""Real English text from Debian packages: Jane Austen's six novels (`r-cran-janeaustenr`, R data read with `rds`)
and the Python manual (`python3.X-doc`, GNU Info), or the standard library's `pydoc_data.topics` as a fallback."""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from ee_transformers.tools.assets.cache import (
    MARKER,
    announce,
    build_folder,
    cache_folder,
    install_folder,
    read_marker,
    restore_folder,
    run_command,
    sha256_of,
)
from ee_transformers.tools.assets.rds import MAX_RDB_BYTES, RDataError, iter_rdb_blocks, parse_rdb_strings, read_rdx

logger = logging.getLogger(__name__)

AUSTEN_PACKAGE = "r-cran-janeaustenr"
# pinned like the model wheel: the .deb's sha256 is checked before it is opened (Debian bookworm's 1.0.0-1)
AUSTEN_VERSION = "1.0.0-1"
AUSTEN_DEB_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
AUSTEN_RDB = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"

# (slug, R object name in janeaustenr, title). Publication order, except that "Sense and Sensibility" is placed
# last so that ``AUSTEN_NOVELS[:5]`` / ``AUSTEN_NOVELS[5]`` is the train / held-out split.
_AUSTEN = (
    ("pride-and-prejudice", "prideprejudice", "Pride and Prejudice"),
    ("mansfield-park", "mansfieldpark", "Mansfield Park"),
    ("emma", "emma", "Emma"),
    ("northanger-abbey", "northangerabbey", "Northanger Abbey"),
    ("persuasion", "persuasion", "Persuasion"),
    ("sense-and-sensibility", "sensesensibility", "Sense and Sensibility"),
)
AUSTEN_NOVELS: tuple[str, ...] = tuple(slug for slug, _, _ in _AUSTEN)
"""Slugs of the six novels; file ``<cache>/text/austen/<slug>.txt`` holds each."""
AUSTEN_TITLES: dict[str, str] = {slug: title for slug, _, title in _AUSTEN}
AUSTEN_HELDOUT = "sense-and-sensibility"
"""The novel meant to be held out of training (it is ``AUSTEN_NOVELS[-1]``)."""
AUSTEN_TRAIN: tuple[str, ...] = AUSTEN_NOVELS[:-1]

PYTHON_DOCS_FILE = "python_docs.txt"

# Where the demo and bench-pool read their text, as (start, stop) fractions of the source: no overlap between fit,
# calibration and the comparison prompts (those are the benchmark's `HELDOUT_REGIONS`, tools/bench/loading.py).
FIT_REGIONS = {"python": (0.0, 0.5)}  # plus the five training novels, whole
CALIBRATION_REGIONS = {"austen": (0.0, 0.5), "python": (0.6, 0.7)}


def text_slice(path, region, max_chars):
    """The text of `path` between the fractions `region` = (start, stop), at most `max_chars` of it."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    start, stop = int(region[0] * len(text)), int(region[1] * len(text))
    return text[start : min(stop, start + max_chars)]


def training_texts(max_chars: int | None = None, cache_dir=None) -> list[str]:
    """The main job's fitting text: the five training novels, whole, and `FIT_REGIONS["python"]` of the Python
    manual (at most `max_chars` of each; None: all)."""
    text = fetch_text(cache_dir, progress=False)
    novels = {Path(p).stem: p for p in text["austen"]}
    limit = max_chars or sys.maxsize
    return [text_slice(novels[name], (0.0, 1.0), limit) for name in AUSTEN_TRAIN] + [
        text_slice(text["python"][0], FIT_REGIONS["python"], limit)
    ]


def token_sequences(texts: list[str], tokenizer, chunk_chars: int = 100_000) -> list:
    """One list of token ids per text (no special tokens), tokenised `chunk_chars` characters at a time (a
    chunk boundary may split a word): the input of `EarlyExitMixin.set_draft_table`."""
    out = []
    for text in texts:
        ids = []
        for start in range(0, len(text), chunk_chars):
            ids += tokenizer(text[start : start + chunk_chars], add_special_tokens=False)["input_ids"]
        out.append(ids)
    return out


def read_austen_rdb(rdb_path: Path) -> dict[str, list[str | None]]:
    """The novels (character vectors with more than 1000 lines) in janeaustenr's ``Rdata.rdb``, by R name.

    Names come from the ``.rdx`` index beside it; without a usable index the blocks are read in file order and
    named ``novel-1``, ``novel-2``...
    """
    if rdb_path.stat().st_size > MAX_RDB_BYTES:
        raise RDataError(f"{rdb_path} holds {rdb_path.stat().st_size} bytes, more than the {MAX_RDB_BYTES} accepted")
    rdb = rdb_path.read_bytes()
    rdx_path = rdb_path.with_suffix(".rdx")
    named: list[tuple[str, bytes]] = []
    try:
        index = read_rdx(rdx_path.read_bytes())
        named = [(name, rdb[off : off + length]) for name, (off, length) in sorted(index.items(), key=lambda kv: kv[1])]
    except (OSError, RDataError) as err:
        logger.info("could not use the index %s (%s); naming the novels by their order", rdx_path, err)
    novels: dict[str, list[str | None]] = {}
    if named:
        for name, block in named:
            vectors = [v for v in parse_rdb_strings(block) if len(v) > 1000]
            if vectors:
                novels[name] = max(vectors, key=len)
    else:
        vectors = [v for block in iter_rdb_blocks(rdb) for v in parse_rdb_strings(block) if len(v) > 1000]
        novels = {f"novel-{i + 1}": v for i, v in enumerate(vectors)}
    return novels


# --------------------------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------------------------


def _apt_download(package: str, dest: Path, version: str | None = None) -> Path:
    """``apt-get download package[=version]`` into ``dest`` (running ``apt-get update`` once if needed); return the
    .deb."""
    hint = "this step needs a Debian/Ubuntu system with apt and access to its package mirror"
    spec = f"{package}={version}" if version else package
    try:
        run_command(["apt-get", "download", spec], f"apt-get download {spec}", hint, cwd=dest)
    except RuntimeError as first:
        logger.info("apt-get download %s failed (%s); running apt-get update and retrying", spec, first)
        try:
            run_command(["apt-get", "update"], "apt-get update", hint + " (apt-get update needs root)")
        except RuntimeError as err:
            raise RuntimeError(f"{first}; and then {err}") from err
        run_command(["apt-get", "download", spec], f"apt-get download {spec}", hint, cwd=dest)
    debs = sorted(dest.glob(f"{package}_*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download {package} left no .deb in {dest}")
    return debs[-1]


def _deb_extract(deb: Path, dest: Path) -> Path:
    run_command(
        ["dpkg-deb", "-x", str(deb), str(dest)], f"dpkg-deb -x {deb.name}", "dpkg-deb (Debian's dpkg) is needed"
    )
    return dest


def _austen_texts(work: Path) -> dict[str, str]:
    """Download janeaustenr and return ``slug -> text`` (lines joined by newlines) for the six novels."""
    deb = _apt_download(AUSTEN_PACKAGE, work, AUSTEN_VERSION)
    digest = sha256_of(deb)
    if digest != AUSTEN_DEB_SHA256:
        raise RuntimeError(
            f"sha256 mismatch for {deb.name}: expected {AUSTEN_DEB_SHA256}, got {digest}; refusing to use it"
        )
    root = _deb_extract(deb, work / "austen-deb")
    rdb = root / AUSTEN_RDB
    if not rdb.is_file():
        raise RuntimeError(f"{AUSTEN_PACKAGE} has no {AUSTEN_RDB}; its layout changed")
    try:
        novels = read_austen_rdb(rdb)
    except RDataError as error:
        raise RuntimeError(f"the R data in {deb.name} ({AUSTEN_RDB}) cannot be read: {error}") from None
    if len(novels) != len(_AUSTEN):
        raise RuntimeError(f"expected {len(_AUSTEN)} novels in {AUSTEN_RDB}, found {len(novels)}")
    by_rname = {rname: slug for slug, rname, _ in _AUSTEN}
    if set(novels) == set(by_rname):
        named = {by_rname[rname]: lines for rname, lines in novels.items()}
    else:
        # R's makeLazyLoadDB writes the objects sorted by name, so file order is the order of the R names.
        logger.warning("novel names %s not recognised; naming them by file order", sorted(novels))
        named = {by_rname[rname]: lines for rname, lines in zip(sorted(by_rname), novels.values())}
    return {slug: "\n".join(line or "" for line in named[slug]) + "\n" for slug in AUSTEN_NOVELS}


def _python_doc_package() -> str | None:
    """The name of this system's ``python3.X-doc`` package, found through apt (not pinned)."""
    try:
        out = run_command(["apt-cache", "depends", "python3-doc"], "apt-cache depends python3-doc", "").stdout
        match = re.search(r"Depends:\s*(python3\.\d+-doc)\b", out)
        if match:
            return match.group(1)
    except RuntimeError as err:
        logger.info("%s", err)
    try:
        out = run_command(
            ["apt-cache", "search", "--names-only", r"^python3\.[0-9]+-doc$"], "apt-cache search", ""
        ).stdout
    except RuntimeError as err:
        logger.info("%s", err)
        return None
    names = re.findall(r"^(python3\.(\d+)-doc)\s", out, flags=re.MULTILINE)
    return max(names, key=lambda n: int(n[1]))[0] if names else None


def clean_info_text(info: str) -> str:
    """Plain text from a GNU Info file: drop node headers, the tag table and the Emacs local-variables trailer."""
    parts = []
    for chunk in info.split("\x1f"):
        body = chunk.lstrip("\n")
        if body.startswith(("Tag Table:", "End Tag Table", "Local Variables:")):
            continue
        if body.startswith("File: ") and "Node: " in body.split("\n", 1)[0]:
            body = body.split("\n", 1)[1] if "\n" in body else ""
        parts.append(body.strip("\n"))
    text = "\n\n".join(part for part in parts if part)
    return re.sub(r"\n{4,}", "\n\n\n", text) + "\n"


def _pydoc_topics_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(f"{name}\n{'=' * len(name)}\n\n{text.strip()}" for name, text in sorted(topics.items())) + "\n"


def _python_docs_text(work: Path) -> tuple[str, str]:
    """The Python manual as text, and a description of where it came from."""
    package = _python_doc_package()
    try:
        if package is None:
            raise RuntimeError("no python3.X-doc package is known to apt-cache")
        deb = _apt_download(package, work)
        root = _deb_extract(deb, work / "python-doc-deb")
        infos = sorted(
            (root / "usr/share/info").glob("python3*.info*.gz"),
            key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)],
        )
        if not infos:
            raise RuntimeError(f"{package} has no usr/share/info/python3*.info*.gz")
        text = "".join(gzip.decompress(p.read_bytes()).decode("utf-8", "replace") for p in infos)
        return clean_info_text(text), f"Debian package {deb.name} ({', '.join(p.name for p in infos)})"
    except (RuntimeError, OSError, EOFError) as err:  # no apt, no such package, or an unreadable archive
        logger.warning("using pydoc_data.topics instead of the Python manual (%s)", err)
        return _pydoc_topics_text(), f"pydoc_data.topics of Python {sys.version.split()[0]} (fallback: {err})"


def _text_paths(root: Path) -> dict[str, list[Path]]:
    return {
        "austen": [root / "austen" / f"{slug}.txt" for slug in AUSTEN_NOVELS],
        "python": [root / "python" / PYTHON_DOCS_FILE],
    }


def fetch_text(cache_dir: str | os.PathLike | None = None, force: bool = False, progress: bool = True) -> dict:
    """Return ``{"austen": [paths], "python": [paths]}``, building ``<cache>/text/`` first if needed.

    ``austen`` lists ``<cache>/text/austen/<slug>.txt`` in :data:`AUSTEN_NOVELS` order; ``python`` lists
    ``<cache>/text/python/python_docs.txt``. A complete cached copy is returned without network access unless
    ``force`` is set.

    Raises:
        RuntimeError: if the Austen package cannot be downloaded or parsed (needs Debian's apt mirror).
    """
    cache = cache_folder(cache_dir)
    final = cache / "text"
    restore_folder(final)
    paths = _text_paths(final)
    if not force and read_marker(final) is not None and all(p.is_file() for ps in paths.values() for p in ps):
        logger.info("text already cached at %s", final)
        return paths

    start = time.monotonic()
    with build_folder(cache, "text") as tmp:
        tmp = Path(tmp)
        work, staging = tmp / "work", tmp / "text"
        work.mkdir()
        announce(progress, f"downloading {AUSTEN_PACKAGE} (apt) and reading its R data")
        austen = _austen_texts(work)
        announce(progress, "downloading the Python manual (apt python3.X-doc)")
        python_text, python_source = _python_docs_text(work)

        staged = _text_paths(staging)
        for path in staged["austen"] + staged["python"]:
            path.parent.mkdir(parents=True, exist_ok=True)
        for slug, path in zip(AUSTEN_NOVELS, staged["austen"]):
            path.write_text(austen[slug], encoding="utf-8")
        staged["python"][0].write_text(python_text, encoding="utf-8")
        marker = {
            "asset": "text",
            "austen": {
                "source": f"Debian package {AUSTEN_PACKAGE} {AUSTEN_VERSION} (sha256 {AUSTEN_DEB_SHA256}), {AUSTEN_RDB}",
                "license": "novels: public domain; janeaustenr packaging: MIT",
                "files": {
                    slug: {"title": AUSTEN_TITLES[slug], "chars": len(austen[slug]), "words": len(austen[slug].split())}
                    for slug in AUSTEN_NOVELS
                },
                "heldout": AUSTEN_HELDOUT,
            },
            "python": {
                "source": python_source,
                "license": "PSF License (Python documentation)",
                "chars": len(python_text),
                "words": len(python_text.split()),
            },
        }
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        install_folder(staging, final)
    announce(progress, f"text ready at {final} ({time.monotonic() - start:.0f} s)")
    return paths
