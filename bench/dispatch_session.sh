#!/usr/bin/env bash
# One device call: the dispatch's evidence at the 1B model's shapes and the table it ships with.
#   TUNE=new (default): this GPU's shipped table, its dispatch entries measured again (GPU and host
#             time apart) and the 1B shapes at M=4096 and 8192 added, into $OUT/tc (copy the file
#             into fastaf/kernels/tuned/ when the steps below bear it out)
#   TUNE=old: the 1B shapes at M=4096 tuned into $OUT/tc the way this checkout's fastaf-tune does
#             (before 7ce9d20: do_bench times of ungraphed calls, the old measurement)
#   TUNE=none: the steps alone, on the shipped table
# then whole eager steps at 4 x 1024 and 8 x 1024 tokens (auto beside every layer on one path,
# -triton / -addmm), one process per batch, interleaved rounds, with that table. ~5 min on an H100.
#   bash bench/dispatch_session.sh [batches...]   (default 4 8; carry .whl: optree, liger-kernel)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
TC=$OUT/tc
if ls .whl/*.whl >/dev/null 2>&1; then  # optree (and liger-kernel) for the device image
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
mkdir -p "$TC"
SHOWN='^\[|->|done|rror|untuned'
case "${TUNE:-new}" in
  old)
    FASTAF_CACHE_DIR=$TC python3 -m fastaf.cli.tune --model-config bench/configs/llama-3.2-1b-shape.json \
      --tokens 4096 --ranks 16 --budget-s 150 2>&1 | tee "$OUT/tune-1b-m4096.log" | grep -E "$SHOWN"
    export FASTAF_CACHE_DIR=$TC;;
  new)
    # this GPU's shipped table (its kernel configs stay; its dispatch entries are measured again)
    shipped=$(python3 -c "from fastaf.kernels import _cache; print(_cache.shipped_path() or '')")
    target=$(python3 -c "from fastaf.kernels import _cache; print(_cache.cache_path().name)")
    [ -n "$shipped" ] && cp "$shipped" "$TC/$target"
    FASTAF_CACHE_DIR=$TC python3 -m fastaf.cli.tune --kernels dispatch --budget-s 200 2>&1 \
      | tee "$OUT/tune-dispatch.log" | grep -E "$SHOWN"
    FASTAF_CACHE_DIR=$TC python3 -m fastaf.cli.tune --model-config bench/configs/llama-3.2-1b-shape.json \
      --tokens 4096,8192 --kernels dispatch --budget-s 100 2>&1 | tee -a "$OUT/tune-dispatch.log" | grep -E "$SHOWN"
    export FASTAF_CACHE_DIR=$TC;;
  none) ;;
  *) echo "TUNE must be new, old or none" >&2; exit 2;;
esac
PROVIDERS=${PROVIDERS:-base,fastaf-autograd,fastaf-autograd-triton,fastaf-autograd-addmm,fastaf-func,fastaf-func-triton}
for b in ${@:-4 8}; do
  echo "== batch $b"
  timeout 150 python3 bench/bench_e2e.py --batch "$b" --interleave 3 --providers "$PROVIDERS" \
    --name "e2e-dispatch-${TUNE:-new}-b$b" 2>&1 | grep -E "^ +[a-z-]+ +[0-9.]+ ms|^[a-z-]+ +[0-9.]+ ms|graphs|rror"
done
