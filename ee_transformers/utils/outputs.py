"""Output folders, written the one way every command writes them: whole, or not at all.

    out = OutputFolder(args.out, overwrite=args.overwrite)   # at the start, before any work: checks, cleans up
    ...                                                       # the work
    with out.writing() as folder:                             # at the end: write into `folder`, a sibling temporary
        model.save_pretrained(folder)
    # now `args.out` is the new folder; had anything raised (or the process been killed) it would still be the old one

What a user can rely on:
* the folder is written into a hidden sibling (`.<name>.ee-tmp-<pid>`) and swapped into place in one atomic step
  (Linux `renameat2(RENAME_EXCHANGE)`; elsewhere two renames, and a run killed between them is repaired by the next
  run), so `<out>` is always either the previous folder, intact, or the new one, complete;
* a non-empty `<out>` is refused unless `overwrite`, and `overwrite` only replaces a folder an ee-transformers command
  wrote (it lists what it wrote in `.ee-output.json`): anything else in it, e.g. a note the user added, is carried into
  the new folder, never deleted; a file, a symbolic link or a folder no command wrote is refused;
* temporaries left by killed runs are removed by the next run on the same `<out>`; a successful run leaves none.

Updating a folder in place (`carry_from=<out>`, as `calibrate` does without `--out`) keeps every entry the command does
not write anew; carried files are hard links where the file system allows, so a large model is not copied.
"""

import ctypes
import errno
import json
import os
import re
import shutil
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from ee_transformers.utils.arguments import InputError

__all__ = ["MANIFEST", "OutputFolder", "clean_stale", "read_manifest", "replace_folder"]

MANIFEST = ".ee-output.json"


class OutputFolder:
    """An output folder of a command, checked when made (`InputError` naming `argument`) and written by `writing()`.

    overwrite: allow replacing a non-empty folder that an ee-transformers command wrote.
    carry_from: a folder whose entries the new folder keeps when the command does not write them anew (the input
        folder of a command that updates it: in place when it is `path` itself).
    """

    def __init__(self, path, overwrite: bool = False, carry_from=None, argument: str = "--out"):
        self.path = Path(os.path.abspath(os.path.expanduser(str(path))))
        self.overwrite, self.argument = overwrite, argument
        self.carry_from = Path(os.path.abspath(str(carry_from))) if carry_from is not None else None
        self.in_place = self.carry_from == self.path
        self.clean_stale()
        self.check()

    # checks --------------------------------------------------------------------------------------------------------
    def _refuse(self, why: str):
        raise InputError(f"`{self.argument}` {str(self.path)!r} {why}")

    def check(self) -> None:
        """Raises `InputError` unless the folder can be written as asked. Run when made and again before writing."""
        path = self.path
        if path.is_symlink():
            self._refuse("is a symbolic link: give the folder itself.")
        if path.exists() and not path.is_dir():
            self._refuse("is a file, not a folder: choose a folder.")
        ancestor = path.parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
            self._refuse(f"cannot be created: {str(ancestor)!r} is not a writable folder.")
        if self.carry_from is not None and not self.in_place and self.carry_from in path.parents:
            self._refuse(f"is inside {str(self.carry_from)!r}, the folder it is made from: choose a folder outside it.")
        if self.in_place or not path.is_dir() or not os.listdir(path):
            return
        if not self.overwrite:
            self._refuse("already exists and is not empty: pass `--overwrite` to replace it, or choose another folder.")
        if read_manifest(path) is None:
            self._refuse(
                f"was not written by an ee-transformers command (no {MANIFEST}): `--overwrite` only "
                "replaces such folders, so nothing of yours is lost; empty it yourself or choose another "
                "folder."
            )

    def clean_stale(self) -> None:
        clean_stale(self.path, self.argument)

    # writing -------------------------------------------------------------------------------------------------------
    @contextmanager
    def writing(self, command: str | None = None):
        """Yields an empty temporary folder beside `path`; on leaving the block without an exception, carries what
        must be kept, records what the command wrote and swaps the folder into place. On an exception the temporary
        folder is removed and `path` is as it was."""
        self.clean_stale()
        self.check()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.parent / f".{self.path.name}.ee-tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            yield tmp
            written = set(os.listdir(tmp)) - {MANIFEST}
            ours = set(written)
            if self.carry_from is not None and self.carry_from.is_dir():
                # linked when the source is the folder being replaced (it goes away), copied when it stays
                carried = _carry(self.carry_from, tmp, skip=written, link=self.in_place)
                ours |= carried & set(read_manifest(self.carry_from) or ())
            if not self.in_place and self.path.is_dir():  # overwrite: what the user added is kept, not deleted
                users = set(os.listdir(self.path)) - set(read_manifest(self.path) or ()) - {MANIFEST}
                clash = sorted(users & set(os.listdir(tmp)))
                if clash:
                    self._refuse(
                        f"holds {clash}, which no ee-transformers command wrote and which this one would "
                        "replace: move them away and run again (nothing was changed)."
                    )
                _carry(self.path, tmp, skip=set(), only=users, link=True)
            record = {
                "written_by": f"ee-transformers {command}" if command else "ee-transformers",
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "entries": sorted(ours),
            }
            (tmp / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")
            replace_folder(tmp, self.path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def clean_stale(path, argument: str = "--out") -> None:
    """Removes the temporaries killed runs left beside `path` (`.<name>.ee-tmp-<pid>`, `.<name>.ee-old-<pid>`) and
    restores the previous folder when a run died between the two renames of the portable swap. Refuses (with an
    `InputError` naming `argument`) while another live process is writing the same folder."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(path.name)}\.ee-(tmp|old)-(\d+)")
    for entry in sorted(path.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if not match or not entry.is_dir() or entry.is_symlink():
            continue
        kind, pid = match.group(1), int(match.group(2))
        if pid != os.getpid() and process_alive(pid):
            raise InputError(
                f"`{argument}` {str(path)!r} is being written by another process (pid {pid}); wait for "
                f"it to finish, or remove {str(entry)!r} if it is not an ee-transformers command."
            )
        if kind == "old" and not path.exists():
            os.replace(entry, path)  # the new folder was never put in place: the old one is still current
        else:
            shutil.rmtree(entry)


def read_manifest(folder) -> list[str] | None:
    """The entries an ee-transformers command wrote in `folder`, or None when no command recorded any."""
    try:
        record = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    entries = record.get("entries") if isinstance(record, dict) else None
    return [e for e in entries if isinstance(e, str)] if isinstance(entries, list) else None


def replace_folder(new, target) -> None:
    """Puts the complete folder `new` at `target` (a sibling), removing what was there: one atomic exchange where the
    system has one; otherwise `target` moves to `.<name>.ee-old-<pid>` first, which `OutputFolder` restores should
    the process die before `new` is in place."""
    new, target = Path(new), Path(target)
    if not target.exists() or (target.is_dir() and not any(target.iterdir())):
        os.replace(new, target)  # rename(2) onto an empty folder is atomic too
        return
    if _exchange(new, target):  # `new` now holds the old folder
        shutil.rmtree(new)
        return
    old = target.parent / f".{target.name}.ee-old-{os.getpid()}"
    os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old)


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths atomically (Linux `renameat2` with `RENAME_EXCHANGE`); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # a C library without the wrapper (glibc < 2.28, some musl builds)
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):  # the file system cannot exchange
        return False
    raise OSError(code, os.strerror(code), str(b))


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _link_or_copy(source, target):
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _carry(source: Path, target: Path, skip: set, only: set | None = None, link: bool = False) -> set:
    """Copies the entries of `source` that are not in `skip` (and, with `only`, are in it) into `target`; with `link`,
    as hard links where the file system allows (for a source that is about to be removed). Returns their names."""
    copy = _link_or_copy if link else shutil.copy2
    carried = set()
    for name in os.listdir(source):
        if name in skip or name == MANIFEST or (only is not None and name not in only):
            continue
        src, dst = source / name, target / name
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        elif src.is_dir():
            shutil.copytree(src, dst, symlinks=True, copy_function=copy)
        else:
            copy(src, dst)
        carried.add(name)
    return carried
