"""The main job's final screen (`ee_transformers.tools.demo`): the HELIOS pool's rows on a mixed prompt set."""

from test_pool import ALWAYS, NEVER, model_with

from ee_transformers.lean_early_exit import resident_parameter_bytes
from ee_transformers.tools import bench
from ee_transformers.tools.demo import pool_rows


def test_pool_rows_show_each_model_alone_and_the_pool_that_moves_to_the_one_that_exits(base_dirs):
    never = model_with(base_dirs, seed=5, **NEVER)
    always = model_with(base_dirs, seed=7, **ALWAYS)
    alone_bytes = resident_parameter_bytes(never) + resident_parameter_bytes(always)
    plain = bench.plain_twin(never)
    prompts = bench.random_prompts(99, 2, window=6)
    lines = pool_rows(
        {"never": never, "always": always}, plain, prompts, new_tokens=8, repeats=1, settings={}, interval=4
    )
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert [c[0] for c in cells] == ["never alone", "always alone", "pool [never, always]"]
    never_row, always_row, pool_row = cells
    assert never_row[3:6] == ["1.000", "1.000", "8.0"], "a model that never exits decodes the full-depth text"
    assert float(always_row[3]) < 1.0 or float(always_row[4]) < 1.0, "exiting at layer 0 changes tokens"
    assert "switched in 2 of 2 requests" in pool_row[-1], pool_row[-1]
    assert "the best single model (always alone)" in pool_row[-1]
    assert all(c[2].endswith("x (tok/s)") and float(c[2].split("x")[0]) > 0 for c in cells)
    # the pool holds the backbone once: the second model now uses the first one's modules
    assert always.model is never.model and always.get_output_embeddings() is never.get_output_embeddings()
    assert resident_parameter_bytes(never, always) < alone_bytes
