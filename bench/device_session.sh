#!/usr/bin/env bash
# One device call: GPU tests, a timed fastaf-tune, then the linear bench. Usage (repo root):
#   bash bench/device_session.sh [tune-budget-seconds, 0 = no tuning] [bench args...]
# Writes logs, the tuning cache and the bench JSON under $OUT (device tool) or bench/results.
# Env: SKIP_TESTS=1, DIAG=1 (bench/diag_linear.py), BENCH_TIMEOUT (s, default 480).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
BUDGET=${1:-280}; shift || true
if ls .whl/*.whl >/dev/null 2>&1; then  # optree (and peft) for the device image
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export FASTAF_CACHE_DIR=${FASTAF_CACHE_DIR:-$OUT}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 python3 -m pytest -q tests/kernels tests/functional/test_gpu.py tests/functional/test_lora_linear.py \
    2>&1 | tee $OUT/pytest.log | tail -6
  timeout 60 python3 -m pytest -q -m gpu tests/functional/test_merge.py 2>&1 | tee -a $OUT/pytest.log | tail -2
fi
if [ "$BUDGET" != 0 ]; then
  t0=$(date +%s)
  python3 -m fastaf.cli.tune --budget-s "$BUDGET" 2>&1 | tee $OUT/tune.log | grep -E '^\[|->|done|fail|Error|budget' | tail -60
  echo "fastaf-tune wall time: $(( $(date +%s) - t0 )) s" | tee -a $OUT/tune.log
fi
if [ "${DIAG:-0}" = 1 ]; then python3 bench/diag_linear.py 2>&1 | tee $OUT/diag.log; fi
timeout ${BENCH_TIMEOUT:-480} python3 bench/bench_linear.py "$@" 2>&1 | tee $OUT/bench.log | grep -v '^  '
