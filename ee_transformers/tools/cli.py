"""The `ee-transformers` command: convert, fetch-assets, fit, calibrate, bench, demo.

Each subcommand's module owns its argument parser (`main(argv)`); this file only dispatches, importing lazily so that
`ee-transformers convert --help` does not pay for the training stack.
"""

import importlib
import sys

from ee_transformers.tools.arguments import ArgumentParser, InputError, comma_list, run_command

SUBCOMMANDS = {
    "convert": ("ee_transformers.tools.cli", "convert_main", "build an early-exit folder from a plain checkpoint"),
    "fetch-assets": ("ee_transformers.tools.assets", "main", "fetch SmolLM2-135M and real English text (cached)"),
    "fit": ("ee_transformers.training.fit_exit_heads", "main", "fit exit heads (same as python -m ee_transformers.training.fit_exit_heads)"),
    "calibrate": ("ee_transformers.training.calibrate", "main", "choose exits and thresholds for a quality target"),
    "bench": ("ee_transformers.tools.bench", "main", "benchmark early exit against plain transformers generate"),
    "demo": ("ee_transformers.tools.demo", "main", "the main job: fetch, convert, fit, calibrate, compare side by side"),
}


def convert_main(argv=None):
    parser = ArgumentParser(prog="ee-transformers convert",
                            description="Build an early-exit model folder from a plain checkpoint folder.")
    parser.add_argument("base", help="plain Llama / Mistral / Qwen2 / Qwen3 checkpoint folder")
    parser.add_argument("out", help="output folder (loads with trust_remote_code=True; written atomically)")
    parser.add_argument("--exit-layers", required=True, type=comma_list(int),
                        help="comma-separated 0-based decoder layers after which an exit head sits, e.g. 7,15,22")
    parser.add_argument("--exit-head", default="norm", choices=["norm", "adapter"])
    parser.add_argument("--exit-adapter-rank", type=int, default=64)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder that "
                        "ee-transformers wrote")
    return run_command(parser, _convert, argv)


def _convert(args):
    from ee_transformers.convert import check_weights, from_base, read_config
    from ee_transformers.tools.outputs import OutputFolder

    out = OutputFolder(args.out, overwrite=args.overwrite, argument="out")
    if not args.exit_layers:
        raise InputError(f"`--exit-layers` names no layer ({args.exit_layers!r}): give one or more, e.g. 7,15,22.")
    read_config(args.base, "base")
    check_weights(args.base, "base")
    model = from_base(args.base, exit_layers=args.exit_layers, exit_head=args.exit_head,
                      exit_adapter_rank=args.exit_adapter_rank)
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
