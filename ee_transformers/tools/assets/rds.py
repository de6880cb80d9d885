"""A pure-Python reader of R serializations (XDR format, `serialize()` / `saveRDS` version 2 or 3), enough for the
lazy-load databases that R packages store their data in (`data/Rdata.rdb` with its `.rdx` index).

The input is downloaded data, so the reader is bounded: every length is checked against the bytes that remain before
anything is allocated, expanded sequences and nesting depth are capped, inflating stops at a size derived from the
pinned package, and anything malformed raises `RDataError` (a `ValueError`) instead of looping, exhausting memory or
ending in another exception.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from typing import Any

# Limits, from the pinned r-cran-janeaustenr 1.0.0-1: its Rdata.rdb is 1.53 MiB; its largest object (Emma) inflates
# to 0.95 MiB and its index (Rdata.rdx) to 401 bytes; the deepest nesting is 4. Each limit leaves room to spare.
MAX_RDB_BYTES = 16 << 20  # a whole .rdb file, compressed
MAX_BLOCK_BYTES = 8 << 20  # one object, inflated
MAX_INDEX_BYTES = 1 << 20  # the .rdx index, inflated
MAX_DEPTH = 100  # nested objects
MAX_EXPANDED = 1 << 20  # elements of a compact (ALTREP) sequence, which its 3 numbers do not bound
_NATIVE_ENCODINGS = {
    "utf-8",
    "utf8",
    "latin1",
    "latin-1",
    "iso-8859-1",
    "iso8859-1",
    "ascii",
    "us-ascii",
    "cp1252",
    "windows-1252",
}


class RDataError(ValueError):
    """Malformed, truncated or oversized R data."""


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
        names = self.attributes.get("names")
        return list(names) if isinstance(names, list) and all(isinstance(n, str) for n in names) else None

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
_SPECIALS = {242: "emptyenv", 241: "baseenv", 253: "globalenv", 252: "unbound", 251: "missingarg", 250: "basenamespace"}
_NA_INTEGER = -(2**31)


class _RReader:
    """Reads one R serialization in XDR format (``serialize()``/``saveRDS`` version 2 or 3)."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.refs, self.depth = data, 0, [], 0
        self.native_encoding = "utf-8"

    def _take(self, n: int) -> bytes:
        if n < 0 or n > len(self.data) - self.pos:
            raise RDataError(
                f"R serialization truncated or corrupt: {n} bytes asked for at offset {self.pos}, "
                f"{len(self.data) - self.pos} left"
            )
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def _int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def _length(self, item_bytes: int) -> int:
        """A vector length, checked against what remains: each element takes at least `item_bytes` bytes."""
        n = self._int()
        if n == -1:  # long vector: two more ints
            upper, lower = self._int(), self._int()
            n = (upper << 32) + lower if upper >= 0 and lower >= 0 else -1
        if n < 0 or n * item_bytes > len(self.data) - self.pos:
            raise RDataError(
                f"R serialization has a vector of length {n} at offset {self.pos}, more than the "
                f"{len(self.data) - self.pos} bytes left can hold"
            )
        return n

    def read(self) -> Any:
        if self.data[:5] in (b"RDX2\n", b"RDX3\n"):  # save() files carry one more magic line
            self.pos = 5
        fmt = self._take(2)
        if fmt != b"X\n":
            raise RDataError(f"only XDR R serializations are supported, got format {fmt!r}")
        version = self._int()
        self._int(), self._int()  # writer's R version, minimal reader version
        if version == 3:
            name = self._take(self._int()).decode("ascii", "replace").lower()
            self.native_encoding = name if name in _NATIVE_ENCODINGS else "utf-8"
        elif version != 2:
            raise RDataError(f"unsupported R serialization version {version}")
        return self._item()

    def _item(self) -> Any:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise RDataError(f"R serialization nests objects deeper than {MAX_DEPTH}")
        try:
            return self._dispatch(self._int())
        finally:
            self.depth -= 1

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
                raise RDataError(f"R serialization refers to object {index}, only {len(self.refs)} seen")
            return self.refs[index - 1]
        if rtype == 9:  # CHARSXP
            return self._charsxp(flags)
        if rtype == 1:  # SYMSXP
            name = self._item()
            if name is not None and not isinstance(name, str):
                raise RDataError(f"R serialization has a symbol whose name is a {type(name).__name__}")
            symbol = RSymbol(name or "")
            self.refs.append(symbol)
            return symbol
        if rtype in (248, 249):  # PACKAGESXP, NAMESPACESXP: a persistent name as a string vector
            if self._int() != 0:
                raise RDataError("unexpected persistent-name header")
            obj = ROther("namespace" if rtype == 249 else "package", [self._item() for _ in range(self._length(4))])
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
            n = self._length(4)
            values = [None if v == _NA_INTEGER else v for v in struct.unpack(f">{n}i", self._take(4 * n))]
            items = [v if v is None else bool(v) for v in values] if rtype == 10 else values
        elif rtype == 14:  # REALSXP
            n = self._length(8)
            items = list(struct.unpack(f">{n}d", self._take(8 * n)))
        elif rtype == 15:  # CPLXSXP
            n = self._length(16)
            parts = struct.unpack(f">{2 * n}d", self._take(16 * n))
            items = [complex(parts[i], parts[i + 1]) for i in range(0, 2 * n, 2)]
        elif rtype in (STRSXP, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            items = [self._item() for _ in range(self._length(4))]
        elif rtype == 24:  # RAWSXP
            items = list(self._take(self._length(1)))
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
            raise RDataError(f"unsupported R object type {rtype} (byte code, closure internals...)")
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
            if (
                not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 2**53 for v in (n, first, step)
                )
                or not 0 <= n <= MAX_EXPANDED
            ):
                raise RDataError(
                    f"R compact sequence {list(state)!r}: its length must be 0..{MAX_EXPANDED} and its "
                    "values finite numbers"
                )
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


def inflate(data, limit: int, what: str, wbits: int = zlib.MAX_WBITS) -> tuple[bytes, int]:
    """(the inflated bytes, the compressed bytes used) of the zlib (or, `wbits=31`, gzip) stream at the start of
    `data`; `RDataError` when it is corrupt, truncated or would inflate beyond `limit` bytes."""
    inflater = zlib.decompressobj(wbits)
    parts, size = [], 0
    pending = memoryview(data)
    try:
        while not inflater.eof:  # every round consumes input or makes output, and output is capped: it ends
            chunk = inflater.decompress(pending, limit + 1 - size)
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                raise RDataError(f"{what} inflates beyond {limit} bytes, more than this reader accepts")
            if not chunk and not pending:
                raise RDataError(f"{what} is truncated: its compressed stream ends early")
            pending = inflater.unconsumed_tail
    except zlib.error as error:
        raise RDataError(f"{what} is not a valid compressed stream ({error})") from None
    return b"".join(parts), len(data) - len(inflater.unused_data)


def decompress_block(block: bytes) -> bytes:
    """Inflate one lazy-load database block: a 4-byte big-endian uncompressed length, then a zlib stream."""
    if len(block) < 4:
        raise RDataError("R lazy-load block too short")
    (expected,) = struct.unpack(">I", block[:4])
    if expected > MAX_BLOCK_BYTES:
        raise RDataError(
            f"R lazy-load block says it inflates to {expected} bytes, more than the {MAX_BLOCK_BYTES} "
            "this reader accepts"
        )
    data, _ = inflate(block[4:], expected, "R lazy-load block")
    if len(data) != expected:
        raise RDataError(f"R lazy-load block inflated to {len(data)} bytes, header says {expected}")
    return data


def iter_rdb_blocks(rdb: bytes) -> Iterator[bytes]:
    """Split a whole ``.rdb`` file into its blocks, in file order, without its ``.rdx`` index."""
    if len(rdb) > MAX_RDB_BYTES:
        raise RDataError(f"R lazy-load database of {len(rdb)} bytes, more than the {MAX_RDB_BYTES} accepted")
    pos = 0
    while pos < len(rdb):
        _, used = inflate(memoryview(rdb)[pos + 4 :], MAX_BLOCK_BYTES, f"block at offset {pos} of the database")
        end = pos + 4 + used
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
    if rdx[:2] == b"\x1f\x8b":
        raw, _ = inflate(rdx, MAX_INDEX_BYTES, "R lazy-load index", wbits=31)  # gzip
    else:
        raw = decompress_block(rdx)
    index = unserialize(raw)
    variables = index.as_dict().get("variables") if isinstance(index, RVector) else None
    if not isinstance(variables, RVector):
        raise RDataError("R lazy-load index has no `variables` list")
    found = {}
    for name, where in variables.as_dict().items():
        if not (isinstance(where, RVector) and len(where) == 2 and all(_whole(v) for v in where)):
            raise RDataError(f"R lazy-load index: {name!r} has no (offset, length) pair")
        found[name] = (int(where[0]), int(where[1]))
    return found


def _whole(value) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and 0 <= value < 2**53
        and float(value).is_integer()
    )
