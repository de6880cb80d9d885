"""matplotlib for the plots, which are optional: every command writes its JSON without it, and skips its PNGs."""

import logging

__all__ = ["PLOTS_EXTRA", "pyplot", "pyplot_or_skip"]

logger = logging.getLogger(__name__)

PLOTS_EXTRA = "pip install 'ee-transformers[bench]'"  # the `bench` extra of pyproject.toml brings matplotlib


def pyplot():
    """`matplotlib.pyplot` on the Agg backend (files, no display); an ImportError naming the extra without it."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(f"Plots need matplotlib, which is not installed: `{PLOTS_EXTRA}`.") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pyplot_or_skip(*skipped: str):
    """`pyplot()`, or None after one warning line naming the `skipped` files and how to get them."""
    try:
        return pyplot()
    except ImportError:
        logger.warning(f"matplotlib is not installed: skipped {', '.join(skipped)}; `{PLOTS_EXTRA}` draws them.")
        return None
