"""`OutputFolder`, the one way every command writes its output folder: whole or not at all, nothing of the user's
deleted, nothing left behind."""

import json
import os
import subprocess
import sys

import pytest

from ee_transformers.utils import outputs
from ee_transformers.utils.arguments import InputError
from ee_transformers.utils.outputs import MANIFEST, OutputFolder


def tree(root):
    """{relative path: bytes or 'dir'} of everything under root."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(folder, name), root)] = "dir"
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def write(out, files, overwrite=False, carry_from=None):
    with OutputFolder(out, overwrite=overwrite, carry_from=carry_from).writing("test") as folder:
        for name, text in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)


def test_writes_the_folder_whole_and_leaves_nothing_behind(tmp_path):
    write(tmp_path / "out", {"a.txt": "A", "sub/b.txt": "B"})
    assert sorted(os.listdir(tmp_path)) == ["out"], "no temporary left beside it"
    assert (tmp_path / "out" / "sub" / "b.txt").read_text() == "B"
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["entries"] == ["a.txt", "sub"]


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: (p / "out").write_text("a user's file"), "is a file, not a folder"),
        (
            lambda p: ((p / "out").mkdir(), (p / "out" / "notes.txt").write_text("mine")),
            "already exists and is not empty",
        ),
        (lambda p: ((p / "real").mkdir(), (p / "out").symlink_to(p / "real")), "is a symbolic link"),
    ],
)
def test_refuses_before_any_work_and_changes_nothing(tmp_path, setup, message):
    setup(tmp_path)
    before = tree(tmp_path)
    with pytest.raises(InputError, match=message):
        OutputFolder(tmp_path / "out")
    assert tree(tmp_path) == before


def test_overwrite_replaces_only_a_folder_a_command_wrote(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_text("someone else's model")
    with pytest.raises(InputError, match="was not written by an ee-transformers command"):
        OutputFolder(tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "model.safetensors").read_text() == "someone else's model"


def test_overwrite_keeps_what_the_user_added_and_drops_what_the_last_run_wrote(tmp_path):
    out = tmp_path / "out"
    write(out, {"config.json": "old", "old-report.json": "stale"})
    (out / "notes.txt").write_text("the user's notes")
    write(out, {"config.json": "new"}, overwrite=True)
    assert (out / "config.json").read_text() == "new"
    assert (out / "notes.txt").read_text() == "the user's notes", "a file the command did not write is kept"
    assert not (out / "old-report.json").exists(), "what the previous run wrote and this one did not is gone"
    assert json.loads((out / MANIFEST).read_text())["entries"] == ["config.json"], "the notes stay the user's"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_user_file_the_new_output_would_replace_is_refused_and_nothing_changes(tmp_path):
    out = tmp_path / "out"
    write(out, {"config.json": "old"})
    (out / "calibration.json").write_text("the user's own")
    before = tree(tmp_path)
    with pytest.raises(InputError, match=r"holds \['calibration.json'\], which no ee-transformers command wrote"):
        write(out, {"config.json": "new", "calibration.json": "ours"}, overwrite=True)
    assert tree(tmp_path) == before


def test_an_error_while_writing_leaves_the_previous_folder(tmp_path):
    out = tmp_path / "out"
    write(out, {"config.json": "old"})
    before = tree(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        with OutputFolder(out, overwrite=True).writing() as folder:
            (folder / "config.json").write_text("half")
            raise RuntimeError("boom")
    assert tree(tmp_path) == before


def test_in_place_update_keeps_every_entry_and_links_instead_of_copying(tmp_path):
    out = tmp_path / "out"
    write(out, {"model.safetensors": "weights", "README.md": "old card"})
    (out / "notes.txt").write_text("mine")
    inode = (out / "model.safetensors").stat().st_ino
    write(out, {"README.md": "new card"}, carry_from=out)  # no --overwrite needed: the folder is the input
    assert tree(out) == {
        "model.safetensors": b"weights",
        "README.md": b"new card",
        "notes.txt": b"mine",
        MANIFEST: (out / MANIFEST).read_bytes(),
    }
    assert (out / "model.safetensors").stat().st_ino == inode, "a carried file is a hard link, not a copy"
    assert set(json.loads((out / MANIFEST).read_text())["entries"]) == {"README.md", "model.safetensors"}


def test_carrying_from_another_folder_copies(tmp_path):
    write(tmp_path / "src", {"fit_report.json": "{}"})
    write(tmp_path / "out", {"config.json": "x"}, carry_from=tmp_path / "src")
    assert (tmp_path / "out" / "fit_report.json").read_text() == "{}"
    assert (tmp_path / "out" / "fit_report.json").stat().st_ino != (tmp_path / "src" / "fit_report.json").stat().st_ino
    with pytest.raises(InputError, match="is inside"):
        OutputFolder(tmp_path / "src" / "sub", carry_from=tmp_path / "src")


def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temporaries_of_killed_runs_are_cleaned_and_a_half_done_swap_is_undone(tmp_path):
    out, pid = tmp_path / "out", dead_pid()
    write(out, {"config.json": "old"})
    (tmp_path / f".out.ee-tmp-{pid}").mkdir()  # a run killed while writing
    (tmp_path / f".out.ee-tmp-{pid}" / "config.json").write_text("half")
    OutputFolder(out, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    # a run killed between the two renames of the portable swap: the previous folder is out of place
    os.replace(out, tmp_path / f".out.ee-old-{pid}")
    (tmp_path / f".out.ee-tmp-{pid}").mkdir()
    OutputFolder(out, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["out"] and (out / "config.json").read_text() == "old"


def test_a_live_writer_is_not_disturbed(tmp_path):
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as other:
        try:
            (tmp_path / f".out.ee-tmp-{other.pid}").mkdir()
            with pytest.raises(InputError, match=f"being written by another process \\(pid {other.pid}\\)"):
                OutputFolder(tmp_path / "out")
            assert (tmp_path / f".out.ee-tmp-{other.pid}").is_dir()
        finally:
            other.kill()


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_both_swaps_replace_the_folder(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    write(out, {"config.json": "old"})
    write(out, {"config.json": "new"}, overwrite=True)
    assert (out / "config.json").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["out"]
