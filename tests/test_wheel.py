"""The package as a user installs it: the wheel built from this checkout holds the runtime, the tools, training and
the model-card template, and nothing at top level but `ee_transformers`; installed into a fresh virtualenv that cannot
see this checkout, it converts, saves (card included), loads, fits and calibrates a tiny model."""

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# run by the fresh virtualenv's python, from an empty folder, without PYTHONPATH
SCRIPT = r"""
import json, os, sys
import ee_transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from ee_transformers.tools.cli import main
from ee_transformers.training.tiny import save_tiny_base, tiny_texts, write_texts

base = save_tiny_base("base")
texts = write_texts("text", tiny_texts(n_docs=6))
codes = [main(["convert", base, "ee", "--exit-layers", "1,2"]),
         main(["fit", "--model", "ee", "--data", *texts, "--block-size", "32", "--steps", "2", "--batch-size", "2",
               "--no-progress", "--out", "fitted"]),
         main(["calibrate", "fitted", "--data", *texts, "--block-size", "32", "--verify-prompts", "0",
               "--costs", '{"head_cost": 0, "backfill_cost": 0}', "--out", "calibrated"])]
remote = AutoModelForCausalLM.from_pretrained("calibrated", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("calibrated", config=remote.config)
ids = tokenizer("w1 w2 w3", return_tensors="pt")["input_ids"]
out = remote.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
print(json.dumps({"package": ee_transformers.__file__, "codes": codes,
                  "class": type(remote).__name__, "exit_layers": remote.config.exit_layers,
                  "new_tokens": out.sequences.shape[1] - ids.shape[1],
                  "files": {name: sorted(os.listdir(name)) for name in ("ee", "fitted", "calibrated")},
                  "card": open("calibrated/README.md").read()}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel of this checkout, built from a copy of it (the build leaves build/ and *.egg-info behind)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("ee_transformers", "model_cards", "training"):  # training/: to show the wheel leaves it out
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    (found,) = (tmp / "dist").glob("ee_transformers-*.whl")
    return found


@pytest.mark.slow
def test_wheel_holds_the_package_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    top = {name.split("/")[0] for name in names}
    packages = {name for name in top if not name.endswith(".dist-info")}
    assert packages == {"ee_transformers"}, f"top-level entries besides the metadata: {packages}"
    sources = {
        str(p.relative_to(ROOT)).replace(os.sep, "/")
        for p in (ROOT / "ee_transformers").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert sources - names == set(), f"modules missing from the wheel: {sorted(sources - names)}"
    for required in (
        "ee_transformers/modeling_early_exit.py",
        "ee_transformers/tools/bench/run.py",
        "ee_transformers/tools/assets/rds.py",
        "ee_transformers/training/calibrate.py",
        "ee_transformers/model_cards/early_exit_model_card.md",
    ):
        assert required in names, f"{required} is not in the wheel"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "ee-transformers = ee_transformers.tools.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow
def test_wheel_installed_in_a_fresh_venv_converts_saves_loads_fits_and_calibrates(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True, timeout=60
    )
    python = venv / "bin" / "python"
    # pip of this environment installs into the fresh one (--python): the fresh venv needs no pip of its own
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # the dependencies (torch, transformers...) come from this environment's site-packages, added after the fresh
    # venv's own: a plain path in a .pth file, so that folder's own .pth files (an editable install of this very
    # checkout) are not run
    Path(purelib, "test-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    run = subprocess.run(
        [python, "-c", SCRIPT], cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["package"].startswith(purelib), f"imported {result['package']}, not the installed wheel"
    assert result["codes"] == [0, 0, 0]
    assert result["class"] == "EarlyExitLlamaForCausalLM" and result["exit_layers"] == [1, 2]
    assert result["new_tokens"] == 3
    for folder, files in result["files"].items():
        assert {"config.json", "model.safetensors", "README.md", "modeling_early_exit.py"} <= set(files), folder
    assert "## Calibration" in result["card"] and "Early-exit" in result["card"]
    help_ = subprocess.run(
        [venv / "bin" / "ee-transformers", "--help"], cwd=work, env=env, capture_output=True, text=True, timeout=60
    )
    assert help_.returncode == 0 and "calibrate" in help_.stdout, "the console script is installed and runs"
