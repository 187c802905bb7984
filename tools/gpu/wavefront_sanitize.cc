// A framework-free driver of rnnfuse's wavefront kernel for compute-sanitizer
// (memcheck, racecheck, synccheck start in seconds here, not the minutes
// torch takes under them). Random inputs, small shapes (two batch chunks,
// partial CTAs, lengths, both dtypes, LSTM and GRU); it checks launch errors
// and that every output was written (no NaN left of the poison), not values
// (bench/bench_wavefront.py check does that). For a GRU it also runs the
// saving forward (gates_out, c_out) and the GRU backward of the top layer
// (rnnfuse_wf_backward_kind, gru 1) on what it saved, with every output
// poisoned the same way.
//
//   g++ -std=c++17 -O1 -I$CUDA/include tools/gpu/wavefront_sanitize.cc \
//       $CUDA/lib/libcudart_static.a -ldl -lpthread -lrt -o wf_sanitize
//   compute-sanitizer --tool memcheck ./wf_sanitize path/to/librnnfuse_wavefront.so

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmath>
#include <random>
#include <vector>

typedef int (*ForwardFn)(void*, int, int, int, int, int, int, int, const void*, const void*,
                         const void*, const void*, const int*, void*, void*, void*, void*, int,
                         unsigned long long*, int);
typedef size_t (*WorkspaceFn)(int, int, int, int, int);
typedef int (*SavingFn)(void*, int, int, int, int, int, int, int, const void*, const void*,
                        const void*, const void*, const int*, void*, void*, void*, void*, int,
                        unsigned long long*, int, float*, float*);
typedef int (*BackwardKindFn)(void*, int, int, int, int, int, const void*, const float*,
                              const float*, const void*, const void*, const void*, const void*,
                              const int*, void*, float*, float*, void*);
typedef size_t (*BwdWorkspaceFn)();
typedef const char* (*ErrorFn)();

#define CHECK(x)                                                              \
  do {                                                                        \
    cudaError_t e_ = (x);                                                     \
    if (e_ != cudaSuccess) {                                                  \
      fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_));         \
      exit(2);                                                                \
    }                                                                         \
  } while (0)

static uint16_t ToBits(float f, int bf16) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if (bf16) return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  // float -> half (round to nearest even, normal range only: inputs are small)
  const uint32_t sign = (u >> 16) & 0x8000;
  const int exp = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
  uint32_t mant = u & 0x7fffff;
  if (exp <= 0) return static_cast<uint16_t>(sign);
  uint32_t h = sign | (exp << 10) | (mant >> 13);
  if ((mant & 0x1fff) > 0x1000 || ((mant & 0x1fff) == 0x1000 && (h & 1))) ++h;
  return static_cast<uint16_t>(h);
}

static bool IsNan(uint16_t v, int bf16) {
  return bf16 ? ((v & 0x7f80) == 0x7f80 && (v & 0x7f)) : ((v & 0x7c00) == 0x7c00 && (v & 0x3ff));
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s librnnfuse_wavefront.so\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW);
  if (!lib) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  auto forward = reinterpret_cast<ForwardFn>(dlsym(lib, "rnnfuse_wf_forward"));
  auto workspace = reinterpret_cast<WorkspaceFn>(dlsym(lib, "rnnfuse_wf_workspace_bytes"));
  auto last_error = reinterpret_cast<ErrorFn>(dlsym(lib, "rnnfuse_wf_last_error"));
  auto saving = reinterpret_cast<SavingFn>(dlsym(lib, "rnnfuse_wf_forward_saving"));
  auto backward_kind = reinterpret_cast<BackwardKindFn>(dlsym(lib, "rnnfuse_wf_backward_kind"));
  auto bwd_workspace =
      reinterpret_cast<BwdWorkspaceFn>(dlsym(lib, "rnnfuse_wf_backward_workspace_bytes"));
  if (!forward || !workspace || !last_error || !saving || !backward_kind || !bwd_workspace) {
    fprintf(stderr, "the library lacks an entry point: %s\n", dlerror());
    return 2;
  }
  CHECK(cudaFree(0));  // makes the primary context current
  struct Case { int gru, L, H, B, T, I, bf16, lengths; };
  const Case cases[] = {
      {0, 2, 64, 70, 5, 24, 0, 1},  {1, 2, 64, 70, 5, 24, 1, 1}, {0, 3, 40, 3, 4, 8, 1, 0},
      {1, 1, 8, 1, 1, 3, 0, 0},     {0, 2, 512, 9, 3, 512, 0, 1}, {1, 2, 256, 130, 3, 64, 0, 1},
  };
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> uni(-0.3f, 0.3f);
  int failures = 0;
  for (const Case& c : cases) {
    const int G = c.gru ? 3 : 4, GH = G * c.H;
    size_t nparams = 0;
    for (int l = 0; l < c.L; ++l) nparams += size_t(GH) * ((l ? c.H : c.I) + c.H) + 2 * GH;
    auto fill = [&](size_t n) {
      std::vector<uint16_t> v(n);
      for (auto& x : v) x = ToBits(uni(rng), c.bf16);
      return v;
    };
    const size_t nx = size_t(c.T) * c.B * GH, ns = size_t(c.L) * c.B * c.H,
                 ny = size_t(c.T) * c.B * c.H;
    std::vector<uint16_t> hx = fill(nx), hp = fill(nparams), hh = fill(ns), hc = fill(ns);
    std::vector<int> hl(c.B);
    for (int n = 0; n < c.B; ++n) hl[n] = c.lengths ? 1 + int(rng() % c.T) : c.T;
    void *dx, *dp, *dh, *dc, *dy, *dhy, *dcy, *dws;
    int* dl;
    const size_t wsb = workspace(c.L, c.H, c.B, c.T, 2);
    CHECK(cudaMalloc(&dx, nx * 2));
    CHECK(cudaMalloc(&dp, nparams * 2));
    CHECK(cudaMalloc(&dh, ns * 2));
    CHECK(cudaMalloc(&dc, ns * 2));
    CHECK(cudaMalloc(&dy, ny * 2));
    CHECK(cudaMalloc(&dhy, ns * 2));
    CHECK(cudaMalloc(&dcy, ns * 2));
    CHECK(cudaMalloc(&dws, wsb));
    CHECK(cudaMalloc(reinterpret_cast<void**>(&dl), c.B * 4));
    CHECK(cudaMemcpy(dx, hx.data(), nx * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dp, hp.data(), nparams * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dh, hh.data(), ns * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dc, hc.data(), ns * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dl, hl.data(), c.B * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(dy, 0xff, ny * 2));  // NaN in both formats
    CHECK(cudaMemset(dhy, 0xff, ns * 2));
    CHECK(cudaMemset(dcy, 0xff, ns * 2));
    const int rc = forward(nullptr, c.bf16, c.gru, c.L, c.H, c.B, c.T, c.I, dx, dp, dh, dc, dl, dy,
                           dhy, dcy, dws, 0, nullptr, 0);
    if (rc != 0) {
      fprintf(stderr, "case gru=%d L=%d H=%d B=%d T=%d: %s\n", c.gru, c.L, c.H, c.B, c.T,
              last_error());
      ++failures;
      continue;
    }
    CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> y(ny), hy(ns), cy(ns);
    CHECK(cudaMemcpy(y.data(), dy, ny * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(hy.data(), dhy, ns * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(cy.data(), dcy, ns * 2, cudaMemcpyDeviceToHost));
    size_t nan = 0;
    for (auto v : y) nan += IsNan(v, c.bf16);
    for (auto v : hy) nan += IsNan(v, c.bf16);
    if (!c.gru)
      for (auto v : cy) nan += IsNan(v, c.bf16);
    printf("case gru=%d L=%d H=%d B=%d T=%d bf16=%d: %s (%zu unwritten)\n", c.gru, c.L, c.H, c.B,
           c.T, c.bf16, nan ? "FAIL" : "ok", nan);
    failures += nan != 0;
    if (c.gru) {
      // The saving forward, then the top layer's GRU backward on what it saved.
      const size_t ng = size_t(c.L) * c.T * c.B * 4 * c.H, nc = size_t(c.L) * ny;
      float *dg, *dcs, *ddh0;
      void *ddg, *dbws;
      CHECK(cudaMalloc(reinterpret_cast<void**>(&dg), ng * 4));
      CHECK(cudaMalloc(reinterpret_cast<void**>(&dcs), nc * 4));
      CHECK(cudaMalloc(reinterpret_cast<void**>(&ddh0), size_t(c.B) * c.H * 4));
      CHECK(cudaMalloc(&ddg, ny * 4 * 2));
      CHECK(cudaMalloc(&dbws, bwd_workspace()));
      CHECK(cudaMemset(dg, 0xff, ng * 4));  // float NaN
      CHECK(cudaMemset(dcs, 0xff, nc * 4));
      CHECK(cudaMemset(ddh0, 0xff, size_t(c.B) * c.H * 4));
      CHECK(cudaMemset(ddg, 0xff, ny * 4 * 2));
      int src = saving(nullptr, c.bf16, 1, c.L, c.H, c.B, c.T, c.I, dx, dp, dh, nullptr, dl, dy,
                       dhy, nullptr, dws, 0, nullptr, 0, dg, dcs);
      const int top = c.L - 1;
      size_t w_hh = 0;  // the top layer's W_hh in the canonical buffer (wavefront_plan.h)
      for (int l = 0; l < c.L; ++l) {
        const size_t n = l ? c.H : c.I;
        if (l == top) w_hh += size_t(GH) * n;
        else w_hh += size_t(GH) * (n + c.H);
        if (l == top) break;
      }
      if (src == 0)
        src = backward_kind(nullptr, c.bf16, 1, c.H, c.B, c.T,
                            static_cast<uint16_t*>(dp) + w_hh, dg + size_t(top) * ng / c.L,
                            dcs + size_t(top) * ny, nullptr, dy, static_cast<uint16_t*>(dhy) +
                            size_t(top) * c.B * c.H, nullptr, dl, ddg, ddh0, nullptr, dbws);
      if (src != 0) {
        fprintf(stderr, "GRU training case L=%d H=%d B=%d T=%d: %s\n", c.L, c.H, c.B, c.T,
                last_error());
        ++failures;
      } else {
        CHECK(cudaDeviceSynchronize());
        std::vector<float> g(ng), cs(nc), h0g(size_t(c.B) * c.H);
        std::vector<uint16_t> dga(ny * 4);
        CHECK(cudaMemcpy(g.data(), dg, ng * 4, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(cs.data(), dcs, nc * 4, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(h0g.data(), ddh0, h0g.size() * 4, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(dga.data(), ddg, ny * 4 * 2, cudaMemcpyDeviceToHost));
        size_t bad = 0;
        for (float v : g) bad += std::isnan(v);
        for (float v : cs) bad += std::isnan(v);
        for (float v : h0g) bad += std::isnan(v);
        for (auto v : dga) bad += IsNan(v, c.bf16);
        printf("GRU training case L=%d H=%d B=%d T=%d bf16=%d: %s (%zu unwritten)\n", c.L, c.H,
               c.B, c.T, c.bf16, bad ? "FAIL" : "ok", bad);
        failures += bad != 0;
      }
      for (void* p : {static_cast<void*>(dg), static_cast<void*>(dcs),
                      static_cast<void*>(ddh0), ddg, dbws})
        CHECK(cudaFree(p));
    }
    for (void* p : {dx, dp, dh, dc, dy, dhy, dcy, dws}) CHECK(cudaFree(p));
    CHECK(cudaFree(dl));
  }
  printf("sanitize driver: %d failures\n", failures);
  return failures ? 1 : 0;
}
