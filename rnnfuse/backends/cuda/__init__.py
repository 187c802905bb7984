"""rnnfuse's own CUDA kernels, shared by the TensorFlow and torch bindings.

- `csrc/`: the persistent wavefront kernel for stacked LSTM/GRU inference
  (wavefront.cuh: design, layout arithmetic, synchronisation, limits) and
  its C-ABI host library over the CUDA driver API;
- `build`: compiles them (nvcc, g++) into the user cache, no GPU needed;
- `library`: the ctypes binding of the host library (plan, forward).

Nothing here imports a framework: rnnfuse/backends/torch/wavefront.py and
the TensorFlow op (rnnfuse/backends/tensorflow/csrc/) bind it.
"""
