"""`ee-transformers bench`: the command line. Its measurement flags are generated from `BenchConfig`.

ee-transformers bench --model runs/smollm2-135m-ee --batch-sizes 1,8 --new-tokens 128 --out bench-out
ee-transformers bench --model PLAIN_FOLDER --exit-layers 7,15,23,26 --exit-head norm --quick
"""

import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from ee_transformers.convert import check_weights, read_config
from ee_transformers.measure.config import QUICK, BenchConfig
from ee_transformers.tools.bench.loading import default_text_files, heldout_prompts, load_models, random_prompts
from ee_transformers.tools.bench.report import format_table, write_outputs
from ee_transformers.tools.bench.run import run_benchmark
from ee_transformers.training.data import read_texts
from ee_transformers.utils.arguments import (
    ArgumentParser,
    InputError,
    add_config_arguments,
    comma_list,
    config_from_args,
    run_command,
)
from ee_transformers.utils.outputs import OutputFolder


def build_parser():
    parser = ArgumentParser(
        prog="ee-transformers bench",
        description="Benchmark early exit against plain transformers generate on the same weights, interleaved in "
        "one process: speed-up, greedy agreement, exits, ideal vs realised, overhead, sweep, forced "
        "profiles. Writes report.json, results.md and PNG plots.",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="early-exit folder (fitted/calibrated or not), or a plain checkpoint folder together with --exit-layers",
    )
    parser.add_argument(
        "--exit-layers",
        type=comma_list(int),
        default=None,
        help="convert on the fly with these exits (e.g. 7,15,23,26); overrides the folder's",
    )
    parser.add_argument("--exit-head", choices=["norm", "adapter"], default=None)
    parser.add_argument(
        "--prompts-from",
        nargs="+",
        default=None,
        metavar="FILE",
        help="held-out text files (default: the held-out tails of Austen's Sense and Sensibility "
        "and the Python manual, from ee_transformers.tools.assets.fetch_text())",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small settings (CI) for every flag below not given: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()),
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument(
        "--out", default="bench-out", help="output folder for report.json, results.md, PNGs (written atomically)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out that ee-transformers wrote")
    add_config_arguments(parser, BenchConfig)
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--memory-budget" or a.startswith("--memory-budget=") for a in argv):  # HELIOS: lean vs full
        from ee_transformers.tools.bench.lean import main as lean_main

        return lean_main(argv)
    return run_command(build_parser(), lambda args: _run(args, argv), argv)


def _run(args, argv):
    # ---- every input checked before the benchmark starts ---------------------------------------------------------
    output = OutputFolder(args.out, overwrite=args.overwrite)
    config = config_from_args(BenchConfig, args, defaults=QUICK if args.quick else None)
    read_config(args.model, "--model")
    check_weights(args.model, "--model")
    if args.prompts_from:
        read_texts(args.prompts_from, argument="--prompts-from")  # exist, UTF-8 text, not empty
    elif any((Path(args.model) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        try:  # the default prompts: fetched (or found in the cache) now rather than after loading the model
            default_text_files()
        except RuntimeError as error:
            raise InputError(
                f"`--prompts-from` not given, and the default held-out text cannot be fetched ({error}); "
                "pass --prompts-from FILE..."
            ) from None
    calibration = _calibration(Path(args.model) / "calibration.json")
    if calibration is not None and config.calibrated == "auto":
        config = config.replace(calibrated="always")  # a calibrated folder: measure what it does, exits off or not
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(config.seed)
    ee_model, plain_model = load_models(
        args.model, args.exit_layers, args.exit_head, getattr(torch, args.dtype), args.device
    )
    tokenizer = ee_model.tokenizer
    if tokenizer is None:
        prompts = random_prompts(ee_model.config.vocab_size, config.num_prompts, config.prompt_tokens, config.seed)
        print("[bench] the model folder has no tokenizer: random token prompts")
    else:
        prompts = heldout_prompts(tokenizer, args.prompts_from, config.num_prompts, config.prompt_tokens, config.seed)
    start = time.perf_counter()
    report = run_benchmark(ee_model, plain_model, prompts, config)
    home = str(Path.home())
    report["command"] = (
        "ee-transformers bench "
        + " ".join(  # no machine-specific home folder in the record
            "~" + a[len(home) :] if a.startswith(home + os.sep) else shlex.quote(a)
            for a in (sys.argv[2:] if argv is None else argv)
        )
    )
    report["model"]["path"] = Path(args.model).name
    if calibration is not None:
        report["model"]["calibration"] = {
            k: calibration.get(k) for k in ("criterion", "policy", "target_agreement", "chosen", "heldout_B", "message")
        }
    report["wall_seconds"] = time.perf_counter() - start
    with output.writing("bench") as folder:
        paths = write_outputs(report, folder)
    print(format_table(report))
    print(
        f"[bench] wrote {', '.join(p.name for p in paths.values())} into {output.path} ({report['wall_seconds']:.0f} s)"
    )
    return 0


def _calibration(path):
    """The folder's calibration.json (a JSON object), or None when it has none."""
    if not path.is_file():
        return None
    try:
        calibration = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"{path} is not readable JSON ({error}).") from None
    if not isinstance(calibration, dict):
        raise InputError(f"{path} must hold a JSON object, not a JSON {type(calibration).__name__}.")
    return calibration


if __name__ == "__main__":
    sys.exit(main())
