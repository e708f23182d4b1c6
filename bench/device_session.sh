#!/usr/bin/env bash
# One device call: GPU tests, fastaf-tune, then the linear bench. Usage (from the repo root):
#   bash bench/device_session.sh [tune-budget-seconds] [bench args...]
# Writes logs, the tuning cache and the bench JSON under $OUT (device tool) or bench/results.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
BUDGET=${1:-200}; shift || true
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export FASTAF_CACHE_DIR=${FASTAF_CACHE_DIR:-$OUT}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 200 python3 -m pytest -q tests/kernels 2>&1 | tee $OUT/pytest.log | tail -15
if [ "$BUDGET" != 0 ]; then
  python3 -m fastaf.cli.tune --budget-s "$BUDGET" 2>&1 | tee $OUT/tune.log | grep -E '^\[|->|done|fail|Error' | tail -60
fi
if [ "${DIAG:-0}" = 1 ]; then python3 bench/diag_linear.py 2>&1 | tee $OUT/diag.log; fi
timeout ${BENCH_TIMEOUT:-480} python3 bench/bench_linear.py "$@" 2>&1 | tee $OUT/bench.log | grep -v '^  '
