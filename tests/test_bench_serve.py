"""`ee-transformers bench-serve` end to end on tiny folders: servers start, every request is answered, rows add up."""

import json

import pytest
from helpers import served_folders

from ee_transformers.tools.bench.serve import ServeBenchConfig, main

pytest.importorskip("openai")


def test_bench_serve_runs_plain_and_lean_servers(tmp_path):
    base, folder = served_folders(tmp_path)
    argv = ["--model", str(folder), "--base", str(base), "--out", str(tmp_path / "out"), "--servers", "plain,lean"]
    argv += ["--modes", "continuous-batching", "--clients", "1,2", "--requests", "2", "--new-tokens", "4"]
    argv += ["--exit-max-layer", "1", "--threads", "1", "--cb-block-size", "16", "--num-prompts", "2"]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "out" / "serve.json").read_text())["rows"]
    assert [(r["server"], r["clients"]) for r in rows] == [("plain", 1), ("plain", 2), ("lean", 1), ("lean", 2)]
    assert all(r["requests"] == 2 and r["tokens"] == 2 * 4 and r["tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "out" / "serve.md").read_text().startswith("| server |")


def test_bench_serve_config_names_bad_fields():
    with pytest.raises(ValueError, match="servers"):
        ServeBenchConfig(servers=["fast"])
    with pytest.raises(ValueError, match="exit_settings"):
        ServeBenchConfig(exit_settings="{")
