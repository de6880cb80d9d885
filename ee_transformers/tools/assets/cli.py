"""`ee-transformers fetch-assets`: the model and the text, into the cache."""

from __future__ import annotations

import logging
import os
import sys

from ee_transformers.tools.assets.cache import cache_folder
from ee_transformers.tools.assets.gemma import fetch_gemma3_270m
from ee_transformers.tools.assets.model import fetch_model
from ee_transformers.tools.assets.text import fetch_text
from ee_transformers.utils.arguments import ArgumentParser, run_command


def fetch_assets(cache_dir: str | os.PathLike | None = None, force: bool = False) -> dict:
    """Fetch the model and the text; return ``{"model": folder, "austen": [paths], "python": [paths]}``."""
    cache = cache_folder(cache_dir)
    print(f"[ee-transformers assets] cache: {cache}", flush=True)
    model = fetch_model(cache, force=force, progress=True)
    text = fetch_text(cache, force=force, progress=True)
    return {"model": model, **text}


def main(argv: list[str] | None = None) -> int:
    """``ee-transformers fetch-assets [--cache-dir DIR] [--force] [--model-only | --text-only]``."""
    parser = ArgumentParser(
        prog="ee-transformers fetch-assets",
        description="Fetch SmolLM2-135M-Instruct and real English text into a cache.",
    )
    parser.add_argument(
        "--cache-dir", default=None, help="cache folder (default: $EE_TRANSFORMERS_CACHE or ~/.cache/ee-transformers)"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if already cached")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--model-only", action="store_true", help="fetch only the model")
    only.add_argument("--text-only", action="store_true", help="fetch only the text")
    only.add_argument(
        "--model",
        choices=["smollm2-135m", "gemma3-270m"],
        default=None,
        help="fetch only this model (gemma3-270m: Gemma-3-270M base, Gemma Terms of Use)",
    )
    return run_command(parser, _run, argv)


def _run(args) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cache = cache_folder(args.cache_dir)  # a bad --cache-dir: exit code 2, before any download
    try:
        if args.model == "gemma3-270m":
            print(fetch_gemma3_270m(args.cache_dir, force=args.force))
        elif args.model_only or args.model == "smollm2-135m":
            print(fetch_model(cache, force=args.force))
        elif args.text_only:
            for group, paths in fetch_text(cache, force=args.force).items():
                print(group, *paths, sep="\n  ")
        else:
            found = fetch_assets(cache, force=args.force)
            print(f"model: {found['model']}")
            for group in ("austen", "python"):
                print(f"{group}:", *found[group], sep="\n  ")
    except RuntimeError as error:  # a download or an external tool failed: one line, exit code 1
        print(f"ee-transformers fetch-assets: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
