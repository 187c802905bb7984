#!/bin/bash
# On the GPU machine (no TensorFlow needed; carry .gpu/whl): the torch-backend
# GPU tests and benchmark, then the JAX measurement. Logs and JSON go to $OUT.
#   bash tools/gpu/run_torch_jax.sh torch|torch-tests|torch-view|ddp|jax|jax-tests
# ddp: tests/gpu/test_gpu_distribute_torch.py (two DDP processes on the one
# GPU through gloo; the two-GPU NCCL test where there are two GPUs).
OUT=${OUT:-/tmp}
mkdir -p /tmp/ks
for w in .gpu/whl/keras-*.whl .gpu/whl/namex-*.whl .gpu/whl/optree-*.whl; do
  python3 -m zipfile -e "$w" /tmp/ks
done
# Keras only: TensorFlow's CUDA 12 libraries must not shadow PyTorch's.
export PYTHONPATH=$(pwd):/tmp/ks OMP_WAIT_POLICY=PASSIVE
unset LD_LIBRARY_PATH
case "$1" in
  torch|torch-tests)
    KERAS_BACKEND=torch python3 -m pytest -q -p no:cacheprovider -s -rs tests/gpu/test_gpu_torch.py \
      > $OUT/torch_gpu_tests.log 2>&1
    grep -E "relative errors|contracting|tuner ms|passed|failed|FAILED|Error" $OUT/torch_gpu_tests.log | tail -40
    [ "$1" = torch-tests ] && exit 0
    KERAS_BACKEND=torch python3 bench/bench_torch.py --call-modes auto --tuned \
      --max-seconds ${BENCH_SECONDS:-220} --out $OUT/torch_tuned_h200.json > $OUT/torch_bench.log 2>&1
    tail -4 $OUT/torch_bench.log ;;
  torch-view)
    KERAS_BACKEND=torch timeout $(( ${BENCH_SECONDS:-400} + 60 )) python3 bench/bench_user_view.py \
      ${BENCH_ARGS---anchors} --budget ${BENCH_SECONDS:-400} --rounds ${ROUNDS:-15} --steps 20 \
      --out $OUT/user_view_torch_h200${BENCH_TAG}.json > $OUT/user_view_torch.log 2>&1
    grep -E "fit .*x predict|ERROR|cells|geomean|below|overhead" $OUT/user_view_torch.log | tail -40 ;;
  ddp)
    KERAS_BACKEND=torch python3 -m pytest -q -p no:cacheprovider -s -rs tests/gpu/test_gpu_distribute_torch.py \
      > $OUT/ddp_gpu_tests.log 2>&1
    grep -E "GPU_REPORT|passed|failed|FAILED|Error|SKIP" $OUT/ddp_gpu_tests.log | cut -c1-600 | tail -20 ;;
  jax-tests)
    KERAS_BACKEND=jax python3 -m pytest -q -p no:cacheprovider -s -rs tests/gpu/test_gpu_jax.py \
      > $OUT/jax_gpu_tests.log 2>&1
    grep -E "worst|tuner ms|custom calls|passed|failed|FAILED|Error" $OUT/jax_gpu_tests.log | tail -40 ;;
  jax)
    KERAS_BACKEND=jax python3 bench/bench_jax.py --max-seconds ${BENCH_SECONDS:-150} \
      --out $OUT/jax_h200.json 2>&1 | tee $OUT/jax_bench.log | tail -40 ;;
esac
