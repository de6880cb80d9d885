"""`ee-transformers profile`: where do tokens exit under a model's exit settings, and how deep must a lean model be?

The command line of `ee_transformers.measure.profile` (`profile_exits`, `ExitProfile`; the names stay importable
from here):

    ee-transformers profile FOLDER --data notes.txt more.txt --coverage 0.95
"""

import argparse
from pathlib import Path

from ee_transformers.measure.profile import *  # noqa: F403 (the library's names, importable from here as before)
from ee_transformers.measure.profile import PROFILE_FILE, ProfileConfig, profile_exits
from ee_transformers.measure.profile import __all__ as _library_names
from ee_transformers.utils.arguments import add_config_arguments, config_from_args

__all__ = [*_library_names, "main"]


def _float_list(text):
    values = [float(x) for x in text.split(",") if x.strip()]
    return values[0] if len(values) == 1 else values


def main(argv=None):
    parser = argparse.ArgumentParser(prog="ee-transformers profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="early-exit model folder (or a plain one with --exit-layers)")
    parser.add_argument("--data", nargs="+", required=True, help="text files to profile on (teacher-forced)")
    parser.add_argument("--exit-layers", default=None, help="comma-separated exits, to convert a plain folder")
    parser.add_argument("--exit-criterion", default=None, help="default: the folder's stored setting")
    parser.add_argument("--exit-threshold", type=_float_list, default=None, help="a float or one per checked exit")
    parser.add_argument("--exit-patience", type=int, default=None)
    add_config_arguments(parser, ProfileConfig)
    parser.add_argument("--coverage", type=float, default=0.95, help="target share for the recommendation")
    parser.add_argument("--out", default=None, help="where to write exit_profile.json/.png (default: the folder)")
    args = parser.parse_args(argv)
    from ee_transformers.convert import from_base

    exit_layers = [int(x) for x in args.exit_layers.split(",")] if args.exit_layers else None
    overrides = {
        k: v
        for k, v in dict(
            exit_criterion=args.exit_criterion, exit_threshold=args.exit_threshold, exit_patience=args.exit_patience
        ).items()
        if v is not None
    }
    try:
        config = config_from_args(ProfileConfig, args)
        model = from_base(args.folder, exit_layers=exit_layers).eval()
        if model.tokenizer is None:
            raise ValueError(f"`folder` {args.folder!r} holds no tokenizer.")
        texts = [Path(p).read_text(encoding="utf-8", errors="replace") for p in args.data]
        profile = profile_exits(model, model.tokenizer, texts, config, out_dir=args.out or args.folder, **overrides)
        recommended = profile.recommend(args.coverage)
    except ValueError as error:
        parser.exit(2, f"ee-transformers profile: error: {error}\n")
    print(profile)
    print(
        f"exit_max_layer for {100 * args.coverage:g}% coverage: {recommended}; wrote "
        f"{Path(args.out or args.folder) / PROFILE_FILE}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
