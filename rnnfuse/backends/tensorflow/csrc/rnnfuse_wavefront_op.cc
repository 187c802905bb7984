// RnnfuseWavefront: rnnfuse's persistent wavefront kernel as a TensorFlow
// GPU op (inference: no reserve space, no gradient). Training has three
// more ops, below the first (the two per-layer ones LSTM or GRU, rnn_mode;
// the stack backward LSTM only): RnnfuseWavefrontSaving (the same
// forward, also returning what the backward reads), RnnfuseWavefrontBackward
// (the backward recurrence of one layer, v1) and
// RnnfuseWavefrontBackwardStack (every layer's backward recurrence in one
// reverse-wavefront launch, v2); their gradient is assembled in Python
// (rnnfuse/backends/tensorflow/wavefront_training.py).
//
// The kernel and its launcher are rnnfuse/backends/cuda/csrc/ (design,
// layout and limits in wavefront.cuh); this file only adapts tensors:
// it is compiled together with wavefront_host.cc (which embeds the cubin
// and calls the CUDA driver through dlopen, so no second CUDA runtime is
// linked) against TensorFlow's headers.
//
// Inputs (time-major; T = steps, B = batch, H = num_units, G = 4 for
// LSTM, 3 for GRU):
//   xproj            [T, B, G*H]  layer 0's input projection x W_ih^T (no bias)
//   params           rnnfuse's canonical flat buffer (see
//                    rnnfuse/backends/tensorflow/__init__.py)
//   input_h          [L, B, H]
//   input_c          [L, B, H] (LSTM; anything for a GRU)
//   sequence_lengths [B] int32 in host memory, each in [1, T]; or [0]: all T
// Outputs: output [T, B, H] (0 past each length), output_h, output_c
// ([L, B, H]; output_c is [0] for a GRU). RnnfuseWavefrontSaving takes the
// same inputs and adds hseq, gates and cseq (see its class);
// RnnfuseWavefrontBackward is one layer's backward recurrence,
// RnnfuseWavefrontBackwardStack the whole stack's (see their classes).
// A shape outside the kernel's limits is an Unimplemented op error naming
// the limit (Python checks the same plan first and runs cuDNN instead).

#define EIGEN_USE_GPU
#include <cuda_runtime_api.h>

#include <string>

#include "rnnfuse_tf_op.h"
#include "wavefront.cuh"  // kMaxLayers, kFlagStride: where the timed-out word is

#include "wavefront_abi.h"  // the wavefront library's C ABI

namespace rnnfuse {

template <typename T> struct WavefrontDtype;
template <> struct WavefrontDtype<Eigen::half> { static constexpr int value = 0; };
template <> struct WavefrontDtype<Eigen::bfloat16> { static constexpr int value = 1; };

// `lengths` ([B] int32 in host memory, or [0]) copied to the device on
// `stream`: *out is the device copy (held by `dev`), or null for [0].
Status DeviceLengths(OpKernelContext* ctx, cudaStream_t stream, const Tensor& lengths, int batch,
                     Tensor* dev, const int** out) {
  *out = nullptr;
  if (lengths.NumElements() != batch || batch == 0) return absl::OkStatus();
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tensorflow::DT_INT32, TensorShape({batch}), dev));
  const cudaError_t err = cudaMemcpyAsync(Mut(dev), lengths.tensor_data().data(),
                                          batch * sizeof(int), cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess)
    return errors::Internal("rnnfuse wavefront: copying sequence_lengths failed (CUDA error ",
                            static_cast<int>(err), ")");
  *out = reinterpret_cast<const int*>(dev->tensor_data().data());
  return absl::OkStatus();
}

// sequence_lengths must be [B] or [0] (every sequence T long).
Status CheckLengths(const Tensor& lengths, int64_t batch) {
  if (lengths.NumElements() != 0 && lengths.NumElements() != batch)
    return errors::InvalidArgument("sequence_lengths must be [B] or [0], got ",
                                   lengths.shape().DebugString());
  return absl::OkStatus();
}

// The inputs both backward ops share: 0 the weights (w_hh, or the stack's
// params), 1 gates, 2 cseq, 3 c0, 4 dy, 5 dhy, 6 dcy, 7 sequence_lengths.
struct BackwardInputs {
  const Tensor &weights, &gates, &cseq, &c0, &dy, &dhy, &dcy, &lengths;
  explicit BackwardInputs(OpKernelContext* ctx)
      : weights(ctx->input(0)), gates(ctx->input(1)), cseq(ctx->input(2)), c0(ctx->input(3)),
        dy(ctx->input(4)), dhy(ctx->input(5)), dcy(ctx->input(6)), lengths(ctx->input(7)) {}
};

// What both backward ops do before their launch: allocate dgates (the
// gates' shape), dh0 and dc0 (`dc0_shape`), copy the lengths to the device
// on the op's stream, and allocate `workspace_bytes` of workspace.
struct BackwardCall {
  Tensor *dgates = nullptr, *dh0 = nullptr, *dc0 = nullptr;
  cudaStream_t stream = nullptr;
  Tensor dev_lengths, workspace;
  const int* lengths = nullptr;

  Status Begin(OpKernelContext* ctx, const BackwardInputs& in, const TensorShape& state,
               const TensorShape& dc0_shape, int64_t batch, size_t workspace_bytes) {
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, in.gates.shape(), &dgates));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, state, &dh0));
    TF_RETURN_IF_ERROR(ctx->allocate_output(2, dc0_shape, &dc0));
    stream = ctx->eigen_device<Eigen::GpuDevice>().stream();
    TF_RETURN_IF_ERROR(
        DeviceLengths(ctx, stream, in.lengths, static_cast<int>(batch), &dev_lengths, &lengths));
    return AllocateBytes(ctx, workspace_bytes, &workspace);
  }
  float* dh0_ptr() const { return reinterpret_cast<float*>(Mut(dh0)); }
  float* dc0_ptr() const { return reinterpret_cast<float*>(Mut(dc0)); }
};

// The forward (inference), or with kSave the saving forward
// (RnnfuseWavefrontSaving): outputs 3-5 are then hseq [L-1, T, B, H]
// (the sequences of the layers below the top, in T: a view of the
// workspace, where the kernel writes them), gates [L, T, B, 4H] (an LSTM's
// activated i, f, g, o; a GRU's r, z, n, W_hn h + b_hn) and cseq
// [L, T, B, H] (an LSTM's c; a GRU's h_{t-1}), both float32.
template <typename T, bool kSave>
class RnnfuseWavefrontOp : public StatusKernel {
 public:
  explicit RnnfuseWavefrontOp(OpKernelConstruction* ctx) : StatusKernel(ctx) {
    std::string mode;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rnn_mode", &mode));
    gru_ = mode == "gru";
    OP_REQUIRES_OK(ctx, ctx->GetAttr("input_size", &input_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("kernel_variant", &variant_));
  }

 private:
  Status DoCompute(OpKernelContext* ctx) override {
    const Tensor& xproj = ctx->input(0);
    const Tensor& params = ctx->input(1);
    const Tensor& h0 = ctx->input(2);
    const Tensor& c0 = ctx->input(3);
    const Tensor& lengths = ctx->input(4);
    if (xproj.dims() != 3) return errors::InvalidArgument("xproj must be [T, B, G*H]");
    if (h0.dims() != 3) return errors::InvalidArgument("input_h must be [L, B, H]");
    const int steps = static_cast<int>(xproj.dim_size(0));
    const int batch = static_cast<int>(xproj.dim_size(1));
    const int layers = static_cast<int>(h0.dim_size(0));
    const int units = static_cast<int>(h0.dim_size(2));
    const int gates = gru_ ? 3 : 4;
    if (xproj.dim_size(2) != int64_t(gates) * units || h0.dim_size(1) != batch)
      return errors::InvalidArgument("xproj ", xproj.shape().DebugString(), " and input_h ",
                                     h0.shape().DebugString(), " disagree (xproj is [T, B, ",
                                     gates, " * H], input_h [L, B, H])");
    if (!gru_ && c0.shape() != h0.shape())
      return errors::InvalidArgument("input_c must be ", h0.shape().DebugString());
    TF_RETURN_IF_ERROR(CheckLengths(lengths, batch));
    if (kSave && layers < 1)
      return errors::InvalidArgument("input_h must have at least one layer");

    Tensor *y = nullptr, *hy = nullptr, *cy = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({steps, batch, units}), &y));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, h0.shape(), &hy));
    TF_RETURN_IF_ERROR(
        ctx->allocate_output(2, gru_ ? TensorShape({0}) : h0.shape(), &cy));
    Tensor *gates_out = nullptr, *c_out = nullptr;
    if (kSave) {
      TF_RETURN_IF_ERROR(
          ctx->allocate_output(4, TensorShape({layers, steps, batch, 4 * units}), &gates_out));
      TF_RETURN_IF_ERROR(
          ctx->allocate_output(5, TensorShape({layers, steps, batch, units}), &c_out));
    }
    if (!kSave && (steps == 0 || batch == 0)) return absl::OkStatus();
    const size_t ws_bytes = rnnfuse_wf_workspace_bytes(layers, units, batch, steps, sizeof(T));
    Tensor workspace;
    TF_RETURN_IF_ERROR(AllocateBytes(ctx, ws_bytes, &workspace));
    if (kSave) {
      // hseq is the workspace past its flags (rnnfuse_wf_workspace_bytes:
      // the flags, 256-byte aligned, then the L-1 sequences), shared.
      const int64_t seq_bytes =
          int64_t(layers - 1) * steps * batch * units * static_cast<int64_t>(sizeof(T));
      Tensor hseq;
      TF_RETURN_IF_ERROR(hseq.BitcastFrom(
          workspace.Slice(static_cast<int64_t>(ws_bytes) - seq_bytes, ws_bytes),
          tensorflow::DataTypeToEnum<T>::v(), TensorShape({layers - 1, steps, batch, units})));
      ctx->set_output(3, hseq);
    }
    if (steps == 0 || batch == 0) return absl::OkStatus();

    cudaStream_t stream = ctx->eigen_device<Eigen::GpuDevice>().stream();
    Tensor dev_lengths;
    const int* lengths_ptr = nullptr;
    TF_RETURN_IF_ERROR(DeviceLengths(ctx, stream, lengths, batch, &dev_lengths, &lengths_ptr));
    const int rc = rnnfuse_wf_forward_variant(
        stream, WavefrontDtype<T>::value, gru_ ? 1 : 0, layers, units, batch, steps, input_size_,
        Ptr(xproj), Ptr(params), Ptr(h0), gru_ ? nullptr : Ptr(c0), lengths_ptr, Mut(y), Mut(hy),
        gru_ ? nullptr : Mut(cy), Mut(&workspace), 0, variant_, nullptr, 0,
        kSave ? reinterpret_cast<float*>(Mut(gates_out)) : nullptr,
        kSave ? reinterpret_cast<float*>(Mut(c_out)) : nullptr);
    if (rc != 0) return errors::Unimplemented("rnnfuse wavefront: ", rnnfuse_wf_last_error());
    return absl::OkStatus();
  }

  bool gru_ = false;
  int input_size_ = 0;
  int variant_ = 0;  // the forward step's variant (wavefront.cuh)
};

// The backward recurrence of one LSTM or GRU layer (rnn_mode;
// rnnfuse_wf_backward_kind): dgates [T, B, 4H] (T: the gradient of the
// gates' pre-activations, a GRU's (dr, dz, dn_x, dn_h), 0 at t >= length),
// dh0 and dc0 [B, H] (float32; a GRU's dc0 is [0]) from the layer's w_hh
// [G*H, H] (G = 4, a GRU's 3), its saved gates [T, B, 4H] and cseq
// [T, B, H] (float32), c0 [B, H], and the gradients of its output
// sequence dy [T, B, H] and of its final states dhy, dcy [B, H] (a GRU's
// c0 and dcy are not read: anything, [0] say). A shape outside the
// backward's plan is an Unimplemented error naming the limit.
template <typename T>
class RnnfuseWavefrontBackwardOp : public StatusKernel {
 public:
  explicit RnnfuseWavefrontBackwardOp(OpKernelConstruction* ctx) : StatusKernel(ctx) {
    std::string mode;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rnn_mode", &mode));
    gru_ = mode == "gru";
  }

 private:
  Status DoCompute(OpKernelContext* ctx) override {
    const BackwardInputs in(ctx);
    const Tensor &w_hh = in.weights, &gates = in.gates, &cseq = in.cseq, &c0 = in.c0;
    const Tensor &dy = in.dy, &dhy = in.dhy, &dcy = in.dcy;
    if (dy.dims() != 3) return errors::InvalidArgument("dy must be [T, B, H], got ",
                                                       dy.shape().DebugString());
    const int64_t steps = dy.dim_size(0), batch = dy.dim_size(1), units = dy.dim_size(2);
    const TensorShape state({batch, units});
    if (steps == 0 || batch == 0 || units == 0)
      return errors::InvalidArgument("rnnfuse wavefront backward: dy ", dy.shape().DebugString(),
                                     " is empty (T, B and H must be at least 1)");
    const int64_t gh = (gru_ ? 3 : 4) * units;
    if (w_hh.shape() != TensorShape({gh, units}))
      return errors::InvalidArgument("w_hh must be [G*H, H] = [", gh, ", ", units,
                                     "], got ", w_hh.shape().DebugString());
    if (gates.shape() != TensorShape({steps, batch, 4 * units}))
      return errors::InvalidArgument("gates must be [T, B, 4H] = [", steps, ", ", batch, ", ",
                                     4 * units, "], got ", gates.shape().DebugString());
    if (cseq.shape() != dy.shape())
      return errors::InvalidArgument("cseq must be dy's shape ", dy.shape().DebugString(),
                                     ", got ", cseq.shape().DebugString());
    for (const Tensor* t : {&c0, &dhy, &dcy})
      if (t->shape() != state && (t == &dhy || !gru_))
        return errors::InvalidArgument("c0, dhy and dcy must be [B, H] = ",
                                       state.DebugString(), ", got ", t->shape().DebugString());
    TF_RETURN_IF_ERROR(CheckLengths(in.lengths, batch));

    BackwardCall call;
    TF_RETURN_IF_ERROR(call.Begin(ctx, in, state, gru_ ? TensorShape({0}) : state, batch,
                                  rnnfuse_wf_backward_workspace_bytes()));
    const int rc = rnnfuse_wf_backward_kind(
        call.stream, WavefrontDtype<T>::value, gru_ ? 1 : 0, static_cast<int>(units),
        static_cast<int>(batch), static_cast<int>(steps), Ptr(w_hh),
        static_cast<const float*>(Ptr(gates)), static_cast<const float*>(Ptr(cseq)),
        gru_ ? nullptr : Ptr(c0), Ptr(dy), Ptr(dhy), gru_ ? nullptr : Ptr(dcy), call.lengths,
        Mut(call.dgates), call.dh0_ptr(), gru_ ? nullptr : call.dc0_ptr(), Mut(&call.workspace));
    if (rc != 0)
      return errors::Unimplemented("rnnfuse wavefront backward: ", rnnfuse_wf_last_error());
    return absl::OkStatus();
  }

  bool gru_ = false;
};

// Every layer's backward recurrence of an LSTM stack in ONE reverse-
// wavefront launch (rnnfuse_wf_backward_stack; wavefront.cuh, "The stack
// backward"): dgates [L, T, B, 4H] (T: the gradient of the gates'
// pre-activations, 0 at t >= length), dh0 and dc0 [L, B, H] (float32) from
// the canonical flat params (T; layer 0's W_ih, of `input_size` inputs, is
// not read), the saving forward's gates [L, T, B, 4H] and cseq
// [L, T, B, H] (float32), c0 [L, B, H], the gradient of the TOP layer's
// output sequence dy [T, B, H] and of the final states dhy, dcy
// [L, B, H]. The layers below the top get their dy inside the kernel.
// A shape outside the stack backward's plan is an Unimplemented error
// naming the limit. With `check`, the op waits for the kernel and fails
// (Internal) if one of its waits timed out (a bug: the results are wrong),
// as the torch binding's backward_stack_kernel(check=True) raises.
template <typename T>
class RnnfuseWavefrontBackwardStackOp : public StatusKernel {
 public:
  explicit RnnfuseWavefrontBackwardStackOp(OpKernelConstruction* ctx) : StatusKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("input_size", &input_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("check", &check_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("kernel_variant", &variant_));
  }

 private:
  Status DoCompute(OpKernelContext* ctx) override {
    const BackwardInputs in(ctx);
    const Tensor &params = in.weights, &gates = in.gates, &cseq = in.cseq, &c0 = in.c0;
    const Tensor &dy = in.dy, &dhy = in.dhy, &dcy = in.dcy;
    if (cseq.dims() != 4)
      return errors::InvalidArgument("cseq must be [L, T, B, H], got ",
                                     cseq.shape().DebugString());
    const int64_t layers = cseq.dim_size(0), steps = cseq.dim_size(1);
    const int64_t batch = cseq.dim_size(2), units = cseq.dim_size(3);
    if (layers == 0 || steps == 0 || batch == 0 || units == 0)
      return errors::InvalidArgument("rnnfuse wavefront stack backward: cseq ",
                                     cseq.shape().DebugString(),
                                     " is empty (L, T, B and H must be at least 1)");
    if (gates.shape() != TensorShape({layers, steps, batch, 4 * units}))
      return errors::InvalidArgument("gates must be [L, T, B, 4H] = [", layers, ", ", steps,
                                     ", ", batch, ", ", 4 * units, "], got ",
                                     gates.shape().DebugString());
    if (dy.shape() != TensorShape({steps, batch, units}))
      return errors::InvalidArgument("dy (the top layer's) must be [T, B, H] = [", steps, ", ",
                                     batch, ", ", units, "], got ", dy.shape().DebugString());
    const TensorShape state({layers, batch, units});
    for (const Tensor* t : {&c0, &dhy, &dcy})
      if (t->shape() != state)
        return errors::InvalidArgument("c0, dhy and dcy must be [L, B, H] = ",
                                       state.DebugString(), ", got ", t->shape().DebugString());
    // The canonical buffer: per layer W_ih [4H, n] and W_hh [4H, H], then
    // per layer b_ih and b_hh [4H] (n: input_size for layer 0, else H).
    const int64_t want = 4 * units * (input_size_ + units) +
                         (layers - 1) * 4 * units * 2 * units + layers * 8 * units;
    if (params.dims() != 1 || params.NumElements() != want)
      return errors::InvalidArgument("params must be the canonical flat buffer of ", layers,
                                     " layers of ", units, " units over ", input_size_,
                                     " inputs: [", want, "], got ",
                                     params.shape().DebugString());
    TF_RETURN_IF_ERROR(CheckLengths(in.lengths, batch));

    BackwardCall call;
    TF_RETURN_IF_ERROR(call.Begin(
        ctx, in, state, state, batch,
        rnnfuse_wf_backward_stack_workspace_bytes(static_cast<int>(layers), static_cast<int>(units),
                                                  static_cast<int>(batch),
                                                  static_cast<int>(steps))));
    const int rc = rnnfuse_wf_backward_stack(
        call.stream, WavefrontDtype<T>::value, static_cast<int>(layers), static_cast<int>(units),
        static_cast<int>(batch), static_cast<int>(steps), input_size_, Ptr(params),
        static_cast<const float*>(Ptr(gates)), static_cast<const float*>(Ptr(cseq)), Ptr(c0),
        Ptr(dy), Ptr(dhy), Ptr(dcy), call.lengths, Mut(call.dgates), call.dh0_ptr(),
        call.dc0_ptr(), Mut(&call.workspace), variant_);
    if (rc != 0)
      return errors::Unimplemented("rnnfuse wavefront stack backward: ",
                                   rnnfuse_wf_last_error());
    if (check_) return CheckTimeout(call.stream, call.workspace);
    return absl::OkStatus();
  }

  // Waits for the launch and reads the workspace word a timed-out wait sets
  // (after kMaxLayers x kFlagStride flags; library.STACK_TIMEOUT_WORD).
  static Status CheckTimeout(cudaStream_t stream, const Tensor& workspace) {
    const int64_t word = int64_t(rnnfuse_wf::kMaxLayers) * rnnfuse_wf::kFlagStride;
    unsigned timed_out = 0;
    cudaError_t err = cudaMemcpyAsync(&timed_out, workspace.tensor_data().data() + 4 * word,
                                      sizeof(timed_out), cudaMemcpyDeviceToHost, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess)
      return errors::Internal("rnnfuse wavefront stack backward: reading its timeout word "
                              "failed (CUDA error ", static_cast<int>(err), ")");
    if (timed_out != 0)
      return errors::Internal("the reverse-wavefront backward's wait timed out (a bug): the "
                              "results are wrong");
    return absl::OkStatus();
  }

  int input_size_ = 0;
  bool check_ = false;
  int variant_ = 0;  // the stack kernel's variant (wavefront.cuh, "Variants")
};

// The forward ops' inputs, first outputs and attributes.
#define RF_WAVEFRONT_FORWARD_SIGNATURE                  \
  .Input("xproj: T")                                    \
      .Input("params: T")                               \
      .Input("input_h: T")                              \
      .Input("input_c: T")                              \
      .Input("sequence_lengths: int32")                 \
      .Output("output: T")                              \
      .Output("output_h: T")                            \
      .Output("output_c: T")                            \
      .Attr("T: {half, bfloat16}")                      \
      .Attr("rnn_mode: {'lstm', 'gru'} = 'lstm'")       \
      .Attr("input_size: int >= 1")                     \
      .Attr("kernel_variant: int >= 0 = 0")

// The backward ops' inputs after the weights (input 0), and outputs.
#define RF_WAVEFRONT_BACKWARD_SIGNATURE \
  .Input("gates: float")                \
      .Input("cseq: float")             \
      .Input("c0: T")                   \
      .Input("dy: T")                   \
      .Input("dhy: T")                  \
      .Input("dcy: T")                  \
      .Input("sequence_lengths: int32") \
      .Output("dgates: T")              \
      .Output("dh0: float")             \
      .Output("dc0: float")             \
      .Attr("T: {half, bfloat16}")

REGISTER_OP("RnnfuseWavefront")
    RF_WAVEFRONT_FORWARD_SIGNATURE
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle x, h;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 3, &h));
      std::string mode;
      TF_RETURN_IF_ERROR(c->GetAttr("rnn_mode", &mode));
      c->set_output(0, c->MakeShape({c->Dim(x, 0), c->Dim(x, 1), c->Dim(h, 2)}));
      c->set_output(1, c->input(2));
      c->set_output(2, mode == "gru" ? c->Vector(0) : c->input(2));
      return absl::OkStatus();
    });

REGISTER_OP("RnnfuseWavefrontSaving")
    RF_WAVEFRONT_FORWARD_SIGNATURE
    .Output("hseq: T")
    .Output("gates: float")
    .Output("cseq: float")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      std::string mode;
      TF_RETURN_IF_ERROR(c->GetAttr("rnn_mode", &mode));
      shape_inference::ShapeHandle x, h;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 3, &h));
      shape_inference::DimensionHandle steps = c->Dim(x, 0), batch = c->Dim(x, 1);
      shape_inference::DimensionHandle layers = c->Dim(h, 0), units = c->Dim(h, 2);
      shape_inference::DimensionHandle below, gates;
      TF_RETURN_IF_ERROR(c->Subtract(layers, 1, &below));
      TF_RETURN_IF_ERROR(c->Multiply(units, 4, &gates));
      c->set_output(0, c->MakeShape({steps, batch, units}));
      c->set_output(1, c->input(2));
      c->set_output(2, mode == "gru" ? c->Vector(0) : c->input(2));
      c->set_output(3, c->MakeShape({below, steps, batch, units}));
      c->set_output(4, c->MakeShape({layers, steps, batch, gates}));
      c->set_output(5, c->MakeShape({layers, steps, batch, units}));
      return absl::OkStatus();
    });

REGISTER_OP("RnnfuseWavefrontBackward")
    .Input("w_hh: T")
    RF_WAVEFRONT_BACKWARD_SIGNATURE
    .Attr("rnn_mode: {'lstm', 'gru'} = 'lstm'")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle g, s;
      std::string mode;
      TF_RETURN_IF_ERROR(c->GetAttr("rnn_mode", &mode));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 3, &g));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(5), 2, &s));  // dhy: a GRU's c0 may be [0]
      c->set_output(0, g);
      c->set_output(1, s);
      c->set_output(2, mode == "gru" ? c->Vector(0) : s);
      return absl::OkStatus();
    });

REGISTER_OP("RnnfuseWavefrontBackwardStack")
    .Input("params: T")
    RF_WAVEFRONT_BACKWARD_SIGNATURE
    .Attr("input_size: int >= 1")
    .Attr("check: bool = false")
    .Attr("kernel_variant: int >= 0 = 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle g, s;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 4, &g));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 3, &s));
      c->set_output(0, g);
      c->set_output(1, s);
      c->set_output(2, s);
      return absl::OkStatus();
    });

// One GPU kernel of op NAME for element type T (sequence_lengths in host memory).
#define RF_REGISTER_WAVEFRONT_KERNEL(NAME, T, ...)                                          \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name(NAME).Device(DEVICE_GPU).TypeConstraint<T>("T").HostMemory("sequence_lengths"), \
      __VA_ARGS__);
#define RF_REGISTER_WAVEFRONT(T)                                                       \
  RF_REGISTER_WAVEFRONT_KERNEL("RnnfuseWavefront", T, RnnfuseWavefrontOp<T, false>)     \
  RF_REGISTER_WAVEFRONT_KERNEL("RnnfuseWavefrontSaving", T, RnnfuseWavefrontOp<T, true>) \
  RF_REGISTER_WAVEFRONT_KERNEL("RnnfuseWavefrontBackward", T, RnnfuseWavefrontBackwardOp<T>) \
  RF_REGISTER_WAVEFRONT_KERNEL("RnnfuseWavefrontBackwardStack", T,                     \
                               RnnfuseWavefrontBackwardStackOp<T>)

RF_REGISTER_WAVEFRONT(Eigen::half);
RF_REGISTER_WAVEFRONT(Eigen::bfloat16);

}  // namespace rnnfuse
