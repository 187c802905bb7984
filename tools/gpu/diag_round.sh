#!/bin/bash
# On the H200 after the staging runs: build rnnfuse's cuDNN op, then run each
# argument as one command (a diagnostic, a test selection), each with a
# fresh plan cache, its output in $OUT/step_N.log and its seconds printed.
#   bash tools/gpu/diag_round.sh "python3 bench/diag_tuning_cost.py --cells 15 --out \$OUT/t.json"
# The logs come back in $OUT/diag_logs.tgz; keep the JSON outputs to 7 files.
OUT=${OUT:-/tmp}
export OUT
start=$(date +%s)
bash tools/gpu/setup.sh > $OUT/setup.log 2>&1 || { tail -20 $OUT/setup.log; exit 3; }
source tools/gpu/env.sh
source tools/gpu/xla.sh
export CUDNN=${CUDNN:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn}
export PYTHONUNBUFFERED=1
python3 -m rnnfuse build-ops > $OUT/build.log 2>&1; echo "build-ops rc $? at $(( $(date +%s) - start )) s: $(tail -1 $OUT/build.log)"
n=0
for cmd in "$@"; do
  n=$((n + 1))
  export RNNFUSE_CACHE_DIR=$(mktemp -d)
  t=$(date +%s)
  bash -c "$cmd" > $OUT/step_$n.log 2>&1
  echo "step $n rc $? in $(( $(date +%s) - t )) s (at $(( $(date +%s) - start )) s): $cmd"
  grep -vE "^(I|W|E)0000|^WARNING: All log|^To enable" $OUT/step_$n.log | tail -${TAIL:-25}
done
# The device returns at most 8 files from $OUT: the logs go into one tarball.
(cd $OUT && tar czf diag_logs.tgz setup.log build.log step_*.log && rm -f setup.log build.log step_*.log)
