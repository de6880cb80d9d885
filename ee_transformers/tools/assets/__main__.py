import sys

from ee_transformers.tools.assets.cli import main

sys.exit(main())
