"""rnnfuse's own CUDA kernels, shared by the TensorFlow and torch bindings.

`csrc/` holds the wavefront kernel with its C-ABI host library and the
cuDNN RNN core; `build` compiles them (no GPU needed), `library` and
`cudnn_core` are their ctypes bindings, and `segments` splits a stack too
large for one launch. Nothing here imports a framework.
"""
