"""Gemma-3-270M from PyPI chunk wheels: reassembly is checked against the pinned sha256 (no network here)."""

import zipfile

import pytest

from ee_transformers.tools.assets import gemma
from ee_transformers.tools.assets.cli import main


def _fake_wheels(tmp_path, chunks):
    wheels = {}
    for i, (requirement, data) in enumerate(zip(list(gemma.GEMMA_WHEELS)[1:], chunks)):
        path = tmp_path / gemma._wheel_file(requirement)
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(f"pkg{i}/data/{gemma.GEMMA_GGUF}.part{i:02d}", data)
            archive.writestr(f"pkg{i}/__init__.py", "")
        wheels[requirement] = path
    return wheels


def test_reassembly_concatenates_chunks_in_order_and_refuses_a_wrong_sha256(tmp_path):
    wheels = _fake_wheels(tmp_path, [b"a" * 3, b"b" * 2, b"c", b"d" * 4])
    with pytest.raises(RuntimeError, match="sha256 mismatch for the reassembled"):
        gemma.reassemble(wheels, tmp_path / "out.gguf")
    assert (tmp_path / "out.gguf").read_bytes() == b"aaabbcdddd"  # in order, each chunk once


def test_fetch_assets_takes_the_gemma_model(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr(
        "ee_transformers.tools.assets.cli.fetch_gemma3_270m",
        lambda cache_dir, force: seen.update(cache_dir=cache_dir, force=force) or tmp_path,
    )
    assert main(["--model", "gemma3-270m", "--cache-dir", str(tmp_path)]) == 0
    assert seen == {"cache_dir": str(tmp_path), "force": False}
    assert str(tmp_path) in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", "gemma3-1b"])
