// What rnnfuse's XLA FFI handlers of the cuDNN core (jax_cudnn_*.cc) share:
// the attributes every call takes, the core's configuration built from
// them and the operands, the sequence lengths on the host, the workspace
// (a result the binding sizes), and the core's errors as FFI errors.
//
// The handlers are thin: every cuDNN call is the core's
// (cudnn_rnn_core.h, linked as librnnfuse_cudnn_core.so, the library the
// torch binding loads), on XLA's stream, with buffers XLA allocated. The
// one driver call here (the lengths' copy to the host) goes through the
// libraries' shared loader (cuda_driver.h: dlopen, cuda.h for types).

#ifndef RNNFUSE_JAX_CUDNN_RNN_H_
#define RNNFUSE_JAX_CUDNN_RNN_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "cudnn_rnn_core.h"
#include "xla/ffi/api/ffi.h"

// CUDA's stream type, declared as cuda_runtime_api.h does (XLA hands the
// handler its CUDA stream; the core takes it as void*).
typedef struct CUstream_st* cudaStream_t;

namespace {
// The driver calls of a masked call's lengths copy (one loader a handler file).
#define RNNFUSE_CUDNN_FFI_DRIVER_FUNCTIONS(X) \
  X(cuInit)                                  \
  X(cuGetErrorString)                        \
  X(cuMemcpyDtoHAsync)                       \
  X(cuStreamSynchronize)
RF_DEFINE_DRIVER(RNNFUSE_CUDNN_FFI_DRIVER_FUNCTIONS)
}  // namespace

// A handler symbol that survives -fvisibility=hidden (Python finds it with
// ctypes and registers it with jax.ffi.register_ffi_target).
#define RNNFUSE_CUDNN_FFI_HANDLER(name, impl, binding)                                  \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* name(XLA_FFI_CallFrame*); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, binding)

namespace rnnfuse_cudnn_ffi {

namespace ffi = xla::ffi;

// Every call's attributes: the fields of rnnfuse_cudnn_rnn that are not
// read off the operands (input_size and dtype are x's), and whether every
// sequence is full length (then no lengths are copied to the host).
struct Attrs {
  int32_t mode;
  int32_t num_layers;
  int32_t num_units;
  int32_t proj_size;
  int32_t directions;
  int32_t algorithm;
  int32_t allow_tf32;
  float dropout;
  int64_t seed;
  int32_t full_lengths;
};

// One call's configuration and shape, ready for the core.
struct Call {
  rnnfuse_cudnn_rnn rnn;
  int steps = 0;
  int batch = 0;
  void* stream = nullptr;
  std::vector<int32_t> host;           // the lengths, when not all full
  const int32_t* host_lengths = nullptr;  // host.data() or NULL (all full)
  const int32_t* dev_lengths = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  size_t reserve_bytes = 0;
};

inline ffi::Error Invalid(const char* what, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string("rnnfuse cuDNN ") + what + ": " + message);
}

// The core's refusal (its code and rnnfuse_cudnn_last_error message).
inline ffi::Error CoreError(const char* what, int rc) {
  const char* message = rnnfuse_cudnn_last_error();
  std::string text = std::string("rnnfuse cuDNN ") + what + ": " +
                     (message && *message ? message : "failed") + " (core code " +
                     std::to_string(rc) + ")";
  switch (rc) {
    case RF_CUDNN_E_ARGUMENT:
      return ffi::Error::InvalidArgument(text);
    case RF_CUDNN_E_NOT_SUPPORTED:
      return ffi::Error(ffi::ErrorCode::kUnimplemented, text);
    case RF_CUDNN_E_UNAVAILABLE:
      return ffi::Error(ffi::ErrorCode::kUnavailable, text);
    default:
      return ffi::Error::Internal(text);
  }
}

// The core's dtype code of an element type, or -1.
inline int DtypeCode(ffi::DataType t) {
  if (t == ffi::DataType::F32) return RF_CUDNN_FLOAT32;
  if (t == ffi::DataType::F16) return RF_CUDNN_FLOAT16;
  if (t == ffi::DataType::BF16) return RF_CUDNN_BFLOAT16;
  if (t == ffi::DataType::F64) return RF_CUDNN_FLOAT64;
  return -1;
}

// A buffer's device pointer, or null for an empty one (a GRU's [0] c).
inline void* Data(const ffi::AnyBuffer& b) {
  return b.element_count() == 0 ? nullptr : b.untyped_data();
}

// cuDNN 9 reads the lengths on the host too (its data descriptors): a
// masked call copies them there and waits for the copy (full-length calls
// skip this).
inline ffi::Error CopyLengths(const char* what, Call& call) {
  Driver* d = GetDriver();
  if (!d->ok)
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      std::string("rnnfuse cuDNN ") + what + ": " + d->why);
  call.host.resize(call.batch);
  CUstream stream = static_cast<CUstream>(call.stream);
  CUresult r = d->cuMemcpyDtoHAsync_(call.host.data(),
                                     reinterpret_cast<CUdeviceptr>(call.dev_lengths),
                                     sizeof(int32_t) * call.batch, stream);
  const char* step = "cuMemcpyDtoHAsync (the lengths to the host)";
  if (r == CUDA_SUCCESS) {
    r = d->cuStreamSynchronize_(stream);
    step = "cuStreamSynchronize (the lengths' copy)";
  }
  if (r != CUDA_SUCCESS)
    return ffi::Error::Internal(std::string("rnnfuse cuDNN ") + what + ": " +
                                DriverError(d, step, r));
  call.host_lengths = call.host.data();
  return ffi::Error::Success();
}

// The configuration of a call on x [T, B, input_size] with `lengths`
// int32 [B] (device), its lengths on the host and the core's sizes.
inline ffi::Error Prepare(const char* what, cudaStream_t stream, const Attrs& a,
                          const ffi::AnyBuffer& x, const ffi::AnyBuffer& lengths, Call& call) {
  const int dtype = DtypeCode(x.element_type());
  if (dtype < 0) return Invalid(what, "x must be float32, float16, bfloat16 or float64");
  if (x.dimensions().size() != 3)
    return Invalid(what, "x must be [T, B, input_size], not of rank " +
                             std::to_string(x.dimensions().size()));
  call.steps = static_cast<int>(x.dimensions()[0]);
  call.batch = static_cast<int>(x.dimensions()[1]);
  call.rnn = rnnfuse_cudnn_rnn{a.mode,       a.num_layers, a.num_units,
                               a.proj_size,  static_cast<int32_t>(x.dimensions()[2]),
                               a.directions, dtype,        a.algorithm,
                               a.allow_tf32, a.dropout,    static_cast<uint64_t>(a.seed)};
  call.stream = stream;
  if (lengths.element_type() != ffi::DataType::S32 ||
      lengths.element_count() != static_cast<size_t>(call.batch))
    return Invalid(what, "lengths must be int32 [B] with B = " + std::to_string(call.batch));
  call.dev_lengths = static_cast<const int32_t*>(lengths.untyped_data());
  if (!a.full_lengths) {
    if (auto e = CopyLengths(what, call); e.failure()) return e;
  }
  size_t reserve = 0;
  int rc = rnnfuse_cudnn_sizes(&call.rnn, call.steps, call.batch, call.host_lengths, stream,
                               &call.workspace_bytes, &reserve);
  if (rc != RF_CUDNN_OK) return CoreError(what, rc);
  call.reserve_bytes = reserve;
  return ffi::Error::Success();
}

// The call's workspace: a uint8 result the binding sizes when the step is
// traced (XLA's scratch allocator refused cuDNN's workspace sizes on the GPU).
inline ffi::Error Workspace(const char* what, ffi::AnyBuffer& space, Call& call) {
  if (space.size_bytes() < call.workspace_bytes)
    return Invalid(what, "the workspace holds " + std::to_string(space.size_bytes()) +
                             " bytes; this call needs " + std::to_string(call.workspace_bytes) +
                             " (the binding sized it for another configuration)");
  call.workspace = space.untyped_data();
  call.workspace_bytes = space.size_bytes();
  return ffi::Error::Success();
}

// The reserve space a result holds, checked against the core's size.
inline ffi::Error Reserve(const char* what, const Call& call, size_t bytes) {
  if (bytes < call.reserve_bytes)
    return Invalid(what, "the reserve space holds " + std::to_string(bytes) +
                             " bytes; this call needs " + std::to_string(call.reserve_bytes) +
                             " (the binding sized it for another configuration)");
  return ffi::Error::Success();
}

}  // namespace rnnfuse_cudnn_ffi

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(rnnfuse_cudnn_ffi::Attrs,
                                      ::xla::ffi::StructMember<int32_t>("mode"),
                                      ::xla::ffi::StructMember<int32_t>("num_layers"),
                                      ::xla::ffi::StructMember<int32_t>("num_units"),
                                      ::xla::ffi::StructMember<int32_t>("proj_size"),
                                      ::xla::ffi::StructMember<int32_t>("directions"),
                                      ::xla::ffi::StructMember<int32_t>("algorithm"),
                                      ::xla::ffi::StructMember<int32_t>("allow_tf32"),
                                      ::xla::ffi::StructMember<float>("dropout"),
                                      ::xla::ffi::StructMember<int64_t>("seed"),
                                      ::xla::ffi::StructMember<int32_t>("full_lengths"));

#endif  // RNNFUSE_JAX_CUDNN_RNN_H_
