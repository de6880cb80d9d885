"""`kill -9` of `convert` and `calibrate` while they write, at three moments: halfway through the weights, between the
two renames of the portable swap, and right after the atomic exchange. Whatever the moment, the folder at `<out>` is
the previous one, intact, or (after the exchange) the new one, complete; with no previous folder, no folder is at
`<out>`. The next run repairs and cleans up, and leaves nothing behind. (fit's own kill-and-resume test is in
test_training.py.)

The commands run in child processes forked from one helper process that imports torch and transformers once (cheaper
than a fresh interpreter per case); each child stops at its moment and is killed there with SIGKILL."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ee_transformers as eet
from ee_transformers.tools import cli
from ee_transformers.training.tiny import save_tiny_base, tiny_texts, write_texts
from ee_transformers.utils.outputs import OutputFolder

ROOT = Path(__file__).resolve().parents[1]

# Forks one child per case of the plan; a child runs `ee-transformers ARGV...` and stops dead at its moment (it writes
# its signal file, then sleeps until killed). Records how each child ended.
FORKER = r"""
import json, os, shutil, sys, time
import transformers.modeling_utils as modeling_utils
from ee_transformers.tools import cli, outputs

def run(moment, signal_file, argv):
    def stop_here():
        open(signal_file, "w").close()
        time.sleep(600)

    if moment == "mid-weights":  # half of the safetensors file written, then the process dies
        save = modeling_utils.safe_save_file
        def half_written(tensors, filename, metadata=None):
            save(tensors, filename + ".whole", metadata=metadata)
            data = open(filename + ".whole", "rb").read()
            os.remove(filename + ".whole")
            with open(filename, "wb") as f:
                f.write(data[: len(data) // 2])
            stop_here()
        modeling_utils.safe_save_file = half_written
    elif moment == "between-renames":  # the portable swap: <out> moved aside, the new folder not yet in place
        outputs._exchange = lambda a, b: False
        replace = os.replace
        def replace_then_stop(src, dst):
            replace(src, dst)
            if ".ee-old-" in os.path.basename(dst):
                stop_here()
        os.replace = replace_then_stop
    elif moment == "after-exchange":  # <out> is the new folder; the temporary still holds the old one
        rmtree = shutil.rmtree
        def stop_before_cleanup(path, *args, **kwargs):
            if ".ee-tmp-" in os.path.basename(str(path)) and os.path.exists(path):
                stop_here()
            rmtree(path, *args, **kwargs)
        shutil.rmtree = stop_before_cleanup
    cli.main(argv)

plan = json.load(open(sys.argv[1]))
children = {}
for case in plan:
    pid = os.fork()
    if pid == 0:
        try:
            run(case["moment"], case["signal"], case["argv"])
        finally:
            os._exit(3)  # the command ended by itself: it was never stopped at its moment
    children[pid] = case["name"]
    with open(case["pid"], "w") as f:
        f.write(str(pid))
ended = {}
for _ in children:
    pid, status = os.wait()
    ended[children[pid]] = os.waitstatus_to_exitcode(status)
json.dump(ended, open(sys.argv[2], "w"))
"""


def digest(folder):
    """sha256 of every file under folder, by relative path (None when there is no folder)."""
    if not os.path.isdir(folder):
        return None
    found = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def leftovers(parent, name):
    return sorted(n for n in os.listdir(parent) if n.startswith(f".{name}.ee-"))


def calibrate_argv(model, texts):
    return [
        "calibrate",
        str(model),
        "--data",
        *texts,
        "--block-size",
        "32",
        "--verify-prompts",
        "0",
        "--costs",
        '{"head_cost": 0, "backfill_cost": 0}',
    ]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Every case set up, run in a child and killed at its moment: {case: (folder of the case, previous digest,
    argv of the command)}."""
    root = tmp_path_factory.mktemp("kill")
    save_tiny_base(root / "base")
    texts = write_texts(root / "text", tiny_texts(n_docs=6))
    assert cli.main(["convert", str(root / "base"), str(root / "ee"), "--exit-layers", "1,2"]) == 0
    cases, plan = {}, []
    for name, moment in [
        ("convert mid-weights", "mid-weights"),
        ("convert between-renames", "between-renames"),
        ("convert after-exchange", "after-exchange"),
        ("convert new folder", "mid-weights"),
        ("calibrate mid-weights", "mid-weights"),
        ("calibrate between-renames", "between-renames"),
    ]:
        case = root / name.replace(" ", "-")
        case.mkdir()
        out = case / "ee"
        if name != "convert new folder":
            shutil.copytree(root / "ee", out)  # the previous model at <out>, written by convert
            (out / "notes.txt").write_text("the user's notes")
        if name.startswith("convert"):  # another model: other exits
            argv = ["convert", str(root / "base"), str(out), "--exit-layers", "1", "--overwrite"]
        else:
            argv = calibrate_argv(out, texts)  # in place
        cases[name] = (case, digest(out), argv)
        plan.append(
            {"name": name, "moment": moment, "argv": argv, "signal": str(case / "reached"), "pid": str(case / "pid")}
        )
    (root / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    forker = subprocess.Popen(
        [sys.executable, "-c", FORKER, str(root / "plan.json"), str(root / "ended.json")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        for case in plan:
            while not (os.path.exists(case["signal"]) and os.path.exists(case["pid"])):
                if forker.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{case['name']} never reached its moment: {forker.stderr.read()[-3000:]}")
                time.sleep(0.05)
            os.kill(int(Path(case["pid"]).read_text()), signal.SIGKILL)
        forker.wait(timeout=60)
    finally:
        if forker.poll() is None:
            forker.kill()
    ended = json.loads((root / "ended.json").read_text())
    assert ended == {case["name"]: -signal.SIGKILL for case in plan}, (ended, forker.stderr.read()[-3000:])
    forker.stderr.close()
    return cases, texts


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["mid-weights", "between-renames", "after-exchange"])
def test_convert_killed_while_writing_over_a_model(killed, moment):
    case, previous, argv = killed[0][f"convert {moment}"]
    out = case / "ee"
    assert leftovers(case, "ee"), "a killed run leaves its temporary (removed by the next run)"
    if moment == "between-renames":
        assert digest(out) is None, "killed between the renames, <out> is missing until the next run restores it"
    OutputFolder(out, overwrite=True)  # what every command does first: repair, clean
    assert leftovers(case, "ee") == []
    if moment == "after-exchange":
        assert digest(out) != previous, "after the exchange <out> is the new folder"
        assert eet.from_base(out).config.exit_layers == [1], "complete: it loads"
    else:
        assert digest(out) == previous, "the previous model is intact"
    assert cli.main(argv) == 0, "the next run succeeds"
    assert json.loads((out / "config.json").read_text())["exit_layers"] == [1]
    assert (out / "notes.txt").read_text() == "the user's notes", "the user's file survives all of it"
    assert leftovers(case, "ee") == []


@pytest.mark.slow
def test_convert_killed_writing_a_new_folder_leaves_no_folder(killed):
    case, _, argv = killed[0]["convert new folder"]
    assert not (case / "ee").exists(), "no folder at <out> that looks complete"
    assert cli.main(argv) == 0
    assert leftovers(case, "ee") == [] and eet.from_base(case / "ee").config.exit_layers == [1]


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["mid-weights", "between-renames"])
def test_calibrate_in_place_killed_while_writing(killed, moment):
    case, previous, argv = killed[0][f"calibrate {moment}"]
    model = case / "ee"
    if moment == "between-renames":
        assert digest(model) is None
        OutputFolder(model, carry_from=model)  # what the next run on this folder does first: restore it
    assert digest(model) == previous, "the previous folder is intact (restored) after the kill"
    assert cli.main(argv) == 0
    assert (model / "calibration.json").is_file() and (model / "notes.txt").read_text() == "the user's notes"
    assert leftovers(case, "ee") == []
