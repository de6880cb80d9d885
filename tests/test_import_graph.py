"""One import direction: runtime <- library <- command line, no cycles (read from the source with `ast`, nothing is
imported). Every `import` counts, also those inside functions: a lazy import is still a dependency.

The layers, lowest first (a module may import its own layer or lower ones, never a higher one):

    rank  layer          modules
    0     runtime        the flat files a Hub checkpoint's remote code copies (RUNTIME below)
    1     library        ee_transformers.utils      argument dataclasses, output folders, model cards, plots
    2     library        ee_transformers.convert    plain checkpoint -> early-exit model
    3     library        ee_transformers.measure    what calibration and the benchmarks share: twin, timing, costs
    4     library        ee_transformers            the package's public names (`import ee_transformers as eet`)
    5     library        ee_transformers.training   fitting and calibration
    6     command line   ee_transformers.tools      commands, benchmarks, assets, the server
    7     scripts        training/*.py, benchmarks/*.py at the repository root
"""

from pathlib import Path

from helpers import cycles, import_graph, imports_of, package_modules

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "ee_transformers"

RUNTIME = {
    f"{PACKAGE}.{name}"
    for name in (
        "cache_early_exit",
        "compat",
        "configuration_early_exit",
        "decode_core",
        "decode_loop",
        "draft_table",
        "drafts",
        "exit_heads",
        "families",
        "generation_early_exit",
        "lean_early_exit",
        "model_mixins",
        "modeling_early_exit",
        "paged_early_exit",
        "paged_speculative",
        "pool_early_exit",
        "request",
        "settings",
        "speculative_batch",
        "speculative_early_exit",
    )
}
# the runtime's decoding modes: each sits on the decode core beside the others, none imports another
# (speculative_batch, the speculative mode's ragged batch, is not listed: it imports no mode, and its importer is the mode)
MODES = {f"{PACKAGE}.{name}_early_exit" for name in ("generation", "speculative", "paged", "lean", "pool")} | {
    f"{PACKAGE}.paged_speculative"
}

# (module or subpackage, rank, layer): the one table of layers; a module's entry is the longest prefix that names it
LAYERS = [
    *((name, 0, "runtime") for name in sorted(RUNTIME)),
    (f"{PACKAGE}.utils", 1, "library"),
    (f"{PACKAGE}.convert", 2, "library"),
    (f"{PACKAGE}.measure", 3, "library"),
    (PACKAGE, 4, "library"),
    (f"{PACKAGE}.training", 5, "library"),
    (f"{PACKAGE}.tools", 6, "command line"),
    ("scripts", 7, "scripts"),
]

# Edges up that this change could not remove: they start in files being rewritten at the same time (issue 29), which
# this change does not edit; `test_pending_edges_are_still_there` fails once one is gone, so the list only shrinks.
PENDING: set = set()


def graph_with_scripts() -> dict[str, set[str]]:
    """`import_graph` of the package, plus the root scripts (`training/*.py`, `benchmarks/*.py`) as `scripts.<file>`."""
    graph = import_graph(ROOT, PACKAGE)
    modules = package_modules(ROOT, PACKAGE)
    for folder in ("training", "benchmarks"):
        for path in sorted((ROOT / folder).glob("*.py")):
            name = f"scripts.{folder}.{path.stem}"
            graph[name] = {target for target, _, _ in imports_of(name, path, modules) if target in modules}
    return graph


GRAPH = graph_with_scripts()


def layer_of(name: str) -> tuple[int, str, str]:
    """(rank, layer, table entry) of a module: the longest entry of `LAYERS` that is the module or a package above it."""
    matches = [
        (len(entry), rank, layer, entry)
        for entry, rank, layer in LAYERS
        if name == entry or name.startswith(entry + ".")
    ]
    assert matches, f"`{name}` has no layer: add it (or its subpackage) to LAYERS"
    _, rank, layer, entry = max(matches)
    return rank, layer, entry


def test_the_graph_sees_relative_absolute_and_function_level_imports_and_reports_cycles(tmp_path):
    files = {
        "pkg/__init__.py": "from .a import f\n",
        "pkg/a.py": "import os\nfrom . import b\ndef f():\n    from pkg.sub import c\n",
        "pkg/b.py": "",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "def g():\n    import pkg.a\nfrom ..b import x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b", "pkg.sub.c"},
        "pkg.b": set(),
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.a", "pkg.b"},
    }
    assert cycles(graph) == [["pkg.a", "pkg.sub.c", "pkg.a"]]


def test_the_package_graph_has_the_edges_it_must():
    # relative, absolute, `from package import module`, and the root scripts
    assert f"{PACKAGE}.decode_core" in GRAPH[f"{PACKAGE}.lean_early_exit"]  # `from .decode_core import ...`
    assert f"{PACKAGE}.utils.arguments" in GRAPH[f"{PACKAGE}.convert"]
    assert f"{PACKAGE}.tools.bench" in GRAPH[f"{PACKAGE}.tools.demo"]  # `from ee_transformers.tools import bench`
    assert f"{PACKAGE}.tools.fit" in GRAPH["scripts.training.fit"]
    assert RUNTIME <= set(GRAPH)


def test_every_module_has_a_layer():
    for name in GRAPH:
        layer_of(name)


def test_no_import_cycles():
    found = cycles(GRAPH)
    assert not found, "import cycles among the package's modules:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_edge_runs_up():
    up = []
    for name, targets in GRAPH.items():
        rank, layer, entry = layer_of(name)
        for target in targets:
            target_rank, target_layer, target_entry = layer_of(target)
            if target_rank > rank and (name, target) not in PENDING:
                up.append(f"{name} ({entry}, {layer}) imports {target} ({target_entry}, {target_layer})")
    assert not up, "imports against the layer order:\n" + "\n".join(sorted(up))


def test_the_layers_keep_their_order():
    ranks = [rank for _, rank, _ in LAYERS]
    assert ranks == sorted(ranks)
    order = ["runtime", "library", "command line", "scripts"]
    assert [order.index(layer) for _, _, layer in LAYERS] == sorted(order.index(layer) for _, _, layer in LAYERS)


def test_pending_edges_are_still_there():
    gone = {edge for edge in PENDING if edge[1] not in GRAPH.get(edge[0], ())}
    assert not gone, f"fixed, so drop them from PENDING: {sorted(gone)}"


def test_the_runtime_imports_only_the_runtime():
    outside = {(name, t) for name in RUNTIME for t in GRAPH[name] if t not in RUNTIME}
    assert not outside, f"runtime files must stay copyable as Hub remote code: {sorted(outside)}"


def test_no_mode_imports_another_mode():
    edges = sorted((name, target) for name in MODES for target in GRAPH[name] if target in MODES)
    assert not edges, f"mode -> mode imports: {edges}"
