#!/usr/bin/env bash
# Creates .venv with the CPU build of torch first (a looser requirement could pull a multi-GB CUDA build), then
# installs this package with every optional dependency. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[all]"
.venv/bin/python -c "import torch, transformers, ee_transformers; print(f'ee-transformers {ee_transformers.__version__}: torch {torch.__version__}, transformers {transformers.__version__}')"
