#!/bin/bash
# On the GPU machine, after tools/gpu/setup.sh: the TensorFlow GPU suite,
# then its MirroredStrategy tests on two logical GPUs (run_distribute_tests
# in env.sh). Writes the logs and JUnit reports under $OUT (when set).
source tools/gpu/env.sh
source tools/gpu/xla.sh
OUT=${OUT:-/tmp}
python3 - <<'PY' || exit 3
import tensorflow as tf
gpus = tf.config.list_logical_devices("GPU")
print("TensorFlow", tf.__version__, "GPUs:", gpus)
assert gpus, "TensorFlow sees no GPU"
PY
set -o pipefail
RNNFUSE_REPORT_DIR=$OUT python3 -m pytest -q -p no:cacheprovider -rs tests/gpu \
  --ignore=tests/gpu/test_gpu_torch.py --ignore=tests/gpu/test_gpu_distribute.py \
  --junitxml=$OUT/gpu_tests.xml "$@" 2>&1 | tee $OUT/gpu_tests.log | grep -v "^I0000\|^W0000"
RNNFUSE_REPORT_DIR=$OUT run_distribute_tests --junitxml=$OUT/gpu_distribute.xml 2>&1 \
  | tee $OUT/gpu_distribute.log | grep -v "^I0000\|^W0000"
