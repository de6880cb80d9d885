"""The `ee-transformers` command: convert, fetch-assets, fit, calibrate, profile, bench (and its lean, speculative
and pool modes), demo.

Each subcommand's module owns its argument parser (`main(argv)`); this file only dispatches, importing lazily so that
`ee-transformers convert --help` does not pay for the training stack.
"""

import importlib
import sys

from ee_transformers.utils.arguments import ArgumentParser, InputError, comma_list, run_command

SUBCOMMANDS = {
    "convert": ("ee_transformers.tools.cli", "convert_main", "build an early-exit folder from a plain checkpoint"),
    "fetch-assets": ("ee_transformers.tools.assets", "main", "fetch SmolLM2-135M and real English text (cached)"),
    "fit": (
        "ee_transformers.tools.fit",
        "main",
        "fit exit heads (same as python training/fit.py)",
    ),
    "calibrate": ("ee_transformers.tools.calibrate", "main", "choose exits and thresholds for a quality target"),
    "profile": (
        "ee_transformers.tools.profile",
        "main",
        "where tokens exit under the stored settings; recommend exit_max_layer for a lean model",
    ),
    "bench": (
        "ee_transformers.tools.bench",
        "main",
        "benchmark early exit against plain transformers generate "
        "(with --memory-budget: lean HELIOS models, see bench-lean)",
    ),
    "bench-lean": (
        "ee_transformers.tools.bench.lean",
        "main",
        "full vs lean (HELIOS) at the largest batch each fits in a memory budget",
    ),
    "bench-speculative": (
        "ee_transformers.tools.bench.speculative",
        "main",
        "lossless self-speculative decoding vs plain and transformers' assistant_early_exit",
    ),
    "bench-lossless": (
        "ee_transformers.tools.bench.lossless",
        "main",
        "lossless decoding (context and exit-head drafts) vs plain and transformers' prompt lookup",
    ),
    "bench-pool": (
        "ee_transformers.tools.bench.pool",
        "main",
        "a pool of early-exit models switched by their exit profiles vs each model alone",
    ),
    "serve": (
        "ee_transformers.tools.serve",
        "main",
        "serve an early-exit folder with transformers serve (OpenAI API; --continuous-batching for exits in batches)",
    ),
    "bench-serve": (
        "ee_transformers.tools.bench.serve",
        "main",
        "transformers serve under load from the openai client: early-exit folders vs plain serving of the base",
    ),
    "demo": (
        "ee_transformers.tools.demo",
        "main",
        "the main job: fetch, convert, fit, calibrate, compare side by side",
    ),
}


def convert_main(argv=None):
    parser = ArgumentParser(
        prog="ee-transformers convert", description="Build an early-exit model folder from a plain checkpoint folder."
    )
    parser.add_argument("base", help="plain checkpoint folder of a supported family (see README: Families)")
    parser.add_argument("out", help="output folder (loads with trust_remote_code=True; written atomically)")
    parser.add_argument(
        "--exit-layers",
        required=True,
        type=comma_list(int),
        help="comma-separated 0-based decoder layers after which an exit head sits, e.g. 7,15,22",
    )
    parser.add_argument("--exit-head", default="norm", choices=["norm", "adapter"])
    parser.add_argument("--exit-adapter-rank", type=int, default=64)
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing output folder that ee-transformers wrote"
    )
    return run_command(parser, _convert, argv)


def _convert(args):
    from ee_transformers.convert import check_weights, from_base, read_config
    from ee_transformers.utils.outputs import OutputFolder

    out = OutputFolder(args.out, overwrite=args.overwrite, argument="out")
    if not args.exit_layers:
        raise InputError(f"`--exit-layers` names no layer ({args.exit_layers!r}): give one or more, e.g. 7,15,22.")
    read_config(args.base, "base")
    check_weights(args.base, "base")
    model = from_base(
        args.base, exit_layers=args.exit_layers, exit_head=args.exit_head, exit_adapter_rank=args.exit_adapter_rank
    )
    with out.writing("convert") as folder:
        model.save_pretrained(folder)
    print(f"Wrote {args.out}: {type(model).__name__} with exits after layers {model.config.exit_layers}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        lines = [f"  {name:<13} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
        print("usage: ee-transformers COMMAND [ARGS]\n\ncommands:\n" + "\n".join(lines))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, function, _ = SUBCOMMANDS[argv[0]]
    result = getattr(importlib.import_module(module), function)(argv[1:])
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
