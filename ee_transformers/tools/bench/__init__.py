"""`ee-transformers bench`: early-exit generate against plain transformers generate on the same weights.

Everything runs in one process, interleaved: for every repeat and every batch the runs go plain, c1, plain, c2, ...,
plain (plain = the family's `...ForCausalLM.generate` at full depth on the very same modules; the configurations'
order flips every repeat), and each early-exit run is compared with the mean of its two neighbouring plain runs, so
drift of a shared machine cancels. Reported per configuration:

* speed-up: median (min, max) over the paired ratios of milliseconds per decoding step (the prefill, identical in
  both, is timed apart and left out; `speedup_end_to_end` keeps it);
* greedy agreement with full depth: share of identical tokens and tokens until the first divergence;
* where tokens exited: mean exit layer, histogram;
* the ideal speed-up of those exits under the measured cost model (`costs.py`), and realised / ideal.

Configurations: the model's calibrated settings (from its config), exits disabled (overhead of the class), a sweep of
criteria / thresholds / policies (the speed-versus-agreement frontier), and forced exit profiles (exit layers drawn
from a given profile, decoded through the same code path: the implementation-efficiency half).

Python API: `BenchConfig` (the settings; the CLI's flags are generated from it), `Variant` (one way of decoding),
`load_models`, `plain_twin`, `heldout_prompts`, `compare`, `compare_many`, `measure_costs`, `forced_profile`,
`profile_step`, `run_benchmark`, `plot_frontier`, `plot_histogram`, `format_table`, `write_outputs`, `main`.

    ee-transformers bench --model runs/smollm2-135m-ee --batch-sizes 1,8 --new-tokens 128 --out bench-out
    ee-transformers bench --model PLAIN_FOLDER --exit-layers 7,15,23,26 --exit-head norm --quick

Modules, in the order a run uses them: `loading` (the plain twin, prompts, batches), `forced` (forced exit profiles),
`timing` (interleaved generate, paired ratios, agreement), `step_profile` (where a step's time goes), `run` (the
configurations and the whole benchmark), `report` (targets, table, plots, files), `cli` (`ee-transformers bench`).
`config`, `forced`, `timing` and the loading of models and batches are the library's `ee_transformers.measure`
(calibration measures with them too), here under their old names.
The other benchmarks are one module each, with a config dataclass their flags are generated from: `lean`
(`ee-transformers bench-lean`), `speculative` (`bench-speculative`), `lossless` (`bench-lossless`), `pool`
(`bench-pool`), `serve` (`bench-serve`).
"""

from ee_transformers.measure.config import BenchConfig, Variant
from ee_transformers.measure.costs import measure_costs
from ee_transformers.measure.forced import (
    FORCED_GRID,
    FORCED_MODES,
    FORCED_PROFILES,
    ForcedExits,
    ForcedProfile,
    forced_profile,
)
from ee_transformers.measure.timing import agreement, compare, compare_many
from ee_transformers.tools.bench import config, forced, timing  # noqa: F401 (`bench.timing` etc., as before)
from ee_transformers.tools.bench.cli import build_parser, main
from ee_transformers.tools.bench.loading import (
    HELDOUT_REGIONS,
    heldout_prompts,
    load_models,
    make_batches,
    plain_twin,
    random_prompts,
)
from ee_transformers.tools.bench.report import (
    TARGETS,
    evaluate_targets,
    format_table,
    frontier_points,
    jsonable,
    plot_frontier,
    plot_histogram,
    write_outputs,
)
from ee_transformers.tools.bench.run import (
    SWEEP_FULL,
    SWEEP_GRIDS,
    SWEEP_MEDIUM,
    SWEEP_SMALL,
    calibrated_variant,
    forced_variants,
    machine_info,
    run_benchmark,
    sweep_variants,
)
from ee_transformers.tools.bench.step_profile import profile_step

__all__ = [
    "FORCED_GRID",
    "FORCED_MODES",
    "FORCED_PROFILES",
    "HELDOUT_REGIONS",
    "SWEEP_FULL",
    "SWEEP_GRIDS",
    "SWEEP_MEDIUM",
    "SWEEP_SMALL",
    "TARGETS",
    "BenchConfig",
    "ForcedProfile",
    "Variant",
    "agreement",
    "build_parser",
    "calibrated_variant",
    "compare",
    "compare_many",
    "evaluate_targets",
    "forced_profile",
    "forced_variants",
    "ForcedExits",
    "ForcedProfile",
    "format_table",
    "frontier_points",
    "heldout_prompts",
    "jsonable",
    "load_models",
    "machine_info",
    "main",
    "make_batches",
    "measure_costs",
    "plain_twin",
    "plot_frontier",
    "plot_histogram",
    "profile_step",
    "random_prompts",
    "run_benchmark",
    "sweep_variants",
    "write_outputs",
]
