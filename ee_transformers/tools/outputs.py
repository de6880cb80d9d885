"""Moved to `ee_transformers.utils.outputs` (library code, below the command line).

This old name stays importable: it is the same module object."""

import sys

from ee_transformers.utils import outputs as _moved

sys.modules[__name__] = _moved
