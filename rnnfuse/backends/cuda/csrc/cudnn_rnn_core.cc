// rnnfuse's cuDNN RNN core (the C ABI of cudnn_rnn_core.h).
//
// Why cuDNN and the CUDA driver are reached through dlopen, not linked:
// the library must load where neither exists (CI compiles it and checks
// its errors on a CPU machine), and inside a framework it must bind to the
// libcudnn.so.9 that framework already loaded (torch's wheel, TensorFlow's)
// rather than a second copy: dlopen of the soname returns the loaded one.
// A missing cuDNN is then an error code with a message, never a loader
// failure or an abort. cudnn.h and cuda.h are read for types only.
//
// The cuDNN logic lives here only (the TensorFlow op, backends/tensorflow/
// csrc/rnnfuse_cudnn_rnn.cc, compiles this file in and adapts tensors to
// it; torch calls the built library through ctypes): a handle per device, one RNN
// descriptor per configuration and algorithm (a "plan", cached with its
// weight-space layout), dropout states per (device, dropout, seed), all
// under one mutex per device that a call holds from start to end.

#include "cudnn_rnn_core.h"
#include "cuda_driver.h"

#include <cuda.h>
#include <cudnn.h>
#include <dlfcn.h>

#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#define RF_EXPORT __attribute__((visibility("default")))

namespace {

thread_local std::string g_error;

int Fail(int code, const std::string& message) {
  g_error = message;
  return code;
}

// ---------------------------------------------------------------------------
// cuDNN, resolved from libcudnn.so.9.
#define RF_CUDNN_FUNCTIONS(X)          \
  X(cudnnGetVersion)                   \
  X(cudnnGetErrorString)               \
  X(cudnnCreate)                       \
  X(cudnnSetStream)                    \
  X(cudnnCreateTensorDescriptor)       \
  X(cudnnDestroyTensorDescriptor)      \
  X(cudnnSetTensorNdDescriptor)        \
  X(cudnnGetTensorNdDescriptor)        \
  X(cudnnCreateRNNDataDescriptor)      \
  X(cudnnDestroyRNNDataDescriptor)     \
  X(cudnnSetRNNDataDescriptor)         \
  X(cudnnCreateDropoutDescriptor)      \
  X(cudnnDropoutGetStatesSize)         \
  X(cudnnSetDropoutDescriptor)         \
  X(cudnnCreateRNNDescriptor)          \
  X(cudnnDestroyRNNDescriptor)         \
  X(cudnnSetRNNDescriptor_v8)          \
  X(cudnnGetRNNWeightSpaceSize)        \
  X(cudnnGetRNNWeightParams)           \
  X(cudnnBuildRNNDynamic)              \
  X(cudnnGetRNNTempSpaceSizes)         \
  X(cudnnRNNForward)                   \
  X(cudnnRNNBackwardData_v8)           \
  X(cudnnRNNBackwardWeights_v8)

struct Cudnn {
#define RF_DECLARE(name) decltype(&name) name##_ = nullptr;
  RF_CUDNN_FUNCTIONS(RF_DECLARE)
#undef RF_DECLARE
  int version = 0;
};

std::mutex g_load_mu;
Cudnn* g_cudnn = nullptr;  // set once, never freed
std::string g_cudnn_why = "cuDNN was not loaded yet";

int LoadCudnn(const char* path) {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (g_cudnn) return g_cudnn->version;
  const char* name = path && *path ? path : "libcudnn.so.9";
  void* lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    const char* why = dlerror();
    return Fail(RF_CUDNN_E_UNAVAILABLE,
                std::string("cuDNN not found: ") + (why ? why : name) +
                    ". Fix: pip install nvidia-cudnn-cu12 (cuDNN 9), or pass the path of "
                    "libcudnn.so.9");
  }
  std::unique_ptr<Cudnn> c(new Cudnn());
#define RF_RESOLVE(fn)                                                         \
  c->fn##_ = reinterpret_cast<decltype(&fn)>(dlsym(lib, RF_DRIVER_STR(fn)));          \
  if (!c->fn##_)                                                               \
    return Fail(RF_CUDNN_E_UNAVAILABLE,                                        \
                std::string(name) + " lacks " RF_DRIVER_STR(fn) " (cuDNN 9 is needed)");
  RF_CUDNN_FUNCTIONS(RF_RESOLVE)
#undef RF_RESOLVE
  c->version = static_cast<int>(c->cudnnGetVersion_());
  if (c->version < 90000)
    return Fail(RF_CUDNN_E_UNAVAILABLE,
                std::string(name) + " is cuDNN " + std::to_string(c->version) +
                    "; the core needs cuDNN 9");
  g_cudnn = c.release();
  return g_cudnn->version;
}

// ---------------------------------------------------------------------------
// The CUDA driver, resolved from libcuda.so.1 (names as cuda.h maps them).
#define RF_DRIVER_FUNCTIONS(X) \
  RF_DRIVER_CONTEXT_FUNCTIONS(X) \
  X(cuMemAlloc)                  \
  X(cuMemcpyDtoDAsync)           \
  X(cuMemsetD8Async)

RF_DEFINE_DRIVER(RF_DRIVER_FUNCTIONS)

#define RF_CU(d, expr)                                                             \
  do {                                                                             \
    CUresult rf_r_ = (expr);                                                       \
    if (rf_r_ != CUDA_SUCCESS) return Fail(RF_CUDNN_E_CUDA, DriverError(d, #expr, rf_r_)); \
  } while (0)

int CudnnFail(const char* what, cudnnStatus_t status) {
  std::string msg = std::string("cuDNN call ") + what + " failed: " +
                    g_cudnn->cudnnGetErrorString_(status) + " (" +
                    std::to_string(static_cast<int>(status)) + ")";
  // cuDNN 9's NOT_SUPPORTED family is 3000-3999.
  if (static_cast<int>(status) / 1000 == 3)
    return Fail(RF_CUDNN_E_NOT_SUPPORTED, msg + ": cuDNN does not run this configuration");
  return Fail(RF_CUDNN_E_CUDNN, msg);
}

#define RF_DNN(expr)                                                    \
  do {                                                                  \
    cudnnStatus_t rf_s_ = (g_cudnn->expr);                              \
    if (rf_s_ != CUDNN_STATUS_SUCCESS) return CudnnFail(#expr, rf_s_);  \
  } while (0)

#define RF_TRY(expr)          \
  do {                        \
    int rf_rc_ = (expr);      \
    if (rf_rc_ != 0) return rf_rc_; \
  } while (0)

// ---------------------------------------------------------------------------
// The configuration, checked.
const int kGates[4] = {4, 3, 1, 1};
const char* const kModes[4] = {"lstm", "gru", "rnn_tanh", "rnn_relu"};

size_t AlignUp(size_t n) { return (n + 255) / 256 * 256; }

size_t ElementBytes(int dtype) {
  return dtype == RF_CUDNN_FLOAT64 ? 8 : (dtype == RF_CUDNN_FLOAT32 ? 4 : 2);
}

int CheckConfig(const rnnfuse_cudnn_rnn* r) {
  if (!r) return Fail(RF_CUDNN_E_ARGUMENT, "the configuration pointer is NULL");
  if (r->mode < 0 || r->mode > 3)
    return Fail(RF_CUDNN_E_ARGUMENT, "mode must be 0-3 (lstm, gru, rnn_tanh, rnn_relu); got " +
                                         std::to_string(r->mode));
  if (r->num_layers < 1 || r->num_units < 1 || r->input_size < 1)
    return Fail(RF_CUDNN_E_ARGUMENT,
                "num_layers, num_units and input_size must be >= 1; got " +
                    std::to_string(r->num_layers) + ", " + std::to_string(r->num_units) + ", " +
                    std::to_string(r->input_size));
  if (r->directions != 1 && r->directions != 2)
    return Fail(RF_CUDNN_E_ARGUMENT,
                "directions must be 1 or 2; got " + std::to_string(r->directions));
  if (r->proj_size != 0 &&
      (r->mode != RF_CUDNN_LSTM || r->proj_size < 0 || r->proj_size >= r->num_units))
    return Fail(RF_CUDNN_E_ARGUMENT,
                "proj_size must be 0, or in [1, num_units) for an LSTM; got proj_size " +
                    std::to_string(r->proj_size) + " with mode " + kModes[r->mode] +
                    " and num_units " + std::to_string(r->num_units));
  if (r->dtype < 0 || r->dtype > 3)
    return Fail(RF_CUDNN_E_ARGUMENT,
                "dtype must be 0-3 (float32, float16, bfloat16, float64); got " +
                                         std::to_string(r->dtype));
  if (r->algorithm < 0 || r->algorithm >= 16)
    return Fail(RF_CUDNN_E_ARGUMENT, "algorithm must be 4 * algo + math in [0, 16); got " +
                                         std::to_string(r->algorithm));
  if (!(r->dropout >= 0.0f && r->dropout < 1.0f))
    return Fail(RF_CUDNN_E_ARGUMENT, "dropout must be in [0, 1); got " +
                                         std::to_string(r->dropout));
  return 0;
}

int64_t ParamCount(const rnnfuse_cudnn_rnn* r) {
  const int64_t h = r->num_units, out = r->proj_size ? r->proj_size : r->num_units;
  const int64_t g = kGates[r->mode];
  int64_t total = 0;
  for (int p = 0; p < r->num_layers * r->directions; ++p) {
    const int64_t n = p < r->directions ? r->input_size : int64_t(r->directions) * out;
    total += g * h * n + g * h * out + int64_t(r->proj_size) * h + 2 * g * h;
  }
  return total;
}

int CheckShape(int steps, int batch, const int32_t* lengths) {
  if (steps < 1 || batch < 1)
    return Fail(RF_CUDNN_E_ARGUMENT, "steps and batch must be >= 1; got " +
                                         std::to_string(steps) + ", " + std::to_string(batch));
  if (lengths) {
    for (int b = 0; b < batch; ++b) {
      if (lengths[b] < 1 || lengths[b] > steps)
        return Fail(RF_CUDNN_E_ARGUMENT, "lengths[" + std::to_string(b) + "] = " +
                                             std::to_string(lengths[b]) + " is outside [1, " +
                                             std::to_string(steps) + "]");
    }
  }
  return 0;
}

// ---------------------------------------------------------------------------
// Cached cuDNN state.

// One contiguous copy between the canonical buffer and the weight space.
struct Copy {
  size_t flat, space, bytes;
};

// (steps, batch, lengths or empty for all `steps`) -> (work, reserve).
using ShapeKey = std::tuple<int, int, std::vector<int32_t>>;

// One configuration's RNN descriptor, weight-space size and layout, and
// cuDNN's temp-space sizes per shape (asked once: not before every call).
struct Plan {
  cudnnRNNDescriptor_t rnn = nullptr;
  size_t weight_bytes = 0;
  int built_batch = -1;  // persistent dynamic: the batch it was built for
  bool dynamic = false;
  bool copies_cover_space = false;  // no gap for a memset to zero
  std::vector<Copy> copies;  // computed on the first call that has a workspace
  std::map<ShapeKey, std::pair<size_t, size_t>> temp_sizes;
  ~Plan() {
    if (rnn && g_cudnn) g_cudnn->cudnnDestroyRNNDescriptor_(rnn);
  }
};

struct Dropout {
  cudnnDropoutDescriptor_t desc = nullptr;
  CUdeviceptr states = 0;  // kept for the process's life
};

using PlanKey = std::tuple<int, int, int, int, int, int, int, int, int, uint32_t, uint64_t>;

struct Device {
  std::mutex mu;  // held by a call from start to end
  cudnnHandle_t handle = nullptr;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
  std::map<std::pair<uint32_t, uint64_t>, Dropout> dropouts;
};

std::mutex g_devices_mu;
std::map<int, Device*>* g_devices = new std::map<int, Device*>();

uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

cudnnDataType_t DataType(int dtype) {
  if (dtype == RF_CUDNN_FLOAT64) return CUDNN_DATA_DOUBLE;
  return dtype == RF_CUDNN_FLOAT16 ? CUDNN_DATA_HALF
                                   : (dtype == RF_CUDNN_BFLOAT16 ? CUDNN_DATA_BFLOAT16
                                                                 : CUDNN_DATA_FLOAT);
}

// float64 computes in float64 (cuDNN requires it); every other type in float32.
cudnnDataType_t MathPrecision(int dtype) {
  return dtype == RF_CUDNN_FLOAT64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
}

// The math type that runs: float32 without TF32 is FMA and float64 the
// default, whatever was asked.
int MathOf(const rnnfuse_cudnn_rnn* r) {
  int math = r->algorithm % 4;
  if (r->dtype == RF_CUDNN_FLOAT32 && !r->allow_tf32) math = 3;
  if (r->dtype == RF_CUDNN_FLOAT64) math = 0;
  return math;
}

// Everything one entry needs: the stream's context made current, the
// device's lock held, the handle on the stream, the plan ready.
class Call {
 public:
  ~Call() {
    lock_ = std::unique_lock<std::mutex>();
    if (pushed_) {
      CUcontext c;
      d_->cuCtxPopCurrent_(&c);
    }
  }

  int Begin(const rnnfuse_cudnn_rnn* r, int steps, int batch, const int32_t* lengths,
            void* stream) {
    RF_TRY(CheckConfig(r));
    RF_TRY(CheckShape(steps, batch, lengths));
    r_ = *r;
    steps_ = steps;
    batch_ = batch;
    int loaded = rnnfuse_cudnn_load(nullptr);
    if (loaded < 0) return loaded;
    d_ = GetDriver();
    if (!d_->ok) return Fail(RF_CUDNN_E_UNAVAILABLE, d_->why);
    stream_ = static_cast<CUstream>(stream);
    CUcontext ctx = nullptr;
    if (stream_) {
      RF_CU(d_, d_->cuStreamGetCtx_(stream_, &ctx));
    } else {
      RF_CU(d_, d_->cuCtxGetCurrent_(&ctx));
    }
    if (!ctx)
      return Fail(RF_CUDNN_E_UNAVAILABLE,
                  "no CUDA context is current on this thread (initialise the framework's GPU "
                  "first, or pass its stream)");
    RF_CU(d_, d_->cuCtxPushCurrent_(ctx));
    pushed_ = true;
    CUdevice dev;
    RF_CU(d_, d_->cuCtxGetDevice_(&dev));
    {
      std::lock_guard<std::mutex> lock(g_devices_mu);
      Device*& slot = (*g_devices)[static_cast<int>(dev)];
      if (!slot) slot = new Device();
      device_ = slot;
    }
    lock_ = std::unique_lock<std::mutex>(device_->mu);
    if (!device_->handle) RF_DNN(cudnnCreate_(&device_->handle));
    RF_DNN(cudnnSetStream_(device_->handle, reinterpret_cast<cudaStream_t>(stream_)));
    RF_TRY(GetPlan());
    RF_TRY(Descriptors(lengths));
    return 0;
  }

  cudnnHandle_t handle() const { return device_->handle; }
  cudnnRNNDescriptor_t rnn() const { return plan_->rnn; }
  size_t weight_bytes() const { return plan_->weight_bytes; }
  bool lstm() const { return r_.mode == RF_CUDNN_LSTM; }
  CUstream stream() const { return stream_; }
  Driver* driver() const { return d_; }

  // The workspace this shape needs (two weight spaces, cuDNN's work space)
  // and the training reserve.
  int Sizes(size_t* workspace, size_t* reserve, size_t* work) {
    auto found = plan_->temp_sizes.find(shape_);
    if (found == plan_->temp_sizes.end()) {
      size_t w_inf = 0, r_inf = 0, w_tr = 0, r_tr = 0;
      RF_DNN(cudnnGetRNNTempSpaceSizes_(handle(), rnn(), CUDNN_FWD_MODE_INFERENCE, xd_, &w_inf,
                                        &r_inf));
      RF_DNN(cudnnGetRNNTempSpaceSizes_(handle(), rnn(), CUDNN_FWD_MODE_TRAINING, xd_, &w_tr,
                                        &r_tr));
      if (plan_->temp_sizes.size() >= 256) plan_->temp_sizes.clear();
      found = plan_->temp_sizes.emplace(shape_, std::make_pair(w_inf > w_tr ? w_inf : w_tr, r_tr))
                  .first;
    }
    *work = found->second.first;
    *workspace = 2 * AlignUp(weight_bytes()) + AlignUp(*work);
    *reserve = found->second.second;
    return 0;
  }

  // Splits the caller's workspace; checks the sizes it was given.
  int Spaces(void* workspace, size_t workspace_bytes, void* reserve, size_t reserve_bytes,
             bool need_reserve) {
    size_t need = 0, reserve_need = 0;
    RF_TRY(Sizes(&need, &reserve_need, &work_bytes_));
    if (!workspace || workspace_bytes < need)
      return Fail(RF_CUDNN_E_ARGUMENT, "the workspace has " + std::to_string(workspace_bytes) +
                                           " bytes; this call needs " + std::to_string(need) +
                                           " (rnnfuse_cudnn_sizes)");
    if (need_reserve && (!reserve || reserve_bytes < reserve_need))
      return Fail(RF_CUDNN_E_ARGUMENT,
                  "the reserve space has " + std::to_string(reserve_bytes) +
                      " bytes; this call needs " + std::to_string(reserve_need) +
                      " (rnnfuse_cudnn_sizes; was the forward run with training=1?)");
    reserve_bytes_ = reserve_need;
    char* base = static_cast<char*>(workspace);
    space_ = base;
    dspace_ = base + AlignUp(weight_bytes());
    work_ = base + 2 * AlignUp(weight_bytes());
    return Layout();
  }

  // The canonical parameters scattered into the weight space.
  int Scatter(const void* params) {
    if (!plan_->copies_cover_space)
      RF_CU(d_, d_->cuMemsetD8Async_(reinterpret_cast<CUdeviceptr>(space_), 0, weight_bytes(),
                                     stream_));
    for (const Copy& c : plan_->copies) {
      RF_CU(d_, d_->cuMemcpyDtoDAsync_(reinterpret_cast<CUdeviceptr>(space_ + c.space),
                                       reinterpret_cast<CUdeviceptr>(params) + c.flat, c.bytes,
                                       stream_));
    }
    return 0;
  }

  int ZeroGradientSpace() {
    RF_CU(d_, d_->cuMemsetD8Async_(reinterpret_cast<CUdeviceptr>(dspace_), 0, weight_bytes(),
                                   stream_));
    return 0;
  }

  int Gather(void* dparams) {
    for (const Copy& c : plan_->copies) {
      RF_CU(d_, d_->cuMemcpyDtoDAsync_(reinterpret_cast<CUdeviceptr>(dparams) + c.flat,
                                       reinterpret_cast<CUdeviceptr>(dspace_ + c.space), c.bytes,
                                       stream_));
    }
    return 0;
  }

  cudnnRNNDataDescriptor_t xd_ = nullptr, yd_ = nullptr;
  cudnnTensorDescriptor_t hd_ = nullptr, cd_ = nullptr;
  char *space_ = nullptr, *dspace_ = nullptr, *work_ = nullptr;
  size_t work_bytes_ = 0, reserve_bytes_ = 0;

  // Descriptors are destroyed with the call (after the lock is released is
  // fine: they are this call's own).
  struct Owned {
    Call* c;
    ~Owned() {
      if (!g_cudnn) return;
      if (c->xd_) g_cudnn->cudnnDestroyRNNDataDescriptor_(c->xd_);
      if (c->yd_) g_cudnn->cudnnDestroyRNNDataDescriptor_(c->yd_);
      if (c->hd_) g_cudnn->cudnnDestroyTensorDescriptor_(c->hd_);
      if (c->cd_) g_cudnn->cudnnDestroyTensorDescriptor_(c->cd_);
    }
  } owned_{this};

 private:
  int out() const { return r_.proj_size ? r_.proj_size : r_.num_units; }
  int pseudo() const { return r_.num_layers * r_.directions; }

  int GetDropout(Dropout** out) {
    // Without dropout every plan shares one zero-dropout descriptor.
    const float rate = r_.dropout;
    std::pair<uint32_t, uint64_t> key(FloatBits(rate), rate > 0.0f ? r_.seed : 0);
    Dropout& dr = device_->dropouts[key];
    if (!dr.desc) {
      cudnnDropoutDescriptor_t desc = nullptr;
      RF_DNN(cudnnCreateDropoutDescriptor_(&desc));
      size_t bytes = 0;
      if (rate > 0.0f) {
        RF_DNN(cudnnDropoutGetStatesSize_(handle(), &bytes));
        if (!dr.states) RF_CU(d_, d_->cuMemAlloc_(&dr.states, bytes));
      }
      RF_DNN(cudnnSetDropoutDescriptor_(desc, handle(), rate,
                                        rate > 0.0f ? reinterpret_cast<void*>(dr.states) : nullptr,
                                        bytes, static_cast<unsigned long long>(r_.seed)));
      dr.desc = desc;  // only a fully set descriptor is kept
    }
    *out = &dr;
    return 0;
  }

  int GetPlan() {
    const int math = MathOf(&r_);
    PlanKey key(r_.mode, r_.num_layers, r_.num_units, r_.proj_size, r_.input_size,
                r_.directions, r_.dtype, r_.algorithm / 4, math, FloatBits(r_.dropout),
                r_.dropout > 0.0f ? r_.seed : 0);
    std::unique_ptr<Plan>& slot = device_->plans[key];
    if (!slot) {
      Dropout* dr = nullptr;
      RF_TRY(GetDropout(&dr));
      std::unique_ptr<Plan> plan(new Plan());
      static const cudnnRNNAlgo_t kAlgos[] = {
          CUDNN_RNN_ALGO_STANDARD, CUDNN_RNN_ALGO_PERSIST_STATIC, CUDNN_RNN_ALGO_PERSIST_DYNAMIC,
          CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H};
      static const cudnnMathType_t kMaths[] = {CUDNN_DEFAULT_MATH, CUDNN_TENSOR_OP_MATH,
                                               CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
                                               CUDNN_FMA_MATH};
      static const cudnnRNNMode_t kCells[] = {CUDNN_LSTM, CUDNN_GRU, CUDNN_RNN_TANH,
                                              CUDNN_RNN_RELU};
      const cudnnRNNAlgo_t algo = kAlgos[r_.algorithm / 4];
      RF_DNN(cudnnCreateRNNDescriptor_(&plan->rnn));
      RF_DNN(cudnnSetRNNDescriptor_v8_(
          plan->rnn, algo, kCells[r_.mode], CUDNN_RNN_DOUBLE_BIAS,
          r_.directions == 2 ? CUDNN_BIDIRECTIONAL : CUDNN_UNIDIRECTIONAL, CUDNN_LINEAR_INPUT,
          DataType(r_.dtype), MathPrecision(r_.dtype), kMaths[math], r_.input_size, r_.num_units, out(),
          r_.num_layers, dr->desc, CUDNN_RNN_PADDED_IO_ENABLED));
      RF_DNN(cudnnGetRNNWeightSpaceSize_(handle(), plan->rnn, &plan->weight_bytes));
      plan->dynamic = algo == CUDNN_RNN_ALGO_PERSIST_DYNAMIC;
      slot = std::move(plan);  // only a fully set plan is kept
    }
    plan_ = slot.get();
    if (plan_->dynamic && plan_->built_batch != batch_) {
      RF_DNN(cudnnBuildRNNDynamic_(handle(), plan_->rnn, batch_));
      plan_->built_batch = batch_;
    }
    return 0;
  }

  int Descriptors(const int32_t* lengths) {
    const cudnnDataType_t dt = DataType(r_.dtype);
    std::vector<int> all;
    std::get<0>(shape_) = steps_;
    std::get<1>(shape_) = batch_;
    if (lengths) std::get<2>(shape_).assign(lengths, lengths + batch_);
    if (!lengths) {
      all.assign(batch_, steps_);
      lengths = all.data();
    }
    double fill = 0.0;  // all-zero bytes: 0 in any data type
    RF_DNN(cudnnCreateRNNDataDescriptor_(&xd_));
    RF_DNN(cudnnCreateRNNDataDescriptor_(&yd_));
    RF_DNN(cudnnSetRNNDataDescriptor_(xd_, dt, CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_UNPACKED, steps_,
                                      batch_, r_.input_size, lengths, &fill));
    RF_DNN(cudnnSetRNNDataDescriptor_(yd_, dt, CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_UNPACKED, steps_,
                                      batch_, r_.directions * out(), lengths, &fill));
    RF_DNN(cudnnCreateTensorDescriptor_(&hd_));
    RF_DNN(cudnnCreateTensorDescriptor_(&cd_));
    int hdims[3] = {pseudo(), batch_, out()};
    int hstr[3] = {batch_ * out(), out(), 1};
    int cdims[3] = {pseudo(), batch_, r_.num_units};
    int cstr[3] = {batch_ * r_.num_units, r_.num_units, 1};
    RF_DNN(cudnnSetTensorNdDescriptor_(hd_, dt, 3, hdims, hstr));
    RF_DNN(cudnnSetTensorNdDescriptor_(cd_, dt, 3, cdims, cstr));
    return 0;
  }

  // The canonical <-> weight-space copies, computed once a plan with the
  // workspace as the base address; each cuDNN matrix's shape is checked
  // against the canonical layout, so a mismatch is an error, not wrong
  // numbers.
  int Layout() {
    if (!plan_->copies.empty()) return 0;
    cudnnTensorDescriptor_t m = nullptr, b = nullptr;
    int rc = LayoutWith(&m, &b);
    if (m) g_cudnn->cudnnDestroyTensorDescriptor_(m);
    if (b) g_cudnn->cudnnDestroyTensorDescriptor_(b);
    return rc;
  }

  int Count(cudnnTensorDescriptor_t d, int64_t* count) {
    cudnnDataType_t dt;
    int nb = 0, dims[8], strides[8];
    RF_DNN(cudnnGetTensorNdDescriptor_(d, 8, &dt, &nb, dims, strides));
    int64_t c = 1;
    for (int i = 0; i < nb; ++i) c *= dims[i];
    *count = c;
    return 0;
  }

  int LayoutWith(cudnnTensorDescriptor_t* m, cudnnTensorDescriptor_t* b) {
    RF_DNN(cudnnCreateTensorDescriptor_(m));
    RF_DNN(cudnnCreateTensorDescriptor_(b));
    const int64_t h = r_.num_units, rr = out(), g = kGates[r_.mode];
    const size_t es = ElementBytes(r_.dtype);
    std::vector<Copy> copies;
    size_t flat = 0;
    auto add = [&](const void* addr, int64_t count) {
      size_t off = static_cast<const char*>(addr) - space_;
      size_t bytes = count * es;
      if (!copies.empty() && copies.back().flat + copies.back().bytes == flat &&
          copies.back().space + copies.back().bytes == off) {
        copies.back().bytes += bytes;  // contiguous on both sides: one copy
      } else {
        copies.push_back({flat, off, bytes});
      }
      flat += bytes;
    };
    const int matrices = 2 * kGates[r_.mode] + (r_.proj_size ? 1 : 0);
    for (int pass = 0; pass < 2; ++pass) {  // matrices, then biases
      for (int p = 0; p < pseudo(); ++p) {
        const int64_t n = p < r_.directions ? r_.input_size : int64_t(r_.directions) * rr;
        for (int k = 0; k < (pass == 0 ? matrices : 2 * kGates[r_.mode]); ++k) {
          void* maddr = nullptr;
          void* baddr = nullptr;
          RF_DNN(cudnnGetRNNWeightParams_(handle(), rnn(), p, weight_bytes(), space_, k, *m,
                                          &maddr, *b, &baddr));
          int64_t expected = 0, got = 0;
          if (pass == 0) {
            expected = k < g ? h * n : (k < 2 * g ? h * rr : int64_t(r_.proj_size) * h);
            RF_TRY(Count(*m, &got));
            if (!maddr || got != expected)
              return Fail(RF_CUDNN_E_CUDNN,
                          "cuDNN's weight matrix (pseudo-layer " + std::to_string(p) +
                              ", linLayerID " + std::to_string(k) + ") has " +
                              std::to_string(got) + " elements; the canonical layout expects " +
                              std::to_string(expected));
            add(maddr, got);
          } else {
            RF_TRY(Count(*b, &got));
            if (!baddr || got != h)
              return Fail(RF_CUDNN_E_CUDNN,
                          "cuDNN's bias (pseudo-layer " + std::to_string(p) + ", linLayerID " +
                              std::to_string(k) + ") has " + std::to_string(got) +
                              " elements; expected " + std::to_string(h));
            add(baddr, got);
          }
        }
      }
    }
    if (flat != size_t(ParamCount(&r_)) * es)
      return Fail(RF_CUDNN_E_CUDNN, "the canonical layout covers " + std::to_string(flat / es) +
                                        " elements; expected " +
                                        std::to_string(ParamCount(&r_)));
    plan_->copies_cover_space = flat == weight_bytes();
    plan_->copies = std::move(copies);
    return 0;
  }

  rnnfuse_cudnn_rnn r_{};
  int steps_ = 0, batch_ = 0;
  Driver* d_ = nullptr;
  CUstream stream_ = nullptr;
  bool pushed_ = false;
  Device* device_ = nullptr;
  std::unique_lock<std::mutex> lock_;
  Plan* plan_ = nullptr;
  ShapeKey shape_;
};

int CheckDeviceLengths(const int32_t* host_lengths, const int32_t* dev_lengths) {
  if (host_lengths && !dev_lengths)
    return Fail(RF_CUDNN_E_ARGUMENT,
                "dev_lengths is NULL with host_lengths given: padded lengths need their copy "
                "in device memory too (int32 [batch])");
  return 0;
}

// Runs an entry's body; a C++ exception (an allocation failing, say) is
// an error code with its message, never an exception through the C ABI.
template <typename F>
int Guarded(F body) {
  try {
    return body();
  } catch (const std::exception& e) {
    return Fail(RF_CUDNN_E_CUDA, std::string("the cuDNN core failed: ") + e.what());
  } catch (...) {
    return Fail(RF_CUDNN_E_CUDA, "the cuDNN core failed: an unknown C++ exception");
  }
}

}  // namespace

extern "C" {

RF_EXPORT int rnnfuse_cudnn_abi_version(void) { return RNNFUSE_CUDNN_ABI_VERSION; }

RF_EXPORT const char* rnnfuse_cudnn_last_error(void) { return g_error.c_str(); }

RF_EXPORT int rnnfuse_cudnn_load(const char* path) {
  return Guarded([&]() -> int { return LoadCudnn(path); });
}

RF_EXPORT int64_t rnnfuse_cudnn_param_count(const rnnfuse_cudnn_rnn* rnn) {
  if (CheckConfig(rnn) != 0) return -1;
  return ParamCount(rnn);
}

RF_EXPORT int rnnfuse_cudnn_sizes(const rnnfuse_cudnn_rnn* rnn, int steps, int batch,
                                  const int32_t* host_lengths, void* stream,
                                  size_t* workspace_bytes, size_t* reserve_bytes) {
  return Guarded([&]() -> int {
    if (!workspace_bytes || !reserve_bytes)
      return Fail(RF_CUDNN_E_ARGUMENT, "workspace_bytes and reserve_bytes must not be NULL");
    Call call;
    RF_TRY(call.Begin(rnn, steps, batch, host_lengths, stream));
    size_t work = 0;
    return call.Sizes(workspace_bytes, reserve_bytes, &work);
  });
}

RF_EXPORT int rnnfuse_cudnn_forward(const rnnfuse_cudnn_rnn* rnn, int training, int steps,
                                    int batch, const int32_t* host_lengths,
                                    const int32_t* dev_lengths, void* stream, const void* x,
                                    const void* hx, const void* cx, const void* params, void* y,
                                    void* hy, void* cy, void* workspace, size_t workspace_bytes,
                                    void* reserve, size_t reserve_bytes) {
  return Guarded([&]() -> int {
    RF_TRY(CheckDeviceLengths(host_lengths, dev_lengths));
    if (!x || !params || !y) return Fail(RF_CUDNN_E_ARGUMENT, "x, params and y must not be NULL");
    Call call;
    RF_TRY(call.Begin(rnn, steps, batch, host_lengths, stream));
    RF_TRY(call.Spaces(workspace, workspace_bytes, reserve, reserve_bytes, training != 0));
    RF_TRY(call.Scatter(params));
    const bool lstm = call.lstm();
    RF_DNN(cudnnRNNForward_(call.handle(), call.rnn(),
                            training ? CUDNN_FWD_MODE_TRAINING : CUDNN_FWD_MODE_INFERENCE,
                            dev_lengths, call.xd_, x, call.yd_, y, call.hd_, hx, hy, call.cd_,
                            lstm ? cx : nullptr, lstm ? cy : nullptr, call.weight_bytes(),
                            call.space_, call.work_bytes_, call.work_,
                            training ? call.reserve_bytes_ : 0, training ? reserve : nullptr));
    return 0;
  });
}

RF_EXPORT int rnnfuse_cudnn_backward_data(const rnnfuse_cudnn_rnn* rnn, int steps, int batch,
                                          const int32_t* host_lengths,
                                          const int32_t* dev_lengths, void* stream, const void* y,
                                          const void* dy, const void* dhy, const void* dcy,
                                          const void* hx, const void* cx, const void* params,
                                          void* dx, void* dhx, void* dcx, void* workspace,
                                          size_t workspace_bytes, void* reserve,
                                          size_t reserve_bytes) {
  return Guarded([&]() -> int {
    RF_TRY(CheckDeviceLengths(host_lengths, dev_lengths));
    if (!y || !dy || !params || !dx)
      return Fail(RF_CUDNN_E_ARGUMENT, "y, dy, params and dx must not be NULL");
    Call call;
    RF_TRY(call.Begin(rnn, steps, batch, host_lengths, stream));
    RF_TRY(call.Spaces(workspace, workspace_bytes, reserve, reserve_bytes, true));
    RF_TRY(call.Scatter(params));
    const bool lstm = call.lstm();
    RF_DNN(cudnnRNNBackwardData_v8_(call.handle(), call.rnn(), dev_lengths, call.yd_, y, dy,
                                    call.xd_, dx, call.hd_, hx, dhy, dhx, call.cd_,
                                    lstm ? cx : nullptr, lstm ? dcy : nullptr,
                                    lstm ? dcx : nullptr, call.weight_bytes(), call.space_,
                                    call.work_bytes_, call.work_, call.reserve_bytes_, reserve));
    return 0;
  });
}

RF_EXPORT int rnnfuse_cudnn_backward_weights(const rnnfuse_cudnn_rnn* rnn, int steps, int batch,
                                             const int32_t* host_lengths,
                                             const int32_t* dev_lengths, void* stream,
                                             const void* x, const void* hx, const void* y,
                                             void* dparams, void* workspace,
                                             size_t workspace_bytes, void* reserve,
                                             size_t reserve_bytes) {
  return Guarded([&]() -> int {
    RF_TRY(CheckDeviceLengths(host_lengths, dev_lengths));
    if (!x || !y || !dparams)
      return Fail(RF_CUDNN_E_ARGUMENT, "x, y and dparams must not be NULL");
    Call call;
    RF_TRY(call.Begin(rnn, steps, batch, host_lengths, stream));
    RF_TRY(call.Spaces(workspace, workspace_bytes, reserve, reserve_bytes, true));
    RF_TRY(call.ZeroGradientSpace());
    RF_DNN(cudnnRNNBackwardWeights_v8_(call.handle(), call.rnn(), CUDNN_WGRAD_MODE_ADD,
                                       dev_lengths, call.xd_, x, call.hd_, hx, call.yd_, y,
                                       call.weight_bytes(), call.dspace_, call.work_bytes_,
                                       call.work_, call.reserve_bytes_, reserve));
    RF_TRY(call.Gather(dparams));
    return 0;
  });
}

}  // extern "C"
