"""The main job's recipe on a real small model (fetch, convert, fit, calibrate, lossless calibration, every mode
against full depth): `python training/main_job.py --help`. The same entry point as `ee-transformers demo`."""

import sys

from ee_transformers.tools.demo import main

if __name__ == "__main__":
    sys.exit(main())
