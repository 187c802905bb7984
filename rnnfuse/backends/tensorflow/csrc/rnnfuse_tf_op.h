// What rnnfuse's TensorFlow op files (rnnfuse_cudnn_rnn.cc,
// rnnfuse_wavefront_op.cc) share: the TensorFlow names they use, the views
// of a tensor's bytes that the native C ABIs take, and byte buffers from
// TensorFlow's allocator. Include after defining EIGEN_USE_GPU.

#pragma once

#include <algorithm>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

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

inline const void* Ptr(const Tensor& t) { return static_cast<const void*>(t.tensor_data().data()); }
inline void* Mut(const Tensor& t) { return const_cast<char*>(t.tensor_data().data()); }
inline char* Mut(Tensor* t) { return const_cast<char*>(t->tensor_data().data()); }

// An OpKernel whose work returns a Status (DoCompute), so it can use
// TF_RETURN_IF_ERROR; Compute turns a failure into the op's error.
class StatusKernel : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) final { OP_REQUIRES_OK(ctx, DoCompute(ctx)); }

 protected:
  virtual Status DoCompute(OpKernelContext* ctx) = 0;
};

// A temporary buffer of `bytes` bytes (at least one).
inline Status AllocateBytes(OpKernelContext* ctx, size_t bytes, Tensor* t) {
  return ctx->allocate_temp(tensorflow::DT_UINT8,
                            TensorShape({static_cast<int64_t>(std::max<size_t>(bytes, 1))}), t);
}

}  // namespace rnnfuse
