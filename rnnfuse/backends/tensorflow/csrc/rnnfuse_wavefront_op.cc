// RnnfuseWavefront: rnnfuse's persistent wavefront kernel as a TensorFlow
// GPU op (inference: no reserve space, no gradient).
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
// ([L, B, H]; output_c is [0] for a GRU).
// A shape outside the kernel's limits is an Unimplemented op error naming
// the limit (Python checks the same plan first and runs cuDNN instead).

#define EIGEN_USE_GPU
#include <cuda_runtime_api.h>

#include <string>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

extern "C" {
const char* rnnfuse_wf_last_error();
size_t rnnfuse_wf_workspace_bytes(int num_layers, int units, int batch, int steps,
                                  int elem_bytes);
int rnnfuse_wf_forward(void* stream, int dtype, int gru, int num_layers, int units, int batch,
                       int steps, int input_size, const void* xproj, const void* params,
                       const void* h0, const void* c0, const int* lengths, void* y, void* hy,
                       void* cy, void* workspace, int mode, unsigned long long* trace,
                       int trace_steps);
}

namespace rnnfuse {

using tensorflow::DEVICE_GPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
namespace errors = tensorflow::errors;
namespace shape_inference = tensorflow::shape_inference;

template <typename T> struct WavefrontDtype;
template <> struct WavefrontDtype<Eigen::half> { static constexpr int value = 0; };
template <> struct WavefrontDtype<Eigen::bfloat16> { static constexpr int value = 1; };

template <typename T>
class RnnfuseWavefrontOp : public OpKernel {
 public:
  explicit RnnfuseWavefrontOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string mode;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rnn_mode", &mode));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("input_size", &input_size_));
    gru_ = mode == "gru";
  }

  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, DoCompute(ctx)); }

 private:
  Status DoCompute(OpKernelContext* ctx) {
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
    if (lengths.NumElements() != 0 && lengths.NumElements() != batch)
      return errors::InvalidArgument("sequence_lengths must be [B] or [0]");

    Tensor *y = nullptr, *hy = nullptr, *cy = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({steps, batch, units}), &y));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, h0.shape(), &hy));
    TF_RETURN_IF_ERROR(
        ctx->allocate_output(2, gru_ ? TensorShape({0}) : h0.shape(), &cy));
    if (steps == 0 || batch == 0) return absl::OkStatus();

    cudaStream_t stream = ctx->eigen_device<Eigen::GpuDevice>().stream();
    Tensor dev_lengths;
    const int* lengths_ptr = nullptr;
    if (lengths.NumElements() == batch) {
      TF_RETURN_IF_ERROR(
          ctx->allocate_temp(tensorflow::DT_INT32, TensorShape({batch}), &dev_lengths));
      const cudaError_t err =
          cudaMemcpyAsync(const_cast<char*>(dev_lengths.tensor_data().data()),
                          lengths.tensor_data().data(), batch * sizeof(int),
                          cudaMemcpyHostToDevice, stream);
      if (err != cudaSuccess)
        return errors::Internal("rnnfuse wavefront: copying sequence_lengths failed (CUDA error ",
                                static_cast<int>(err), ")");
      lengths_ptr = reinterpret_cast<const int*>(dev_lengths.tensor_data().data());
    }
    const size_t ws_bytes = rnnfuse_wf_workspace_bytes(layers, units, batch, steps, sizeof(T));
    Tensor workspace;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        tensorflow::DT_UINT8, TensorShape({static_cast<int64_t>(ws_bytes)}), &workspace));
    auto ptr = [](const Tensor& t) { return static_cast<const void*>(t.tensor_data().data()); };
    auto mut = [](Tensor* t) { return const_cast<char*>(t->tensor_data().data()); };
    const int rc = rnnfuse_wf_forward(
        stream, WavefrontDtype<T>::value, gru_ ? 1 : 0, layers, units, batch, steps, input_size_,
        ptr(xproj), ptr(params), ptr(h0), gru_ ? nullptr : ptr(c0), lengths_ptr, mut(y), mut(hy),
        gru_ ? nullptr : mut(cy), mut(&workspace), 0, nullptr, 0);
    if (rc != 0) return errors::Unimplemented("rnnfuse wavefront: ", rnnfuse_wf_last_error());
    return absl::OkStatus();
  }

  bool gru_ = false;
  int input_size_ = 0;
};

REGISTER_OP("RnnfuseWavefront")
    .Input("xproj: T")
    .Input("params: T")
    .Input("input_h: T")
    .Input("input_c: T")
    .Input("sequence_lengths: int32")
    .Output("output: T")
    .Output("output_h: T")
    .Output("output_c: T")
    .Attr("T: {half, bfloat16}")
    .Attr("rnn_mode: {'lstm', 'gru'} = 'lstm'")
    .Attr("input_size: int >= 1")
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

#define RF_REGISTER_WAVEFRONT(T)                                                   \
  REGISTER_KERNEL_BUILDER(Name("RnnfuseWavefront")                                 \
                              .Device(DEVICE_GPU)                                  \
                              .TypeConstraint<T>("T")                              \
                              .HostMemory("sequence_lengths"),                     \
                          RnnfuseWavefrontOp<T>);

RF_REGISTER_WAVEFRONT(Eigen::half);
RF_REGISTER_WAVEFRONT(Eigen::bfloat16);

}  // namespace rnnfuse
