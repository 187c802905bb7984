// Host side of rnnfuse's wavefront kernel: a C ABI over the CUDA driver API.
//
// Why the driver API, reached through dlopen("libcuda.so.1"): the same
// library serves TensorFlow (compiled into its op, where no second CUDA
// runtime may be linked: TensorFlow's own cudart stub owns those symbols)
// and torch (loaded with ctypes next to torch's own runtime). Both
// frameworks use the device's primary context, so a module loaded here runs
// on their streams. The library loads on a machine without a driver (CI
// compiles and loads it); the first call then fails with a clear error.
//
// The kernel (wavefront.cu, compiled by nvcc to an sm_90 cubin) is embedded
// with .incbin (RF_WAVEFRONT_CUBIN, a path, at compile time) and loaded once
// per CUDA context with cuModuleLoadData.
//
// C ABI (every function returns 0 on success, else a negative code and
// rnnfuse_wf_last_error() says why):
//   rnnfuse_wf_plan(...)        can this stack run? (no GPU needed)
//   rnnfuse_wf_workspace_bytes  bytes of workspace a call needs
//   rnnfuse_wf_device_limits    SM count, shared-memory limit, compute capability
//   rnnfuse_wf_forward(...)     one forward pass on a stream
//   rnnfuse_wf_forward_saving   the same, also saving gates and c (training)
//   rnnfuse_wf_forward_variant  the same, with the forward step's variant
//                               (wavefront.cuh: 0 to 4, or 5: 4 where it takes the stack)
//   rnnfuse_wf_tma_staging      variant 4's copies of one chunk (CPU tests)
//   rnnfuse_wf_backward_plan    can the backward run one LSTM or GRU layer? (no GPU)
//   rnnfuse_wf_backward_kind(...)  the backward recurrence of one LSTM or GRU layer
//   rnnfuse_wf_backward_stack_plan  can the reverse-wavefront backward run the
//                               whole LSTM stack? (no GPU)
//   rnnfuse_wf_backward_stack(...)  every layer's backward recurrence in one
//                               launch (v2, reverse wavefront)

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "cuda_driver.h"
#include "wavefront_plan.h"

#ifndef RF_WAVEFRONT_CUBIN
#error "define RF_WAVEFRONT_CUBIN as the path of the compiled wavefront cubin"
#endif

asm(".section .rodata\n"
    ".balign 64\n"
    ".hidden rnnfuse_wf_cubin_start\n"
    "rnnfuse_wf_cubin_start:\n"
    ".incbin \"" RF_WAVEFRONT_CUBIN "\"\n"
    ".hidden rnnfuse_wf_cubin_end\n"
    "rnnfuse_wf_cubin_end:\n"
    ".byte 0\n"
    ".previous\n");
extern "C" const unsigned char rnnfuse_wf_cubin_start[];
extern "C" const unsigned char rnnfuse_wf_cubin_end[];

namespace {

using rnnfuse_wf::Args;

thread_local std::string g_error;

int Fail(const std::string& message) {
  g_error = message;
  return -1;
}

// The driver functions this library calls (cuda_driver.h resolves them).
#define RF_DRIVER_FUNCTIONS(X)                       \
  RF_DRIVER_CONTEXT_FUNCTIONS(X)                     \
  X(cuDeviceGet)                                     \
  X(cuDeviceGetAttribute)                            \
  X(cuModuleLoadData)                                \
  X(cuModuleGetFunction)                             \
  X(cuFuncSetAttribute)                              \
  X(cuOccupancyMaxActiveBlocksPerMultiprocessor)     \
  X(cuMemsetD32Async)                                \
  X(cuLaunchKernelEx)                                \
  X(cuTensorMapEncodeTiled)

RF_DEFINE_DRIVER(RF_DRIVER_FUNCTIONS)

#define RF_CHECK_CU(d, expr)                                  \
  do {                                                        \
    CUresult rf_r_ = (expr);                                  \
    if (rf_r_ != CUDA_SUCCESS) return Fail(DriverError(d, #expr, rf_r_)); \
  } while (0)

struct Kernels {
  CUmodule module = nullptr;
  CUfunction f16 = nullptr, bf16 = nullptr;
  CUfunction f16_v1 = nullptr, bf16_v1 = nullptr;  // the forward's variant 1
  CUfunction f16_v2 = nullptr, bf16_v2 = nullptr;  // the forward's variant 2 (wgmma)
  CUfunction f16_v3 = nullptr, bf16_v3 = nullptr;  // the forward's variant 3 (data as flags)
  CUfunction f16_v4 = nullptr, bf16_v4 = nullptr;  // the forward's variant 4 (tensor copies)
  CUfunction f16_ind = nullptr, bf16_ind = nullptr;  // independent layers
  CUfunction bwd_f16 = nullptr, bwd_bf16 = nullptr;
  CUfunction bwd_gru_f16 = nullptr, bwd_gru_bf16 = nullptr;  // the GRU backward
  CUfunction bwds_f16 = nullptr, bwds_bf16 = nullptr;
  // The stack backward's variants 1 and 2 (wavefront.cuh, "Variants").
  CUfunction bwds_v_f16[2] = {nullptr, nullptr}, bwds_v_bf16[2] = {nullptr, nullptr};
  int configured_bwds_v_smem[2] = {0, 0};
  int configured_smem = 0, configured_bwd_smem = 0, configured_bwds_smem = 0;
  int configured_v1_smem = 0, configured_v2_smem = 0, configured_ind_smem = 0;
  int configured_v3_smem = 0, configured_v4_smem = 0;
  int configured_bwd_gru_smem = 0;
};

std::mutex g_mu;
std::map<CUcontext, Kernels>* g_kernels = new std::map<CUcontext, Kernels>();

// The kernels in the current context (loads the module the first time).
int GetKernels(Driver* d, CUcontext ctx, Kernels** out) {
  std::lock_guard<std::mutex> lock(g_mu);
  Kernels& k = (*g_kernels)[ctx];
  if (!k.module) {
    RF_CHECK_CU(d, d->cuModuleLoadData_(&k.module, rnnfuse_wf_cubin_start));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.f16, k.module, "rnnfuse_wf_forward_f16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bf16, k.module, "rnnfuse_wf_forward_bf16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.f16_v1, k.module, "rnnfuse_wf_forward_v1_f16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bf16_v1, k.module, "rnnfuse_wf_forward_v1_bf16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.f16_v2, k.module, "rnnfuse_wf_forward_v2_f16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bf16_v2, k.module, "rnnfuse_wf_forward_v2_bf16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.f16_v3, k.module, "rnnfuse_wf_forward_v3_f16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bf16_v3, k.module, "rnnfuse_wf_forward_v3_bf16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.f16_v4, k.module, "rnnfuse_wf_forward_v4_f16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bf16_v4, k.module, "rnnfuse_wf_forward_v4_bf16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.f16_ind, k.module, "rnnfuse_wf_forward_ind_f16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bf16_ind, k.module,
                                           "rnnfuse_wf_forward_ind_bf16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bwd_f16, k.module, "rnnfuse_wf_backward_f16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bwd_bf16, k.module, "rnnfuse_wf_backward_bf16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bwd_gru_f16, k.module,
                                           "rnnfuse_wf_backward_gru_f16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bwd_gru_bf16, k.module,
                                           "rnnfuse_wf_backward_gru_bf16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bwds_f16, k.module,
                                           "rnnfuse_wf_backward_stack_f16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bwds_bf16, k.module,
                                           "rnnfuse_wf_backward_stack_bf16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bwds_v_f16[0], k.module,
                                           "rnnfuse_wf_backward_stack_v1_f16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bwds_v_bf16[0], k.module,
                                           "rnnfuse_wf_backward_stack_v1_bf16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bwds_v_f16[1], k.module,
                                           "rnnfuse_wf_backward_stack_v2_f16"));
    RF_CHECK_CU(d, d->cuModuleGetFunction_(&k.bwds_v_bf16[1], k.module,
                                           "rnnfuse_wf_backward_stack_v2_bf16"));
  }
  *out = &k;
  return 0;
}

int DeviceLimits(Driver* d, CUdevice dev, int* sms, int* smem, int* major, int* minor) {
  RF_CHECK_CU(d, d->cuDeviceGetAttribute_(sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
  RF_CHECK_CU(d, d->cuDeviceGetAttribute_(
                     smem, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev));
  RF_CHECK_CU(d, d->cuDeviceGetAttribute_(major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
  RF_CHECK_CU(d, d->cuDeviceGetAttribute_(minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
  return 0;
}

size_t AlignUp(size_t n) { return (n + 255) / 256 * 256; }

size_t FlagBytes(int L) { return AlignUp(static_cast<size_t>(L) * rnnfuse_wf::kFlagStride * 4); }

// Plans a stack into `args` (the reason in g_error when it cannot run).
bool PlanInto(int gru, int num_layers, int units, int batch, int steps, int input_size, int sms,
              int smem_limit, Args* args, int* smem, int independent = 0) {
  memset(args, 0, sizeof(*args));
  char why[512];
  if (rnnfuse_wf::Plan(gru, num_layers, units, batch, steps, input_size, sms, smem_limit, args,
                       smem, why, sizeof(why), independent))
    return true;
  g_error = why;
  return false;
}

// Makes the context of stream `s` (or the current one) current for the
// object's lifetime and reads the device's limits; `rc` != 0 on failure.
struct StreamContext {
  Driver* d;
  CUcontext ctx = nullptr;
  bool pushed = false;
  int rc = 0;
  int sms = 0, smem_limit = 0, major = 0, minor = 0;
  StreamContext(Driver* driver, CUstream s) : d(driver) {
    rc = Init(s);
  }
  int Init(CUstream s) {
    if (s) {
      RF_CHECK_CU(d, d->cuStreamGetCtx_(s, &ctx));
    } else {
      RF_CHECK_CU(d, d->cuCtxGetCurrent_(&ctx));
    }
    if (!ctx) return Fail("no CUDA context is current (initialise the framework's GPU first)");
    RF_CHECK_CU(d, d->cuCtxPushCurrent_(ctx));
    pushed = true;
    CUdevice dev;
    RF_CHECK_CU(d, d->cuCtxGetDevice_(&dev));
    if (DeviceLimits(d, dev, &sms, &smem_limit, &major, &minor) != 0) return -1;
    if (major != 9) {
      return Fail("the wavefront kernel is built for compute capability 9.0 (Hopper); this GPU "
                  "is " + std::to_string(major) + "." + std::to_string(minor));
    }
    return 0;
  }
  ~StreamContext() {
    if (pushed) {
      CUcontext c;
      d->cuCtxPopCurrent_(&c);
    }
  }
};

// A cooperative launch of `ctas` CTAs of kThreads threads (every CTA must
// be resident at once: they wait on each other), after zeroing `flag_words`
// words at `flags`. `maps`: the second parameter of a kernel that has one
// (variant 4's StageMaps).
int LaunchCooperative(Driver* d, CUfunction f, CUstream s, int sms, int ctas, int smem,
                      void* args, void* flags, size_t flag_words, void* maps = nullptr) {
  int per_sm = 0;
  RF_CHECK_CU(d, d->cuOccupancyMaxActiveBlocksPerMultiprocessor_(&per_sm, f,
                                                                  rnnfuse_wf::kThreads, smem));
  if (per_sm * sms < ctas) {
    return Fail("the wavefront kernel's " + std::to_string(ctas) +
                " CTAs cannot all be resident (" + std::to_string(per_sm) +
                " a multiprocessor, " + std::to_string(sms) + " multiprocessors)");
  }
  CUlaunchAttribute cooperative;
  memset(&cooperative, 0, sizeof(cooperative));
  cooperative.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
  cooperative.value.cooperative = 1;
  CUlaunchConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.gridDimX = static_cast<unsigned>(ctas);
  cfg.gridDimY = cfg.gridDimZ = 1;
  cfg.blockDimX = rnnfuse_wf::kThreads;
  cfg.blockDimY = cfg.blockDimZ = 1;
  cfg.sharedMemBytes = static_cast<unsigned>(smem);
  cfg.hStream = s;
  cfg.attrs = &cooperative;
  cfg.numAttrs = 1;
  RF_CHECK_CU(d, d->cuMemsetD32Async_(reinterpret_cast<CUdeviceptr>(flags), 0, flag_words, s));
  void* params_list[] = {args, maps};
  RF_CHECK_CU(d, d->cuLaunchKernelEx_(&cfg, f, params_list, nullptr));
  return 0;
}

// Raises the kernels' dynamic shared-memory limit to `smem` if needed.
int ConfigureSmem(Driver* d, CUfunction a, CUfunction b, int smem, int* configured) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (smem > *configured) {
    RF_CHECK_CU(d, d->cuFuncSetAttribute_(a, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                          smem));
    RF_CHECK_CU(d, d->cuFuncSetAttribute_(b, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                          smem));
    *configured = smem;
  }
  return 0;
}

// The backward's flags: one a CTA and the timed-out word after them.
constexpr int kBwdMaxCtas = 1024;
size_t BwdFlagBytes() { return AlignUp((kBwdMaxCtas + 1) * 4); }

bool PlanBackwardInto(int units, int batch, int steps, int sms, int smem_limit,
                      rnnfuse_wf::BwdArgs* args) {
  memset(args, 0, sizeof(*args));
  char why[512];
  if (!rnnfuse_wf::PlanBackward(units, batch, steps, sms, smem_limit, args, why, sizeof(why))) {
    g_error = why;
    return false;
  }
  if (args->ctas > kBwdMaxCtas) {
    g_error = "the wavefront backward kernel runs at most " + std::to_string(kBwdMaxCtas) +
              " CTAs";
    return false;
  }
  return true;
}

// The stack backward's flags: kFlagStride a layer, then the timed-out word.
size_t BwdStackFlagBytes() {
  return AlignUp((static_cast<size_t>(rnnfuse_wf::kMaxLayers) * rnnfuse_wf::kFlagStride + 1) * 4);
}

bool PlanBackwardStackInto(int num_layers, int units, int batch, int steps, int input_size,
                           int sms, int smem_limit, rnnfuse_wf::BwdStackArgs* args,
                           int variant = 0) {
  memset(args, 0, sizeof(*args));
  char why[512];
  if (!rnnfuse_wf::PlanBackwardStack(num_layers, units, batch, steps, input_size, sms,
                                     smem_limit, args, why, sizeof(why), variant)) {
    g_error = why;
    return false;
  }
  return true;
}

// The driver, in *out, for an entry of element type `dtype`; -1 with the
// reason where the driver cannot be used or dtype is neither 0 (float16)
// nor 1 (bfloat16).
int Begin(int dtype, Driver** out) {
  Driver* d = GetDriver();
  if (!d->ok) return Fail(d->why);
  if (dtype != 0 && dtype != 1) return Fail("dtype must be 0 (float16) or 1 (bfloat16)");
  *out = d;
  return 0;
}

// The buffers both backward kernels read and write (BwdArgs, BwdStackArgs:
// wavefront.cuh), the flags at the start of `workspace`.
template <typename A>
void SetBackwardBuffers(A* args, const float* gates, const float* cseq, const void* c0,
                        const void* dy, const void* dhy, const void* dcy, const int* lengths,
                        void* dgates, float* dh0, float* dc0, void* workspace) {
  args->gates = gates;
  args->cseq = cseq;
  args->c0 = c0;
  args->dy = dy;
  args->dhy = dhy;
  args->dcy = dcy;
  args->lengths = lengths;
  args->dgates = dgates;
  args->dh0 = dh0;
  args->dc0 = dc0;
  args->flags = static_cast<unsigned*>(workspace);
}

// Raises the kernel pair's shared-memory limit where needed, then launches
// the one of element type `dtype` (0: f16, 1: bf16) cooperatively.
int Launch(Driver* d, const StreamContext& sc, CUstream s, int dtype, CUfunction f16,
           CUfunction bf16, int* configured, int ctas, int smem, void* args, void* workspace,
           size_t flag_words, void* maps = nullptr) {
  if (ConfigureSmem(d, f16, bf16, smem, configured) != 0) return -1;
  return LaunchCooperative(d, dtype == 0 ? f16 : bf16, s, sc.sms, ctas, smem, args, workspace,
                           flag_words, maps);
}

// Variant 4's tensor maps (wavefront.cuh, "Variant 4"): each sequence buffer
// as [planes][B][H] of the element type, boxes of 64 inputs x 32 rows x 1
// plane with the 128-byte swizzle; rows past B read as zeros. The work map
// only where there is a layer below the top.
int EncodeStageMaps(Driver* d, int dtype, const Args& a, const void* h0, rnnfuse_wf::StageMaps* m) {
  static_assert(sizeof(rnnfuse_wf::TmaMap) == sizeof(CUtensorMap), "TmaMap is a CUtensorMap");
  memset(m, 0, sizeof(*m));
  const void* base[rnnfuse_wf::kTmaMaps] = {a.work, a.y, h0};
  const int planes[rnnfuse_wf::kTmaMaps] = {(a.L - 1) * a.T, a.T, a.L};
  for (int i = 0; i < rnnfuse_wf::kTmaMaps; ++i) {
    if (planes[i] == 0) continue;
    if (reinterpret_cast<uintptr_t>(base[i]) % 16 != 0)
      return Fail("the forward's variant 4 copies y, h0 and the workspace by tensor copies, "
                  "which need 16-byte-aligned buffers; one is not (pass aligned tensors)");
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(a.H), static_cast<cuuint64_t>(a.B),
                                static_cast<cuuint64_t>(planes[i])};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(a.H) * 2,
                                   static_cast<cuuint64_t>(a.B) * a.H * 2};
    const cuuint32_t box[3] = {rnnfuse_wf::kTmaBlockK, rnnfuse_wf::kNGroup, 1};
    const cuuint32_t unit[3] = {1, 1, 1};
    CUtensorMap map;
    RF_CHECK_CU(d, d->cuTensorMapEncodeTiled_(
                       &map, dtype == 0 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                        : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                       3, const_cast<void*>(base[i]), dims, strides, box, unit,
                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                       CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    memcpy(&m->map[i], &map, sizeof(map));
  }
  return 0;
}

// One forward launch (the entries below; `independent`: wavefront.cuh,
// "Independent layers").
int Forward(void* stream, int dtype, int gru, int num_layers, int units, int batch, int steps,
            int input_size, const void* xproj, const void* params, const void* h0, const void* c0,
            const int* lengths, void* y, void* hy, void* cy, void* workspace, int mode,
            int variant, unsigned long long* trace, int trace_steps, float* gates_out,
            float* c_out, int independent);

}  // namespace

extern "C" {

__attribute__((visibility("default"))) const char* rnnfuse_wf_last_error() {
  return g_error.c_str();
}

// 1 if the stack can run with these device limits, 0 if not (the reason in
// rnnfuse_wf_last_error).
__attribute__((visibility("default"))) int rnnfuse_wf_plan(int gru, int num_layers, int units,
                                                           int batch, int steps, int input_size,
                                                           int sms, int smem_limit,
                                                           int* ctas_out, int* smem_out) {
  Args args;
  int smem = 0;
  if (!PlanInto(gru, num_layers, units, batch, steps, input_size, sms, smem_limit, &args, &smem))
    return 0;
  if (ctas_out) *ctas_out = args.cta_start[num_layers];
  if (smem_out) *smem_out = smem;
  return 1;
}

// The per-layer plan as numbers (for tests and the docs): for each layer
// ctas, mg, kg, ng, units, kpad, smem_total (7 ints).
__attribute__((visibility("default"))) int rnnfuse_wf_plan_layers(int gru, int num_layers,
                                                                  int units, int batch, int steps,
                                                                  int input_size, int sms,
                                                                  int smem_limit, int* out) {
  Args args;
  int smem = 0;
  if (!PlanInto(gru, num_layers, units, batch, steps, input_size, sms, smem_limit, &args, &smem))
    return 0;
  for (int l = 0; l < num_layers; ++l) {
    const rnnfuse_wf::LayerPlan& p = args.layer[l];
    const int v[7] = {p.ctas, p.mg, p.kg, p.ng, p.units, p.kpad, p.smem_total};
    memcpy(out + 7 * l, v, sizeof(v));
  }
  return 1;
}

// Workspace bytes of one call: the flags, then L-1 sequence buffers.
__attribute__((visibility("default"))) size_t rnnfuse_wf_workspace_bytes(int num_layers, int units,
                                                                          int batch, int steps,
                                                                          int elem_bytes) {
  return FlagBytes(num_layers) + static_cast<size_t>(num_layers - 1) * steps * batch * units *
                                     static_cast<size_t>(elem_bytes);
}

// Device `ordinal`'s SM count, opt-in shared memory a block and compute
// capability (no context needed: TensorFlow keeps its contexts on its own
// threads).
__attribute__((visibility("default"))) int rnnfuse_wf_device_limits(int ordinal, int* sms,
                                                                    int* smem, int* major,
                                                                    int* minor) {
  Driver* d = GetDriver();
  if (!d->ok) return Fail(d->why);
  CUdevice dev;
  RF_CHECK_CU(d, d->cuDeviceGet_(&dev, ordinal));
  return DeviceLimits(d, dev, sms, smem, major, minor);
}

// One forward pass, saving what the backward reads where `gates_out` and
// `c_out` are not null (LSTM; float32 [L][T][B][4H] and [L][T][B][H], see
// wavefront.cuh). dtype: 0 float16, 1 bfloat16. Pointers are device
// pointers laid out as wavefront.cuh's Args says; `lengths` may be null
// (every sequence `steps` long); `cy`/`c0` are ignored for a GRU;
// `workspace` holds rnnfuse_wf_workspace_bytes. mode: 0 (wavefront.cuh has
// the debug modes). variant: the forward step's variant (wavefront.cuh; 0
// is the default step, 1 the opt-in rescheduled one: same results up to
// float32 rounding; 2 wgmma products; 3 the h values as their own flags,
// variant 0's arithmetic). trace: null, or 2 * trace_steps * kTraceSlots uint64
// for the timeline (wavefront.cuh).
__attribute__((visibility("default"))) int rnnfuse_wf_forward_variant(
    void* stream, int dtype, int gru, int num_layers, int units, int batch, int steps,
    int input_size, const void* xproj, const void* params, const void* h0, const void* c0,
    const int* lengths, void* y, void* hy, void* cy, void* workspace, int mode, int variant,
    unsigned long long* trace, int trace_steps, float* gates_out, float* c_out) {
  return Forward(stream, dtype, gru, num_layers, units, batch, steps, input_size, xproj, params,
                 h0, c0, lengths, y, hy, cy, workspace, mode, variant, trace, trace_steps,
                 gates_out, c_out, 0);
}

// A bidirectional layer's two directions (`directions` independent layers,
// wavefront.cuh "Independent layers") in one launch, on disjoint CTA sets
// with both weight sets resident: xproj [D][T][B][G*H] (direction 1's
// already reversed within each row's length), params the layer's canonical
// buffer (cuDNN's order: [W_ih, W_hh] forward, then backward, then their
// biases; both W_ih of input_size columns), h0/c0/hy/cy [D][B][H], y
// [D][T][B][H] (direction 1's in its reversed time), `workspace` of
// rnnfuse_wf_directions_workspace_bytes; gates_out/c_out as the forward's,
// [D][T][B][4H] and [D][T][B][H].
__attribute__((visibility("default"))) int rnnfuse_wf_forward_directions(
    void* stream, int dtype, int gru, int directions, int units, int batch, int steps,
    int input_size, const void* xproj, const void* params, const void* h0, const void* c0,
    const int* lengths, void* y, void* hy, void* cy, void* workspace, float* gates_out,
    float* c_out) {
  return Forward(stream, dtype, gru, directions, units, batch, steps, input_size, xproj, params,
                 h0, c0, lengths, y, hy, cy, workspace, 0, 0, nullptr, 0, gates_out, c_out, 1);
}

// 1 if a bidirectional layer's `directions` fit one launch with these
// device limits, 0 if not (the reason in rnnfuse_wf_last_error).
__attribute__((visibility("default"))) int rnnfuse_wf_plan_directions(
    int gru, int directions, int units, int batch, int steps, int input_size, int sms,
    int smem_limit, int* ctas_out, int* smem_out) {
  Args args;
  int smem = 0;
  if (!PlanInto(gru, directions, units, batch, steps, input_size, sms, smem_limit, &args, &smem,
                1))
    return 0;
  if (ctas_out) *ctas_out = args.cta_start[directions];
  if (smem_out) *smem_out = smem;
  return 1;
}

// Workspace bytes of rnnfuse_wf_forward_directions: the flags only (each
// direction's sequence is in y).
__attribute__((visibility("default"))) size_t rnnfuse_wf_directions_workspace_bytes(
    int directions) {
  return FlagBytes(directions);
}

// Variant 4's staging of chunk `chunk` of layer `layer` at step t, as the
// kernel computes it (wavefront.cuh, "Variant 4"), for the CPU tests: the
// copies (6 ints each: map, input, batch row, plane, destination byte,
// half) in `copies` [32][6], each half's expected bytes in half_bytes[2]
// (0 for a half the chunk lacks), and the wgmma descriptor of k-step j of
// warpgroup g in half h at descs[(h * 2 + g) * 32 + j] for a chunk at
// shared address `base`. Returns the number of copies, or -1 with the reason.
__attribute__((visibility("default"))) int rnnfuse_wf_tma_staging(
    int gru, int num_layers, int units, int batch, int steps, int input_size, int sms,
    int smem_limit, int layer, int t, int chunk, unsigned base, int* copies, int* half_bytes,
    unsigned long long* descs) {
  Args args;
  int smem = 0;
  if (!PlanInto(gru, num_layers, units, batch, steps, input_size, sms, smem_limit, &args, &smem))
    return -1;
  char why[256];
  if (!rnnfuse_wf::Variant4Fits(args, why, sizeof(why))) return Fail(why);
  if (layer < 0 || layer >= num_layers || t < 0 || t >= steps || chunk < 0 ||
      chunk * rnnfuse_wf::kNC >= batch)
    return Fail("layer, step or chunk out of range");
  const rnnfuse_wf::LayerPlan& p = args.layer[layer];
  const int n0 = chunk * rnnfuse_wf::kNC, nc = std::min(rnnfuse_wf::kNC, batch - n0);
  const int halves = nc > rnnfuse_wf::kNGroup ? 2 : 1;
  const int n = halves * rnnfuse_wf::TmaCopies(p, units);
  for (int i = 0; i < n; ++i) {
    const rnnfuse_wf::TmaCopy c = rnnfuse_wf::TmaStageCopy(args, p, layer, t, n0, i);
    const int v[6] = {c.map, c.k, c.row, c.plane, c.dst, c.half};
    memcpy(copies + 6 * i, v, sizeof(v));
  }
  for (int h = 0; h < 2; ++h) {
    half_bytes[h] = h < halves ? rnnfuse_wf::TmaHalfBytes(p, units) : 0;
    for (int g = 0; g < 2; ++g)
      for (int j = 0; j < p.kpad / 32; ++j)
        descs[(h * 2 + g) * 32 + j] =
            rnnfuse_wf::Sw128Desc(base + rnnfuse_wf::Sw128StepOffset(h, g, j, p.kpad));
  }
  return n;
}

// The weight and bias offsets the kernel reads (PlanOffsets), 4 a layer:
// w_ih, w_hh, b_in, b_rec, in elements of the canonical buffer; with
// `independent`, a bidirectional layer's directions. For the CPU tests of
// the layout arithmetic.
__attribute__((visibility("default"))) int rnnfuse_wf_plan_offsets(int gru, int independent,
                                                                   int num_layers, int units,
                                                                   int input_size,
                                                                   long long* out) {
  if (num_layers < 1 || num_layers > rnnfuse_wf::kMaxLayers)
    return Fail("num_layers must be 1 to " + std::to_string(rnnfuse_wf::kMaxLayers));
  Args args;
  memset(&args, 0, sizeof(args));
  rnnfuse_wf::PlanOffsets(gru, num_layers, units, input_size, &args, independent);
  for (int l = 0; l < num_layers; ++l) {
    const rnnfuse_wf::LayerPlan& p = args.layer[l];
    out[4 * l] = p.w_ih;
    out[4 * l + 1] = p.w_hh;
    out[4 * l + 2] = p.b_in;
    out[4 * l + 3] = p.b_rec;
  }
  return 1;
}

}  // extern "C"

namespace {

int Forward(void* stream, int dtype, int gru, int num_layers, int units, int batch, int steps,
            int input_size, const void* xproj, const void* params, const void* h0, const void* c0,
            const int* lengths, void* y, void* hy, void* cy, void* workspace, int mode,
            int variant, unsigned long long* trace, int trace_steps, float* gates_out,
            float* c_out, int independent) {
  if (variant < 0 || variant > rnnfuse_wf::kVariantBest)
    return Fail("variant must be 0, 1, 2, 3, 4 (the forward step's variants) or 5 (the best "
                "that takes the stack), not " + std::to_string(variant));
  if (independent && variant != 0 && variant != rnnfuse_wf::kVariantBest)
    return Fail("independent layers (a bidirectional layer's directions) run variant 0 only");
  Driver* d = nullptr;
  if (Begin(dtype, &d) != 0) return -1;
  CUstream s = static_cast<CUstream>(stream);
  StreamContext sc(d, s);
  if (sc.rc != 0) return -1;
  Args args;
  int smem = 0;
  if (!PlanInto(gru, num_layers, units, batch, steps, input_size, sc.sms, sc.smem_limit, &args,
                &smem, independent))
    return -1;
  if (variant == rnnfuse_wf::kVariantBest) {
    char why[256];
    const bool aligned = (reinterpret_cast<uintptr_t>(y) | reinterpret_cast<uintptr_t>(h0) |
                          reinterpret_cast<uintptr_t>(workspace)) % 16 == 0;
    variant = aligned && rnnfuse_wf::Variant4Fits(args, why, sizeof(why)) ? 4 : 0;
  } else if (variant == 2 || variant == 4) {
    char why[256];
    if (!(variant == 2 ? rnnfuse_wf::Variant2Fits : rnnfuse_wf::Variant4Fits)(args, why,
                                                                              sizeof(why)))
      return Fail(why);
  }
  args.mode = mode;
  args.variant = variant;
  args.trace = trace;
  args.trace_steps = trace ? trace_steps : 0;
  args.xproj = xproj;
  args.params = params;
  args.h0 = h0;
  args.c0 = c0;
  args.lengths = lengths;
  args.y = y;
  args.hy = hy;
  args.cy = cy;
  args.flags = static_cast<unsigned*>(workspace);
  args.work = static_cast<unsigned char*>(workspace) + FlagBytes(num_layers);
  args.gates_out = gates_out;
  args.c_out = c_out;

  Kernels* k = nullptr;
  if (GetKernels(d, sc.ctx, &k) != 0) return -1;
  CUfunction f16 = independent    ? k->f16_ind
                   : variant == 1 ? k->f16_v1
                   : variant == 2 ? k->f16_v2
                   : variant == 3 ? k->f16_v3
                   : variant == 4 ? k->f16_v4
                                  : k->f16;
  CUfunction bf16 = independent    ? k->bf16_ind
                    : variant == 1 ? k->bf16_v1
                    : variant == 2 ? k->bf16_v2
                    : variant == 3 ? k->bf16_v3
                    : variant == 4 ? k->bf16_v4
                                   : k->bf16;
  int* configured = independent    ? &k->configured_ind_smem
                    : variant == 1 ? &k->configured_v1_smem
                    : variant == 2 ? &k->configured_v2_smem
                    : variant == 3 ? &k->configured_v3_smem
                    : variant == 4 ? &k->configured_v4_smem
                                   : &k->configured_smem;
  if (variant == 3) {
    // Variant 3 (wavefront.cuh): every sequence buffer (the workspace's L-1
    // and y) starts as sentinels, in stream order before the launch, so a
    // value left by an earlier call never reads as this call's h.
    const size_t words = static_cast<size_t>(steps) * batch * units / 2;  // units % 8 == 0
    RF_CHECK_CU(d, d->cuMemsetD32Async_(reinterpret_cast<CUdeviceptr>(y),
                                        rnnfuse_wf::kSentinelWord, words, s));
    if (num_layers > 1)
      RF_CHECK_CU(d, d->cuMemsetD32Async_(reinterpret_cast<CUdeviceptr>(args.work),
                                          rnnfuse_wf::kSentinelWord, words * (num_layers - 1),
                                          s));
  }
  rnnfuse_wf::StageMaps maps;
  if (variant == 4 && EncodeStageMaps(d, dtype, args, h0, &maps) != 0) return -1;
  return Launch(d, sc, s, dtype, f16, bf16, configured, args.cta_start[num_layers], smem, &args,
                workspace, FlagBytes(num_layers) / 4, variant == 4 ? &maps : nullptr);
}

}  // namespace

extern "C" {

// One forward pass with the default step (variant 0), saving what the
// backward reads where `gates_out` and `c_out` are not null (the TensorFlow
// op's entry point).
__attribute__((visibility("default"))) int rnnfuse_wf_forward_saving(
    void* stream, int dtype, int gru, int num_layers, int units, int batch, int steps,
    int input_size, const void* xproj, const void* params, const void* h0, const void* c0,
    const int* lengths, void* y, void* hy, void* cy, void* workspace, int mode,
    unsigned long long* trace, int trace_steps, float* gates_out, float* c_out) {
  return rnnfuse_wf_forward_variant(stream, dtype, gru, num_layers, units, batch, steps,
                                    input_size, xproj, params, h0, c0, lengths, y, hy, cy,
                                    workspace, mode, 0, trace, trace_steps, gates_out, c_out);
}

// One forward pass (inference): rnnfuse_wf_forward_saving saving nothing.
__attribute__((visibility("default"))) int rnnfuse_wf_forward(
    void* stream, int dtype, int gru, int num_layers, int units, int batch, int steps,
    int input_size, const void* xproj, const void* params, const void* h0, const void* c0,
    const int* lengths, void* y, void* hy, void* cy, void* workspace, int mode,
    unsigned long long* trace, int trace_steps) {
  return rnnfuse_wf_forward_saving(stream, dtype, gru, num_layers, units, batch, steps,
                                   input_size, xproj, params, h0, c0, lengths, y, hy, cy,
                                   workspace, mode, trace, trace_steps, nullptr, nullptr);
}

// 1 if the backward kernel can run an LSTM or GRU layer (the same plan: a
// GRU's 4 virtual gate columns r, z, n_x, n_h) of `units` at `batch`
// with these device limits (CTAs, shared bytes a CTA and rows a group in
// the outputs), 0 if not (the reason in rnnfuse_wf_last_error).
__attribute__((visibility("default"))) int rnnfuse_wf_backward_plan(int units, int batch,
                                                                    int steps, int sms,
                                                                    int smem_limit,
                                                                    int* ctas_out,
                                                                    int* smem_out,
                                                                    int* rows_out) {
  rnnfuse_wf::BwdArgs args;
  if (!PlanBackwardInto(units, batch, steps, sms, smem_limit, &args)) return 0;
  if (ctas_out) *ctas_out = args.ctas;
  if (smem_out) *smem_out = args.smem_total;
  if (rows_out) *rows_out = args.rows;
  return 1;
}

// Workspace bytes of one backward call: its flags, one a CTA; word `ctas`
// (the plan's CTA count) is set when a wait timed out (a bug: the results
// are then wrong).
__attribute__((visibility("default"))) size_t rnnfuse_wf_backward_workspace_bytes() {
  return BwdFlagBytes();
}

// The backward recurrence of one LSTM (gru 0) or GRU (gru 1) layer
// (wavefront.cuh, "The backward kernel"): dgates [T][B][4H] (element type)
// and dh0 [B][H] (float32; an LSTM's dc0 too) from the layer's W_hh [G*H][H]
// (G = 4, a GRU's 3), the forward's saved gates and cseq of the layer
// (float32 [T][B][4H] and [T][B][H]: an LSTM's i, f, g, o and c; a GRU's r,
// z, n, W_hn h + b_hn and h_{t-1}), and the gradients of its output
// sequence dy [T][B][H] and final states dhy, dcy [B][H] (element type).
// A GRU's c0, dcy and dc0 are not read (may be null). `lengths` may be
// null. dtype: 0 float16, 1 bfloat16.
__attribute__((visibility("default"))) int rnnfuse_wf_backward_kind(
    void* stream, int dtype, int gru, int units, int batch, int steps, const void* w_hh,
    const float* gates, const float* cseq, const void* c0, const void* dy, const void* dhy,
    const void* dcy, const int* lengths, void* dgates, float* dh0, float* dc0,
    void* workspace) {
  Driver* d = nullptr;
  if (Begin(dtype, &d) != 0) return -1;
  if (gru != 0 && gru != 1) return Fail("gru must be 0 (LSTM) or 1 (GRU)");
  if (!gru && (!c0 || !dcy || !dc0)) return Fail("an LSTM's backward needs c0, dcy and dc0");
  CUstream s = static_cast<CUstream>(stream);
  StreamContext sc(d, s);
  if (sc.rc != 0) return -1;
  rnnfuse_wf::BwdArgs args;
  if (!PlanBackwardInto(units, batch, steps, sc.sms, sc.smem_limit, &args)) return -1;
  args.w_hh = w_hh;
  SetBackwardBuffers(&args, gates, cseq, c0, dy, dhy, dcy, lengths, dgates, dh0, dc0, workspace);
  Kernels* k = nullptr;
  if (GetKernels(d, sc.ctx, &k) != 0) return -1;
  CUfunction f16 = gru ? k->bwd_gru_f16 : k->bwd_f16;
  CUfunction bf16 = gru ? k->bwd_gru_bf16 : k->bwd_bf16;
  int* configured = gru ? &k->configured_bwd_gru_smem : &k->configured_bwd_smem;
  return Launch(d, sc, s, dtype, f16, bf16, configured, args.ctas, args.smem_total, &args,
                workspace, BwdFlagBytes() / 4);
}

// 1 if the reverse-wavefront backward (wavefront.cuh, "The stack
// backward") can run an LSTM stack of `num_layers` x `units` at `batch` with
// these device limits (CTAs, shared bytes a CTA and rows a group in the
// outputs), 0 if not (the reason in rnnfuse_wf_last_error). No GPU needed.
// `variant`: the asked kernel variant (wavefront.cuh, "Variants"); the
// planned one (the asked one, or a simpler one where it does not fit) and
// its rows a chunk go to variant_out and chunk_out (either may be null).
__attribute__((visibility("default"))) int rnnfuse_wf_backward_stack_plan(
    int num_layers, int units, int batch, int steps, int sms, int smem_limit, int* ctas_out,
    int* smem_out, int* rows_out, int variant, int* variant_out, int* chunk_out) {
  rnnfuse_wf::BwdStackArgs args;
  if (!PlanBackwardStackInto(num_layers, units, batch, steps, 1, sms, smem_limit, &args,
                             variant))
    return 0;
  if (ctas_out) *ctas_out = args.L * args.ctas_per_layer;
  if (smem_out) *smem_out = args.smem_total;
  if (rows_out) *rows_out = args.rows;
  if (variant_out) *variant_out = args.variant;
  if (chunk_out) *chunk_out = args.chunk;
  return 1;
}

// Workspace bytes of one stack backward call: its flags (kFlagStride a
// layer; the word after them is set when a wait timed out, a bug: the
// results are then wrong), then the float32 dy hand-off of the layers below
// the top, [L-1][T][B][H].
__attribute__((visibility("default"))) size_t rnnfuse_wf_backward_stack_workspace_bytes(
    int num_layers, int units, int batch, int steps) {
  return BwdStackFlagBytes() + static_cast<size_t>(num_layers > 1 ? num_layers - 1 : 0) * steps *
                                   batch * units * sizeof(float);
}

// Every layer's backward recurrence of an LSTM stack in one launch, as a
// reverse wavefront (wavefront.cuh, "The stack backward"): dgates
// [L][T][B][4H] (element type; 0 at t >= length), dh0 and dc0 [L][B][H]
// (float32) from the canonical flat `params` (element type; layer 0's
// W_ih, of `input_size` inputs, is not read), the forward's saved gates
// [L][T][B][4H] and c [L][T][B][H] (float32), c0 [L][B][H], the gradient
// of the top layer's output sequence dy [T][B][H] and of the final states
// dhy, dcy [L][B][H] (element type). `lengths` may be null. dtype: 0
// float16, 1 bfloat16. `workspace`: rnnfuse_wf_backward_stack_workspace_bytes
// of the same shape. `variant`: the kernel variant to ask the plan for (0:
// the default; wavefront.cuh, "Variants"; the same results).
__attribute__((visibility("default"))) int rnnfuse_wf_backward_stack(
    void* stream, int dtype, int num_layers, int units, int batch, int steps, int input_size,
    const void* params, const float* gates, const float* cseq, const void* c0, const void* dy,
    const void* dhy, const void* dcy, const int* lengths, void* dgates, float* dh0, float* dc0,
    void* workspace, int variant) {
  Driver* d = nullptr;
  if (Begin(dtype, &d) != 0) return -1;
  CUstream s = static_cast<CUstream>(stream);
  StreamContext sc(d, s);
  if (sc.rc != 0) return -1;
  rnnfuse_wf::BwdStackArgs args;
  if (!PlanBackwardStackInto(num_layers, units, batch, steps, input_size, sc.sms, sc.smem_limit,
                             &args, variant))
    return -1;
  args.params = params;
  SetBackwardBuffers(&args, gates, cseq, c0, dy, dhy, dcy, lengths, dgates, dh0, dc0, workspace);
  args.dyl = reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + BwdStackFlagBytes());
  Kernels* k = nullptr;
  if (GetKernels(d, sc.ctx, &k) != 0) return -1;
  CUfunction f16 = k->bwds_f16, bf16 = k->bwds_bf16;
  int* configured = &k->configured_bwds_smem;
  if (args.variant > 0) {  // the plan's choice: 1 or 2
    f16 = k->bwds_v_f16[args.variant - 1];
    bf16 = k->bwds_v_bf16[args.variant - 1];
    configured = &k->configured_bwds_v_smem[args.variant - 1];
  }
  return Launch(d, sc, s, dtype, f16, bf16, configured, args.L * args.ctas_per_layer,
                args.smem_total, &args, workspace, BwdStackFlagBytes() / 4);
}

}  // extern "C"
