// XLA FFI handlers of the wavefront kernel's backward recurrences
// (wavefront_host.cc):
//
// rnnfuse_wf_ffi_backward_stack (rnnfuse_wf_backward_stack): every layer's
// backward recurrence of an LSTM stack in one reverse-wavefront launch.
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
//
// rnnfuse_wf_ffi_backward_layer (rnnfuse_wf_backward_kind): one LSTM or GRU
// layer's backward recurrence (G = 4 for an LSTM, 3 for a GRU).
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
//
// Element types float16 or bfloat16 unless said.

#include "jax_ffi_common.h"

namespace rnnfuse_ffi {
namespace {

// What both backwards check alike: dy's type and rank, the saved gates and
// cseq (float32, `rank` dimensions), the lengths and the workspace size.
// Sets `dtype` to the library's code of dy's element type.
ffi::Error CheckBackward(const std::string& what, const ffi::AnyBuffer& dy,
                         const ffi::AnyBuffer& gates, const ffi::AnyBuffer& cseq,
                         const ffi::AnyBuffer& lengths, int rank, size_t workspace_bytes,
                         size_t workspace_need, int& dtype) {
  const ffi::DataType t = dy.element_type();
  dtype = DtypeCode(t);
  if (dtype < 0) return Invalid(what, "dy must be float16 or bfloat16");
  if (auto e = Expect(what, "dy", dy, 3, t); e.failure()) return e;
  if (auto e = Expect(what, "gates", gates, rank, ffi::DataType::F32); e.failure()) return e;
  if (auto e = Expect(what, "cseq", cseq, rank, ffi::DataType::F32); e.failure()) return e;
  if (lengths.element_count() != 0 && lengths.element_count() != size_t(Dim(dy, 1)))
    return Invalid(what, "lengths must be int32 [B] or [0]");
  if (workspace_bytes < workspace_need)
    return Invalid(what, "the workspace holds " + std::to_string(workspace_bytes) +
                             " bytes; the call needs " + std::to_string(workspace_need));
  return ffi::Error::Success();
}

ffi::Error BackwardStack(cudaStream_t stream, ffi::AnyBuffer params, ffi::AnyBuffer gates,
                         ffi::AnyBuffer cseq, ffi::AnyBuffer c0, ffi::AnyBuffer dy,
                         ffi::AnyBuffer dhy, ffi::AnyBuffer dcy, ffi::AnyBuffer lengths,
                         int32_t input_size, int32_t variant, ffi::Result<ffi::AnyBuffer> dgates,
                         ffi::Result<ffi::AnyBuffer> dh0, ffi::Result<ffi::AnyBuffer> dc0,
                         ffi::Result<ffi::AnyBuffer> workspace) {
  const std::string what = "wavefront stack backward";
  if (cseq.dimensions().size() != 4) return Invalid(what, "cseq must be [L, T, B, H]");
  const int layers = static_cast<int>(Dim(cseq, 0));
  const int steps = static_cast<int>(Dim(cseq, 1));
  const int batch = static_cast<int>(Dim(cseq, 2));
  const int units = static_cast<int>(Dim(cseq, 3));
  int dtype = -1;
  if (auto e = CheckBackward(what, dy, gates, cseq, lengths, 4, workspace->size_bytes(),
                             rnnfuse_wf_backward_stack_workspace_bytes(layers, units, batch,
                                                                       steps),
                             dtype);
      e.failure())
    return e;
  const ffi::DataType t = dy.element_type();
  const size_t states = size_t(layers) * batch * units;
  if (c0.element_count() != states || dhy.element_count() != states ||
      dcy.element_count() != states || c0.element_type() != t || dhy.element_type() != t ||
      dcy.element_type() != t || params.element_type() != t)
    return Invalid(what, "params, c0, dhy and dcy must be of dy's type, the states [L, B, H]");
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

ffi::Error BackwardLayer(cudaStream_t stream, ffi::AnyBuffer w_hh, ffi::AnyBuffer gates,
                         ffi::AnyBuffer cseq, ffi::AnyBuffer c0, ffi::AnyBuffer dy,
                         ffi::AnyBuffer dhy, ffi::AnyBuffer dcy, ffi::AnyBuffer lengths,
                         int32_t gru, ffi::Result<ffi::AnyBuffer> dgates,
                         ffi::Result<ffi::AnyBuffer> dh0, ffi::Result<ffi::AnyBuffer> dc0,
                         ffi::Result<ffi::AnyBuffer> workspace) {
  const std::string what = "wavefront layer backward";
  int dtype = -1;
  if (auto e = CheckBackward(what, dy, gates, cseq, lengths, 3, workspace->size_bytes(),
                             rnnfuse_wf_backward_workspace_bytes(), dtype);
      e.failure())
    return e;
  const int steps = static_cast<int>(Dim(dy, 0));
  const int batch = static_cast<int>(Dim(dy, 1));
  const int units = static_cast<int>(Dim(dy, 2));
  const size_t state = size_t(batch) * units;
  const ffi::DataType t = dy.element_type();
  if (w_hh.element_type() != t || dhy.element_type() != t || dhy.element_count() != state)
    return Invalid(what, "w_hh and dhy must be of dy's type, dhy [B, H]");
  if (!gru && (c0.element_count() != state || dcy.element_count() != state ||
               dc0->element_count() != state))
    return Invalid(what, "an LSTM's c0, dcy and dc0 must be [B, H]");
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

// Both backwards take eight operands (the first is params or w_hh) and give
// dgates, dh0, dc0 and the workspace; only their attributes differ.
#define RNNFUSE_WF_BACKWARD_BINDING(attributes)   \
  ffi::Ffi::Bind()                                \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()   \
      .Arg<ffi::AnyBuffer>() /* params or w_hh */ \
      .Arg<ffi::AnyBuffer>() /* gates */          \
      .Arg<ffi::AnyBuffer>() /* cseq */           \
      .Arg<ffi::AnyBuffer>() /* c0 */             \
      .Arg<ffi::AnyBuffer>() /* dy */             \
      .Arg<ffi::AnyBuffer>() /* dhy */            \
      .Arg<ffi::AnyBuffer>() /* dcy */            \
      .Arg<ffi::AnyBuffer>() /* lengths */        \
      attributes                                  \
      .Ret<ffi::AnyBuffer>() /* dgates */         \
      .Ret<ffi::AnyBuffer>() /* dh0 */            \
      .Ret<ffi::AnyBuffer>() /* dc0 */            \
      .Ret<ffi::AnyBuffer>() /* workspace */

RNNFUSE_FFI_HANDLER(rnnfuse_wf_ffi_backward_stack, rnnfuse_ffi::BackwardStack,
                    RNNFUSE_WF_BACKWARD_BINDING(.Attr<int32_t>("input_size")
                                                    .Attr<int32_t>("variant")));

RNNFUSE_FFI_HANDLER(rnnfuse_wf_ffi_backward_layer, rnnfuse_ffi::BackwardLayer,
                    RNNFUSE_WF_BACKWARD_BINDING(.Attr<int32_t>("gru")));
