// rnnfuse's own TensorFlow GPU ops on cuDNN 9's RNN API.
//
// RnnfuseCudnnRnn         forward (training mode: returns a reserve space)
// RnnfuseCudnnRnnBackprop gradient (cudnnRNNBackwardData_v8 then
//                         cudnnRNNBackwardWeights_v8, CUDNN_WGRAD_MODE_ADD
//                         into a zeroed buffer)
//
// Both build their cuDNN RNN descriptor from the same attributes and the
// same `algorithm` input (the gradient passes the forward's tensor on), so
// the algorithm chosen in Python (standard, persistent static, persistent
// dynamic, persistent static small-h, with its math type) runs in the
// forward AND the backward pass. The algorithm is an int32 host input, not
// an attribute, so one traced graph runs every algorithm: rnnfuse's tuner
// traces one step per split of a run and times each algorithm on it.
//   algorithm = 4 * algo + math, algo: 0 standard, 1 persistent_static,
//   2 persistent_dynamic, 3 persistent_static_small_h; math: 0 default,
//   1 tensor_op, 2 tensor_op_allow_conversion, 3 fma.
// Each kernel keeps one cuDNN RNN descriptor (and weight-space layout) per
// algorithm it has run. Data are time-major padded (CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_UNPACKED)
// with per-sequence lengths; padded outputs are filled with 0.
//
// Weights come in rnnfuse's canonical flat layout (the one CudnnRNNV3 takes,
// see rnnfuse/backends/tensorflow/__init__.py), extended for projections:
//
//   flat = W(p0) ++ W(p1) ++ ... ++ B(p0) ++ B(p1) ++ ...
//   W(p) = M_0 ++ ... ++ M_{2G-1} [++ M_proj]   (row-major matrices)
//   M_k  = [H, n] for k < G (n: input width of the pseudo-layer),
//          [H, R] for G <= k < 2G (R = projSize if set, else H),
//          M_proj = [P, H] (LSTM with projSize P only; cuDNN's linLayerID 8)
//   B(p) = b_0 ++ ... ++ b_{2G-1}, each [H]   (the projection has no bias)
//
// Inside the kernel the flat buffer is scattered into cuDNN's weight space
// with offsets from cudnnGetRNNWeightParams (and dweights gathered back).
// The shapes cuDNN reports are checked against this layout, so a mismatch
// is an op error, not wrong numbers.
//
// Between-level dropout (attribute `dropout` > 0) is cuDNN's own: each
// kernel keeps its dropout states (cudnnDropoutGetStatesSize bytes from
// TensorFlow's allocator), initialised once from the `seed` attribute; the
// states advance on every training forward, so each step draws new masks,
// and the backward reads the forward's masks from the reserve space (as
// TensorFlow's CudnnRNN kernels do).
//
// Every cuDNN failure becomes an op error (never a CHECK) carrying the cuDNN
// status; it reaches the caller as it is (the tuner leaves out a candidate
// cuDNN refuses). Only what Python rules out before the call (a
// NotImplementedError) sends a FusedRNN to the original layers.
// Only host code: cuDNN plus cudaMemcpyAsync/cudaMemsetAsync on
// TensorFlow's stream, so g++ can compile it against TensorFlow's headers.

#define EIGEN_USE_GPU
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

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

#define RF_RETURN_IF_CUDNN(expr)                                               \
  do {                                                                         \
    cudnnStatus_t rf_status_ = (expr);                                         \
    if (rf_status_ != CUDNN_STATUS_SUCCESS) return CudnnError(#expr, rf_status_); \
  } while (0)

#define RF_RETURN_IF_CUDA(expr)                                                \
  do {                                                                         \
    cudaError_t rf_err_ = (expr);                                              \
    if (rf_err_ != cudaSuccess)                                                \
      return errors::Internal("rnnfuse: ", #expr, " failed: CUDA error ",      \
                              static_cast<int>(rf_err_));                      \
  } while (0)

Status CudnnError(const char* what, cudnnStatus_t status) {
  std::string msg = std::string("rnnfuse cuDNN call ") + what + " failed: " +
                    cudnnGetErrorString(status);
  if (status == CUDNN_STATUS_NOT_SUPPORTED ||
      status == CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH) {
    return errors::Unimplemented(msg, " (cuDNN does not support this configuration)");
  }
  return errors::Internal(msg);
}

// ---------------------------------------------------------------------------
// One cuDNN handle per CUDA device, shared by every kernel; its stream is set
// on each call, under its mutex.
struct SharedHandle {
  std::mutex mu;
  cudnnHandle_t handle = nullptr;
};

Status GetHandle(SharedHandle** out) {
  static std::mutex registry_mu;
  static std::map<int, std::unique_ptr<SharedHandle>>* registry =
      new std::map<int, std::unique_ptr<SharedHandle>>();
  int device = 0;
  RF_RETURN_IF_CUDA(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(registry_mu);
  auto& slot = (*registry)[device];
  if (!slot) {
    auto shared = std::make_unique<SharedHandle>();
    RF_RETURN_IF_CUDNN(cudnnCreate(&shared->handle));
    slot = std::move(shared);
  }
  *out = slot.get();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// RAII descriptors.
struct TensorDesc {
  cudnnTensorDescriptor_t d = nullptr;
  ~TensorDesc() { if (d) cudnnDestroyTensorDescriptor(d); }
  Status Create() { RF_RETURN_IF_CUDNN(cudnnCreateTensorDescriptor(&d)); return absl::OkStatus(); }
};
struct DataDesc {
  cudnnRNNDataDescriptor_t d = nullptr;
  ~DataDesc() { if (d) cudnnDestroyRNNDataDescriptor(d); }
  Status Create() { RF_RETURN_IF_CUDNN(cudnnCreateRNNDataDescriptor(&d)); return absl::OkStatus(); }
};

template <typename T> struct CudnnType;
template <> struct CudnnType<float> { static constexpr cudnnDataType_t value = CUDNN_DATA_FLOAT; };
template <> struct CudnnType<Eigen::half> { static constexpr cudnnDataType_t value = CUDNN_DATA_HALF; };
template <> struct CudnnType<Eigen::bfloat16> { static constexpr cudnnDataType_t value = CUDNN_DATA_BFLOAT16; };

// One contiguous copy between the canonical flat buffer and the weight space.
struct Copy {
  size_t flat;   // byte offset in the canonical buffer
  size_t space;  // byte offset in cuDNN's weight space
  size_t bytes;
};

// The attributes shared by both ops, and the cuDNN state derived from them.
class RnnConfig {
 public:
  explicit RnnConfig(OpKernelConstruction* ctx) {
    std::string mode, direction;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rnn_mode", &mode));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("direction", &direction));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_layers", &num_layers_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_units", &num_units_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("proj_size", &proj_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("input_size", &input_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dropout", &dropout_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed_));
    if (mode == "lstm") { cell_ = CUDNN_LSTM; gates_ = 4; }
    else if (mode == "gru") { cell_ = CUDNN_GRU; gates_ = 3; }
    else if (mode == "rnn_tanh") { cell_ = CUDNN_RNN_TANH; gates_ = 1; }
    else if (mode == "rnn_relu") { cell_ = CUDNN_RNN_RELU; gates_ = 1; }
    else { ctx->CtxFailure(errors::InvalidArgument("rnn_mode ", mode)); return; }
    dirs_ = direction == "bidirectional" ? 2 : 1;
    OP_REQUIRES(ctx, proj_size_ == 0 || cell_ == CUDNN_LSTM,
                errors::InvalidArgument("proj_size needs rnn_mode='lstm'"));
    OP_REQUIRES(ctx, proj_size_ >= 0 && proj_size_ < num_units_ + (proj_size_ == 0),
                errors::InvalidArgument("proj_size must be 0 or in [1, num_units); got ",
                                        proj_size_, " with num_units ", num_units_));
    OP_REQUIRES(ctx, dropout_ >= 0.0f && dropout_ < 1.0f,
                errors::InvalidArgument("dropout must be in [0, 1); got ", dropout_));
    OP_REQUIRES(ctx, num_layers_ >= 1 && num_units_ >= 1 && input_size_ >= 1,
                errors::InvalidArgument("num_layers, num_units and input_size must be >= 1"));
  }

  ~RnnConfig() {
    if (dropout_desc_) cudnnDestroyDropoutDescriptor(dropout_desc_);
  }

  // Makes the algorithm in input `index` (see the header) this call's
  // variant; the caller holds `mu` until the call ends.
  Status Select(OpKernelContext* ctx, int index) {
    const Tensor& t = ctx->input(index);
    if (t.dims() != 0)
      return errors::InvalidArgument("algorithm must be an int32 scalar; got shape ",
                                     t.shape().DebugString());
    const int code = t.scalar<int32_t>()();
    static const cudnnRNNAlgo_t kAlgos[] = {CUDNN_RNN_ALGO_STANDARD, CUDNN_RNN_ALGO_PERSIST_STATIC,
                                            CUDNN_RNN_ALGO_PERSIST_DYNAMIC,
                                            CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H};
    static const cudnnMathType_t kMaths[] = {CUDNN_DEFAULT_MATH, CUDNN_TENSOR_OP_MATH,
                                             CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION, CUDNN_FMA_MATH};
    if (code < 0 || code >= 16)
      return errors::InvalidArgument("algorithm must be 4 * algo + math in [0, 16); got ", code);
    std::unique_ptr<Variant>& v = variants_[code];
    if (!v) {
      v.reset(new Variant);
      v->algo = kAlgos[code / 4];
      v->math = kMaths[code % 4];
    }
    v_ = v.get();
    return absl::OkStatus();
  }

  int out_units() const { return proj_size_ ? proj_size_ : num_units_; }
  int pseudo_layers() const { return num_layers_ * dirs_; }
  int dirs() const { return dirs_; }
  int num_units() const { return num_units_; }
  bool lstm() const { return cell_ == CUDNN_LSTM; }

  // Elements of the canonical flat buffer.
  int64_t FlatSize() const {
    int64_t h = num_units_, r = out_units(), g = gates_, total = 0;
    for (int p = 0; p < pseudo_layers(); ++p) {
      int64_t n = p < dirs_ ? input_size_ : int64_t(dirs_) * r;
      total += g * h * n + g * h * r + (proj_size_ ? int64_t(proj_size_) * h : 0) + 2 * g * h;
    }
    return total;
  }

  // Creates the selected algorithm's RNN descriptor once (holding the
  // handle's lock); with dropout, first the kernel's dropout states
  // (allocated from `ctx`), which every algorithm's descriptor shares.
  template <typename T>
  Status Prepare(OpKernelContext* ctx, cudnnHandle_t handle, int batch) {
    if (CudnnType<T>::value == CUDNN_DATA_BFLOAT16 && cudnnGetVersion() < 90000) {
      return errors::Unimplemented("bfloat16 RNNs need cuDNN >= 9.0; this process loaded ",
                                   cudnnGetVersion());
    }
    if (!dropout_ready_) {  // a failed attempt is retried whole on the next call
      if (!dropout_desc_) RF_RETURN_IF_CUDNN(cudnnCreateDropoutDescriptor(&dropout_desc_));
      void* states = nullptr;
      size_t state_bytes = 0;
      if (dropout_ > 0.0f) {
        RF_RETURN_IF_CUDNN(cudnnDropoutGetStatesSize(handle, &state_bytes));
        if (dropout_states_.NumElements() != static_cast<int64_t>(state_bytes))
          TF_RETURN_IF_ERROR(ctx->allocate_temp(
              tensorflow::DT_UINT8, TensorShape({static_cast<int64_t>(state_bytes)}),
              &dropout_states_));
        states = const_cast<char*>(dropout_states_.tensor_data().data());
      }
      RF_RETURN_IF_CUDNN(cudnnSetDropoutDescriptor(dropout_desc_, handle, dropout_, states,
                                                   state_bytes,
                                                   static_cast<unsigned long long>(seed_)));
      dropout_ready_ = true;
    }
    Variant& v = *v_;
    if (!v.prepared) {  // a failed attempt is retried whole on the next call
      if (!v.rnn) RF_RETURN_IF_CUDNN(cudnnCreateRNNDescriptor(&v.rnn));
      RF_RETURN_IF_CUDNN(cudnnSetRNNDescriptor_v8(
          v.rnn, v.algo, cell_, CUDNN_RNN_DOUBLE_BIAS,
          dirs_ == 2 ? CUDNN_BIDIRECTIONAL : CUDNN_UNIDIRECTIONAL, CUDNN_LINEAR_INPUT,
          CudnnType<T>::value, CUDNN_DATA_FLOAT, v.math, input_size_, num_units_, out_units(),
          num_layers_, dropout_desc_, CUDNN_RNN_PADDED_IO_ENABLED));
      RF_RETURN_IF_CUDNN(cudnnGetRNNWeightSpaceSize(handle, v.rnn, &v.weight_bytes));
      v.prepared = true;
    }
    if (v.algo == CUDNN_RNN_ALGO_PERSIST_DYNAMIC && v.built_batch != batch) {
      RF_RETURN_IF_CUDNN(cudnnBuildRNNDynamic(handle, v.rnn, batch));
      v.built_batch = batch;
    }
    return absl::OkStatus();
  }

  // The canonical <-> weight space copies (computed once, with `space`, a
  // real weight-space allocation, as the base address).
  template <typename T>
  Status Layout(cudnnHandle_t handle, const void* space, const std::vector<Copy>** out) {
    std::vector<Copy>& cached = v_->copies;
    if (!cached.empty()) { *out = &cached; return absl::OkStatus(); }
    TensorDesc m, b;
    TF_RETURN_IF_ERROR(m.Create());
    TF_RETURN_IF_ERROR(b.Create());
    const int64_t h = num_units_, r = out_units(), g = gates_;
    const size_t es = sizeof(T);
    std::vector<Copy> copies;
    size_t flat = 0;
    auto add = [&](const void* addr, int64_t count) {
      size_t space_off = static_cast<const char*>(addr) - static_cast<const char*>(space);
      size_t bytes = count * es;
      if (!copies.empty() && copies.back().flat + copies.back().bytes == flat &&
          copies.back().space + copies.back().bytes == space_off) {
        copies.back().bytes += bytes;  // contiguous on both sides: merge
      } else {
        copies.push_back({flat, space_off, bytes});
      }
      flat += bytes;
    };
    auto count_of = [&](cudnnTensorDescriptor_t d, int64_t* count) -> Status {
      cudnnDataType_t dt;
      int nb = 0, dims[8], strides[8];
      RF_RETURN_IF_CUDNN(cudnnGetTensorNdDescriptor(d, 8, &dt, &nb, dims, strides));
      int64_t c = 1;
      for (int i = 0; i < nb; ++i) c *= dims[i];
      *count = c;
      return absl::OkStatus();
    };
    const int matrices = 2 * gates_ + (proj_size_ ? 1 : 0);
    // Pass 1: matrices; pass 2: biases.
    for (int pass = 0; pass < 2; ++pass) {
      for (int p = 0; p < pseudo_layers(); ++p) {
        const int64_t n = p < dirs_ ? input_size_ : int64_t(dirs_) * r;
        for (int k = 0; k < (pass == 0 ? matrices : 2 * gates_); ++k) {
          void* maddr = nullptr;
          void* baddr = nullptr;
          RF_RETURN_IF_CUDNN(cudnnGetRNNWeightParams(handle, rnn(), p, weight_bytes(), space, k,
                                                     m.d, &maddr, b.d, &baddr));
          int64_t expected, got;
          if (pass == 0) {
            expected = k < g ? h * n : (k < 2 * g ? h * r : int64_t(proj_size_) * h);
            TF_RETURN_IF_ERROR(count_of(m.d, &got));
            if (maddr == nullptr || got != expected)
              return errors::Internal("rnnfuse: cuDNN weight matrix (pseudo-layer ", p,
                                      ", linLayerID ", k, ") has ", got,
                                      " elements; the canonical layout expects ", expected);
            add(maddr, got);
          } else {
            expected = h;
            TF_RETURN_IF_ERROR(count_of(b.d, &got));
            if (baddr == nullptr || got != expected)
              return errors::Internal("rnnfuse: cuDNN bias (pseudo-layer ", p, ", linLayerID ",
                                      k, ") has ", got, " elements; expected ", expected);
            add(baddr, got);
          }
        }
      }
    }
    if (flat != size_t(FlatSize()) * es)
      return errors::Internal("rnnfuse: canonical layout covers ", flat / es,
                              " elements, expected ", FlatSize());
    cached = std::move(copies);
    *out = &cached;
    return absl::OkStatus();
  }

  Status DataDescs(cudnnDataType_t dtype, int steps, int batch, const int* lengths,
                   DataDesc* x, DataDesc* y) const {
    double fill = 0.0;  // all-zero bytes: 0 in any data type
    TF_RETURN_IF_ERROR(x->Create());
    TF_RETURN_IF_ERROR(y->Create());
    RF_RETURN_IF_CUDNN(cudnnSetRNNDataDescriptor(x->d, dtype,
                                                 CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_UNPACKED, steps,
                                                 batch, input_size_, lengths, &fill));
    RF_RETURN_IF_CUDNN(cudnnSetRNNDataDescriptor(y->d, dtype,
                                                 CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_UNPACKED, steps,
                                                 batch, dirs_ * out_units(), lengths, &fill));
    return absl::OkStatus();
  }

  Status StateDescs(cudnnDataType_t dtype, int batch, TensorDesc* h, TensorDesc* c) const {
    TF_RETURN_IF_ERROR(h->Create());
    TF_RETURN_IF_ERROR(c->Create());
    int hd[3] = {pseudo_layers(), batch, out_units()};
    int hs[3] = {batch * out_units(), out_units(), 1};
    int cd[3] = {pseudo_layers(), batch, num_units_};
    int cs[3] = {batch * num_units_, num_units_, 1};
    RF_RETURN_IF_CUDNN(cudnnSetTensorNdDescriptor(h->d, dtype, 3, hd, hs));
    RF_RETURN_IF_CUDNN(cudnnSetTensorNdDescriptor(c->d, dtype, 3, cd, cs));
    return absl::OkStatus();
  }

  // Checks the inputs shared by both ops; fills the host sequence lengths.
  Status CheckInputs(OpKernelContext* ctx, std::vector<int>* lengths) const {
    const Tensor& x = ctx->input(0);
    const Tensor& h = ctx->input(1);
    const Tensor& c = ctx->input(2);
    const Tensor& params = ctx->input(3);
    const Tensor& seq = ctx->input(4);
    if (x.dims() != 3 || x.dim_size(2) != input_size_)
      return errors::InvalidArgument("input must be [time, batch, ", input_size_, "]; got ",
                                     x.shape().DebugString());
    const int64_t steps = x.dim_size(0), batch = x.dim_size(1);
    if (steps < 1 || batch < 1)
      return errors::InvalidArgument("input needs time >= 1 and batch >= 1; got ",
                                     x.shape().DebugString());
    TensorShape hshape({pseudo_layers(), batch, out_units()});
    if (h.shape() != hshape)
      return errors::InvalidArgument("input_h must be ", hshape.DebugString(), "; got ",
                                     h.shape().DebugString());
    TensorShape cshape({pseudo_layers(), batch, num_units_});
    if (lstm() && c.shape() != cshape)
      return errors::InvalidArgument("input_c must be ", cshape.DebugString(), "; got ",
                                     c.shape().DebugString());
    if (params.dims() != 1 || params.NumElements() != FlatSize())
      return errors::InvalidArgument("params must be a flat vector of ", FlatSize(),
                                     " elements; got ", params.shape().DebugString());
    if (seq.dims() != 1 || seq.dim_size(0) != batch)
      return errors::InvalidArgument("sequence_lengths must be [", batch, "]; got ",
                                     seq.shape().DebugString());
    auto v = seq.flat<int32_t>();
    lengths->resize(batch);
    for (int64_t i = 0; i < batch; ++i) {
      int len = v(i);
      if (len < 1 || len > steps)
        return errors::InvalidArgument("sequence_lengths[", i, "] = ", len,
                                       " is outside [1, ", steps, "]");
      (*lengths)[i] = len;
    }
    return absl::OkStatus();
  }

  cudnnRNNDescriptor_t rnn() const { return v_->rnn; }
  size_t weight_bytes() const { return v_->weight_bytes; }
  std::mutex mu;  // guards the cached descriptors, layouts and the selection

 private:
  cudnnRNNMode_t cell_ = CUDNN_LSTM;
  int gates_ = 4;
  int dirs_ = 1;
  // One algorithm's cuDNN state.
  struct Variant {
    cudnnRNNAlgo_t algo = CUDNN_RNN_ALGO_STANDARD;
    cudnnMathType_t math = CUDNN_DEFAULT_MATH;
    cudnnRNNDescriptor_t rnn = nullptr;
    bool prepared = false;
    size_t weight_bytes = 0;
    int built_batch = -1;
    std::vector<Copy> copies;
    ~Variant() {
      if (rnn) cudnnDestroyRNNDescriptor(rnn);
    }
  };
  int num_layers_ = 1, num_units_ = 1, proj_size_ = 0, input_size_ = 1;
  float dropout_ = 0.0f;
  int64_t seed_ = 0;
  cudnnDropoutDescriptor_t dropout_desc_ = nullptr;
  Tensor dropout_states_;  // cuDNN's RNG states, kept for the kernel's life
  bool dropout_ready_ = false;
  std::map<int, std::unique_ptr<Variant>> variants_;
  Variant* v_ = nullptr;  // the selected one (under `mu`)
};

Status CopyParams(const std::vector<Copy>& copies, const char* flat, char* space, bool to_space,
                  cudaStream_t stream) {
  for (const Copy& c : copies) {
    if (to_space) {
      RF_RETURN_IF_CUDA(cudaMemcpyAsync(space + c.space, flat + c.flat, c.bytes,
                                        cudaMemcpyDeviceToDevice, stream));
    } else {
      RF_RETURN_IF_CUDA(cudaMemcpyAsync(const_cast<char*>(flat) + c.flat, space + c.space,
                                        c.bytes, cudaMemcpyDeviceToDevice, stream));
    }
  }
  return absl::OkStatus();
}

Status AllocateBytes(OpKernelContext* ctx, size_t bytes, Tensor* t) {
  return ctx->allocate_temp(tensorflow::DT_UINT8,
                            TensorShape({static_cast<int64_t>(std::max<size_t>(bytes, 1))}), t);
}

template <typename T>
char* Bytes(const Tensor& t) {
  return const_cast<char*>(reinterpret_cast<const char*>(t.tensor_data().data()));
}

// ---------------------------------------------------------------------------
// Holds the shared handle's lock and sets its stream for one call.
struct HandleCall {
  SharedHandle* shared = nullptr;
  std::unique_lock<std::mutex> lock;
  Status Begin(cudaStream_t stream) {
    TF_RETURN_IF_ERROR(GetHandle(&shared));
    lock = std::unique_lock<std::mutex>(shared->mu);
    RF_RETURN_IF_CUDNN(cudnnSetStream(shared->handle, stream));
    return absl::OkStatus();
  }
  cudnnHandle_t handle() const { return shared->handle; }
};

// The per-call cuDNN state both ops build the same way.
template <typename T>
struct CallState {
  HandleCall call;
  DataDesc xd, yd;
  TensorDesc hd, cd;
  Tensor space, dev_lengths;
  const std::vector<Copy>* copies = nullptr;
  int steps = 0, batch = 0;

  Status Begin(OpKernelContext* ctx, RnnConfig* config, int algorithm_input, cudaStream_t stream,
               std::unique_lock<std::mutex>* config_lock) {
    std::vector<int> lengths;
    TF_RETURN_IF_ERROR(config->CheckInputs(ctx, &lengths));
    const Tensor& x = ctx->input(0);
    steps = x.dim_size(0);
    batch = x.dim_size(1);
    const cudnnDataType_t dtype = CudnnType<T>::value;
    TF_RETURN_IF_ERROR(call.Begin(stream));
    *config_lock = std::unique_lock<std::mutex>(config->mu);
    TF_RETURN_IF_ERROR(config->Select(ctx, algorithm_input));
    TF_RETURN_IF_ERROR(config->Prepare<T>(ctx, call.handle(), batch));
    TF_RETURN_IF_ERROR(config->DataDescs(dtype, steps, batch, lengths.data(), &xd, &yd));
    TF_RETURN_IF_ERROR(config->StateDescs(dtype, batch, &hd, &cd));
    // The weight space, scattered from the canonical flat params.
    TF_RETURN_IF_ERROR(AllocateBytes(ctx, config->weight_bytes(), &space));
    char* sp = Bytes<T>(space);
    TF_RETURN_IF_ERROR(config->Layout<T>(call.handle(), sp, &copies));
    RF_RETURN_IF_CUDA(cudaMemsetAsync(sp, 0, config->weight_bytes(), stream));
    TF_RETURN_IF_ERROR(CopyParams(*copies, Bytes<T>(ctx->input(3)), sp, true, stream));
    // Device copy of the sequence lengths.
    TF_RETURN_IF_ERROR(ctx->allocate_temp(tensorflow::DT_INT32, TensorShape({batch}),
                                          &dev_lengths));
    RF_RETURN_IF_CUDA(cudaMemcpyAsync(Bytes<int>(dev_lengths), ctx->input(4).tensor_data().data(),
                                      sizeof(int) * batch, cudaMemcpyHostToDevice, stream));
    return absl::OkStatus();
  }
};

template <typename T>
class RnnfuseCudnnRnnOp : public OpKernel {
 public:
  explicit RnnfuseCudnnRnnOp(OpKernelConstruction* ctx) : OpKernel(ctx), config_(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("is_training", &is_training_));
  }

  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, DoCompute(ctx)); }

 private:
  Status DoCompute(OpKernelContext* ctx) {
    cudaStream_t stream = ctx->eigen_device<Eigen::GpuDevice>().stream();
    CallState<T> st;
    std::unique_lock<std::mutex> config_lock;
    TF_RETURN_IF_ERROR(st.Begin(ctx, &config_, /*algorithm_input=*/5, stream, &config_lock));
    const Tensor& h = ctx->input(1);
    const Tensor& c = ctx->input(2);
    const bool lstm = config_.lstm();
    Tensor *y = nullptr, *hy = nullptr, *cy = nullptr, *reserve = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(
        0, TensorShape({st.steps, st.batch, int64_t(config_.dirs()) * config_.out_units()}), &y));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, h.shape(), &hy));
    TF_RETURN_IF_ERROR(ctx->allocate_output(2, c.shape(), &cy));
    const cudnnForwardMode_t mode = is_training_ ? CUDNN_FWD_MODE_TRAINING : CUDNN_FWD_MODE_INFERENCE;
    size_t work_bytes = 0, reserve_bytes = 0;
    RF_RETURN_IF_CUDNN(cudnnGetRNNTempSpaceSizes(st.call.handle(), config_.rnn(), mode, st.xd.d,
                                                 &work_bytes, &reserve_bytes));
    if (!is_training_) reserve_bytes = 0;
    TF_RETURN_IF_ERROR(ctx->allocate_output(
        3, TensorShape({static_cast<int64_t>(reserve_bytes)}), &reserve));
    Tensor work;
    TF_RETURN_IF_ERROR(AllocateBytes(ctx, work_bytes, &work));
    if (!lstm && cy->NumElements() > 0)
      RF_RETURN_IF_CUDA(cudaMemsetAsync(Bytes<T>(*cy), 0, cy->TotalBytes(), stream));
    RF_RETURN_IF_CUDNN(cudnnRNNForward(
        st.call.handle(), config_.rnn(), mode, reinterpret_cast<const int32_t*>(Bytes<int>(st.dev_lengths)), st.xd.d,
        Bytes<T>(ctx->input(0)), st.yd.d, Bytes<T>(*y), st.hd.d, Bytes<T>(h), Bytes<T>(*hy),
        st.cd.d, lstm ? Bytes<T>(c) : nullptr, lstm ? Bytes<T>(*cy) : nullptr,
        config_.weight_bytes(), Bytes<T>(st.space), work_bytes, Bytes<T>(work), reserve_bytes,
        reserve_bytes ? Bytes<T>(*reserve) : nullptr));
    return absl::OkStatus();
  }

  RnnConfig config_;
  bool is_training_ = true;
};

template <typename T>
class RnnfuseCudnnRnnBackpropOp : public OpKernel {
 public:
  explicit RnnfuseCudnnRnnBackpropOp(OpKernelConstruction* ctx) : OpKernel(ctx), config_(ctx) {}

  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, DoCompute(ctx)); }

 private:
  // Inputs: 0 x, 1 h, 2 c, 3 params, 4 sequence_lengths, 5 output,
  // 6 output_backprop, 7 output_h_backprop, 8 output_c_backprop, 9 reserve_space,
  // 10 algorithm.
  Status DoCompute(OpKernelContext* ctx) {
    cudaStream_t stream = ctx->eigen_device<Eigen::GpuDevice>().stream();
    CallState<T> st;
    std::unique_lock<std::mutex> config_lock;
    TF_RETURN_IF_ERROR(st.Begin(ctx, &config_, /*algorithm_input=*/10, stream, &config_lock));
    const Tensor& x = ctx->input(0);
    const Tensor& h = ctx->input(1);
    const Tensor& c = ctx->input(2);
    const Tensor& y = ctx->input(5);
    const Tensor& dy = ctx->input(6);
    const Tensor& dhy = ctx->input(7);
    const Tensor& dcy = ctx->input(8);
    const Tensor& reserve = ctx->input(9);
    const bool lstm = config_.lstm();
    TensorShape yshape({st.steps, st.batch, int64_t(config_.dirs()) * config_.out_units()});
    if (y.shape() != yshape || dy.shape() != yshape)
      return errors::InvalidArgument("output and output_backprop must be ", yshape.DebugString());
    if (dhy.shape() != h.shape() || dcy.shape() != c.shape())
      return errors::InvalidArgument("output_h/c_backprop must match input_h/c");
    size_t work_bytes = 0, reserve_bytes = 0;
    RF_RETURN_IF_CUDNN(cudnnGetRNNTempSpaceSizes(st.call.handle(), config_.rnn(),
                                                 CUDNN_FWD_MODE_TRAINING, st.xd.d, &work_bytes,
                                                 &reserve_bytes));
    if (size_t(reserve.NumElements()) != reserve_bytes)
      return errors::InvalidArgument("reserve_space has ", reserve.NumElements(),
                                     " bytes; cuDNN needs ", reserve_bytes,
                                     " (was the forward op run with is_training=True?)");
    Tensor *dx = nullptr, *dh = nullptr, *dc = nullptr, *dparams = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, x.shape(), &dx));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, h.shape(), &dh));
    TF_RETURN_IF_ERROR(ctx->allocate_output(2, c.shape(), &dc));
    TF_RETURN_IF_ERROR(ctx->allocate_output(3, ctx->input(3).shape(), &dparams));
    Tensor work, dspace;
    TF_RETURN_IF_ERROR(AllocateBytes(ctx, work_bytes, &work));
    TF_RETURN_IF_ERROR(AllocateBytes(ctx, config_.weight_bytes(), &dspace));
    RF_RETURN_IF_CUDA(cudaMemsetAsync(Bytes<T>(dspace), 0, config_.weight_bytes(), stream));
    if (!lstm && dc->NumElements() > 0)
      RF_RETURN_IF_CUDA(cudaMemsetAsync(Bytes<T>(*dc), 0, dc->TotalBytes(), stream));
    // cuDNN writes into the reserve space: TensorFlow's own CudnnRNN
    // backprop kernel uses its input the same way (its only consumer).
    char* rs = Bytes<T>(reserve);
    RF_RETURN_IF_CUDNN(cudnnRNNBackwardData_v8(
        st.call.handle(), config_.rnn(), reinterpret_cast<const int32_t*>(Bytes<int>(st.dev_lengths)), st.yd.d, Bytes<T>(y),
        Bytes<T>(dy), st.xd.d, Bytes<T>(*dx), st.hd.d, Bytes<T>(h), Bytes<T>(dhy), Bytes<T>(*dh),
        st.cd.d, lstm ? Bytes<T>(c) : nullptr, lstm ? Bytes<T>(dcy) : nullptr,
        lstm ? Bytes<T>(*dc) : nullptr, config_.weight_bytes(), Bytes<T>(st.space), work_bytes,
        Bytes<T>(work), reserve_bytes, rs));
    RF_RETURN_IF_CUDNN(cudnnRNNBackwardWeights_v8(
        st.call.handle(), config_.rnn(), CUDNN_WGRAD_MODE_ADD, reinterpret_cast<const int32_t*>(Bytes<int>(st.dev_lengths)),
        st.xd.d, Bytes<T>(x), st.hd.d, Bytes<T>(h), st.yd.d, Bytes<T>(y), config_.weight_bytes(),
        Bytes<T>(dspace), work_bytes, Bytes<T>(work), reserve_bytes, rs));
    TF_RETURN_IF_ERROR(CopyParams(*st.copies, Bytes<T>(*dparams), Bytes<T>(dspace), false, stream));
    return absl::OkStatus();
  }

  RnnConfig config_;
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
