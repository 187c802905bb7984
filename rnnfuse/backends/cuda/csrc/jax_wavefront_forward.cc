// XLA FFI handlers of the wavefront kernel's forward pass (wavefront_host.cc,
// rnnfuse_wf_forward_variant): rnnfuse_wf_ffi_forward (inference) and
// rnnfuse_wf_ffi_forward_saving (training: also the float32 gates and c the
// backward reads).
//
// Operands (time-major; T steps, B batch, H units, L layers, G = 4 for an
// LSTM, 3 for a GRU; float16 or bfloat16 unless said):
//   xproj   [T, B, G*H]  layer 0's input projection x W_ih^T (no bias)
//   params  [N]          rnnfuse's canonical flat buffer (wavefront.cuh)
//   h0      [L, B, H]
//   c0      [L, B, H]    an LSTM's; a GRU's is [0]
//   lengths [B] int32    each in [1, T]; or [0]: every sequence T long
// Attributes: gru (0 LSTM, 1 GRU), input_size (layer 0's inputs), variant
// (the forward step's, wavefront.cuh).
// Results: y [T, B, H] (0 past each length), hy [L, B, H], cy [L, B, H]
// (a GRU's [0]), workspace [W] of the element type (the kernel's flags,
// then the sequences of the layers below the top, [L-1, T, B, H], which
// the saving forward's caller keeps as the backward's hseq); the saving
// forward adds gates [L, T, B, 4H] and cseq [L, T, B, H] (float32).

#include "jax_ffi_common.h"

namespace rnnfuse_ffi {
namespace {

ffi::Error Forward(cudaStream_t stream, ffi::AnyBuffer xproj, ffi::AnyBuffer params,
                   ffi::AnyBuffer h0, ffi::AnyBuffer c0, ffi::AnyBuffer lengths, int32_t gru,
                   int32_t input_size, int32_t variant, ffi::Result<ffi::AnyBuffer> y,
                   ffi::Result<ffi::AnyBuffer> hy, ffi::Result<ffi::AnyBuffer> cy,
                   ffi::Result<ffi::AnyBuffer> workspace, float* gates, float* cseq) {
  const std::string what = "wavefront forward";
  const ffi::DataType t = xproj.element_type();
  const int dtype = DtypeCode(t);
  if (dtype < 0) return Invalid(what, "xproj must be float16 or bfloat16");
  if (auto e = Expect(what, "xproj", xproj, 3, t); e.failure()) return e;
  if (auto e = Expect(what, "h0", h0, 3, t); e.failure()) return e;
  if (params.element_type() != t) return Invalid(what, "params must be of xproj's type");
  const int steps = static_cast<int>(Dim(xproj, 0));
  const int batch = static_cast<int>(Dim(xproj, 1));
  const int layers = static_cast<int>(Dim(h0, 0));
  const int units = static_cast<int>(Dim(h0, 2));
  const int gates_per_unit = gru ? 3 : 4;
  if (Dim(xproj, 2) != int64_t(gates_per_unit) * units || Dim(h0, 1) != batch)
    return Invalid(what, "xproj [T, B, " + std::to_string(Dim(xproj, 2)) + "] and h0 [L, " +
                             std::to_string(Dim(h0, 1)) + ", " + std::to_string(units) +
                             "] disagree (xproj is [T, B, G * H], h0 [L, B, H])");
  if (!gru && c0.element_count() != h0.element_count())
    return Invalid(what, "an LSTM's c0 must be h0's shape");
  if (lengths.element_count() != 0 &&
      (lengths.element_type() != ffi::DataType::S32 || lengths.element_count() != size_t(batch)))
    return Invalid(what, "lengths must be int32 [B] or [0]");
  const size_t need = rnnfuse_wf_workspace_bytes(layers, units, batch, steps,
                                                 static_cast<int>(ffi::ByteWidth(t)));
  if (workspace->size_bytes() < need)
    return Invalid(what, "the workspace holds " + std::to_string(workspace->size_bytes()) +
                             " bytes; the call needs " + std::to_string(need));
  const int rc = rnnfuse_wf_forward_variant(
      stream, dtype, gru, layers, units, batch, steps, input_size, xproj.untyped_data(),
      params.untyped_data(), h0.untyped_data(), gru ? nullptr : Data(c0),
      static_cast<const int*>(Data(lengths)), y->untyped_data(), hy->untyped_data(),
      gru ? nullptr : cy->untyped_data(), workspace->untyped_data(), /*mode=*/0, variant,
      /*trace=*/nullptr, 0, gates, cseq);
  if (rc != 0) return LibraryError(what, rnnfuse_wf_last_error());
  return ffi::Error::Success();
}

ffi::Error Inference(cudaStream_t stream, ffi::AnyBuffer xproj, ffi::AnyBuffer params,
                     ffi::AnyBuffer h0, ffi::AnyBuffer c0, ffi::AnyBuffer lengths, int32_t gru,
                     int32_t input_size, int32_t variant, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::AnyBuffer> hy, ffi::Result<ffi::AnyBuffer> cy,
                     ffi::Result<ffi::AnyBuffer> workspace) {
  return Forward(stream, xproj, params, h0, c0, lengths, gru, input_size, variant, y, hy, cy,
                 workspace, nullptr, nullptr);
}

ffi::Error Saving(cudaStream_t stream, ffi::AnyBuffer xproj, ffi::AnyBuffer params,
                  ffi::AnyBuffer h0, ffi::AnyBuffer c0, ffi::AnyBuffer lengths, int32_t gru,
                  int32_t input_size, int32_t variant, ffi::Result<ffi::AnyBuffer> y,
                  ffi::Result<ffi::AnyBuffer> hy, ffi::Result<ffi::AnyBuffer> cy,
                  ffi::Result<ffi::AnyBuffer> workspace, ffi::Result<ffi::AnyBuffer> gates,
                  ffi::Result<ffi::AnyBuffer> cseq) {
  const int64_t units = Dim(h0, 2), layers = Dim(h0, 0);
  const int64_t saved = layers * Dim(xproj, 0) * Dim(xproj, 1) * units;
  if (gates->element_type() != ffi::DataType::F32 || cseq->element_type() != ffi::DataType::F32 ||
      gates->element_count() != size_t(4 * saved) || cseq->element_count() != size_t(saved))
    return Invalid("wavefront forward", "gates and cseq must be float32 [L, T, B, 4H] and "
                                        "[L, T, B, H]");
  return Forward(stream, xproj, params, h0, c0, lengths, gru, input_size, variant, y, hy, cy,
                 workspace, static_cast<float*>(gates->untyped_data()),
                 static_cast<float*>(cseq->untyped_data()));
}

}  // namespace
}  // namespace rnnfuse_ffi

namespace ffi = xla::ffi;

// The operands, attributes and first four results both forwards take.
#define RNNFUSE_WF_FORWARD_BINDING                \
  ffi::Ffi::Bind()                                \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()   \
      .Arg<ffi::AnyBuffer>() /* xproj */          \
      .Arg<ffi::AnyBuffer>() /* params */         \
      .Arg<ffi::AnyBuffer>() /* h0 */             \
      .Arg<ffi::AnyBuffer>() /* c0 */             \
      .Arg<ffi::AnyBuffer>() /* lengths */        \
      .Attr<int32_t>("gru")                       \
      .Attr<int32_t>("input_size")                \
      .Attr<int32_t>("variant")                   \
      .Ret<ffi::AnyBuffer>() /* y */              \
      .Ret<ffi::AnyBuffer>() /* hy */             \
      .Ret<ffi::AnyBuffer>() /* cy */             \
      .Ret<ffi::AnyBuffer>() /* workspace */

RNNFUSE_FFI_HANDLER(rnnfuse_wf_ffi_forward, rnnfuse_ffi::Inference, RNNFUSE_WF_FORWARD_BINDING);

RNNFUSE_FFI_HANDLER(rnnfuse_wf_ffi_forward_saving, rnnfuse_ffi::Saving,
                    RNNFUSE_WF_FORWARD_BINDING
                        .Ret<ffi::AnyBuffer>()    // gates
                        .Ret<ffi::AnyBuffer>());  // cseq
