"""rnnfuse's own CUDA kernels, shared by the TensorFlow and torch bindings.

- `csrc/`: the persistent wavefront kernel for stacked LSTM/GRU inference
  (wavefront.cuh: design, layout arithmetic, synchronisation, limits) and
  its C-ABI host library over the CUDA driver API;
  and the cuDNN RNN core (cudnn_rnn_core.h: a C ABI over cuDNN 9's RNN
  API, every cell kind, algorithm, dtype, lengths, dropout, LSTMP);
- `build`: compiles them (nvcc, g++) into the user cache, no GPU needed;
- `library`: the ctypes binding of the host library (plan, forward);
- `cudnn_core`: the ctypes binding of the cuDNN core;
- `segments`: a stack too large for one launch as consecutive segments
  that each fit (the choice; the tuner offers them as a split plan).

Nothing here imports a framework: rnnfuse/backends/torch/wavefront.py and
the TensorFlow op (rnnfuse/backends/tensorflow/csrc/) bind it.
"""
