// rnnfuse's cuDNN RNN core: a C ABI over cuDNN 9's RNN API, no framework.
//
// One library, every binding: torch calls it through ctypes
// (rnnfuse/backends/cuda/cudnn_core.py), the TensorFlow op compiles it in
// (rnnfuse/backends/tensorflow/csrc/rnnfuse_cudnn_rnn.cc), a JAX handler
// could do the same. Every entry takes device pointers and the caller's CUDA stream
// (a cudaStream_t / CUstream; NULL: the legacy default stream of the
// current context); the caller allocates every buffer, sized by
// rnnfuse_cudnn_sizes.
//
// Data are time-major and right-padded: x [T, B, input_size], y [T, B, D*R]
// (zeros past each sequence's length), h [L*D, B, R], c [L*D, B, H], where
// D is the number of directions, H num_units and R = proj_size or H.
// Pseudo-layers (level-major, forward before backward) order the states.
//
// Parameters come in rnnfuse's canonical flat layout (CudnnRNNV3's, with
// the projection appended per pseudo-layer, as the TensorFlow op takes):
//
//   flat = W(p0) ++ W(p1) ++ ... ++ B(p0) ++ B(p1) ++ ...
//   W(p) = M_0 ++ ... ++ M_{2G-1} [++ M_proj]   (row-major matrices)
//   M_k  = [H, n] for k < G (n: the pseudo-layer's input width),
//          [H, R] for G <= k < 2G, M_proj = [P, H]
//   B(p) = b_0 ++ ... ++ b_{2G-1}, each [H]     (the projection has no bias)
//
// with G gates (LSTM 4: i, f, c, o; GRU 3: r, z, h; RNN 1). Each call
// scatters them into cuDNN's weight space inside the caller's workspace
// (and gathers the weight gradient back), with offsets from
// cudnnGetRNNWeightParams checked against this layout.
//
// Every function returns RF_CUDNN_OK (0) or a negative code, and then
// rnnfuse_cudnn_last_error() (per thread) says why: nothing here aborts.
// cuDNN is loaded with dlopen on first use, so the library loads where no
// cuDNN or GPU is present; calls then fail with RF_CUDNN_E_UNAVAILABLE.
//
// Training: rnnfuse_cudnn_forward(training=1) fills the reserve space;
// rnnfuse_cudnn_backward_data then rnnfuse_cudnn_backward_weights read it
// (in that order: cuDNN requires it), with the same configuration.
#ifndef RNNFUSE_CUDNN_RNN_CORE_H_
#define RNNFUSE_CUDNN_RNN_CORE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RNNFUSE_CUDNN_ABI_VERSION 1

// rnnfuse_cudnn_rnn.mode
enum { RF_CUDNN_LSTM = 0, RF_CUDNN_GRU = 1, RF_CUDNN_RNN_TANH = 2, RF_CUDNN_RNN_RELU = 3 };
// rnnfuse_cudnn_rnn.dtype
enum { RF_CUDNN_FLOAT32 = 0, RF_CUDNN_FLOAT16 = 1, RF_CUDNN_BFLOAT16 = 2, RF_CUDNN_FLOAT64 = 3 };
// Return codes.
enum {
  RF_CUDNN_OK = 0,
  RF_CUDNN_E_ARGUMENT = -1,       // a bad argument (the message names it)
  RF_CUDNN_E_UNAVAILABLE = -2,    // no cuDNN 9, no CUDA driver or no context
  RF_CUDNN_E_NOT_SUPPORTED = -3,  // cuDNN does not run this configuration
  RF_CUDNN_E_CUDNN = -4,          // another cuDNN failure
  RF_CUDNN_E_CUDA = -5,           // a CUDA driver failure
};

// One stack's configuration: what every entry takes (48 bytes, no padding).
typedef struct rnnfuse_cudnn_rnn {
  int32_t mode;        // RF_CUDNN_LSTM, ...
  int32_t num_layers;  // levels L >= 1
  int32_t num_units;   // H >= 1
  int32_t proj_size;   // P: 0, or 0 < P < H for an LSTM (LSTMP)
  int32_t input_size;  // features of x
  int32_t directions;  // 1 or 2
  int32_t dtype;       // RF_CUDNN_FLOAT32, ...
  // 4 * algo + math: algo 0 standard, 1 persistent static, 2 persistent
  // dynamic, 3 persistent static small-h; math 0 default, 1 tensor ops,
  // 2 tensor ops with conversion, 3 FMA (float64: the default, whatever is
  // asked). Both passes run it.
  int32_t algorithm;
  // float32 only: 0 keeps IEEE float32 (the math becomes FMA whatever
  // `algorithm` says); 1 lets cuDNN use TF32 tensor cores.
  int32_t allow_tf32;
  // cuDNN's dropout on the input of every level but the first, in [0, 1),
  // applied by training forwards only; its random states live in the
  // library, one set per (device, dropout, seed), seeded once with `seed`
  // and advanced by every training forward (each call draws new masks; the
  // backward reads them from the reserve space).
  float dropout;
  uint64_t seed;
} rnnfuse_cudnn_rnn;

// RNNFUSE_CUDNN_ABI_VERSION of the library (bindings check it).
int rnnfuse_cudnn_abi_version(void);

// Why the last failing call on this thread failed.
const char* rnnfuse_cudnn_last_error(void);

// Loads cuDNN (`path`, or NULL for "libcudnn.so.9" on the loader's search
// path and the library's rpath). Returns cuDNN's version (90100, ...) or a
// negative code. Called by every entry below; once loaded it stays.
int rnnfuse_cudnn_load(const char* path);

// Elements of the canonical flat parameter buffer, or -1 for a bad
// configuration (no GPU, no cuDNN needed).
int64_t rnnfuse_cudnn_param_count(const rnnfuse_cudnn_rnn* rnn);

// Bytes of the workspace every entry takes for this shape (the weight
// space, its gradient and cuDNN's work space) and of the reserve space a
// training forward fills. `host_lengths`: [batch] lengths in [1, steps], or
// NULL (all `steps`).
int rnnfuse_cudnn_sizes(const rnnfuse_cudnn_rnn* rnn, int steps, int batch,
                        const int32_t* host_lengths, void* stream, size_t* workspace_bytes,
                        size_t* reserve_bytes);

// The forward pass. `host_lengths` as above; `dev_lengths` the same lengths
// in device memory (int32 [batch]; NULL only with NULL host_lengths). hx, cx: NULL
// for zeros; hy, cy: NULL to skip. cx/cy are read only for an LSTM. With
// `training`, `reserve` (reserve_bytes from rnnfuse_cudnn_sizes) is filled
// for the backward; without, it may be NULL.
int rnnfuse_cudnn_forward(const rnnfuse_cudnn_rnn* rnn, int training, int steps, int batch,
                          const int32_t* host_lengths, const int32_t* dev_lengths, void* stream,
                          const void* x, const void* hx, const void* cx, const void* params,
                          void* y, void* hy, void* cy, void* workspace, size_t workspace_bytes,
                          void* reserve, size_t reserve_bytes);

// Gradients of x, hx and cx from those of y, hy and cy (dhy, dcy: NULL for
// zeros; dhx, dcx: NULL to skip). Writes into `reserve`, which
// rnnfuse_cudnn_backward_weights then reads.
int rnnfuse_cudnn_backward_data(const rnnfuse_cudnn_rnn* rnn, int steps, int batch,
                                const int32_t* host_lengths, const int32_t* dev_lengths,
                                void* stream, const void* y, const void* dy, const void* dhy,
                                const void* dcy, const void* hx, const void* cx,
                                const void* params, void* dx, void* dhx, void* dcx,
                                void* workspace, size_t workspace_bytes, void* reserve,
                                size_t reserve_bytes);

// The parameters' gradient, written (not added) into `dparams` in the
// canonical layout. Runs after rnnfuse_cudnn_backward_data on the same
// reserve space.
int rnnfuse_cudnn_backward_weights(const rnnfuse_cudnn_rnn* rnn, int steps, int batch,
                                   const int32_t* host_lengths, const int32_t* dev_lengths,
                                   void* stream, const void* x, const void* hx, const void* y,
                                   void* dparams, void* workspace, size_t workspace_bytes,
                                   void* reserve, size_t reserve_bytes);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // RNNFUSE_CUDNN_RNN_CORE_H_
