// The wavefront library's C ABI (wavefront_host.cc) as its bindings
// declare it: the XLA FFI handlers (jax_ffi_common.h) and the TensorFlow
// op (rnnfuse_wavefront_op.cc). Framework-free; wavefront_host.cc's
// header comment says what each entry does.
#ifndef RNNFUSE_WAVEFRONT_ABI_H_
#define RNNFUSE_WAVEFRONT_ABI_H_

#include <stddef.h>

extern "C" {
const char* rnnfuse_wf_last_error();
size_t rnnfuse_wf_workspace_bytes(int num_layers, int units, int batch, int steps,
                                  int elem_bytes);
int rnnfuse_wf_forward_variant(void* stream, int dtype, int gru, int num_layers, int units,
                               int batch, int steps, int input_size, const void* xproj,
                               const void* params, const void* h0, const void* c0,
                               const int* lengths, void* y, void* hy, void* cy, void* workspace,
                               int mode, int variant, unsigned long long* trace, int trace_steps,
                               float* gates_out, float* c_out);
size_t rnnfuse_wf_backward_workspace_bytes();
int rnnfuse_wf_backward_kind(void* stream, int dtype, int gru, int units, int batch, int steps,
                             const void* w_hh, const float* gates, const float* cseq,
                             const void* c0, const void* dy, const void* dhy, const void* dcy,
                             const int* lengths, void* dgates, float* dh0, float* dc0,
                             void* workspace);
size_t rnnfuse_wf_backward_stack_workspace_bytes(int num_layers, int units, int batch,
                                                 int steps);
int rnnfuse_wf_backward_stack(void* stream, int dtype, int num_layers, int units, int batch,
                              int steps, int input_size, const void* params, const float* gates,
                              const float* cseq, const void* c0, const void* dy, const void* dhy,
                              const void* dcy, const int* lengths, void* dgates, float* dh0,
                              float* dc0, void* workspace, int variant);
}

#endif  // RNNFUSE_WAVEFRONT_ABI_H_
