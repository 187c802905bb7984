// XLA FFI handlers of the cuDNN core's backward pass (cudnn_rnn_core.h):
// rnnfuse_cudnn_ffi_backward_data (rnnfuse_cudnn_backward_data) then
// rnnfuse_cudnn_ffi_backward_weights (rnnfuse_cudnn_backward_weights), on
// the reserve space the training forward filled, with its attributes.
//
// backward_data operands (shapes as jax_cudnn_forward.cc's):
//   y, dy [T, B, D*R]; dhy [L*D, B, R]; dcy [L*D, B, H] (else [0]);
//   hx, cx, params, lengths as the forward's; reserve [S] uint8
// Results: dx [T, B, input_size], dhx [L*D, B, R], dcx [L*D, B, H] (else
// [0]), reserve [S] uint8: the operand's buffer (cuDNN writes into it and
// backward_weights reads it; the binding aliases operand 8 to result 3),
// workspace [W] uint8.
// The input size is dx's.
//
// backward_weights operands: x, hx, y, lengths, reserve [S] (what
// backward_data returned). Results: dparams [N] (written, not added),
// workspace [W] uint8.

#include "jax_cudnn_rnn.h"

namespace rnnfuse_cudnn_ffi {
namespace {

ffi::Error BackwardData(cudaStream_t stream, ffi::AnyBuffer y,
                        ffi::AnyBuffer dy, ffi::AnyBuffer dhy, ffi::AnyBuffer dcy,
                        ffi::AnyBuffer hx, ffi::AnyBuffer cx, ffi::AnyBuffer params,
                        ffi::AnyBuffer lengths, ffi::AnyBuffer reserve_in, Attrs a,
                        ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dhx,
                        ffi::Result<ffi::AnyBuffer> dcx, ffi::Result<ffi::AnyBuffer> reserve,
                        ffi::Result<ffi::AnyBuffer> workspace) {
  const char* what = "backward data";
  if (reserve->untyped_data() != reserve_in.untyped_data())
    return Invalid(what, "the reserve result must alias the reserve operand "
                         "(input_output_aliases {8: 3})");
  Call call;
  // dx [T, B, input_size] carries the input size the configuration needs.
  if (auto e = Prepare(what, stream, a, *dx, lengths, call); e.failure()) return e;
  if (auto e = Reserve(what, call, reserve->size_bytes()); e.failure()) return e;
  if (auto e = Workspace(what, *workspace, call); e.failure()) return e;
  const bool lstm = a.mode == RF_CUDNN_LSTM;
  const int rc = rnnfuse_cudnn_backward_data(
      &call.rnn, call.steps, call.batch, call.host_lengths, call.dev_lengths, stream,
      y.untyped_data(), dy.untyped_data(), dhy.untyped_data(), lstm ? Data(dcy) : nullptr,
      hx.untyped_data(), lstm ? Data(cx) : nullptr, params.untyped_data(), dx->untyped_data(),
      dhx->untyped_data(), lstm ? Data(*dcx) : nullptr, call.workspace, call.workspace_bytes,
      reserve->untyped_data(), reserve->size_bytes());
  if (rc != RF_CUDNN_OK) return CoreError(what, rc);
  return ffi::Error::Success();
}

ffi::Error BackwardWeights(cudaStream_t stream, ffi::AnyBuffer x,
                           ffi::AnyBuffer hx, ffi::AnyBuffer y, ffi::AnyBuffer lengths,
                           ffi::AnyBuffer reserve, Attrs a,
                           ffi::Result<ffi::AnyBuffer> dparams,
                           ffi::Result<ffi::AnyBuffer> workspace) {
  const char* what = "backward weights";
  Call call;
  if (auto e = Prepare(what, stream, a, x, lengths, call); e.failure()) return e;
  if (auto e = Reserve(what, call, reserve.size_bytes()); e.failure()) return e;
  if (auto e = Workspace(what, *workspace, call); e.failure()) return e;
  const int rc = rnnfuse_cudnn_backward_weights(
      &call.rnn, call.steps, call.batch, call.host_lengths, call.dev_lengths, stream,
      x.untyped_data(), hx.untyped_data(), y.untyped_data(), dparams->untyped_data(),
      call.workspace, call.workspace_bytes, reserve.untyped_data(), reserve.size_bytes());
  if (rc != RF_CUDNN_OK) return CoreError(what, rc);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace rnnfuse_cudnn_ffi

namespace ffi = xla::ffi;

RNNFUSE_CUDNN_FFI_HANDLER(rnnfuse_cudnn_ffi_backward_data, rnnfuse_cudnn_ffi::BackwardData,
                          ffi::Ffi::Bind()
                              .Ctx<ffi::PlatformStream<cudaStream_t>>()
                              .Arg<ffi::AnyBuffer>()  // y
                              .Arg<ffi::AnyBuffer>()  // dy
                              .Arg<ffi::AnyBuffer>()  // dhy
                              .Arg<ffi::AnyBuffer>()  // dcy
                              .Arg<ffi::AnyBuffer>()  // hx
                              .Arg<ffi::AnyBuffer>()  // cx
                              .Arg<ffi::AnyBuffer>()  // params
                              .Arg<ffi::AnyBuffer>()  // lengths
                              .Arg<ffi::AnyBuffer>()  // reserve
                              .Attrs<rnnfuse_cudnn_ffi::Attrs>()
                              .Ret<ffi::AnyBuffer>()   // dx
                              .Ret<ffi::AnyBuffer>()   // dhx
                              .Ret<ffi::AnyBuffer>()   // dcx
                              .Ret<ffi::AnyBuffer>()   // reserve (aliased)
                              .Ret<ffi::AnyBuffer>());  // workspace

RNNFUSE_CUDNN_FFI_HANDLER(rnnfuse_cudnn_ffi_backward_weights,
                          rnnfuse_cudnn_ffi::BackwardWeights,
                          ffi::Ffi::Bind()
                              .Ctx<ffi::PlatformStream<cudaStream_t>>()
                              .Arg<ffi::AnyBuffer>()  // x
                              .Arg<ffi::AnyBuffer>()  // hx
                              .Arg<ffi::AnyBuffer>()  // y
                              .Arg<ffi::AnyBuffer>()  // lengths
                              .Arg<ffi::AnyBuffer>()  // reserve
                              .Attrs<rnnfuse_cudnn_ffi::Attrs>()
                              .Ret<ffi::AnyBuffer>()   // dparams
                              .Ret<ffi::AnyBuffer>());  // workspace
