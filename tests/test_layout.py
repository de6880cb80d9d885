"""The package's layout, as its docstrings and the style notes state it, checked against the source and against what
saving really does.

The import graph (`helpers.import_graph`, read with `ast`, nothing of the package imported) is checked here for the Hub
runtime: the flat modules a saved folder carries (`modeling_early_exit.py` and the single-dot relative imports
transformers' `custom_object_save` follows from it) import only the standard library, torch, transformers (and
safetensors, which transformers requires) and each other, by single-dot relative imports (a Hub folder holds nothing
else). The layers of the whole package (runtime <- library <- command line, no cycles) are
tests/test_import_graph.py's.

Function length, also read with `ast`: at most 80 lines in `tools/` and `training/`, 60 in the flat modules directly in
`ee_transformers/`, but for the explicit allow-lists below (empty today; lists that may only shrink). The old
`tools/bench_*.py` modules are deprecated aliases of `tools/bench/`, and renamed runtime functions keep their old names
as deprecated aliases for one release (`RENAMED`); public function names of the runtime are unique.
"""

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest
from helpers import imports_of, package_modules
from transformers.dynamic_module_utils import get_relative_import_files

import ee_transformers as eet

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ee_transformers"
RUNTIME_CLAIM = re.compile(r"(?<!not )part of the hub runtime", re.IGNORECASE)
# and the standard library; safetensors is a requirement of transformers itself, so every loading side has it
RUNTIME_MAY_IMPORT = {"torch", "transformers", "safetensors"}


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def runtime_modules(root: Path = ROOT) -> set[str]:
    """The modules a saved folder carries: `modeling_early_exit.py` and what transformers copies with it."""
    modeling = root / "ee_transformers" / "modeling_early_exit.py"
    try:
        files = get_relative_import_files(modeling)
    except FileNotFoundError as error:  # what save_pretrained would raise too
        raise AssertionError(f"a runtime import leads to {error.filename}, which is no flat module") from error
    return {f"ee_transformers.{Path(f).stem}" for f in [modeling, *files]}


def upward_imports(root: Path = ROOT) -> list[str]:
    """Every import of a runtime module that a Hub folder could not satisfy or that points up out of the runtime."""
    modules, runtime = package_modules(root), runtime_modules(root)
    bad = []
    for name in sorted(runtime):
        path = modules[name]
        for target, level, line in imports_of(name, path, modules):
            top = target.split(".")[0]
            if level == 1 and target in runtime:
                continue  # a sibling, copied next to it
            if level == 0 and (top in RUNTIME_MAY_IMPORT or top in sys.stdlib_module_names):
                continue
            how = "relative" if level else "absolute"
            bad.append(f"{path.relative_to(root)}:{line} imports {target} ({how}, level {level})")
    return bad


# -- the package --------------------------------------------------------------------------------------------------------
def test_the_runtime_imports_only_the_standard_library_torch_transformers_and_itself():
    runtime = runtime_modules()
    assert {"ee_transformers.modeling_early_exit", "ee_transformers.configuration_early_exit"} <= runtime, runtime
    bad = upward_imports()
    assert not bad, "the Hub runtime may import only torch, transformers, the standard library and its siblings:\n" + (
        "\n".join(bad)
    )


def test_modules_that_say_they_are_hub_runtime_are_the_files_a_saved_folder_carries(base_dirs, tmp_path):
    eet.from_base(base_dirs["llama"][0], exit_layers=[0, 2]).save_pretrained(tmp_path)
    carried = {path.name for path in tmp_path.glob("*.py")}
    claimed = {path.name for path in PACKAGE.glob("*.py") if RUNTIME_CLAIM.search(_docstring(path))}
    assert claimed == carried, (
        f"say 'Part of the Hub runtime' but saved folders lack them: {sorted(claimed - carried)}; "
        f"carried by saved folders without saying so: {sorted(carried - claimed)}"
    )
    assert carried == {f"{m.split('.')[-1]}.py" for m in runtime_modules()}, "the runtime these tests check"


# --- the tests ---------------------------------------------------------------------------------------------------------
def imports_of_test_modules(tests: Path) -> list[str]:
    """Every import in a `test_*.py` of `tests` that names a `test_*` module (at the top of a file or not)."""
    bad = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):  # `from test_x import y`, `from tests import test_x`
                names = [f"{node.module or ''}.{alias.name}" for alias in node.names]
            else:
                continue
            found = [n for n in names if any(part.startswith("test_") for part in n.split("."))]
            bad += [f"{path.name}:{node.lineno} imports {n}" for n in found]
    return bad


def test_test_modules_share_helpers_through_helpers_py_not_each_other():
    bad = imports_of_test_modules(ROOT / "tests")
    assert not bad, "shared helpers belong in tests/helpers.py (fixtures in conftest.py):\n" + "\n".join(bad)


# --- the design card's top level ---------------------------------------------------------------------------------------

ROOT_SCRIPTS = {"fit.py": "fit", "calibrate.py": "calibrate", "main_job.py": "demo"}


def test_the_top_level_is_the_design_cards():
    root = Path(__file__).resolve().parents[1]
    for name in ("pyproject.toml", "ee_transformers", "training", "tests", "model_cards", "README.md"):
        assert (root / name).exists(), name
    assert (root / "model_cards" / "early_exit_model_card.md").is_file()
    assert not (root / "ee_transformers" / "tools" / "model_cards").exists()  # one home for the templates
    assert not (root / "training" / "__init__.py").exists()  # scripts, not a package to install


@pytest.mark.parametrize("script, command", sorted(ROOT_SCRIPTS.items()))
def test_training_scripts_are_thin_and_the_same_entry_point_as_the_subcommand(script, command):
    import subprocess

    root = Path(__file__).resolve().parents[1]
    source = (root / "training" / script).read_text()
    assert len(source.splitlines()) <= 12, "a thin entry point: the library holds the work"
    imported = [
        (n.module, [a.name for a in n.names]) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)
    ]
    assert imported == [(imported[0][0], ["main"])] and imported[0][0].startswith("ee_transformers.")
    run = dict(capture_output=True, text=True, timeout=120, cwd=root)
    direct = subprocess.run([sys.executable, f"training/{script}", "--help"], **run)
    through = subprocess.run([sys.executable, "-m", "ee_transformers.tools.cli", command, "--help"], **run)
    assert direct.returncode == through.returncode == 0, direct.stderr + through.stderr
    assert direct.stdout == through.stdout  # one parser: the same flags, defaults and help


# --- function length ---------------------------------------------------------------------------------------------------
TOOLS_MAX_LINES, RUNTIME_MAX_LINES = 80, 60  # tools/ and training/; the flat modules directly in ee_transformers/
LONG_TOOLS_FUNCTIONS = set()  # the only functions of tools/ and training/ allowed over TOOLS_MAX_LINES: none
LONG_RUNTIME_FUNCTIONS = set()  # today's functions over RUNTIME_MAX_LINES: none (the list only shrinks)


def long_functions(files, root: Path, limit: int) -> dict[str, int]:
    """{"path:qualified name": lines} of every function in `files` (methods and nested functions too) longer than
    `limit` lines, a function's lines running from its `def` to its last line (decorators not counted)."""
    found = {}

    def visit(node, path, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                lines = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and lines > limit:
                    found[f"{path}:{name}"] = lines
                visit(child, path, name + ".")
            else:
                visit(child, path, prefix)

    for file in sorted(files):
        visit(ast.parse(file.read_text(encoding="utf-8")), file.relative_to(root).as_posix(), "")
    return found


def _over_the_limit(found: dict[str, int], allowed: set[str], limit: int) -> list[str]:
    new = [f"{name}: {lines} lines (at most {limit}: split it into named parts)" for name, lines in found.items()]
    problems = [line for line, name in zip(new, found) if name not in allowed]
    problems += [f"{name}: no longer over {limit} lines, take it off the allow-list" for name in allowed - set(found)]
    return sorted(problems)


def test_function_lengths_are_read_with_methods_and_nested_functions(tmp_path):
    (tmp_path / "m.py").write_text(
        "def short():\n    return 1\n\n\n"
        "class A:\n    @staticmethod\n    def long():\n        x = 1\n        return x\n\n\n"
        "def outer():\n    def inner():\n        y = 2\n        return y\n    return inner\n"
    )
    found = long_functions([tmp_path / "m.py"], tmp_path, limit=2)
    assert found == {"m.py:A.long": 3, "m.py:outer": 5, "m.py:outer.inner": 3}
    assert _over_the_limit(found, {"m.py:outer", "m.py:gone"}, 2) == [
        "m.py:A.long: 3 lines (at most 2: split it into named parts)",
        "m.py:gone: no longer over 2 lines, take it off the allow-list",
        "m.py:outer.inner: 3 lines (at most 2: split it into named parts)",
    ]


def test_no_function_of_tools_or_training_is_over_80_lines():
    files = [*(PACKAGE / "tools").rglob("*.py"), *(PACKAGE / "training").rglob("*.py")]
    problems = _over_the_limit(long_functions(files, PACKAGE, TOOLS_MAX_LINES), LONG_TOOLS_FUNCTIONS, TOOLS_MAX_LINES)
    assert not problems, "\n".join(problems)


def test_no_runtime_function_is_over_60_lines_but_todays_long_ones():
    found = long_functions(PACKAGE.glob("*.py"), PACKAGE, RUNTIME_MAX_LINES)
    problems = _over_the_limit(found, LONG_RUNTIME_FUNCTIONS, RUNTIME_MAX_LINES)
    assert not problems, "\n".join(problems)


# --- the benchmarks' modules -------------------------------------------------------------------------------------------
MOVED_BENCHMARKS = {"bench_lean": "lean", "bench_speculative": "speculative", "bench_pool": "pool"}


@pytest.mark.parametrize("old, new", sorted(MOVED_BENCHMARKS.items()))
def test_the_old_benchmark_modules_are_deprecated_aliases_of_tools_bench(old, new, monkeypatch):
    moved = importlib.import_module(f"ee_transformers.tools.bench.{new}")
    monkeypatch.delitem(sys.modules, f"ee_transformers.tools.{old}", raising=False)
    with pytest.warns(DeprecationWarning, match=rf"ee_transformers\.tools\.bench\.{new}"):
        alias = importlib.import_module(f"ee_transformers.tools.{old}")
    assert alias.__all__ == moved.__all__ and "main" in moved.__all__
    assert all(getattr(alias, name) is getattr(moved, name) for name in moved.__all__)


def test_benchmark_modules_live_in_tools_bench_and_subcommands_do_not_use_the_aliases():
    from ee_transformers.tools import cli

    assert sorted(p.stem for p in (PACKAGE / "tools").glob("bench_*.py")) == sorted(MOVED_BENCHMARKS)
    for name, (module, _, _) in cli.SUBCOMMANDS.items():
        if name.startswith("bench"):
            assert module.startswith("ee_transformers.tools.bench"), (name, module)
            assert module.rpartition(".")[2] not in MOVED_BENCHMARKS, (name, module)


# --- renamed runtime functions -----------------------------------------------------------------------------------------
RENAMED = {  # deprecated aliases kept for one release: (module, old name) -> new name
    ("speculative_early_exit", "prefill"): "prefill_full_depth",  # `generation_early_exit.prefill` is confident exits'
    ("pool_early_exit", "profile_exits"): "pool_profile_exits",  # `ee_transformers.profile_exits` is the profiler's
}


@pytest.mark.parametrize("module, old", sorted(RENAMED))
def test_renamed_functions_stay_importable_under_their_old_names_with_a_deprecation_warning(module, old):
    new = RENAMED[module, old]
    mod = importlib.import_module(f"ee_transformers.{module}")
    assert new in mod.__all__ and old not in mod.__all__
    with pytest.warns(DeprecationWarning, match=rf"`{new}`"):
        alias = getattr(mod, old)
    assert alias is getattr(mod, new)
    with pytest.warns(DeprecationWarning):
        exec(f"from ee_transformers.{module} import {old}", {})
    with pytest.raises(AttributeError):
        mod.no_such_name  # noqa: B018 (an attribute read that must raise)


def test_public_function_names_of_the_runtime_are_unique():
    """No two public functions of the flat modules, or one of them and a function the package exports, share a name."""
    seen = {}
    for name in eet.__all__:
        if inspect.isfunction(getattr(eet, name)):
            seen.setdefault(name, set()).add(getattr(eet, name).__module__)
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                seen.setdefault(node.name, set()).add(f"ee_transformers.{path.stem}")
    duplicates = {name: sorted(modules) for name, modules in seen.items() if len(modules) > 1}
    assert not duplicates, duplicates


def test_the_supported_transformers_range_is_one_range_and_holds_the_installed_release():
    """pyproject's transformers requirement (the package and its `serving` / `all` extras) is compat.py's
    `SUPPORTED`, the range scripts/setup.sh installs from (its lowest and highest release are what CI runs)."""
    import transformers
    from packaging.specifiers import SpecifierSet

    from ee_transformers.compat import BELOW, NEWEST, OLDEST, SUPPORTED

    pinned = re.findall(r'"transformers(?:\[serving\])?([^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert len(pinned) == 3 and set(pinned) == {SUPPORTED.removeprefix("transformers")}, pinned
    assert SpecifierSet(pinned[0]) == SpecifierSet(f">={OLDEST},<{BELOW}") and NEWEST in SpecifierSet(pinned[0])
    assert transformers.__version__ in SpecifierSet(pinned[0]), transformers.__version__
