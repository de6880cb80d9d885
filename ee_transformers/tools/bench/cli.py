"""`ee-transformers bench`: the command line."""

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from ee_transformers.tools.bench.forced import FORCED_GRID, FORCED_MODES, FORCED_PROFILES
from ee_transformers.tools.bench.loading import heldout_prompts, load_models, random_prompts
from ee_transformers.tools.bench.report import format_table, write_outputs
from ee_transformers.tools.bench.run import SWEEP_FULL, SWEEP_MEDIUM, SWEEP_SMALL, run_benchmark

def _int_list(text):
    return [int(x) for x in str(text).split(",") if x.strip()]


def build_parser():
    parser = argparse.ArgumentParser(
        prog="ee-transformers bench",
        description="Benchmark early exit against plain transformers generate on the same weights, interleaved in "
                    "one process: speed-up, greedy agreement, exits, ideal vs realised, overhead, sweep, forced "
                    "profiles. Writes report.json, results.md and PNG plots.")
    parser.add_argument("--model", required=True, help="early-exit folder (fitted/calibrated or not), or a plain "
                        "checkpoint folder together with --exit-layers")
    parser.add_argument("--exit-layers", type=_int_list, default=None,
                        help="convert on the fly with these exits (e.g. 7,15,23,26); overrides the folder's")
    parser.add_argument("--exit-head", choices=["norm", "adapter"], default=None)
    parser.add_argument("--prompts-from", nargs="+", default=None, metavar="FILE",
                        help="held-out text files (default: the held-out tails of Austen's Sense and Sensibility "
                             "and the Python manual, from ee_transformers.tools.assets.fetch_text())")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=_int_list, default=[1, 8])
    parser.add_argument("--max-batches", type=_int_list, default=[2],
                        help="batches per batch size: one value, or one per batch size (e.g. 2,1)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--sweep-repeats", type=int, default=None, help="repeats of the sweep (default --repeats)")
    parser.add_argument("--sweep-grid", choices=["small", "medium", "full"], default=None,
                        help="thresholds per criterion (default full; small with --quick)")
    parser.add_argument("--sweep-batch-sizes", type=_int_list, default=None,
                        help="run the sweep at these batch sizes only (default: all)")
    parser.add_argument("--forced", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--forced-modes", default=None,
                        help="policy/kv pairs, e.g. row/immediate,batch/deferred (default: batch/immediate, "
                             "batch/deferred, row/immediate)")
    parser.add_argument("--forced-grid", choices=["profiles", "full"], default="profiles",
                        help="profiles: 25%%@1/4, 50%%@1/2, 75%%@3/4, mixed; full: every share at every depth")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="profile where one step's time goes")
    parser.add_argument("--quick", action="store_true",
                        help="small settings (CI): 8 new tokens, 1 repeat, 4 prompts, 1 batch per size, small sweep")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-out", help="output folder for report.json, results.md, PNGs")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        defaults = dict(new_tokens=8, repeats=1, num_prompts=4, max_batches=[1])
        for name, value in defaults.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    sweep_grid = {"small": SWEEP_SMALL, "medium": SWEEP_MEDIUM, "full": SWEEP_FULL}[args.sweep_grid or ("small" if args.quick else "full")]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    try:
        ee_model, plain_model = load_models(args.model, args.exit_layers, args.exit_head, dtype, args.device)
    except ValueError as error:
        parser.exit(2, f"ee-transformers bench: error: {error}\n")
    tokenizer = ee_model.tokenizer
    if tokenizer is None:
        prompts = random_prompts(ee_model.config.vocab_size, args.num_prompts, args.prompt_tokens, args.seed)
        print("[bench] the model folder has no tokenizer: random token prompts")
    else:
        prompts = heldout_prompts(tokenizer, args.prompts_from, args.num_prompts, args.prompt_tokens, args.seed)
    profiles = list(FORCED_GRID) if args.forced_grid == "full" else list(FORCED_PROFILES)
    forced_modes = FORCED_MODES
    if args.forced_modes:
        forced_modes = [tuple(m.split("/")) for m in args.forced_modes.split(",")]
        if any(len(m) != 2 or m not in FORCED_MODES for m in forced_modes):
            parser.error(f"--forced-modes must be policy/kv pairs among {['/'.join(m) for m in FORCED_MODES]}")
    calibration_file = Path(args.model) / "calibration.json"
    calibration = json.loads(calibration_file.read_text()) if calibration_file.is_file() else None
    start = time.perf_counter()
    report = run_benchmark(ee_model, plain_model, prompts, args.batch_sizes, args.new_tokens, args.repeats,
                           sweep=args.sweep, forced=args.forced, calibrated="always" if calibration else True,
                           max_batches=args.max_batches, sweep_grid=sweep_grid, forced_modes=forced_modes,
                           sweep_batch_sizes=args.sweep_batch_sizes, forced_profiles=profiles,
                           profile=args.profile, cost_repeats=10 if args.quick else 30,
                           sweep_repeats=args.sweep_repeats)
    home = str(Path.home())
    report["command"] = "ee-transformers bench " + " ".join(  # no machine-specific home folder in the record
        "~" + a[len(home):] if a.startswith(home + os.sep) else shlex.quote(a)
        for a in (sys.argv[2:] if argv is None else argv))
    report["model"]["path"] = Path(args.model).name
    if calibration is not None:
        report["model"]["calibration"] = {k: calibration.get(k) for k in ("criterion", "policy", "target_agreement",
                                                                          "chosen", "heldout_B", "message")}
    report["wall_seconds"] = time.perf_counter() - start
    paths = write_outputs(report, args.out)
    print(format_table(report))
    print(f"[bench] wrote {', '.join(str(p) for p in paths.values())} ({report['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
