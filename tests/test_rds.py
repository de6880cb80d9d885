"""The R reader behind `fetch-assets` on hostile input: each attack of issue 13 ends quickly in `RDataError`, and random
mutations and truncations of real serializations (from the pinned janeaustenr package) either parse or raise
`RDataError`, each within a fraction of a second.

tests/data/janeaustenr/: `Rdata.rdx` and `Rdata.rds` are the package's index files as R wrote them (gzip); and
`emma-first-60-lines.rds` is the start of the package's serialization of Emma, its length field set to 60 (the
header and the first 60 CHARSXPs as R wrote them)."""

import gzip
import random
import struct
import time
import zlib
from pathlib import Path

import pytest

from ee_transformers.tools.assets import rds
from ee_transformers.tools.assets.rds import RDataError

DATA = Path(__file__).parent / "data" / "janeaustenr"
HEADER_V2 = b"X\n" + struct.pack(">iii", 2, 0x040201, 0x020300)
HEADER_V3 = b"X\n" + struct.pack(">iiii", 3, 0x040201, 0x030500, 5) + b"UTF-8"


def ints(*values):
    return struct.pack(f">{len(values)}i", *values)


def block(payload, claimed=None):
    return struct.pack(">I", len(payload) if claimed is None else claimed) + zlib.compress(payload)


def real_serializations():
    return {
        "index": gzip.decompress((DATA / "Rdata.rdx").read_bytes()),
        "names": gzip.decompress((DATA / "Rdata.rds").read_bytes()),
        "emma": (DATA / "emma-first-60-lines.rds").read_bytes(),
    }


def test_the_real_serializations_parse():
    data = real_serializations()
    assert rds.unserialize(data["emma"])[:3] == ["EMMA", "", "By Jane Austen"]
    assert [v[0] for v in rds.unserialize(data["names"])] == [
        "emma",
        "mansfieldpark",
        "northangerabbey",
        "persuasion",
        "prideprejudice",
        "sensesensibility",
    ]
    index = rds.read_rdx((DATA / "Rdata.rdx").read_bytes())
    assert index["emma"] == (0, 352043) and index["sensesensibility"] == (1334779, 266556)


def quick(call, *args):
    start = time.perf_counter()
    try:
        return call(*args)
    finally:
        assert time.perf_counter() - start < 0.5, "the reader must give up at once on bad input"


@pytest.mark.parametrize(
    "name, payload",
    [
        # a CHARSXP of length -8 used to move the cursor back 8 bytes, re-reading itself forever
        ("negative length (the 26-byte hang)", HEADER_V2 + ints(16, 1, 9, -8)),
        ("negative vector length", HEADER_V2 + ints(13, -5)),
        ("length beyond the data", HEADER_V2 + ints(14, 2**31 - 1)),
        ("long-vector length beyond the data", HEADER_V2 + ints(16, -1, 1, 0)),
        ("negative encoding length", b"X\n" + ints(3, 0, 0, -3)),
        (
            "compact sequence of 10^12 elements",
            HEADER_V3
            + ints(238)
            + ints(2, 1)
            + ints(16, 1, 9, 14)
            + b"compact_intseq"
            + ints(254)
            + ints(14, 3)
            + struct.pack(">3d", 1e12, 1, 1)
            + ints(254, 254),
        ),
        ("reference to an object never seen", HEADER_V2 + ints(255 | (7 << 8))),
        ("nesting 100,000 deep", HEADER_V2 + ints(19, 1) * 100_000 + ints(254)),
        ("truncated header", b"X\n\x00\x00"),
        ("not XDR", b"A\n3\n"),
    ],
)
def test_each_attack_is_a_quick_rdata_error(name, payload):
    with pytest.raises(RDataError):
        quick(rds.unserialize, payload)


def test_a_zlib_bomb_is_refused_before_and_while_inflating():
    bomb = zlib.compress(b"\0" * (64 << 20), 9)  # 64 MiB of zeros in ~65 kB
    with pytest.raises(RDataError, match="more than"):
        quick(rds.decompress_block, struct.pack(">I", 64 << 20) + bomb)  # its header says so: not even inflated
    with pytest.raises(RDataError, match="inflates beyond"):
        quick(rds.decompress_block, struct.pack(">I", 100) + bomb)  # its header lies: inflating stops at the cap
    with pytest.raises(RDataError, match="inflates beyond"):
        quick(list, rds.iter_rdb_blocks(struct.pack(">I", 100) + bomb))
    with pytest.raises(RDataError, match="inflates beyond"):
        quick(rds.read_rdx, gzip.compress(b"\0" * (4 << 20)))


def test_corrupt_and_truncated_compression_is_an_rdata_error():
    good = block(real_serializations()["emma"])
    for bad in (good[:4] + b"garbage" + good[11:], good[: len(good) // 2], good[:3]):
        with pytest.raises(RDataError):
            quick(rds.parse_rdb_strings, bad)
        with pytest.raises(RDataError):
            quick(list, rds.iter_rdb_blocks(bad))


def mutations(data: bytes, rng: random.Random):
    """Random truncations, byte flips, spliced integers (lengths, flags) and deleted or repeated spans."""
    data = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0:
        return bytes(data[: rng.randrange(len(data))])
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(data))
        if kind == 1:
            data[at] = rng.randrange(256)
        elif kind == 2:
            value = rng.choice([-1, -2, -(2**31), 2**31 - 1, 0, 1, 255, 238, 19, 16, 9, rng.randrange(-(2**31), 2**31)])
            data[at : at + 4] = struct.pack(">i", value)
        elif kind == 3:
            del data[at : at + rng.randint(1, 16)]
        else:
            span = bytes(data[at : at + rng.randint(1, 64)])
            data[at:at] = span * rng.randint(1, 50)
    return bytes(data)


@pytest.mark.parametrize("layer", ["serialization", "compressed block"])
def test_fuzzed_real_serializations_parse_or_raise_rdata_error_quickly(layer):
    rng = random.Random(13)
    seeds = list(real_serializations().values())
    if layer == "compressed block":
        seeds = [block(s) for s in seeds]
    parse = rds.unserialize if layer == "serialization" else rds.parse_rdb_strings
    cases = errors = 0
    deadline = time.perf_counter() + 2.0
    while time.perf_counter() < deadline:
        case = mutations(rng.choice(seeds), rng)
        start = time.perf_counter()
        try:
            parse(case)
        except RDataError:
            errors += 1
        except Exception as error:  # noqa: BLE001 - the point: nothing but the reader's own error escapes
            pytest.fail(f"{type(error).__name__}: {error} on input {case[:80]!r}... ({len(case)} bytes)")
        elapsed = time.perf_counter() - start
        assert elapsed < 0.5, f"{elapsed:.2f} s on a {len(case)}-byte input: {case[:80]!r}"
        cases += 1
    assert cases > 200 and errors > cases // 4, (cases, errors)
