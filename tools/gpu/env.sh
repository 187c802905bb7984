# Source on the GPU machine after tools/gpu/setup.sh (wraps tf-env.sh).
source .gpu/bin/tf-env.sh
export LD_LIBRARY_PATH=/tmp/rnnfuse-shim:$LD_LIBRARY_PATH
