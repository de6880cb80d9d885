#!/usr/bin/env bash
# Every GPU row in one command, for a short lease on a GPU machine that has torch but not this project's
# transformers (carried as a wheel in .whl/): the drafts' rows (gpu_draft_rows.py), the forced-exit profiles and the
# self-speculative rows (gpu_llama8b_forced.py), each cut at its own time limit so a slow part cannot take the rest
# with it (each script writes its results per batch size, so a cut part keeps what it finished).
#
#     bash benchmarks/gpu_session.sh [OUT]      # OUT defaults to $OUT, else benchmarks/results/gpu-session
#
# It writes seven files into OUT: session.log, drafts.{md,json}, forced.{md,json}, speculative.{md,json}.
set -u
out=${1:-${OUT:-benchmarks/results/gpu-session}}
mkdir -p "$out"
work=$(mktemp -d)
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" .whl/*.whl \
    && export PYTHONPATH="$work/site"
fi
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
  echo "== drafts"
  timeout 170 python3 benchmarks/gpu_draft_rows.py --out "$work/drafts"
  echo "rc=$?"
  echo "== forced"
  timeout 200 python3 benchmarks/gpu_llama8b_forced.py --batch-sizes 1,32,8 --new-tokens 64 --repeats 1 --no-profile \
    --speculative off --out "$work/forced"
  echo "rc=$?"
  echo "== speculative"
  timeout 120 python3 benchmarks/gpu_llama8b_forced.py --speculative only --batch-sizes 1,8 --new-tokens 64 \
    --out "$work/speculative"
  echo "rc=$?"
} >"$out/session.log" 2>&1
cat "$work"/drafts/width_costs.md "$work"/drafts/rows.md >"$out/drafts.md" 2>/dev/null
cp "$work/drafts/report.json" "$out/drafts.json" 2>/dev/null
cp "$work/forced/results.md" "$out/forced.md" 2>/dev/null
cp "$work/forced/report.json" "$out/forced.json" 2>/dev/null
cp "$work/speculative/speculative.md" "$out/speculative.md" 2>/dev/null
cp "$work/speculative/speculative.json" "$out/speculative.json" 2>/dev/null
tail -40 "$out/session.log"
