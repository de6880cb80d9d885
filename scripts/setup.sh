#!/usr/bin/env bash
# Creates .venv with the CPU build of torch first (a looser requirement could pull a multi-GB CUDA build), then
# installs this package with every optional dependency and the highest supported transformers. Idempotent: a second
# run only checks.
#
#   bash scripts/setup.sh                          transformers: the highest supported release (5.24)
#   bash scripts/setup.sh --transformers 5.19.0    that release instead (any of the supported range, 5.19 to 5.24)
#   EE_TRANSFORMERS_VERSION=5.19.0 bash scripts/setup.sh    the same, for CI
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VERSION="${EE_TRANSFORMERS_VERSION:-}"
while [ $# -gt 0 ]; do
    case "$1" in
        --transformers) VERSION="${2:?--transformers needs a version, e.g. 5.19.0}"; shift 2 ;;
        --transformers=*) VERSION="${1#*=}"; shift ;;
        *) echo "scripts/setup.sh: unknown argument $1 (allowed: --transformers VERSION)" >&2; exit 2 ;;
    esac
done
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[all]"
# the supported range is ee_transformers/compat.py's (pyproject's dependency says the same)
WANTED="$(.venv/bin/python - "$VERSION" <<'EOF'
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ee_transformers.compat import BELOW, NEWEST, SUPPORTED

asked = sys.argv[1]
if not asked:  # the highest supported release
    print(f"transformers[serving]>={NEWEST},<{BELOW}")
    sys.exit(0)
try:
    ok = Version(asked) in SpecifierSet(SUPPORTED.removeprefix("transformers"))
except InvalidVersion:
    ok = False
if not ok:
    sys.exit(f"scripts/setup.sh: --transformers {asked!r} is not a supported release ({SUPPORTED})")
print(f"transformers[serving]=={asked}")
EOF
)"
.venv/bin/python -m pip install --quiet "$WANTED"
.venv/bin/python -c "import torch, transformers, ee_transformers; print(f'ee-transformers {ee_transformers.__version__}: torch {torch.__version__}, transformers {transformers.__version__}')"
