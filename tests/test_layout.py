"""The package's layout, as its docstrings and the style notes state it, checked against what saving really does."""

import ast
import re
from pathlib import Path

import ee_transformers as eet

PACKAGE = Path(__file__).resolve().parents[1] / "ee_transformers"
RUNTIME_CLAIM = re.compile(r"(?<!not )part of the hub runtime", re.IGNORECASE)


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def test_modules_that_say_they_are_hub_runtime_are_the_files_a_saved_folder_carries(base_dirs, tmp_path):
    eet.from_base(base_dirs["llama"][0], exit_layers=[0, 2]).save_pretrained(tmp_path)
    carried = {path.name for path in tmp_path.glob("*.py")}
    claimed = {path.name for path in PACKAGE.glob("*.py") if RUNTIME_CLAIM.search(_docstring(path))}
    assert claimed == carried, (
        f"say 'Part of the Hub runtime' but saved folders lack them: {sorted(claimed - carried)}; "
        f"carried by saved folders without saying so: {sorted(carried - claimed)}"
    )
