# Source on the GPU machine after tools/gpu/setup.sh (wraps tf-env.sh).
source .gpu/bin/tf-env.sh
export LD_LIBRARY_PATH=/tmp/rnnfuse-shim:$LD_LIBRARY_PATH

# The MirroredStrategy tests (tests/gpu/test_gpu_distribute.py) with the
# logical-GPU plugin: on one GPU it splits it into two logical GPUs before
# TensorFlow starts; with two or more physical GPUs it changes nothing (the
# real two-GPU path). Extra arguments go to pytest.
# (The plugin is loaded by its module name from tests/gpu, so no other
# package named "tests" on the path can shadow it.)
run_distribute_tests() {
  PYTHONPATH=$PWD/tests/gpu:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider -rs \
    -p logical_gpus tests/gpu/test_gpu_distribute.py "$@"
}
