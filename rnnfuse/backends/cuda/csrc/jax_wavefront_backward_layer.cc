// XLA FFI handler of the wavefront kernel's per-layer backward
// (wavefront_host.cc, rnnfuse_wf_backward_kind): one LSTM or GRU layer's
// backward recurrence.
//
// Operands (T steps, B batch, H units, G = 4 for an LSTM, 3 for a GRU;
// element type float16 or bfloat16 unless said):
//   w_hh    [G*H, H]
//   gates   [T, B, 4H] float32  the layer's slice of the saving forward's
//   cseq    [T, B, H]  float32  (an LSTM's c; a GRU's h_{t-1})
//   c0      [B, H]     an LSTM's; a GRU's [0]
//   dy      [T, B, H]  the gradient of the layer's output sequence
//   dhy     [B, H]
//   dcy     [B, H]     an LSTM's; a GRU's [0]
//   lengths [B] int32, or [0]
// Attribute: gru (0 LSTM, 1 GRU).
// Results: dgates [T, B, 4H] (element type; a GRU's dr, dz, dn_x, dn_h),
// dh0 [B, H] float32, dc0 [B, H] float32 (a GRU's is written as 0 bytes:
// pass [0]), workspace [W] uint8 (rnnfuse_wf_backward_workspace_bytes).

#include "jax_ffi_common.h"

namespace rnnfuse_ffi {
namespace {

ffi::Error BackwardLayer(cudaStream_t stream, ffi::AnyBuffer w_hh, ffi::AnyBuffer gates,
                         ffi::AnyBuffer cseq, ffi::AnyBuffer c0, ffi::AnyBuffer dy,
                         ffi::AnyBuffer dhy, ffi::AnyBuffer dcy, ffi::AnyBuffer lengths,
                         int32_t gru, ffi::Result<ffi::AnyBuffer> dgates,
                         ffi::Result<ffi::AnyBuffer> dh0, ffi::Result<ffi::AnyBuffer> dc0,
                         ffi::Result<ffi::AnyBuffer> workspace) {
  const std::string what = "wavefront layer backward";
  const ffi::DataType t = dy.element_type();
  const int dtype = DtypeCode(t);
  if (dtype < 0) return Invalid(what, "dy must be float16 or bfloat16");
  if (auto e = Expect(what, "dy", dy, 3, t); e.failure()) return e;
  if (auto e = Expect(what, "gates", gates, 3, ffi::DataType::F32); e.failure()) return e;
  if (auto e = Expect(what, "cseq", cseq, 3, ffi::DataType::F32); e.failure()) return e;
  const int steps = static_cast<int>(Dim(dy, 0));
  const int batch = static_cast<int>(Dim(dy, 1));
  const int units = static_cast<int>(Dim(dy, 2));
  const size_t state = size_t(batch) * units;
  if (w_hh.element_type() != t || dhy.element_type() != t || dhy.element_count() != state)
    return Invalid(what, "w_hh and dhy must be of dy's type, dhy [B, H]");
  if (!gru && (c0.element_count() != state || dcy.element_count() != state ||
               dc0->element_count() != state))
    return Invalid(what, "an LSTM's c0, dcy and dc0 must be [B, H]");
  if (lengths.element_count() != 0 && lengths.element_count() != size_t(batch))
    return Invalid(what, "lengths must be int32 [B] or [0]");
  if (workspace->size_bytes() < rnnfuse_wf_backward_workspace_bytes())
    return Invalid(what, "the workspace is smaller than rnnfuse_wf_backward_workspace_bytes()");
  const int rc = rnnfuse_wf_backward_kind(
      stream, dtype, gru, units, batch, steps, w_hh.untyped_data(),
      static_cast<const float*>(gates.untyped_data()),
      static_cast<const float*>(cseq.untyped_data()), gru ? nullptr : c0.untyped_data(),
      dy.untyped_data(), dhy.untyped_data(), gru ? nullptr : dcy.untyped_data(),
      static_cast<const int*>(Data(lengths)), dgates->untyped_data(),
      static_cast<float*>(dh0->untyped_data()),
      gru ? nullptr : static_cast<float*>(dc0->untyped_data()), workspace->untyped_data());
  if (rc != 0) return LibraryError(what, rnnfuse_wf_last_error());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace rnnfuse_ffi

namespace ffi = xla::ffi;

RNNFUSE_FFI_HANDLER(rnnfuse_wf_ffi_backward_layer, rnnfuse_ffi::BackwardLayer,
                    ffi::Ffi::Bind()
                        .Ctx<ffi::PlatformStream<cudaStream_t>>()
                        .Arg<ffi::AnyBuffer>()  // w_hh
                        .Arg<ffi::AnyBuffer>()  // gates
                        .Arg<ffi::AnyBuffer>()  // cseq
                        .Arg<ffi::AnyBuffer>()  // c0
                        .Arg<ffi::AnyBuffer>()  // dy
                        .Arg<ffi::AnyBuffer>()  // dhy
                        .Arg<ffi::AnyBuffer>()  // dcy
                        .Arg<ffi::AnyBuffer>()  // lengths
                        .Attr<int32_t>("gru")
                        .Ret<ffi::AnyBuffer>()   // dgates
                        .Ret<ffi::AnyBuffer>()   // dh0
                        .Ret<ffi::AnyBuffer>()   // dc0
                        .Ret<ffi::AnyBuffer>());  // workspace
