"""Choose exits and thresholds for a quality target, or with `--lossless` the draft settings by measured speed:
`python training/calibrate.py --help`. The same entry point as `ee-transformers calibrate`."""

import sys

from ee_transformers.tools.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
