"""Deprecated alias of `ee_transformers.tools.bench.pool` (`ee-transformers bench-pool`), where this module moved.

It re-exports that module's public names and goes away in the next release."""

import sys
import warnings

from ee_transformers.tools.bench.pool import *  # noqa: F403
from ee_transformers.tools.bench.pool import __all__, main  # noqa: F401 (`__all__`: the same public names)

warnings.warn(
    "`ee_transformers.tools.bench_pool` is deprecated: import `ee_transformers.tools.bench.pool` instead "
    "(this alias goes away in the next release).",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":
    sys.exit(main())
