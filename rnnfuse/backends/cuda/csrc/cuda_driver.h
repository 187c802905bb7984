// The CUDA driver's functions, resolved from libcuda.so.1 with dlopen: the
// loading both native libraries share (the wavefront launcher,
// wavefront_host.cc, and the cuDNN core, cudnn_rnn_core.cc). Neither links
// the driver, so both load on a machine without one (CI) and their first
// call fails with the reason. cuda.h is read for types only.
//
// Use, inside a file's anonymous namespace, with an X-macro list of driver
// API names (cuInit and cuGetErrorString among them):
//
//   #define MY_DRIVER_FUNCTIONS(X) X(cuInit) X(cuGetErrorString) X(cuCtxGetCurrent)
//   RF_DEFINE_DRIVER(MY_DRIVER_FUNCTIONS)
//   ...
//   Driver* d = GetDriver();          // loaded once a process
//   if (!d->ok) return Fail(d->why);  // why the driver cannot be used
//   CUresult r = d->cuCtxGetCurrent_(&ctx);
//   if (r != CUDA_SUCCESS) return Fail(DriverError(d, "cuCtxGetCurrent", r));
//
// Each name resolves to the symbol cuda.h maps it to (cuCtxPushCurrent ->
// cuCtxPushCurrent_v2, ...), so decltype(&name) is the right type.

#pragma once

#include <cuda.h>
#include <dlfcn.h>

#include <string>

#define RF_DRIVER_STR2(x) #x
#define RF_DRIVER_STR(x) RF_DRIVER_STR2(x)

namespace rnnfuse_driver {

// libcuda.so.1, or null with the reason in *why.
inline void* Open(std::string* why) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* err = dlerror();
    *why = std::string("the CUDA driver (libcuda.so.1) could not be loaded: ") +
           (err ? err : "not found") + " (no GPU driver on this machine?)";
  }
  return lib;
}

// cuInit(0); false with the reason in *why.
inline bool Init(decltype(&cuInit) init, std::string* why) {
  const CUresult r = init(0);
  if (r == CUDA_SUCCESS) return true;
  *why = "cuInit failed (CUDA error " + std::to_string(static_cast<int>(r)) +
         "; no usable GPU?)";
  return false;
}

// "<what> failed: <the driver's text> (<code>)".
inline std::string ErrorText(decltype(&cuGetErrorString) get, const char* what, CUresult r) {
  const char* text = nullptr;
  if (get) get(r, &text);
  return std::string(what) + " failed: " + (text ? text : "unknown CUDA error") + " (" +
         std::to_string(static_cast<int>(r)) + ")";
}

}  // namespace rnnfuse_driver

// The functions both libraries call: loading, errors, the stream's context.
#define RF_DRIVER_CONTEXT_FUNCTIONS(X) \
  X(cuInit)                            \
  X(cuGetErrorString)                  \
  X(cuCtxGetCurrent)                   \
  X(cuCtxPushCurrent)                  \
  X(cuCtxPopCurrent)                   \
  X(cuCtxGetDevice)                    \
  X(cuStreamGetCtx)

#define RF_DRIVER_DECLARE(name) decltype(&name) name##_ = nullptr;
#define RF_DRIVER_RESOLVE(name)                                                  \
  d->name##_ = reinterpret_cast<decltype(&name)>(dlsym(lib, RF_DRIVER_STR(name))); \
  if (!d->name##_) {                                                             \
    d->why = "the CUDA driver lacks " RF_DRIVER_STR(name);                       \
    return d;                                                                    \
  }

// Defines `struct Driver` (FUNCTIONS as members name##_, `ok`, `why`),
// `Driver* GetDriver()` (resolved once a process, never freed) and
// `std::string DriverError(Driver*, const char* what, CUresult)`.
#define RF_DEFINE_DRIVER(FUNCTIONS)                                       \
  struct Driver {                                                         \
    FUNCTIONS(RF_DRIVER_DECLARE)                                          \
    bool ok = false;                                                      \
    std::string why;                                                      \
  };                                                                      \
  Driver* GetDriver() {                                                   \
    static Driver* driver = [] {                                          \
      Driver* d = new Driver();                                           \
      void* lib = rnnfuse_driver::Open(&d->why);                          \
      if (!lib) return d;                                                 \
      FUNCTIONS(RF_DRIVER_RESOLVE)                                        \
      d->ok = rnnfuse_driver::Init(d->cuInit_, &d->why);                  \
      return d;                                                           \
    }();                                                                  \
    return driver;                                                        \
  }                                                                       \
  std::string DriverError(Driver* d, const char* what, CUresult r) {      \
    return rnnfuse_driver::ErrorText(d->cuGetErrorString_, what, r);      \
  }
