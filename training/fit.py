"""Fit exit heads by self-distillation: `python training/fit.py --help`. The same entry point as `ee-transformers fit`
(and `accelerate launch training/fit.py ...` on several GPUs); the library is `ee_transformers.training`."""

import sys

from ee_transformers.tools.fit import main

if __name__ == "__main__":
    sys.exit(main())
