// What rnnfuse's XLA FFI handlers (jax_*.cc, one file an operation) share:
// the FFI API, the C ABIs they wrap, and the conversions from FFI buffers
// to those ABIs' arguments.
//
// Why XLA FFI: JAX calls a handler inside a jitted step (jax.ffi.ffi_call),
// on XLA's CUDA stream, with buffers XLA allocated, so a Keras train step
// on JAX runs rnnfuse's kernels with no host round trip. Every handler
// only adapts buffers: the kernels and their launchers are the
// framework-free libraries beside this file (wavefront_host.cc; the JAX
// side is rnnfuse/backends/jax/wavefront.py).
//
// Compiled with g++ against jax.ffi.include_dir() (header-only FFI API)
// and the CUDA toolkit's headers (cudaStream_t only: nothing links the CUDA
// runtime; the libraries reach the driver through dlopen).

#ifndef RNNFUSE_JAX_FFI_COMMON_H_
#define RNNFUSE_JAX_FFI_COMMON_H_

#include <cuda_runtime_api.h>  // cudaStream_t (a CUstream): types only

#include <cstddef>
#include <cstdint>
#include <string>

#include "wavefront_abi.h"
#include "xla/ffi/api/ffi.h"

// A handler symbol that survives -fvisibility=hidden (Python finds it with
// ctypes and registers it with jax.ffi.register_ffi_target).
#define RNNFUSE_FFI_HANDLER(name, impl, binding)                                        \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* name(XLA_FFI_CallFrame*); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, binding)


namespace rnnfuse_ffi {

namespace ffi = xla::ffi;

// The libraries' dtype code of an element type: 0 float16, 1 bfloat16,
// else -1.
inline int DtypeCode(ffi::DataType t) {
  if (t == ffi::DataType::F16) return 0;
  if (t == ffi::DataType::BF16) return 1;
  return -1;
}

inline int64_t Dim(const ffi::AnyBuffer& b, int i) { return b.dimensions()[i]; }

// A buffer's device pointer, or null for an empty one (an optional input:
// [0] lengths, a GRU's [0] c0).
inline void* Data(const ffi::AnyBuffer& b) {
  return b.element_count() == 0 ? nullptr : b.untyped_data();
}

inline ffi::Error Invalid(const std::string& what, const std::string& message) {
  return ffi::Error::InvalidArgument("rnnfuse " + what + ": " + message);
}

// The library's refusal (its rnnfuse_*_last_error message) as an FFI error.
inline ffi::Error LibraryError(const std::string& what, const char* message) {
  return ffi::Error::Internal("rnnfuse " + what + ": " +
                              std::string(message && *message ? message : "failed"));
}

// An InvalidArgument unless `b` has `rank` dimensions and element type `t`.
inline ffi::Error Expect(const std::string& what, const char* name, const ffi::AnyBuffer& b,
                         int rank, ffi::DataType t) {
  if (static_cast<int>(b.dimensions().size()) != rank)
    return Invalid(what, std::string(name) + " must have " + std::to_string(rank) +
                             " dimensions, not " + std::to_string(b.dimensions().size()));
  if (b.element_type() != t)
    return Invalid(what, std::string(name) + " has the wrong element type");
  return ffi::Error::Success();
}

}  // namespace rnnfuse_ffi

#endif  // RNNFUSE_JAX_FFI_COMMON_H_
