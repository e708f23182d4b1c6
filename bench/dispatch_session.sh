#!/usr/bin/env bash
# One device call: the dispatch's evidence at the 1B model's shapes and the table it ships with.
#   TUNE=old: fastaf-tune at M=4096 for the 1B shapes into its own cache dir (the old measurement)
#   TUNE=new: this GPU's shipped table's dispatch entries measured again (GPU and host time apart),
#             plus the 1B shapes at M=4096 and 8192, into $OUT/tc (copy it into fastaf/kernels/tuned/)
# then whole eager steps at 4 x 1024 and 8 x 1024 tokens (auto beside every layer on one path,
# -triton / -addmm), one process per batch, interleaved rounds, with that table.
#   bash bench/dispatch_session.sh [batches...]   (default 4 8; carry .whl)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
TC=$OUT/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
mkdir -p "$TC"
case "${TUNE:-new}" in
  old)
    FASTAF_CACHE_DIR=$TC python3 -m fastaf.cli.tune --model-config bench/configs/llama-3.2-1b-shape.json \
      --tokens 4096 --ranks 16 --budget-s 150 2>&1 | tee "$OUT/tune-1b-m4096.log" | grep -E '^\[|->|done|Error';;
  new)
    # this GPU's shipped table (its kernel configs stay; its dispatch entries are measured again)
    shipped=$(python3 -c "from fastaf.kernels import _cache; print(_cache.shipped_path() or '')")
    [ -n "$shipped" ] && cp "$shipped" "$TC/$(basename "$(python3 -c "from fastaf.kernels import _cache; print(_cache.cache_path())")")"
    FASTAF_CACHE_DIR=$TC python3 -m fastaf.cli.tune --kernels dispatch --budget-s 200 2>&1 \
      | tee "$OUT/tune-dispatch.log" | grep -E '^\[|->|done|rror'
    FASTAF_CACHE_DIR=$TC python3 -m fastaf.cli.tune --model-config bench/configs/llama-3.2-1b-shape.json \
      --tokens 4096,8192 --kernels dispatch --budget-s 150 2>&1 | tee -a "$OUT/tune-dispatch.log" | grep -E '^\[|->|done|rror'
    export FASTAF_CACHE_DIR=$TC;;
esac
PROVIDERS=${PROVIDERS:-base,fastaf-autograd,fastaf-autograd-triton,fastaf-autograd-addmm,fastaf-func,fastaf-func-triton}
for b in ${@:-4 8}; do
  echo "== batch $b"
  timeout 200 python3 bench/bench_e2e.py --batch "$b" --interleave 3 --providers "$PROVIDERS" \
    --name "e2e-dispatch-${TUNE:-new}-b$b" 2>&1 | grep -E "^ +[a-z-]+ +[0-9.]+ ms|^[a-z-]+ +[0-9.]+ ms|graphs:|rror"
done
