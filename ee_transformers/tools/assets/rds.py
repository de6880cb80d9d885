"""A pure-Python reader of R serializations (XDR format, `serialize()` / `saveRDS` version 2 or 3), enough for the
lazy-load databases that R packages store their data in (`data/Rdata.rdb` with its `.rdx` index)."""

from __future__ import annotations

import gzip
import struct
import zlib
from typing import Any, Iterator


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