import sys

from ee_transformers.tools.bench.cli import main

sys.exit(main())
