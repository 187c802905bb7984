// XLA FFI handler of the wavefront kernel's stack backward (wavefront_host.cc,
// rnnfuse_wf_backward_stack): every layer's backward recurrence of an LSTM
// stack in one reverse-wavefront launch.
//
// Operands (T steps, B batch, H units, L layers; element type float16 or
// bfloat16 unless said):
//   params  [N]              the canonical flat buffer (layer 0's W_ih unread)
//   gates   [L, T, B, 4H]    float32, the saving forward's
//   cseq    [L, T, B, H]     float32, the saving forward's
//   c0      [L, B, H]
//   dy      [T, B, H]        the gradient of the top layer's output sequence
//   dhy, dcy [L, B, H]
//   lengths [B] int32, or [0]
// Attributes: input_size, variant (the stack backward's, wavefront.cuh).
// Results: dgates [L, T, B, 4H] (element type, 0 past each length),
// dh0, dc0 [L, B, H] float32, workspace [W] uint8
// (rnnfuse_wf_backward_stack_workspace_bytes).

#include "jax_ffi_common.h"

namespace rnnfuse_ffi {
namespace {

ffi::Error BackwardStack(cudaStream_t stream, ffi::AnyBuffer params, ffi::AnyBuffer gates,
                         ffi::AnyBuffer cseq, ffi::AnyBuffer c0, ffi::AnyBuffer dy,
                         ffi::AnyBuffer dhy, ffi::AnyBuffer dcy, ffi::AnyBuffer lengths,
                         int32_t input_size, int32_t variant, ffi::Result<ffi::AnyBuffer> dgates,
                         ffi::Result<ffi::AnyBuffer> dh0, ffi::Result<ffi::AnyBuffer> dc0,
                         ffi::Result<ffi::AnyBuffer> workspace) {
  const std::string what = "wavefront stack backward";
  const ffi::DataType t = dy.element_type();
  const int dtype = DtypeCode(t);
  if (dtype < 0) return Invalid(what, "dy must be float16 or bfloat16");
  if (auto e = Expect(what, "cseq", cseq, 4, ffi::DataType::F32); e.failure()) return e;
  if (auto e = Expect(what, "gates", gates, 4, ffi::DataType::F32); e.failure()) return e;
  if (auto e = Expect(what, "dy", dy, 3, t); e.failure()) return e;
  const int layers = static_cast<int>(Dim(cseq, 0));
  const int steps = static_cast<int>(Dim(cseq, 1));
  const int batch = static_cast<int>(Dim(cseq, 2));
  const int units = static_cast<int>(Dim(cseq, 3));
  const size_t states = size_t(layers) * batch * units;
  if (c0.element_count() != states || dhy.element_count() != states ||
      dcy.element_count() != states || c0.element_type() != t || dhy.element_type() != t ||
      dcy.element_type() != t || params.element_type() != t)
    return Invalid(what, "params, c0, dhy and dcy must be of dy's type, the states [L, B, H]");
  if (lengths.element_count() != 0 && lengths.element_count() != size_t(batch))
    return Invalid(what, "lengths must be int32 [B] or [0]");
  const size_t need = rnnfuse_wf_backward_stack_workspace_bytes(layers, units, batch, steps);
  if (workspace->size_bytes() < need)
    return Invalid(what, "the workspace holds " + std::to_string(workspace->size_bytes()) +
                             " bytes; the call needs " + std::to_string(need));
  const int rc = rnnfuse_wf_backward_stack(
      stream, dtype, layers, units, batch, steps, input_size, params.untyped_data(),
      static_cast<const float*>(gates.untyped_data()),
      static_cast<const float*>(cseq.untyped_data()), c0.untyped_data(), dy.untyped_data(),
      dhy.untyped_data(), dcy.untyped_data(), static_cast<const int*>(Data(lengths)),
      dgates->untyped_data(), static_cast<float*>(dh0->untyped_data()),
      static_cast<float*>(dc0->untyped_data()), workspace->untyped_data(), variant);
  if (rc != 0) return LibraryError(what, rnnfuse_wf_last_error());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace rnnfuse_ffi

namespace ffi = xla::ffi;

RNNFUSE_FFI_HANDLER(rnnfuse_wf_ffi_backward_stack, rnnfuse_ffi::BackwardStack,
                    ffi::Ffi::Bind()
                        .Ctx<ffi::PlatformStream<cudaStream_t>>()
                        .Arg<ffi::AnyBuffer>()  // params
                        .Arg<ffi::AnyBuffer>()  // gates
                        .Arg<ffi::AnyBuffer>()  // cseq
                        .Arg<ffi::AnyBuffer>()  // c0
                        .Arg<ffi::AnyBuffer>()  // dy
                        .Arg<ffi::AnyBuffer>()  // dhy
                        .Arg<ffi::AnyBuffer>()  // dcy
                        .Arg<ffi::AnyBuffer>()  // lengths
                        .Attr<int32_t>("input_size")
                        .Attr<int32_t>("variant")
                        .Ret<ffi::AnyBuffer>()   // dgates
                        .Ret<ffi::AnyBuffer>()   // dh0
                        .Ret<ffi::AnyBuffer>()   // dc0
                        .Ret<ffi::AnyBuffer>());  // workspace
