// rnnfuse's own TensorFlow GPU ops over rnnfuse's cuDNN RNN core.
//
// RnnfuseCudnnRnn         forward (training mode: returns a reserve space)
// RnnfuseCudnnRnnBackprop gradient (the core's backward data, then its
//                         backward weights, on the forward's reserve space)
//
// The cuDNN logic (descriptors, plans per shape and algorithm, the weight
// space layout, dropout states) lives once, in the core
// (rnnfuse/backends/cuda/csrc/cudnn_rnn_core.h, compiled into this library
// by op_build.py); these kernels only turn TensorFlow's tensors, stream and
// allocations into the core's C ABI arguments, and its error codes into
// TensorFlow errors carrying its message.
//
// Both ops take the same attributes and the same `algorithm` input (the
// gradient passes the forward's tensor on), so the algorithm chosen in
// Python runs in the forward AND the backward pass. It is an int32 host
// input, not an attribute, so one traced graph runs every algorithm:
// rnnfuse's tuner traces one step per split of a run and times each
// algorithm on it.
//   algorithm = 4 * algo + math, algo: 0 standard, 1 persistent_static,
//   2 persistent_dynamic, 3 persistent_static_small_h; math: 0 default,
//   1 tensor_op, 2 tensor_op_allow_conversion, 3 fma.
//
// Data are time-major and right-padded with per-sequence lengths (padded
// outputs are 0); parameters are rnnfuse's canonical flat buffer (the
// CudnnRNNV3 layout with the LSTMP projection appended per pseudo-layer;
// see the core's header). Workspace and reserve space come from
// TensorFlow's allocator, sized by the core; the core's cuDNN dropout
// (attribute `dropout` > 0) keeps its random states per (device, dropout,
// seed), seeded once with `seed` and advanced by every training forward.
//
// Errors: a bad argument is InvalidArgument, what cuDNN does not run
// (CUDNN_STATUS_NOT_SUPPORTED: a persistent algorithm with this shape, ...)
// is Unimplemented (the tuner leaves such a candidate out), no usable cuDNN
// or driver is FailedPrecondition, any other failure Internal.

#define EIGEN_USE_GPU
#include <cuda_runtime_api.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "cudnn_rnn_core.h"
#include "rnnfuse_tf_op.h"

namespace rnnfuse {

// A core return code as a TensorFlow error with the core's message.
Status CoreError(int rc, const char* entry) {
  const std::string msg = std::string("rnnfuse cuDNN core, ") + entry + ": " +
                          rnnfuse_cudnn_last_error();
  switch (rc) {
    case RF_CUDNN_E_ARGUMENT: return errors::InvalidArgument(msg);
    case RF_CUDNN_E_NOT_SUPPORTED: return errors::Unimplemented(msg);
    case RF_CUDNN_E_UNAVAILABLE: return errors::FailedPrecondition(msg);
    default: return errors::Internal(msg);
  }
}

#define RF_RETURN_IF_CORE(entry, ...)                                      \
  do {                                                                     \
    const int rf_rc_ = entry(__VA_ARGS__);                                 \
    if (rf_rc_ != RF_CUDNN_OK) return CoreError(rf_rc_, #entry);          \
  } while (0)

#define RF_RETURN_IF_CUDA(expr)                                                \
  do {                                                                         \
    cudaError_t rf_err_ = (expr);                                              \
    if (rf_err_ != cudaSuccess)                                                \
      return errors::Internal("rnnfuse: ", #expr, " failed: CUDA error ",      \
                              static_cast<int>(rf_err_));                      \
  } while (0)

template <typename T> struct CoreDtype;
template <> struct CoreDtype<float> { static constexpr int value = RF_CUDNN_FLOAT32; };
template <> struct CoreDtype<Eigen::half> { static constexpr int value = RF_CUDNN_FLOAT16; };
template <> struct CoreDtype<Eigen::bfloat16> { static constexpr int value = RF_CUDNN_BFLOAT16; };


// The attributes both ops share, as the core's configuration.
template <typename T>
class CoreConfig {
 public:
  explicit CoreConfig(OpKernelConstruction* ctx) {
    std::string mode, direction;
    int num_layers = 0, num_units = 0, proj_size = 0, input_size = 0;
    int64_t seed = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rnn_mode", &mode));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("direction", &direction));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_layers", &num_layers));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_units", &num_units));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("proj_size", &proj_size));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("input_size", &input_size));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dropout", &rnn_.dropout));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed));
    if (mode == "lstm") rnn_.mode = RF_CUDNN_LSTM;
    else if (mode == "gru") rnn_.mode = RF_CUDNN_GRU;
    else if (mode == "rnn_tanh") rnn_.mode = RF_CUDNN_RNN_TANH;
    else if (mode == "rnn_relu") rnn_.mode = RF_CUDNN_RNN_RELU;
    else { ctx->CtxFailure(errors::InvalidArgument("rnn_mode ", mode)); return; }
    rnn_.num_layers = num_layers;
    rnn_.num_units = num_units;
    rnn_.proj_size = proj_size;
    rnn_.input_size = input_size;
    rnn_.directions = direction == "bidirectional" ? 2 : 1;
    rnn_.dtype = CoreDtype<T>::value;
    // The math type comes with the `algorithm` input (Python's
    // math_type_for picks FMA where TensorFlow's TF32 is off): keep it.
    rnn_.allow_tf32 = 1;
    rnn_.seed = static_cast<uint64_t>(seed);
    flat_size_ = rnnfuse_cudnn_param_count(&rnn_);  // -1: the core refuses the attributes
    OP_REQUIRES(ctx, flat_size_ >= 0, errors::InvalidArgument(rnnfuse_cudnn_last_error()));
  }

  // This call's configuration: the attributes with the algorithm in input
  // `index`.
  Status ForCall(OpKernelContext* ctx, int index, rnnfuse_cudnn_rnn* out) const {
    const Tensor& t = ctx->input(index);
    if (t.dims() != 0)
      return errors::InvalidArgument("algorithm must be an int32 scalar; got shape ",
                                     t.shape().DebugString());
    *out = rnn_;
    out->algorithm = t.scalar<int32_t>()();
    return absl::OkStatus();
  }

  int out_units() const { return rnn_.proj_size ? rnn_.proj_size : rnn_.num_units; }
  int pseudo_layers() const { return rnn_.num_layers * rnn_.directions; }
  int64_t out_width() const { return int64_t(rnn_.directions) * out_units(); }
  bool lstm() const { return rnn_.mode == RF_CUDNN_LSTM; }

  // Checks the inputs both ops share (0 x, 1 h, 2 c, 3 params,
  // 4 sequence_lengths) against the attributes; the core checks the
  // lengths' values.
  Status CheckInputs(OpKernelContext* ctx) const {
    const Tensor& x = ctx->input(0);
    const Tensor& h = ctx->input(1);
    const Tensor& c = ctx->input(2);
    const Tensor& params = ctx->input(3);
    const Tensor& seq = ctx->input(4);
    if (x.dims() != 3 || x.dim_size(2) != rnn_.input_size)
      return errors::InvalidArgument("input must be [time, batch, ", rnn_.input_size, "]; got ",
                                     x.shape().DebugString());
    const int64_t steps = x.dim_size(0), batch = x.dim_size(1);
    if (steps < 1 || batch < 1)
      return errors::InvalidArgument("input needs time >= 1 and batch >= 1; got ",
                                     x.shape().DebugString());
    TensorShape hshape({pseudo_layers(), batch, out_units()});
    if (h.shape() != hshape)
      return errors::InvalidArgument("input_h must be ", hshape.DebugString(), "; got ",
                                     h.shape().DebugString());
    TensorShape cshape({pseudo_layers(), batch, rnn_.num_units});
    if (lstm() && c.shape() != cshape)
      return errors::InvalidArgument("input_c must be ", cshape.DebugString(), "; got ",
                                     c.shape().DebugString());
    if (params.dims() != 1 || params.NumElements() != flat_size_)
      return errors::InvalidArgument("params must be a flat vector of ", flat_size_,
                                     " elements; got ", params.shape().DebugString());
    if (seq.dims() != 1 || seq.dim_size(0) != batch)
      return errors::InvalidArgument("sequence_lengths must be [", batch, "]; got ",
                                     seq.shape().DebugString());
    return absl::OkStatus();
  }

 private:
  rnnfuse_cudnn_rnn rnn_{};
  int64_t flat_size_ = 0;
};

// Allocates outputs 0, 1, ... in order, one a (shape, tensor) pair.
Status AllocateOutputs(OpKernelContext* ctx,
                       std::initializer_list<std::pair<TensorShape, Tensor**>> outputs) {
  int index = 0;
  for (const auto& [shape, tensor] : outputs)
    TF_RETURN_IF_ERROR(ctx->allocate_output(index++, shape, tensor));
  return absl::OkStatus();
}

// What both kernels prepare the same way: the shape, the lengths (host
// and a device copy), the stream and the core's workspace.
struct CallArgs {
  rnnfuse_cudnn_rnn rnn{};
  int steps = 0, batch = 0;
  const int32_t* host_lengths = nullptr;
  cudaStream_t stream = nullptr;
  Tensor dev_lengths, workspace;
  size_t workspace_bytes = 0, reserve_bytes = 0;

  void* dev() const { return Mut(dev_lengths); }

  template <typename T>
  Status Begin(OpKernelContext* ctx, const CoreConfig<T>& config, int algorithm_input) {
    TF_RETURN_IF_ERROR(config.CheckInputs(ctx));
    TF_RETURN_IF_ERROR(config.ForCall(ctx, algorithm_input, &rnn));
    stream = ctx->eigen_device<Eigen::GpuDevice>().stream();
    steps = ctx->input(0).dim_size(0);
    batch = ctx->input(0).dim_size(1);
    host_lengths = ctx->input(4).flat<int32_t>().data();  // a HostMemory input
    RF_RETURN_IF_CORE(rnnfuse_cudnn_sizes, &rnn, steps, batch, host_lengths, stream,
                      &workspace_bytes, &reserve_bytes);
    TF_RETURN_IF_ERROR(AllocateBytes(ctx, workspace_bytes, &workspace));
    TF_RETURN_IF_ERROR(ctx->allocate_temp(tensorflow::DT_INT32, TensorShape({batch}),
                                          &dev_lengths));
    RF_RETURN_IF_CUDA(cudaMemcpyAsync(dev(), host_lengths, sizeof(int32_t) * batch,
                                      cudaMemcpyHostToDevice, stream));
    return absl::OkStatus();
  }

  const int32_t* device_lengths() const { return static_cast<const int32_t*>(dev()); }

  // The core reads and writes c only for an LSTM: any other mode's c
  // output (output_c, input_c_backprop) is 0.
  template <typename T>
  Status ZeroUnlessLstm(const CoreConfig<T>& config, Tensor* c) const {
    if (!config.lstm() && c->NumElements() > 0)
      RF_RETURN_IF_CUDA(cudaMemsetAsync(Mut(*c), 0, c->TotalBytes(), stream));
    return absl::OkStatus();
  }
};

template <typename T>
class RnnfuseCudnnRnnOp : public StatusKernel {
 public:
  explicit RnnfuseCudnnRnnOp(OpKernelConstruction* ctx) : StatusKernel(ctx), config_(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("is_training", &is_training_));
  }

 private:
  // Inputs: 0 x, 1 h, 2 c, 3 params, 4 sequence_lengths, 5 algorithm.
  Status DoCompute(OpKernelContext* ctx) override {
    CallArgs a;
    TF_RETURN_IF_ERROR(a.Begin(ctx, config_, /*algorithm_input=*/5));
    const Tensor& h = ctx->input(1);
    const Tensor& c = ctx->input(2);
    const size_t reserve_bytes = is_training_ ? a.reserve_bytes : 0;
    Tensor *y = nullptr, *hy = nullptr, *cy = nullptr, *reserve = nullptr;
    TF_RETURN_IF_ERROR(AllocateOutputs(
        ctx, {{TensorShape({a.steps, a.batch, config_.out_width()}), &y},
              {h.shape(), &hy},
              {c.shape(), &cy},
              {TensorShape({static_cast<int64_t>(reserve_bytes)}), &reserve}}));
    TF_RETURN_IF_ERROR(a.ZeroUnlessLstm(config_, cy));
    RF_RETURN_IF_CORE(rnnfuse_cudnn_forward, &a.rnn, is_training_ ? 1 : 0, a.steps, a.batch,
                      a.host_lengths, a.device_lengths(), a.stream, Ptr(ctx->input(0)), Ptr(h),
                      Ptr(c), Ptr(ctx->input(3)), Mut(*y), Mut(*hy), Mut(*cy), Mut(a.workspace),
                      a.workspace_bytes, reserve_bytes ? Mut(*reserve) : nullptr, reserve_bytes);
    return absl::OkStatus();
  }

  CoreConfig<T> config_;
  bool is_training_ = true;
};

template <typename T>
class RnnfuseCudnnRnnBackpropOp : public StatusKernel {
 public:
  explicit RnnfuseCudnnRnnBackpropOp(OpKernelConstruction* ctx)
      : StatusKernel(ctx), config_(ctx) {}

 private:
  // Inputs: 0 x, 1 h, 2 c, 3 params, 4 sequence_lengths, 5 output,
  // 6 output_backprop, 7 output_h_backprop, 8 output_c_backprop, 9 reserve_space,
  // 10 algorithm.
  Status DoCompute(OpKernelContext* ctx) override {
    CallArgs a;
    TF_RETURN_IF_ERROR(a.Begin(ctx, config_, /*algorithm_input=*/10));
    const Tensor& x = ctx->input(0);
    const Tensor& h = ctx->input(1);
    const Tensor& c = ctx->input(2);
    const Tensor& y = ctx->input(5);
    const Tensor& dy = ctx->input(6);
    const Tensor& dhy = ctx->input(7);
    const Tensor& dcy = ctx->input(8);
    const Tensor& reserve = ctx->input(9);
    TensorShape yshape({a.steps, a.batch, config_.out_width()});
    if (y.shape() != yshape || dy.shape() != yshape)
      return errors::InvalidArgument("output and output_backprop must be ", yshape.DebugString());
    if (dhy.shape() != h.shape() || dcy.shape() != c.shape())
      return errors::InvalidArgument("output_h/c_backprop must match input_h/c");
    if (size_t(reserve.NumElements()) != a.reserve_bytes)
      return errors::InvalidArgument("reserve_space has ", reserve.NumElements(),
                                     " bytes; cuDNN needs ", a.reserve_bytes,
                                     " (was the forward op run with is_training=True?)");
    Tensor *dx = nullptr, *dh = nullptr, *dc = nullptr, *dparams = nullptr;
    TF_RETURN_IF_ERROR(AllocateOutputs(ctx, {{x.shape(), &dx},
                                             {h.shape(), &dh},
                                             {c.shape(), &dc},
                                             {ctx->input(3).shape(), &dparams}}));
    TF_RETURN_IF_ERROR(a.ZeroUnlessLstm(config_, dc));
    // cuDNN writes into the reserve space: TensorFlow's own CudnnRNN
    // backprop kernel uses its input the same way (its only consumer).
    void* rs = Mut(reserve);
    RF_RETURN_IF_CORE(rnnfuse_cudnn_backward_data, &a.rnn, a.steps, a.batch, a.host_lengths,
                      a.device_lengths(), a.stream, Ptr(y), Ptr(dy), Ptr(dhy), Ptr(dcy), Ptr(h),
                      Ptr(c), Ptr(ctx->input(3)), Mut(*dx), Mut(*dh), Mut(*dc), Mut(a.workspace),
                      a.workspace_bytes, rs, a.reserve_bytes);
    RF_RETURN_IF_CORE(rnnfuse_cudnn_backward_weights, &a.rnn, a.steps, a.batch, a.host_lengths,
                      a.device_lengths(), a.stream, Ptr(x), Ptr(h), Ptr(y), Mut(*dparams),
                      Mut(a.workspace), a.workspace_bytes, rs, a.reserve_bytes);
    return absl::OkStatus();
  }

  CoreConfig<T> config_;
};

// ---------------------------------------------------------------------------
#define RF_COMMON_ATTRS                                                              \
  .Attr("T: {half, bfloat16, float}")                                                \
      .Attr("rnn_mode: {'lstm', 'gru', 'rnn_tanh', 'rnn_relu'} = 'lstm'")            \
      .Attr("direction: {'unidirectional', 'bidirectional'} = 'unidirectional'")     \
      .Attr("num_layers: int >= 1")                                                  \
      .Attr("num_units: int >= 1")                                                   \
      .Attr("proj_size: int >= 0 = 0")                                               \
      .Attr("input_size: int >= 1")                                                  \
      .Attr("dropout: float = 0.0")                                                  \
      .Attr("seed: int = 0")

REGISTER_OP("RnnfuseCudnnRnn")
    .Input("input: T")
    .Input("input_h: T")
    .Input("input_c: T")
    .Input("params: T")
    .Input("sequence_lengths: int32")
    .Input("algorithm: int32")
    .Output("output: T")
    .Output("output_h: T")
    .Output("output_c: T")
    .Output("reserve_space: uint8")
    RF_COMMON_ATTRS
    .Attr("is_training: bool = true")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &x));
      int units = 0, proj = 0;
      std::string direction;
      TF_RETURN_IF_ERROR(c->GetAttr("num_units", &units));
      TF_RETURN_IF_ERROR(c->GetAttr("proj_size", &proj));
      TF_RETURN_IF_ERROR(c->GetAttr("direction", &direction));
      const int width = (direction == "bidirectional" ? 2 : 1) * (proj ? proj : units);
      c->set_output(0, c->MakeShape({c->Dim(x, 0), c->Dim(x, 1), c->MakeDim(width)}));
      c->set_output(1, c->input(1));
      c->set_output(2, c->input(2));
      c->set_output(3, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    });

REGISTER_OP("RnnfuseCudnnRnnBackprop")
    .Input("input: T")
    .Input("input_h: T")
    .Input("input_c: T")
    .Input("params: T")
    .Input("sequence_lengths: int32")
    .Input("output: T")
    .Input("output_backprop: T")
    .Input("output_h_backprop: T")
    .Input("output_c_backprop: T")
    .Input("reserve_space: uint8")
    .Input("algorithm: int32")
    .Output("input_backprop: T")
    .Output("input_h_backprop: T")
    .Output("input_c_backprop: T")
    .Output("params_backprop: T")
    RF_COMMON_ATTRS
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < 4; ++i) c->set_output(i, c->input(i));
      return absl::OkStatus();
    });

#define RF_REGISTER(T)                                                                   \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("RnnfuseCudnnRnn").Device(DEVICE_GPU).TypeConstraint<T>("T")                  \
          .HostMemory("sequence_lengths").HostMemory("algorithm"),                       \
      RnnfuseCudnnRnnOp<T>);                                                             \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("RnnfuseCudnnRnnBackprop").Device(DEVICE_GPU).TypeConstraint<T>("T")          \
          .HostMemory("sequence_lengths").HostMemory("algorithm"),                       \
      RnnfuseCudnnRnnBackpropOp<T>);

RF_REGISTER(float);
RF_REGISTER(Eigen::half);
RF_REGISTER(Eigen::bfloat16);

}  // namespace rnnfuse
