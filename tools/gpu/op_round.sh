#!/bin/bash
# On the H200 after the staging runs (../shared/gpu/README.md): build
# rnnfuse's cuDNN op there (as a user's first GPU use would), run its GPU
# tests, then the op benchmark. Logs and JSON go to $OUT.
#   bash tools/gpu/op_round.sh            # TEST_S, BENCH_BUDGET, BENCH_CELLS
OUT=${OUT:-/tmp}
bash tools/gpu/setup.sh > $OUT/setup.log 2>&1 || { tail -20 $OUT/setup.log; exit 3; }
source tools/gpu/env.sh
source tools/gpu/xla.sh
export CUDNN=${CUDNN:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn}
export RNNFUSE_CACHE_DIR=/tmp/rnnfuse-cache
ls $CUDNN/lib $CUDNN/include 2>&1 | head -30 > $OUT/cudnn_ls.log
start=$(date +%s)
python3 -m rnnfuse build-ops > $OUT/build.log 2>&1; echo "build-ops rc $? in $(( $(date +%s) - start )) s"; tail -3 $OUT/build.log
if ! tail -1 $OUT/build.log | grep -q "rnnfuse_cudnn_rnn.so$" && [ -f .gpu/op/rnnfuse_cudnn_rnn.so ]; then
  target=$(python3 -c "from rnnfuse.backends.tensorflow import op_build; print(op_build.library_path())" 2>/dev/null | tail -1)
  mkdir -p "$(dirname "$target")" && cp .gpu/op/rnnfuse_cudnn_rnn.so "$target" && echo "using the prebuilt library at $target"
fi
RNNFUSE_REPORT_DIR=$OUT timeout ${TEST_S:-260} python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/gpu/test_gpu_cudnn_op.py ${TEST_ARGS:-} > $OUT/op_tests.log 2>&1
echo "tests rc $?"
grep -E "passed|failed|FAILED|Error|SKIP|^E " $OUT/op_tests.log | grep -v "^I0000\|^W0000" | tail -40
[ "${BENCH_BUDGET:-150}" = 0 ] && exit 0
timeout $(( ${BENCH_BUDGET:-150} + 150 )) python3 bench/bench_cudnn_op.py --budget ${BENCH_BUDGET:-150} --warmup 2 --repeats ${BENCH_REPEATS:-5} \
  ${BENCH_CELLS:+--cells $BENCH_CELLS} --out $OUT/cudnn_op_h200.json > $OUT/bench.log 2>&1
echo "bench rc $?"
grep -E "raw|fit|ERROR|budget" $OUT/bench.log | grep -v "^W0000\|retracing" | tail -20
