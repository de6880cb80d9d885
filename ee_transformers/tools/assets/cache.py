"""The asset cache: where assets live, completion markers, the atomic install of a built folder, external commands."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ee_transformers.utils.arguments import InputError
from ee_transformers.utils.outputs import clean_stale, process_alive, replace_folder

logger = logging.getLogger(__name__)

MARKER = "ASSET.json"


def default_cache_dir() -> Path:
    """``$EE_TRANSFORMERS_CACHE`` if set, else ``~/.cache/ee-transformers``."""
    env = os.environ.get("EE_TRANSFORMERS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ee-transformers"


def cache_folder(cache_dir: str | os.PathLike | None) -> Path:
    """The cache folder, created if needed, without the build folders of killed fetches; `InputError` naming
    `--cache-dir` when it cannot be one."""
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if path.exists() and not path.is_dir():
        raise InputError(f"`--cache-dir` {str(path)!r} is a file, not a folder.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError(f"`--cache-dir` {str(path)!r} cannot be created ({error.strerror or error}).") from None
    for entry in path.iterdir():  # build folders are named .<what>-build-<pid>-<random>
        match = re.fullmatch(r"\.\w+-build-(\d+)-\w+", entry.name)
        if match and entry.is_dir() and not process_alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
    return path


def build_folder(cache: Path, what: str) -> tempfile.TemporaryDirectory:
    """A temporary folder in the cache to build `what` in, named after this process so a later fetch can tell it
    was left by a killed one."""
    return tempfile.TemporaryDirectory(prefix=f".{what}-build-{os.getpid()}-", dir=cache)


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
    """Puts the fully built ``staging`` folder at ``final`` in one atomic step, replacing whatever was there (the
    output folders' own swap: ``ee_transformers.utils.outputs.replace_folder``)."""
    replace_folder(staging, final)


def restore_folder(final: Path) -> None:
    """Before reading ``final``: repairs a swap that a killed fetch left half done (see ``outputs.clean_stale``)."""
    clean_stale(final, "--cache-dir")


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
