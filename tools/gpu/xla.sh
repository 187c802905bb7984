# Point XLA at the image's libdevice/ptxas (needed by jit_compile paths).
for d in /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-12; do
  if [ -f $d/nvvm/libdevice/libdevice.10.bc ]; then export XLA_FLAGS=--xla_gpu_cuda_data_dir=$d; break; fi
done
