#!/bin/bash
# On the lent GPU machine, after the staged runs (../shared/gpu/README.md):
# reassemble TensorFlow with ../shared/gpu's tf-setup.sh, then, if the
# cuFFT/cuSOLVER CUDA 12 wheels were not staged (they are 540 MB that the
# RNN kernels never call), point TensorFlow's loader at the image's CUDA 13
# copies under the names it opens (libcufft.so.11, libcusolver.so.11), so it
# still registers the GPU. Then print what TensorFlow sees.
set -euo pipefail
bash .gpu/bin/tf-setup.sh
N=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
mkdir -p /tmp/rnnfuse-shim
for pair in "cufft:libcufft.so.11" "cusolver:libcusolver.so.11"; do
  pkg=${pair%%:*}; want=${pair##*:}
  if ! ls /tmp/tfsite/nvidia/$pkg/lib/$want >/dev/null 2>&1; then
    have=$(ls $N/cu13/lib/lib$pkg.so.* $N/$pkg/lib/lib$pkg.so.* 2>/dev/null | head -1 || true)
    [ -n "$have" ] && ln -sf "$have" /tmp/rnnfuse-shim/$want && echo "shim: $want -> $have"
  fi
done
