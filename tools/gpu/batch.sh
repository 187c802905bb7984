#!/bin/bash
# One device call of a GPU batch: the named stages in order, each under its
# own time limit, each in its own environment (TensorFlow's CUDA 12 libraries
# for the tf-* stages, the image's PyTorch alone for the torch-* stages).
# Logs go to /tmp/batch/<stage>.log; one line of results per stage goes to
# stdout (the device returns the last 12,000 characters); the logs and every
# JSON a stage writes are packed into $OUT/batch_<tag>.tgz, and a stage's
# main JSON is copied to $OUT too (the device returns at most 8 files).
# Nothing is written into the repository: copy a result into bench/results
# by hand only when docs/benchmarks.md cites it, and never the logs.
#
#   bash tools/gpu/batch.sh tf-setup tf-build tf-tests tf-distribute
#   STAGE_S_tf_view=300 bash tools/gpu/batch.sh tf-view tf-single
#   VIEW_ARGS="--anchors 1 --cells 0 --rounds 15" bash tools/gpu/batch.sh torch-view jax-view
#     # the headline through every entry point under optimize's defaults (the plan a short call gets)
#   DIAG_ARGS="--cells 19 --compare 2" bash tools/gpu/batch.sh tf-diag
#   bash tools/gpu/batch.sh torch-tests torch-ddp torch-view
#   bash tools/gpu/batch.sh jax-tests   # the cuDNN core under Keras' JAX backend
#   bash tools/gpu/batch.sh wavefront-check torch-tests
#   bash tools/gpu/batch.sh wavefront-variants   # the kernels' opt-in variants
#   MATRIX_ARGS="--shapes lstm4x512" bash tools/gpu/batch.sh matrix-torch matrix-pytorch
#   bash tools/gpu/batch.sh whole-fit-torch      # whole fits from fresh processes
#   FIRST_ARGS="--shape lstm4x512" bash tools/gpu/batch.sh first-fit-jax   # where optimize and a first fit go
#   WHOLE_ARGS="--shapes gru3x64,lstm2x40 --pairs 5" bash tools/gpu/batch.sh whole-fit-tf
#   WHOLE_ARGS="--epochs 10 --models optimized" bash tools/gpu/batch.sh tf-setup whole-fit-jax whole-fit-tf
#     # tuning's share of a 10-epoch fit on each; then, here:
#     # python bench/bench_whole_fit.py --shares whole_fit_jax.json whole_fit_tf.json
#   DIAG_ARGS="--cells 15" bash tools/gpu/batch.sh jax-diag   # JAX's tuning seconds by candidate
#   MATRIX_ARGS="--epochs 10" bash tools/gpu/batch.sh tf-setup tf-build jax-build matrix-jax matrix-tf
#     # the matrix with tuning's share of its 10-epoch first fits (bench_matrix.py --shares)
#   bash tools/gpu/batch.sh profile-small-torch  # where a small model's step goes
#   KNOBS_ARGS="--jit auto" bash tools/gpu/batch.sh knobs-jax knobs-torch   # Keras' knobs, small shapes
#     # then, here: python bench/bench_knobs.py --table knobs_jax.json knobs_torch.json --peer matrix_pytorch.json
#   bash tools/gpu/batch.sh host-small-torch     # rnnfuse's own host time a step, kernels faked
#   bash tools/gpu/batch.sh core-small-torch     # the core's small steps: GPU time vs host time
#   AGREE_ARGS="--shapes gru3x64,lstm4x512" bash tools/gpu/batch.sh online-agreement-torch
#   KEPT_ARGS="--rounds 15" bash tools/gpu/batch.sh kept-original-torch   # kept original, paired
#   bash tools/gpu/batch.sh wavefront-segments   # stacks larger than the chip
#   bash tools/gpu/batch.sh wavefront-bidirectional   # bidirectional layers on the kernel (torch)
#   bash tools/gpu/batch.sh wavefront-sweep   # randomized exactness, about 150 s
#   bash tools/gpu/batch.sh wavefront-wgmma   # the forward's opt-in wgmma variant
#   bash tools/gpu/batch.sh wavefront-wgmma-diag   # where variant 2 goes wrong, tiny cases (~40 s)
#   bash tools/gpu/batch.sh wavefront-wgmma-trace   # variant 2's step phases beside variant 0's
#   WGMMA_VARIANT=4 bash tools/gpu/batch.sh wavefront-wgmma-diag wavefront-wgmma wavefront-wgmma-trace
#                    # the same three for variant 4 (variant 2 staged by tensor copies)
#   bash tools/gpu/batch.sh wavefront-variant3   # the forward's opt-in variant 3 (h as flags)
#
# The tf-* stages need the staging runs of ../shared/gpu/README.md first
# (tf-setup is a no-op on a machine that already has /tmp/tfsite).
# STAGE_S_<stage> (dashes as underscores) overrides a stage's limit in seconds.
OUT=${OUT:-/tmp/out}
TAG=${TAG:-$(date +%H%M%S)}
LOGS=/tmp/batch
mkdir -p "$LOGS" "$OUT"
start=$(date +%s)
export PYTHONUNBUFFERED=1 RNNFUSE_CACHE_DIR=/tmp/rnnfuse-cache RNNFUSE_REPORT_DIR=$LOGS/reports
export CUDNN=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn
mkdir -p "$RNNFUSE_REPORT_DIR"

since() { echo $(( $(date +%s) - start )); }
limit() { local v="STAGE_S_${1//-/_}"; echo "${!v:-$2}"; }
summary() { grep -E "$2" "$LOGS/$1.log" | grep -v "^[IWE]0000" | cut -c1-400 | tail -${3:-12}; }

tf_env() {
  source tools/gpu/env.sh
  source tools/gpu/xla.sh
}
torch_env() {
  mkdir -p /tmp/ks
  [ -f /tmp/ks/.ready ] || {
    for w in .gpu/whl/keras-*.whl .gpu/whl/namex-*.whl .gpu/whl/optree-*.whl; do
      python3 -m zipfile -e "$w" /tmp/ks
    done
    touch /tmp/ks/.ready
  }
  export PYTHONPATH=$(pwd):/tmp/ks OMP_WAIT_POLICY=PASSIVE KERAS_BACKEND=torch
  unset LD_LIBRARY_PATH
}

# The environment of a backend's stage: tf, jax, or torch (torch, pytorch).
backend_env() {
  case $1 in
    tf) tf_env ;;
    jax) torch_env; export KERAS_BACKEND=jax ;;
    *) torch_env ;;
  esac
}
# A benchmark stage: bench_stage STAGE BACKEND SECONDS JSON PATTERN COMMAND...
# runs COMMAND --out JSON in BACKEND's environment under SECONDS, copies the
# JSON to $OUT and prints the log's lines that match PATTERN.
bench_stage() {
  local stage=$1 backend=$2 s=$3 json=$4 pattern=$5 rc
  shift 5
  ( backend_env "$backend"; timeout "$s" "$@" --out "$LOGS/$json" ) > "$LOGS/$stage.log" 2>&1; rc=$?
  cp "$LOGS/$json" "$OUT/" 2>/dev/null
  echo "[$(since) s] $stage rc $rc"
  summary "$stage" "$pattern" 30
}

# An opt-in forward variant: variant_stage STAGE VARIANT SECONDS checks it
# against float64, cuDNN and variant 0, then times the headline interleaved
# with variant 0, kernel only.
# variant_stage STAGE VARIANT SECONDS [CHECK_ARGS] [BENCH_VARIANTS]: check (4 fixed
# shapes, 6 random, and CHECK_ARGS), then the headline timed interleaved (0,VARIANT).
variant_stage() {
  local stage=$1 v=$2 s log=$LOGS/$1.log rc extra=${4:-} timed=${5:-0,$2}
  s=$(limit "$stage" "$3")
  ( torch_env; timeout "$s" bash -c "python3 bench/bench_wavefront.py check --fixed 4 --random 6 $extra --variant $v --out $LOGS/wavefront_check_v$v.json; \
      python3 bench/bench_wavefront.py bench --cells headline --variants $timed --reps 20 --kernel-only --out $LOGS/wavefront_bench_v0$v.json" ) > "$log" 2>&1; rc=$?
  cp "$LOGS/wavefront_check_v$v.json" "$LOGS/wavefront_bench_v0$v.json" "$OUT/" 2>/dev/null
  echo "[$(since) s] $stage rc $rc"
  grep -E "ok|FAIL|fail|ms|ratio|Error|fallback|passed" "$log" | grep -v Warning | cut -c1-300 | tail -30
}

# TF_TESTS: the TensorFlow GPU test files to run (default: all of them).
TF_TEST_FILES=${TF_TESTS:-$(ls tests/gpu/test_gpu_*.py | grep -v -E "torch|jax|distribute" | tr '\n' ' ')}
# TORCH_TESTS: the torch GPU test files (default: both). TESTS_ARGS: more
# pytest arguments of tf-tests and torch-tests (e.g. --kernel-variants 1,1).
TORCH_TEST_FILES=${TORCH_TESTS:-tests/gpu/test_gpu_torch.py tests/gpu/test_gpu_wavefront_torch.py}

run_stage() {
  local stage=$1 log=$LOGS/$1.log rc
  local s
  case "$stage" in
    tf-setup)
      s=$(limit tf-setup 120)
      timeout $s bash tools/gpu/setup.sh > $log 2>&1; rc=$?
      echo "[$(since) s] tf-setup rc $rc: $(tail -2 $log | tr '\n' ' ')" ;;
    tf-build)
      s=$(limit tf-build 240)
      ( tf_env; timeout $s python3 -m rnnfuse build-ops ) > $log 2>&1; rc=$?
      echo "[$(since) s] tf-build rc $rc: $(tail -3 $log | tr '\n' ' ')" ;;
    jax-build)
      # The XLA FFI libraries (and the cuDNN core), so that no timed JAX run
      # (matrix-jax's first fit, its tuning) pays a compiler.
      s=$(limit jax-build 240)
      ( torch_env; export KERAS_BACKEND=jax; timeout $s python3 -m rnnfuse build-ops ) > $log 2>&1; rc=$?
      echo "[$(since) s] jax-build rc $rc: $(tail -3 $log | tr '\n' ' ')" ;;
    tf-tests)
      s=$(limit tf-tests 330)
      # TF_TESTS_K: a pytest -k expression (TESTS_ARGS is split on spaces,
      # so "-k 'gru or mask'" cannot pass through it).
      ( tf_env; timeout $s python3 -m pytest -q -p no:cacheprovider -rs $TF_TEST_FILES ${TESTS_ARGS} \
          ${TF_TESTS_K:+-k "$TF_TESTS_K"} --junitxml=$LOGS/tf_tests.xml ) > $log 2>&1; rc=$?
      echo "[$(since) s] tf-tests rc $rc"
      summary tf-tests "passed|failed|^FAILED|^ERROR" 40 ;;
    tf-distribute)
      s=$(limit tf-distribute 150)
      ( tf_env; timeout $s bash -c "source tools/gpu/env.sh; run_distribute_tests" ) > $log 2>&1; rc=$?
      echo "[$(since) s] tf-distribute rc $rc"
      summary tf-distribute "logical GPUs|passed|failed|^FAILED" 6 ;;
    tf-view|torch-view|jax-view)
      s=$(limit $stage 300)
      local backend=${stage%-view}
      ( backend_env $backend
        timeout $(( s + 30 )) python3 bench/bench_user_view.py ${VIEW_ARGS:---cells 30 --work-cap 2e11 --rounds 5 --predict-rounds 3 --steps 8} --budget $s \
          --out $LOGS/user_view_${backend}${BENCH_TAG}.json ) > $log 2>&1; rc=$?
      cp $LOGS/user_view_${backend}${BENCH_TAG}.json $OUT/ 2>/dev/null
      echo "[$(since) s] $stage rc $rc"
      summary $stage "x predict|fit .*x|custom|whole|ERROR|cells|geomean|below|overhead|min " 40 ;;
    matrix-tf|matrix-torch|matrix-jax|matrix-pytorch)
      # The backend matrix (bench/bench_matrix.py), one backend a stage;
      # MATRIX_ARGS: its arguments (e.g. --shapes lstm4x512,bilstm4x384).
      local backend=${stage#matrix-}
      bench_stage $stage $backend $(limit $stage 300) matrix_${backend}${BENCH_TAG}.json \
        "fit_ms|^share |ERROR|Error" python3 bench/bench_matrix.py \
        $([ $backend = pytorch ] && echo --backend pytorch) ${MATRIX_ARGS} ;;
    knobs-tf|knobs-torch|knobs-jax)
      # Keras' steps_per_execution and jit_compile on the small shapes
      # (bench/bench_knobs.py); KNOBS_ARGS: its arguments (torch: --jit auto
      # leaves torch.compile out, whose first calls take minutes).
      local backend=${stage#knobs-}
      bench_stage $stage $backend $(limit $stage 300) knobs_${backend}${BENCH_TAG}.json \
        "^knob|ERROR|Error" python3 bench/bench_knobs.py ${KNOBS_ARGS} ;;
    whole-fit-tf|whole-fit-torch|whole-fit-jax)
      # Whole fit(epochs=1) and fit(epochs=10) calls, each model in its own
      # fresh process with an empty plan cache (bench/bench_whole_fit.py);
      # no child starts in the stage's last 60 s. WHOLE_ARGS: its arguments
      # (e.g. --shapes gru3x64,lstm2x40 --pairs 5 --online).
      s=$(limit $stage 270)
      local backend=${stage#whole-fit-}
      bench_stage $stage $backend $s whole_fit_${backend}${BENCH_TAG}.json \
        "^whole |^native |ERROR|budget|forked" \
        python3 bench/bench_whole_fit.py --budget $(( s - 60 )) --child-timeout 55 ${WHOLE_ARGS} ;;
    first-fit-tf|first-fit-torch|first-fit-jax)
      # Where a fresh process's optimize and first fit go (bench/diag_first_fit.py):
      # the optimized model, then the original in float32 (Keras' own policy
      # may fail on JAX), each in its own process. FIRST_ARGS: --shape etc.
      s=$(limit $stage 150)
      local backend=${stage#first-fit-}
      ( backend_env $backend; for m in "--model optimized" "--model original --dtype float32"; do
          timeout $s python3 bench/diag_first_fit.py $m ${FIRST_ARGS} --out $LOGS/first_fit_${backend}.json; done
      ) > $log 2>&1; rc=$?
      cp $LOGS/first_fit_${backend}.json $log $OUT/ 2>/dev/null
      echo "[$(since) s] $stage rc $rc"
      grep -E "^first-fit|Error" $log | cut -c1-220 | head -20 ;;
    kept-original-tf|kept-original-torch|kept-original-jax)
      # A group whose plan keeps the original layers, paired against the
      # original model (bench/bench_kept_original.py). KEPT_ARGS: its arguments.
      s=$(limit $stage 200)
      local backend=${stage#kept-original-}
      bench_stage $stage $backend $s kept_original_${backend}${BENCH_TAG}.json "x |ERROR|Error|rounds" \
        python3 bench/bench_kept_original.py --budget $(( s - 30 )) ${KEPT_ARGS} ;;
    online-agreement-tf|online-agreement-torch)
      # Online tuning's choice against full timing's, per shape
      # (bench/bench_online_agreement.py). AGREE_ARGS: its arguments.
      local backend=${stage#online-agreement-}
      bench_stage $stage $backend $(limit $stage 300) online_agreement_${backend}${BENCH_TAG}.json \
        "^online|ERROR|Error" python3 bench/bench_online_agreement.py ${AGREE_ARGS} ;;
    profile-small-torch)
      # Where a small model's step goes under torch (bench/profile_small.py):
      # step medians, host time in rnnfuse's calls, torch.profiler (GPU
      # busy, gaps, syncs, allocations, ops), then the knobs. PROFILE_ARGS:
      # its arguments (e.g. --shapes gru3x64 --no-jit).
      s=$(limit profile-small-torch 240)
      ( torch_env; timeout $s python3 bench/profile_small.py ${PROFILE_ARGS} \
          --out $LOGS/profile_small_torch${BENCH_TAG}.json ) > $log 2>&1; rc=$?
      cp $LOGS/profile_small_torch${BENCH_TAG}.json $OUT/ 2>/dev/null
      echo "[$(since) s] $stage rc $rc"
      summary $stage "fit_ms|host|profile|knob|ERROR|Error" 40 ;;
    host-small-torch)
      # rnnfuse's own host time a training step of the small shapes' fused
      # layer, the cuDNN core's calls faked (bench/diag_host_small.py): on
      # this host, the packing and binding launch on the GPU. HOST_ARGS: its
      # arguments (e.g. --size full).
      s=$(limit host-small-torch 150)
      ( torch_env; timeout $s python3 bench/diag_host_small.py --rounds 7 ${HOST_ARGS} \
          --out $LOGS/host_small_torch${BENCH_TAG}.json ) > $log 2>&1; rc=$?
      cp $LOGS/host_small_torch${BENCH_TAG}.json $OUT/ 2>/dev/null
      echo "[$(since) s] $stage rc $rc"
      summary $stage "^gru|^rnn|^lstm|ERROR|Error" 20 ;;
    core-small-torch)
      # The fused call on the cuDNN core against torch._VF (a call a layer,
      # one call) on lstm2x40 and gru3x64 training steps: GPU time, host
      # time, each C call's host time, kernel counts, CUDA API calls
      # (bench/diag_core_small.py). CORE_SMALL_ARGS: its arguments. Then
      # each of FRESH_VARIANTS alone in a fresh process on lstm2x40: its
      # first step pays every one-time cost, as a new user's first fit does.
      s=$(limit core-small-torch 200)
      ( torch_env; timeout $s python3 bench/diag_core_small.py ${CORE_SMALL_ARGS} \
          --out $LOGS/diag_core_small${BENCH_TAG}.json
        for v in ${FRESH_VARIANTS:-keras fused}; do
          echo "fresh process, $v alone:"
          timeout 60 python3 bench/diag_core_small.py --shapes lstm2x40 --variants $v \
            --steps 5 --repeats 3 --profile-steps 1 --first-profile --out $LOGS/diag_core_small_fresh_$v.json
        done ) > $log 2>&1; rc=$?
      cp $LOGS/diag_core_small${BENCH_TAG}.json $OUT/ 2>/dev/null
      echo "[$(since) s] $stage rc $rc"
      summary $stage "^gru|^lstm|^cudnn|^the cuDNN|^fresh|ERROR|Error|Traceback" 40 ;;
    tf-diag)
      # DIAG_ARGS: bench/diag_tuning_cost.py's arguments (e.g. --cells 19 --compare 2).
      s=$(limit tf-diag 200)
      ( tf_env; timeout $s python3 bench/diag_tuning_cost.py ${DIAG_ARGS:---cells 15} \
          --out $LOGS/tuning_cost_tf${BENCH_TAG}.json ) > $log 2>&1; rc=$?
      cp $LOGS/tuning_cost_tf${BENCH_TAG}.json $OUT/ 2>/dev/null
      echo "[$(since) s] tf-diag rc $rc"
      summary tf-diag "^cell|^    |Error" 40 ;;
    jax-diag)
      # Where JAX's first-batch tuning seconds go (each candidate's first
      # call is its step's compile and one run); DIAG_ARGS as tf-diag's.
      s=$(limit jax-diag 200)
      ( torch_env; export KERAS_BACKEND=jax; timeout $s python3 bench/diag_tuning_cost.py ${DIAG_ARGS:---cells 15} \
          --out $LOGS/tuning_cost_jax${BENCH_TAG}.json ) > $log 2>&1; rc=$?
      cp $LOGS/tuning_cost_jax${BENCH_TAG}.json $OUT/ 2>/dev/null
      echo "[$(since) s] jax-diag rc $rc"
      summary jax-diag "^cell|^    |Error" 40 ;;
    tf-single|torch-single)
      s=$(limit $stage 200)
      local backend=${stage%-single}
      ( if [ $backend = tf ]; then tf_env; else torch_env; fi
        timeout $(( s + 40 )) python3 bench/bench_single_layers.py --budget $s ${SINGLE_ARGS} \
          --out $LOGS/single_layers_${backend}.json ) > $log 2>&1; rc=$?
      cp $LOGS/single_layers_${backend}.json $OUT/ 2>/dev/null
      echo "[$(since) s] $stage rc $rc"
      summary $stage "x|ERROR|Error" 20 ;;
    torch-tests)
      s=$(limit torch-tests 200)
      # TORCH_TESTS_K: a pytest -k expression (e.g. to leave a kernel path
      # that has never run to its own process: a fault ends the process).
      ( torch_env; timeout $s python3 -m pytest -q -p no:cacheprovider -s -rs $TORCH_TEST_FILES ${TESTS_ARGS} \
          ${TORCH_TESTS_K:+-k "$TORCH_TESTS_K"} ) > $log 2>&1; rc=$?
      echo "[$(since) s] torch-tests rc $rc"
      summary torch-tests "GPU_REPORT|passed|failed|^FAILED|^ERROR" 30 ;;
    jax-tests)
      # The JAX GPU tests (JAX_TESTS: the files; default the cuDNN core's).
      s=$(limit jax-tests 420)
      ( torch_env; export KERAS_BACKEND=jax; timeout $s python3 -m pytest -q -p no:cacheprovider -s -rs \
          ${JAX_TESTS:-tests/gpu/test_gpu_core_jax.py} ${TESTS_ARGS} ${JAX_TESTS_K:+-k "$JAX_TESTS_K"} ) > $log 2>&1; rc=$?
      echo "[$(since) s] jax-tests rc $rc"
      summary jax-tests "GPU_REPORT|worst|path:|registration|passed|failed|^FAILED|^ERROR|Error" 60 ;;
    torch-ddp)
      s=$(limit torch-ddp 120)
      ( torch_env; timeout $s python3 -m pytest -q -p no:cacheprovider -s -rs tests/gpu/test_gpu_distribute_torch.py ) > $log 2>&1; rc=$?
      echo "[$(since) s] torch-ddp rc $rc"
      summary torch-ddp "GPU_REPORT|passed|failed|^FAILED|SKIP" 10 ;;
    wavefront-check)
      # The kernel's exactness checks: forward (with the saving kernel),
      # gradients against float64 and cuDNN, and the headline training step.
      # WF_GRAD_ARGS: more arguments of the grad and train modes.
      s=$(limit wavefront-check 150)
      ( torch_env; timeout $s bash -c "python3 bench/bench_wavefront.py check --fixed 4 --random 4 --out $LOGS/wavefront_check.json; \
          python3 bench/bench_wavefront.py grad --random 4 ${WF_GRAD_ARGS} --out $LOGS/wavefront_grad.json; \
          python3 bench/bench_wavefront.py train --cells 2 ${WF_GRAD_ARGS} --out $LOGS/wavefront_train.json" ) > $log 2>&1; rc=$?
      cp $LOGS/wavefront_grad.json $LOGS/wavefront_train.json $OUT/ 2>/dev/null
      echo "[$(since) s] wavefront-check rc $rc"
      grep -E "ok|FAIL|fail|ms|Error" $log | cut -c1-240 | tail -40 ;;
    wavefront-bench)
      s=$(limit wavefront-bench 150)
      ( torch_env; timeout $(( s + 30 )) python3 bench/bench_wavefront.py bench --cells matrix --budget $s \
          --out $LOGS/wavefront_matrix.json ) > $log 2>&1; rc=$?
      cp $LOGS/wavefront_matrix.json $OUT/ 2>/dev/null
      echo "[$(since) s] wavefront-bench rc $rc"
      tail -25 $log | cut -c1-300 ;;
    wavefront-variants)
      # The kernels' opt-in variants against variant 0, one process each:
      # the forward's variant 1 (exactness against float64, cuDNN and
      # variant 0; then the headline timed interleaved with variant 0) and
      # the stack backward's variants 1 and 2 (gradients; the training step
      # of each variant timed interleaved).
      s=$(limit wavefront-variants 240)
      ( torch_env; timeout $s bash -c "python3 bench/bench_wavefront.py check --fixed 4 --random 6 --variant 1 --out $LOGS/wavefront_check_v1.json; \
          python3 bench/bench_wavefront.py bench --cells headline --variants 0,1 --reps 20 --kernel-only --out $LOGS/wavefront_bench_v01.json; \
          python3 bench/bench_wavefront.py grad --random 4 --backward stack --variant 1 --out $LOGS/wavefront_grad_stack_v1.json; \
          python3 bench/bench_wavefront.py grad --random 2 --backward stack --variant 2 --out $LOGS/wavefront_grad_stack_v2.json; \
          python3 bench/bench_wavefront.py train --cells 2 --backward stack --variants 0,1,2 --out $LOGS/wavefront_train_variants.json" ) > $log 2>&1; rc=$?
      cp $LOGS/wavefront_bench_v01.json $LOGS/wavefront_train_variants.json $OUT/ 2>/dev/null
      echo "[$(since) s] wavefront-variants rc $rc"
      grep -E "ok|FAIL|fail|ms|ratio|Error|refused" $log | grep -v Warning | cut -c1-260 | tail -45 ;;
    wavefront-segments)
      # Stacks larger than the chip as wavefront segments: the kernel-level
      # timings against cuDNN's best, then the torch GPU tests of the path.
      s=$(limit wavefront-segments 420)
      ( torch_env; timeout $s bash -c "python3 bench/bench_wavefront.py segments --train \
          --out $LOGS/wavefront_segments.json; \
          python3 -m pytest -q -p no:cacheprovider -s -rs tests/gpu/test_gpu_wavefront_segments.py" \
      ) > $log 2>&1; rc=$?
      cp $LOGS/wavefront_segments.json $OUT/ 2>/dev/null
      echo "[$(since) s] wavefront-segments rc $rc"
      summary wavefront-segments "kernel_segments|GPU_REPORT|passed|failed|^FAILED|^ERROR|Error" 30 ;;
    wavefront-bidirectional)
      # Bidirectional layers on the kernel (torch), in their own processes
      # (a fault ends only them), and a Keras step against cuDNN's best.
      s=$(limit wavefront-bidirectional 420)
      ( torch_env; timeout $s bash -c "python3 bench/bench_wavefront.py bidirectional --train \
          --out $LOGS/wavefront_bidirectional.json; \
          python3 bench/bench_core_torch.py --bidirectional --wavefront --repeats 7; \
          python3 bench/bench_core_torch.py --bidirectional --wavefront --repeats 7 --kind gru \
            --layers 5 --units 512 --input 512 --batch 32 --steps 500; \
          python3 -m pytest -q -p no:cacheprovider -s -rs tests/gpu/test_gpu_wavefront_bidirectional.py" \
      ) > $log 2>&1; rc=$?
      cp $LOGS/wavefront_bidirectional.json $OUT/ 2>/dev/null
      echo "[$(since) s] wavefront-bidirectional rc $rc"
      summary wavefront-bidirectional "median_ms|^ *\"(keras|core|wavefront|torch)|speedup|status|GPU_REPORT decision|passed|failed|^FAILED|^ERROR|Error" 45 ;;
    wavefront-wgmma)
      # The forward's opt-in variant 2 (wgmma, sm_90a; off by default): its
      # exactness against float64, cuDNN and variant 0 (a shape whose plan
      # it does not take falls back, with the reason), then the headline
      # timed interleaved with variant 0, kernel only. WGMMA_VARIANT=4:
      # variant 4 (variant 2 staged by tensor copies), also on the edge
      # shapes (check --edge), timed interleaved with variants 0 and 2.
      if [ "${WGMMA_VARIANT:-2}" = 4 ]; then
        variant_stage $stage 4 300 "--edge 5" 0,2,4
      else
        variant_stage $stage ${WGMMA_VARIANT:-2} 200
      fi ;;
    wavefront-wgmma-diag)
      # Where the forward's variant 2 goes wrong (variant 0 beside it):
      # tiny LSTM stacks, 1-3 steps, each (step, layer)'s gates against the
      # reference, and one-hot weights that say which (batch row, input)
      # each product read (bench/diag_wavefront_variant.py). DIAG_VARIANT (else
      # WGMMA_VARIANT): another variant.
      s=$(limit wavefront-wgmma-diag 120)
      dv=${DIAG_VARIANT:-${WGMMA_VARIANT:-2}}
      ( torch_env; timeout $s python3 bench/diag_wavefront_variant.py --variant $dv \
          --out $LOGS/wavefront_diag_v$dv.json ) > $log 2>&1; rc=$?
      cp $LOGS/wavefront_diag_v$dv.json $OUT/ 2>/dev/null
      echo "[$(since) s] wavefront-wgmma-diag rc $rc"
      grep -E '^\{|^diag:|Error' $log | cut -c1-600 | tail -14 ;;
    wavefront-wgmma-trace)
      # Where a step of variant 2 goes against variant 0's (the kernel's own
      # %globaltimer timeline, headline, per-phase medians: wait, stage,
      # multiply, pointwise, publish; bench_wavefront.py trace). WGMMA_VARIANT=4:
      # variant 4's beside both.
      s=$(limit wavefront-wgmma-trace 150)
      traced="0 2"; [ "${WGMMA_VARIANT:-2}" = 2 ] || traced="0 2 $WGMMA_VARIANT"
      ( torch_env; timeout $s bash -c "for v in $traced; do python3 bench/bench_wavefront.py trace \
          --cells 1 --variant \$v --out $LOGS/wavefront_trace_v\$v.json; done" ) > $log 2>&1; rc=$?
      for v in $traced; do cp $LOGS/wavefront_trace_v$v.json $OUT/ 2>/dev/null; done
      echo "[$(since) s] wavefront-wgmma-trace rc $rc"
      grep -E '^\{|Error' $log | cut -c1-700 | tail -6 ;;
    wavefront-variant3)
      # The forward's opt-in variant 3 (the h values as their own flags,
      # Lamport-style; off by default), checked and timed as variant 2 is.
      # A wait that never ends shows as NaN results after 4 s.
      variant_stage $stage 3 150 ;;
    wavefront-sweep)
      # Randomized exactness over 1-8 layers, 64-1024 units, batch 1-256,
      # T 1-2000, with and without lengths, both directions, LSTM and GRU,
      # float16 and bfloat16: what runs (the kernel, its segments, the
      # opt-in bidirectional launches, or cuDNN after the kernel refused
      # with a reason) against float64 and cuDNN. Cases stop at the budget;
      # the last line is the summary. SWEEP_SEED, SWEEP_ARGS: more arguments.
      s=$(limit wavefront-sweep 150)
      ( torch_env; timeout $s python3 bench/bench_wavefront.py sweep --cases 400 \
          --seed ${SWEEP_SEED:-0} --budget $(( s - 45 )) ${SWEEP_ARGS} \
          --out $LOGS/wavefront_sweep.json ) > $log 2>&1; rc=$?
      cp $LOGS/wavefront_sweep.json $OUT/ 2>/dev/null
      echo "[$(since) s] wavefront-sweep rc $rc"
      grep -E "^sweep:|FAIL|ERROR|Error|budget" $log | cut -c1-700 | tail -14 ;;
    *) echo "unknown stage $stage"; return 2 ;;
  esac
}

# The tarball is refreshed after every stage: a batch cut off at the
# device's limit still brings back what its finished stages wrote.
for stage in "$@"; do
  run_stage "$stage"
  tar czf $OUT/batch_${TAG}.tgz -C /tmp batch 2>/dev/null
done
echo "[$(since) s] done: $OUT/batch_${TAG}.tgz"
