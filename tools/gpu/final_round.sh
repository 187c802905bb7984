#!/bin/bash
# On the H200 after the staging runs: build rnnfuse's cuDNN op as a user's
# first GPU use would, run the TensorFlow GPU suite, then the user-view
# benchmark (fit/predict through optimize()'s defaults) until DEADLINE_S
# seconds after the start. Logs and JSON go to $OUT.
#   DEADLINE_S=420 bash tools/gpu/final_round.sh
# SKIP_TESTS=1 leaves the suite out; BENCH_ARGS replaces "--anchors" (for
# example "--skip 15" to time the second half of the drawn matrix).
OUT=${OUT:-/tmp}
start=$(date +%s)
left() { echo $(( ${DEADLINE_S:-420} - ($(date +%s) - start) )); }
bash tools/gpu/setup.sh > $OUT/setup.log 2>&1 || { tail -20 $OUT/setup.log; exit 3; }
source tools/gpu/env.sh
source tools/gpu/xla.sh
export CUDNN=${CUDNN:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn}
export RNNFUSE_CACHE_DIR=/tmp/rnnfuse-cache PYTHONUNBUFFERED=1
python3 -m rnnfuse build-ops > $OUT/build.log 2>&1; echo "build-ops rc $? at $(( $(date +%s) - start )) s: $(tail -1 $OUT/build.log)"
# The device returns at most 8 files from $OUT: the tests' JSON reports go
# into one tarball.
mkdir -p /tmp/reports
if [ -z "$SKIP_TESTS" ]; then
  RNNFUSE_REPORT_DIR=/tmp/reports timeout $(( $(left) - ${BENCH_S:-150} )) python3 -m pytest -q -p no:cacheprovider -rs tests/gpu \
    --ignore=tests/gpu/test_gpu_torch.py --ignore=tests/gpu/test_gpu_distribute.py \
    --ignore=tests/gpu/test_gpu_distribute_torch.py --ignore=tests/gpu/test_gpu_jax.py \
    --junitxml=$OUT/gpu_tests.xml > $OUT/gpu_tests.log 2>&1
  rc=$?
  echo "tests rc $rc at $(( $(date +%s) - start )) s"
  grep -E "passed|failed|^FAILED|^ERROR" $OUT/gpu_tests.log | grep -v "^I0000\|^W0000" | tail -30
  # MirroredStrategy on two logical GPUs of this one (env.sh).
  RNNFUSE_REPORT_DIR=/tmp/reports timeout 240 run_distribute_tests > /tmp/reports/gpu_distribute.log 2>&1
  echo "distribute tests rc $? at $(( $(date +%s) - start )) s: $(grep -E "passed|failed|logical GPUs" /tmp/reports/gpu_distribute.log | tr '\n' ' ')"
  tar czf $OUT/test_reports.tgz -C /tmp reports 2>/dev/null
fi
b=$(( $(left) - 20 ))
[ $b -lt 40 ] && exit 0
timeout $(( b + 15 )) python3 bench/bench_user_view.py ${BENCH_ARGS---anchors} --budget $b --rounds ${ROUNDS:-15} --steps 20 \
  --out $OUT/user_view_tf_h200${BENCH_TAG}.json > $OUT/user_view.log 2>&1
echo "bench rc $? at $(( $(date +%s) - start )) s"
grep -E "fit .*x predict|ERROR|cells|geomean|below|overhead" $OUT/user_view.log | tail -40
