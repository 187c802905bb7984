// XLA FFI handlers of the cuDNN core's forward pass (cudnn_rnn_core.h,
// rnnfuse_cudnn_forward): rnnfuse_cudnn_ffi_forward (inference) and
// rnnfuse_cudnn_ffi_forward_training (training: dropout applied, the
// reserve space the backward reads filled).
//
// Operands (time-major, right-padded; T steps, B batch, D directions,
// H num_units, R = proj_size or H; one element type: float32, float16,
// bfloat16 or float64, but lengths):
//   x       [T, B, input_size]
//   hx      [L*D, B, R]
//   cx      [L*D, B, H]   an LSTM's; else [0]
//   params  [N]           the core's canonical flat layout
//   lengths [B] int32     each in [1, T] (read on the host unless full_lengths)
// Attributes: jax_cudnn_rnn.h's Attrs.
// Results: y [T, B, D*R] (zeros past each length), hy [L*D, B, R],
// cy [L*D, B, H] (else [0]); the training forward adds reserve [S] uint8
// (S >= the core's reserve size); last, workspace [W] uint8 (W >= the
// core's workspace size).

#include "jax_cudnn_rnn.h"

namespace rnnfuse_cudnn_ffi {
namespace {

ffi::Error Forward(const char* what, cudaStream_t stream, ffi::AnyBuffer& workspace,
                   const ffi::AnyBuffer& x, const ffi::AnyBuffer& hx, const ffi::AnyBuffer& cx,
                   const ffi::AnyBuffer& params, const ffi::AnyBuffer& lengths, const Attrs& a,
                   ffi::AnyBuffer& y, ffi::AnyBuffer& hy, ffi::AnyBuffer& cy, void* reserve,
                   size_t reserve_bytes) {
  Call call;
  if (auto e = Prepare(what, stream, a, x, lengths, call); e.failure()) return e;
  if (reserve != nullptr) {
    if (auto e = Reserve(what, call, reserve_bytes); e.failure()) return e;
  }
  if (auto e = Workspace(what, workspace, call); e.failure()) return e;
  const bool lstm = a.mode == RF_CUDNN_LSTM;
  const int rc = rnnfuse_cudnn_forward(
      &call.rnn, reserve != nullptr, call.steps, call.batch, call.host_lengths,
      call.dev_lengths, stream, x.untyped_data(), hx.untyped_data(),
      lstm ? Data(cx) : nullptr, params.untyped_data(), y.untyped_data(), hy.untyped_data(),
      lstm ? Data(cy) : nullptr, call.workspace, call.workspace_bytes, reserve,
      reserve_bytes);
  if (rc != RF_CUDNN_OK) return CoreError(what, rc);
  return ffi::Error::Success();
}

ffi::Error Inference(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer hx,
                     ffi::AnyBuffer cx, ffi::AnyBuffer params, ffi::AnyBuffer lengths, Attrs a,
                     ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> hy,
                     ffi::Result<ffi::AnyBuffer> cy, ffi::Result<ffi::AnyBuffer> workspace) {
  return Forward("forward", stream, *workspace, x, hx, cx, params, lengths, a, *y, *hy, *cy,
                 nullptr, 0);
}

ffi::Error Training(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer hx,
                    ffi::AnyBuffer cx, ffi::AnyBuffer params, ffi::AnyBuffer lengths, Attrs a,
                    ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> hy,
                    ffi::Result<ffi::AnyBuffer> cy, ffi::Result<ffi::AnyBuffer> reserve,
                    ffi::Result<ffi::AnyBuffer> workspace) {
  if (reserve->element_type() != ffi::DataType::U8 || reserve->element_count() == 0)
    return Invalid("training forward", "reserve must be a non-empty uint8 [S]");
  return Forward("training forward", stream, *workspace, x, hx, cx, params, lengths, a, *y, *hy,
                 *cy, reserve->untyped_data(), reserve->size_bytes());
}

}  // namespace
}  // namespace rnnfuse_cudnn_ffi

namespace ffi = xla::ffi;

// The operands both forwards take.
#define RNNFUSE_CUDNN_FORWARD_OPERANDS                  \
  ffi::Ffi::Bind()                                      \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()         \
      .Arg<ffi::AnyBuffer>() /* x */                    \
      .Arg<ffi::AnyBuffer>() /* hx */                   \
      .Arg<ffi::AnyBuffer>() /* cx */                   \
      .Arg<ffi::AnyBuffer>() /* params */               \
      .Arg<ffi::AnyBuffer>() /* lengths */              \
      .Attrs<rnnfuse_cudnn_ffi::Attrs>()                \
      .Ret<ffi::AnyBuffer>() /* y */                    \
      .Ret<ffi::AnyBuffer>() /* hy */                   \
      .Ret<ffi::AnyBuffer>() /* cy */

RNNFUSE_CUDNN_FFI_HANDLER(rnnfuse_cudnn_ffi_forward, rnnfuse_cudnn_ffi::Inference,
                          RNNFUSE_CUDNN_FORWARD_OPERANDS.Ret<ffi::AnyBuffer>() /* workspace */);

RNNFUSE_CUDNN_FFI_HANDLER(rnnfuse_cudnn_ffi_forward_training, rnnfuse_cudnn_ffi::Training,
                          RNNFUSE_CUDNN_FORWARD_OPERANDS.Ret<ffi::AnyBuffer>() /* reserve */
                              .Ret<ffi::AnyBuffer>() /* workspace */);
