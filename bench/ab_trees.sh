#!/usr/bin/env bash
# One device call, two builds side by side: bench_e2e.py on an older tree and on this one, in
# alternating rounds (old, new, old, new, ...), each round a process of its own with the same args.
#   git archive <commit> | tar -x -C .old     # the old build, in a folder .git/info/exclude ignores
#   bash bench/ab_trees.sh .old ROUNDS NAME [bench_e2e args...]   (carry .old and .whl to the device)
# Writes bench/results/NAME-{old,new}<round>-<gpu>.json (copied to $OUT when set) and prints each
# provider's ms per round. Each tree's bench_e2e.py imports its own fastaf (PYTHONPATH).
set -uo pipefail
OLD=$1; ROUNDS=$2; NAME=$3; shift 3
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # optree, liger-kernel for the device image
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
NEW_SHA=${FASTAF_SHA:-$(git rev-parse --short HEAD)}
for round in $(seq 1 "$ROUNDS"); do
  for side in old new; do
    dir=$([ $side = old ] && echo "$OLD" || echo .)
    echo "== round $round: $side ($dir)"
    (cd "$dir" && FASTAF_SHA=$([ $side = old ] && echo "${OLD_SHA:-old}" || echo "$NEW_SHA") \
      PYTHONPATH=/tmp/site:$PWD python3 bench/bench_e2e.py --name "$NAME-$side$round" "$@" 2>&1 \
      | grep -E "^ +[a-z-]+ +[0-9.]+ ms|graphs:|error|Error" | tail -20)
    if [ -n "${OUT:-}" ]; then cp "$dir"/bench/results/"$NAME-$side$round"-*.json "$OUT"/ 2>/dev/null; fi
  done
done
