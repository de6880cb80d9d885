"""The asset cache: where assets live, completion markers, the atomic install of a built folder, external commands."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = "ASSET.json"


def default_cache_dir() -> Path:
    """``$EE_TRANSFORMERS_CACHE`` if set, else ``~/.cache/ee-transformers``."""
    env = os.environ.get("EE_TRANSFORMERS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ee-transformers"


def cache_folder(cache_dir: str | os.PathLike | None) -> Path:
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


def announce(enabled: bool, message: str) -> None:
    logger.info(message)
    if enabled:
        print(f"[ee-transformers assets] {message}", flush=True)


def read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def install_folder(staging: Path, final: Path) -> None:
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


def run_command(cmd: list[str], what: str, hint: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd``; on failure raise a ``RuntimeError`` naming ``what`` failed and ``hint`` on what to do."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as err:
        raise RuntimeError(f"{what} failed: {err}; {hint}") from err
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' | '.join(tail)}; {hint}")
    return proc


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()