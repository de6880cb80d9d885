"""Moved to `ee_transformers.measure.config` (library code, below the command line).

This old name stays importable: it is the same module object."""

import sys

from ee_transformers.measure import config as _moved

sys.modules[__name__] = _moved
