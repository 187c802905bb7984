// rnnfuse's persistent wavefront kernel (device code). The design, the
// layout arithmetic, the synchronisation protocol and the limits are in
// wavefront.cuh; this file is the kernel. Compiled to a cubin for sm_90a
// (mma.sync, ldmatrix and cp.async; wgmma in the forward's opt-in variant 2
// only, the other kernels compile as for plain sm_90) and launched through
// the driver API by wavefront_host.cc.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "wavefront.cuh"

namespace rnnfuse_wf {

// ---------------------------------------------------------------------------
// Element types: float conversion, packing two values in 32 bits, and the
// tensor-core product. The two types differ only in their intrinsics' names
// (Pair and the overloads below) and the mma's type suffix.
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
template <typename T> struct Pair;
template <> struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ __half2 of(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ __nv_bfloat162 of(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};

// mma.sync m16n8k16, A row-major, B column-major, float32 accumulators;
// AB: the operands' PTX type (f16, bf16).
#define RF_MMA_M16N8K16(AB, c, a, b0, b1)                                                  \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 {%0,%1,%2,%3}, "           \
      "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                             \
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                     \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

// wgmma.mma_async m64n32k16, A (64 x 16) from registers in mma.sync's
// m16n8k16 A layout a warp, B (16 x 32, K-major) from the shared-memory
// descriptor `desc`, float32 accumulators d += A B (scale-d 1); AB: the
// operands' PTX type. sm_90a only (variant 2; wavefront.cuh, "Variant 2").
#define RF_WGMMA_M64N32K16(AB, d, a, desc)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." AB "." AB " "                   \
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "                    \
               "{%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"                                     \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),     \
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),   \
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))

template <typename T> struct Elem {
  using P2 = typename Pair<T>::type;
  static __device__ __forceinline__ float to_float(T x) { return rnnfuse_wf::to_float(x); }
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    P2 v = Pair<T>::of(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t w) {
    return to_float2(*reinterpret_cast<P2*>(&w));
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    if constexpr (sizeof(T) == 2 && __is_same(T, __half)) {
      RF_MMA_M16N8K16("f16", c, a, b0, b1);
    } else {
      RF_MMA_M16N8K16("bf16", c, a, b0, b1);
    }
  }
  static __device__ __forceinline__ void wgmma(float (&d)[16], const uint32_t (&a)[4],
                                               uint64_t desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (sizeof(T) == 2 && __is_same(T, __half)) {
      RF_WGMMA_M64N32K16("f16", d, a, desc);
    } else {
      RF_WGMMA_M64N32K16("bf16", d, a, desc);
    }
#else
    __trap();  // built without sm_90a: the host never launches variant 2 there
#endif
  }
};

// ---------------------------------------------------------------------------
// PTX wrappers.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_but_one() {
  asm volatile("cp.async.wait_group 1;" ::: "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                            const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Named barrier kId (1-15; 0 is __syncthreads') of kCount threads (a
// multiple of 32, every thread of each warp taking part): arrive does not
// wait, sync waits until kCount threads have arrived or synced. Memory
// accesses before an arrive are performed, for the threads that sync,
// before the sync returns (as with __syncthreads). (Immediate operands: a
// register id makes ptxas reserve all 16 barriers.)
template <int kId, int kCount = kThreads>
__device__ __forceinline__ void named_barrier_arrive() {
  asm volatile("bar.arrive %0, %1;" ::"n"(kId), "n"(kCount) : "memory");
}
template <int kId, int kCount = kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kCount) : "memory");
}

// wgmma's ordering (sm_90a): fence before the first of a group (its
// accumulators and A registers were written by ordinary instructions),
// commit the group, wait for all of them; and the proxy fence that makes a
// thread's generic-proxy writes to shared memory (cp.async, st.shared)
// visible to wgmma's async-proxy reads.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

template <int N> struct Count { static constexpr int value = N; };

// A wgmma shared-memory matrix descriptor without swizzle: the start
// address, the leading (next core matrix along K) and stride (next 8 rows)
// byte offsets, each in 16-byte units in 14 bits.
__device__ __forceinline__ uint64_t smem_desc(uint32_t start, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((start >> 4) & 0x3FFF) |
         (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32);
}

// fence.acq_rel.gpu + a relaxed store, after a CTA barrier: the release
// that CUTLASS's grid barrier uses (cheaper than __threadfence's fence.sc).
__device__ __forceinline__ void publish(unsigned* p, unsigned v) {
  asm volatile("fence.acq_rel.gpu;\n\tst.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v)
               : "memory");
}

// Variant 3 (wavefront.cuh, "Variant 3"): the sequence buffers start
// filled with kSentinel halves and a step's h values are their own flag.
// Nonzero iff a half of w is kSentinel (0xFFFF): with x = ~w, a half of x
// is zero; (x - 1) & ~x has a half's top bit set only for a zero half, and
// a borrow out of the low half happens only when that half is zero itself,
// so the "any" answer is exact.
__device__ __forceinline__ uint32_t sentinel_halves(uint32_t w) {
  return (~w - 0x00010001u) & w & 0x80008000u;
}
__device__ __forceinline__ bool has_sentinel(const uint4& v) {
  return (sentinel_halves(v.x) | sentinel_halves(v.y) | sentinel_halves(v.z) |
          sentinel_halves(v.w)) != 0u;
}
// A computed h never reads as "not written yet": a kSentinel half (a NaN)
// becomes 0x7FFF (a NaN too), so a NaN still propagates.
__device__ __forceinline__ uint32_t lamport_value(uint32_t w) {
  const uint32_t lo = (w & 0xFFFFu) == 0xFFFFu ? 0x8000u : 0u;
  const uint32_t hi = w >= 0xFFFF0000u ? 0x80000000u : 0u;
  return w ^ lo ^ hi;
}
// The producer's store of two h halves: strong (relaxed, gpu scope), so the
// consumers' polling reads of the same word see it without a fence.
__device__ __forceinline__ void store_relaxed(void* p, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Variant 4's staging (wavefront.cuh, "Variant 4"): mbarriers, the tensor
// copy that completes on one, and the proxy fence of global memory.
__device__ __forceinline__ void mbar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
// The barriers' initialisation, to the async proxy's complete_tx.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// The one arrival of the barrier's phase, which also expects `bytes`.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Until the barrier's phase of `parity` completes; a wait past kBwdWaitNs
// traps (bytes the copies never bring: a bug, not a hang).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const unsigned long long start = global_ns();
  while (!mbar_try_wait(bar, parity))
    if (global_ns() - start > kBwdWaitNs) __trap();
}
// This thread's generic-proxy view of global memory (the h it acquired),
// to its async-proxy operations that follow (the tensor copies).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TmaMap* map, int k, int row,
                                            int plane, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
      "l"(map), "r"(k), "r"(row), "r"(plane), "r"(bar)
      : "memory");
}

// sigmoid and tanh from ex2 and rcp (MUFU, approximate: a few ulp of
// float32), a few instructions each (tanhf is a dozen and a branch; an IEEE
// division or __frcp_rn a subroutine).
__device__ __forceinline__ float fast_rcp(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float sigmoid(float x) { return fast_rcp(1.0f + __expf(-x)); }
__device__ __forceinline__ float fast_tanh(float x) {
  return 1.0f - 2.0f * fast_rcp(1.0f + __expf(2.0f * x));
}

// The cell's pointwise step for units (col, col + 1) of one batch row, from
// the gate pre-activations `pre` (LSTM: i, f, g, o; GRU: r, z, n_x, n_h):
// h, and the LSTM's c (updated in `c` in place; `h_prev` is the GRU's
// h_{t-1}); in training, what the backward reads at `row` (= (layer * steps
// + t) * B + batch row): the gates (the GRU's r, z, n and W_hn h + b_hn) in
// gates_out, and c (the GRU's h_{t-1}) in c_out.
__device__ __forceinline__ void cell_pointwise(const Args& a, const float (&pre)[4][2], float2* c,
                                               float2 h_prev, size_t row, int col, int H,
                                               float (&h)[2], float (&cv)[2]) {
  float* gp = a.gates_out ? a.gates_out + row * 4 * H + col : nullptr;
  float2* saved = a.c_out ? reinterpret_cast<float2*>(a.c_out + row * H + col) : nullptr;
  if (!a.gru) {
    const float cold[2] = {c->x, c->y};
    float act[4][2];  // i, f, g, o
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      act[0][v] = sigmoid(pre[0][v]);
      act[1][v] = sigmoid(pre[1][v]);
      act[2][v] = fast_tanh(pre[2][v]);
      act[3][v] = sigmoid(pre[3][v]);
      cv[v] = act[1][v] * cold[v] + act[0][v] * act[2][v];
      h[v] = act[3][v] * fast_tanh(cv[v]);
    }
    *c = make_float2(cv[0], cv[1]);
    if (gp) {
#pragma unroll
      for (int g = 0; g < 4; ++g)
        *reinterpret_cast<float2*>(gp + g * H) = make_float2(act[g][0], act[g][1]);
    }
    if (saved) *saved = make_float2(cv[0], cv[1]);
    return;
  }
  const float hps[2] = {h_prev.x, h_prev.y};
  float act[3][2];  // r, z, n
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    act[0][v] = sigmoid(pre[0][v]);
    act[1][v] = sigmoid(pre[1][v]);
    act[2][v] = fast_tanh(pre[2][v] + act[0][v] * pre[3][v]);
    h[v] = (1.0f - act[1][v]) * act[2][v] + act[1][v] * hps[v];
  }
  if (gp) {
#pragma unroll
    for (int g = 0; g < 3; ++g)
      *reinterpret_cast<float2*>(gp + g * H) = make_float2(act[g][0], act[g][1]);
    *reinterpret_cast<float2*>(gp + 3 * H) = make_float2(pre[3][0], pre[3][1]);
  }
  if (saved) *saved = h_prev;
}

// Offset in params of weight (row r, input k) of this CTA, or -1 where the
// CTA's weight matrix is structurally zero (padding, units past H, the
// GRU's n_x rows against h and n_h rows against the input).
__device__ __forceinline__ long long weight_offset(const Args& a, const LayerPlan& p, int u0,
                                                   int r, int k) {
  const int U = p.units, H = a.H;
  const int vg = r / U, unit = u0 + r % U;
  if (unit >= H) return -1;
  const int g = a.gru ? min(vg, 2) : vg;
  const long long row = static_cast<long long>(g) * H + unit;
  if (k < p.kin) {
    if (a.gru && vg == 3) return -1;
    return p.w_ih + row * p.kin + k;
  }
  k -= p.kin;
  if (k < H) {
    if (a.gru && vg == 2) return -1;
    return p.w_hh + row * H + k;
  }
  return -1;
}

// ---------------------------------------------------------------------------
// Pieces every kernel shares.

// Thread `tid`'s share of a row-major grid of 16-byte chunks, `per_row` a
// row: it starts at (n0, q0) and steps kThreads chunks, (dn, dq), so a
// walk needs no division a chunk.
struct ChunkWalk {
  int n0, q0, dn, dq, per_row;
  __device__ __forceinline__ ChunkWalk(int tid, int row_chunks)
      : n0(tid / row_chunks), q0(tid % row_chunks), dn(kThreads / row_chunks),
        dq(kThreads % row_chunks), per_row(row_chunks) {}
  // f(n, q) for each of this thread's chunks in rows [first, end).
  template <typename F>
  __device__ __forceinline__ void run(int first, int end, F&& f) const {
    int n = first + n0, q = q0;
    while (n < end) {
      f(n, q);
      q += dq;
      n += dn;
      if (q >= per_row) {
        q -= per_row;
        ++n;
      }
    }
  }
};

// cp.async of `rows` rows of `per_row` 16-byte chunks from src (a row every
// src_stride elements) to dst (every dst_stride), as one commit group.
template <typename T>
__device__ __forceinline__ void stage_rows(T* dst, int dst_stride, const T* src, int src_stride,
                                           int rows, const ChunkWalk& walk) {
  walk.run(0, rows, [&](int n, int q) {
    cp_async16(dst + n * dst_stride + q * 8, src + static_cast<size_t>(n) * src_stride + q * 8);
  });
  cp_async_commit();
}

// An m16n8 C fragment (rows row and row + 8, columns col and col + 1) to or
// from a column-major slice p[col * stride + row].
__device__ __forceinline__ void store_fragment(float* p, int stride, int row, int col,
                                               const float (&c)[4]) {
  p[col * stride + row] = c[0];
  p[(col + 1) * stride + row] = c[1];
  p[col * stride + row + 8] = c[2];
  p[(col + 1) * stride + row + 8] = c[3];
}
__device__ __forceinline__ void add_fragment(float (&c)[4], const float* p, int stride, int row,
                                             int col) {
  c[0] += p[col * stride + row];
  c[1] += p[(col + 1) * stride + row];
  c[2] += p[col * stride + row + 8];
  c[3] += p[(col + 1) * stride + row + 8];
}

// lens[n] = the length of batch row row0 + n, at most steps (steps where
// `lengths` is null), for n < rows.
__device__ __forceinline__ void load_lengths(int* lens, const int* lengths, int row0, int rows,
                                             int steps, int tid) {
  for (int n = tid; n < rows; n += kThreads) {
    const int len = lengths ? lengths[row0 + n] : steps;
    lens[n] = len < steps ? len : steps;
  }
}

// The lanes of one warp spin (acquire) until flags[0, count) all reach need.
__device__ __forceinline__ void await_flags(const unsigned* flags, int count, unsigned need,
                                            int lane) {
  for (int i = lane; i < count; i += 32)
    while (load_acquire(flags + i) < need) {
    }
}

// Spins until *flag reaches need; false, with *timed_out set, once
// kBwdWaitNs have passed since `start` (a broken protocol then gives
// flagged wrong numbers, not a hang).
__device__ __forceinline__ bool await_flag_or_time_out(const unsigned* flag, unsigned need,
                                                       unsigned long long start,
                                                       unsigned* timed_out) {
  while (load_acquire(flag) < need) {
    if (global_ns() - start > kBwdWaitNs) {
      atomicExch(timed_out, 1u);
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------
// The forward kernel; V: the step's variant (wavefront.cuh: 0, 1 with
// the overlapped pointwise step, paired partial sums and fixed staging, or
// 2: variant 0's schedule with wgmma products, sm_90a; or 3: variant 0's
// schedule with the h values as their own flags, Lamport-style; or 4:
// variant 2 staged by tensor copies from `maps`);
// I: independent layers (wavefront.cuh, "Independent layers"; variant 0).
template <typename T, int V, bool I = false>
__device__ __forceinline__ void wavefront_body(const Args& a, const StageMaps* maps = nullptr) {
  using E = Elem<T>;
  extern __shared__ __align__(16) unsigned char smem[];

  const int cta = blockIdx.x;
  int l = 0;
  while (l + 1 < a.L && cta >= a.cta_start[l + 1]) ++l;
  const LayerPlan& p = a.layer[l];
  const int j = cta - a.cta_start[l];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int H = a.H, B = a.B, steps = a.T;
  const int U = p.units, R = 4 * U, u0 = j * U;
  const int G = a.gru ? 3 : 4;  // gates in params and xproj
  const int KS = p.kpad + kHsPad;
  const int K = p.kin + H;  // real inputs
  // A layer that reads no layer below: layer 0, or every layer of a launch
  // of independent layers (a bidirectional layer's two directions, each its
  // own xproj slice and output slice; wavefront.cuh, "Independent layers").
  // A template parameter, so the stack kernels compile as before (as a
  // runtime flag it cost variant 1, at 255 registers, a spill).
  static_assert(!I || V == 0, "independent layers run variant 0");
  // Variant 2: warpgroup wg = warp / 4 multiplies all R = 64 rows against
  // K [wg KH, (wg + 1) KH), KH = kpad / 2 (the host's plan check: U = 16,
  // kpad 512 or 1024), as kj = KH / 16 wgmma k-steps.
  const int KH = p.kpad / 2, kj = KH / 16;
  constexpr bool kWgmma = V == 2 || V == 4;  // variant 4: variant 2's products
  const bool independent = I;
  const bool first = l == 0 || independent;

  T* hs = reinterpret_cast<T*>(smem + p.smem_hs);            // [kNC][KS]
  float* part = reinterpret_cast<float*>(smem + p.smem_part);  // [kg][kNC][RS]
  float* cs = reinterpret_cast<float*>(smem + p.smem_cs);      // [B][U]
  float* bias = reinterpret_cast<float*>(smem + p.smem_bias);  // [R]
  int* lens = reinterpret_cast<int*>(smem + p.smem_len);       // [B]
  T* xs = reinterpret_cast<T*>(smem + p.smem_xs);              // 2 x [B][G][U]
  const int RS = R + kPartPad;
  const int xs_size = B * G * U;

  const int mg = warp % p.mg, kg = (warp / p.mg) % p.kg, ng = warp / (p.mg * p.kg);

  // --- this warp's weights, as mma A fragments (loaded once) -------------
  const T* P = static_cast<const T*>(a.params);
  uint32_t wa[kWM][kWK][4];
  uint32_t live = 0;  // bit i*kWK + jt: tile (i, jt) is not all zero
#pragma unroll
  for (int i = 0; i < kWM; ++i) {
#pragma unroll
    for (int jt = 0; jt < kWK; ++jt) {
      bool any = false;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        // Variant 2: k-step i * kWK + jt of warpgroup warp / 4, rows of warp % 4.
        const int r = (kWgmma ? (warp & 3) * 16 : mg * kWarpRows + i * 16) + (lane >> 2) +
                      ((q & 1) ? 8 : 0);
        const int k = (kWgmma ? (warp >> 2) * KH + (i * kWK + jt) * 16 : kg * kWarpK + jt * 16) +
                      (lane & 3) * 2 + ((q & 2) ? 8 : 0);
        const long long off = weight_offset(a, p, u0, r, k);
        uint32_t w = 0;
        if (off >= 0) {
          w = *reinterpret_cast<const uint32_t*>(P + off);
          any = true;
        }
        wa[i][jt][q] = w;
      }
      if (__any_sync(0xffffffffu, any)) live |= 1u << (i * kWK + jt);
    }
  }

  // --- shared state ----------------------------------------------------------
  for (int idx = tid; idx < kNC * KS; idx += kThreads) hs[idx] = T(0.0f);
  if (!a.gru) {
    const T* c0 = static_cast<const T*>(a.c0) + static_cast<size_t>(l) * B * H;
    for (int idx = tid; idx < B * U; idx += kThreads) {
      const int n = idx / U, unit = u0 + idx % U;
      cs[idx] = unit < H ? E::to_float(c0[static_cast<size_t>(n) * H + unit]) : 0.0f;
    }
  }
  for (int r = tid; r < R; r += kThreads) {
    const int vg = r / U, unit = u0 + r % U;
    float v = 0.0f;
    if (unit < H) {
      const int g = a.gru ? min(vg, 2) : vg;
      const float bi = E::to_float(P[p.b_in + g * H + unit]);
      const float br = E::to_float(P[p.b_rec + g * H + unit]);
      v = (!a.gru || vg < 2) ? bi + br : (vg == 2 ? bi : br);
    }
    bias[r] = v;
  }
  load_lengths(lens, a.lengths, 0, B, steps, tid);

  const size_t seq = static_cast<size_t>(B) * H;  // one step of a sequence buffer
  const T* below = !first ? static_cast<const T*>(a.work) + static_cast<size_t>(l - 1) * steps * seq
                         : nullptr;
  T* mine = independent ? static_cast<T*>(a.y) + static_cast<size_t>(l) * steps * seq
         : l == a.L - 1 ? static_cast<T*>(a.y)
                         : static_cast<T*>(a.work) + static_cast<size_t>(l) * steps * seq;
  const T* xproj = static_cast<const T*>(a.xproj) +
                   (independent ? static_cast<size_t>(l) * steps * B * G * H : 0);
  T* hy = static_cast<T*>(a.hy) + static_cast<size_t>(l) * seq;
  T* cy = static_cast<T*>(a.cy) + static_cast<size_t>(l) * seq;
  unsigned* my_flags = a.flags + l * kFlagStride;
  const unsigned* below_flags = !first ? a.flags + (l - 1) * kFlagStride : nullptr;
  const int below_ctas = !first ? a.layer[l - 1].ctas : 0;
  const int UG = U / 8, UP = U / 2;  // powers of two (U = 8 * mg)
  const int ug_shift = __ffs(UG) - 1, up_shift = __ffs(UP) - 1;
  const ChunkWalk xs_walk(tid, G * UG);  // items (n, g, 8 units) of one step's xproj slice
  const ChunkWalk hs_walk(tid, K / 8);   // 16-byte chunks of one hs row
  // Variant 1 (wavefront.cuh): fixed staging where every thread keeps one
  // column chunk (hs_walk.dq == 0); the warps that run their share of the
  // first half's pointwise step after their second-half products (`late`);
  // the K-group pairs (warp (m, k >= kg/2) hands its partials to
  // (m, k - kg/2); with ng == 1, warp = m + mg * k and mg * kg = 8, so those
  // are warps 4-7).
  const bool hs_fixed = V == 1 && hs_walk.dq == 0;
  const int hs_k = hs_walk.q0 * 8;
  const bool pair = V == 1 && p.ng == 1 && p.kg >= 2;
  const bool upper = kg >= p.kg / 2;
  const bool late = p.ng == 1 ? warp >= kWarps / 2 : ng == 1;
  // partial slices the pointwise step sums (variant 2: one a warpgroup)
  const int kparts = kWgmma ? 2 : pair ? p.kg / 2 : p.kg;
  // Split wait (variant 1, layers above 0 with fixed staging where each
  // warp copies only the layer below's h or only its own: half the chunks
  // of a row, (K/8)/2 a multiple of 32): warp 0 (a below warp) polls the
  // layer below's flags and releases the other below warps (named barrier
  // 3, kThreads/2 threads), issues its copies, then polls its own layer's
  // flags and releases the own warps (barrier 4, 32 + kThreads/2 threads).
  const bool split_wait = V == 1 && !first && hs_fixed && (hs_walk.per_row / 2) % 32 == 0;
  const bool stage_below = hs_k < p.kin;  // warp-uniform where split_wait

  const int nchunks = (B + kNC - 1) / kNC;
  unsigned long long* trace = nullptr;
  if (a.trace && tid == 0 && (cta == 0 || cta == a.cta_start[a.L - 1]))
    trace = a.trace + (cta == 0 ? 0 : static_cast<size_t>(a.trace_steps) * kTraceSlots);
  auto mark = [&](int t, int point) {
    if (trace && t < a.trace_steps) {
      trace[t * kTraceSlots + point] = global_ns();
      if (point == 0) trace[t * kTraceSlots + 6] = clock64();
      if (point == kTracePoints - 1) trace[t * kTraceSlots + 7] = clock64();
    }
  };

  // Layer 0: xproj[t] (this CTA's units, every batch row) into xs buffer
  // t & 1, as [B][G][U]: 16 bytes (8 units of one gate) a copy.
  auto stage_xs = [&](int t) {
    if (!first || t >= steps) return;
    T* dst = xs + (t & 1) * xs_size;
    const T* src = xproj + static_cast<size_t>(t) * B * G * H + u0;
    // item (n, g, q): batch row n, gate g, 8 units q.
    xs_walk.run(0, B, [&](int n, int q) {
      const int g = q >> ug_shift, qq = q & (UG - 1);
      if (u0 + qq * 8 < H)
        cp_async16(dst + (n * G + g) * U + qq * 8,
                   src + static_cast<size_t>(n) * G * H + g * H + qq * 8);
    });
  };
  stage_xs(0);
  cp_async_commit();
  // Variant 4: the staged chunk's base (hs rounded up to kTmaAlign) and its
  // halves' mbarriers past it; the zeroed hs (padding inputs stay zero) and
  // the barriers, to the async proxy.
  const uint32_t tma_hs = (smem_addr(hs) + (kTmaAlign - 1)) & ~uint32_t(kTmaAlign - 1);
  const uint32_t tma_bar = tma_hs + p.kpad * 128;
  uint32_t tma_parity = 0;  // bit h: the phase parity half h's barrier completes next
  if constexpr (V == 4) {
    __syncthreads();  // hs zeroed before the barriers inside its padding start
    if (tid == 0) {
      mbar_init(tma_bar);
      mbar_init(tma_bar + 8);
      mbar_init_fence();
    }
    fence_proxy_async();
  }
  __syncthreads();

  for (int t = 0; t < steps; ++t) {
    mark(t, 0);
    // --- wait for the inputs of step t ---------------------------------------
    if ((V == 0 || kWgmma) && warp == 0 && !(a.mode & kModeNoWait)) {
      if (t > 0) await_flags(my_flags, p.ctas, static_cast<unsigned>(t), lane);
      if (!first) await_flags(below_flags, below_ctas, static_cast<unsigned>(t + 1), lane);
      __syncwarp();
    }
    if (V == 1 && !split_wait && warp == 0 && !(a.mode & kModeNoWait)) {
      // Variant 1: a lane polls its own-layer flag and its layer-below flag
      // in the same round (two independent acquire loads in flight), not
      // the second after the first is met: one L2 round trip where both
      // are already set, not two.
      const int n_wait = max(t > 0 ? p.ctas : 0, !first ? below_ctas : 0);
      for (int i = lane; i < n_wait; i += 32) {
        bool own_ok = t == 0 || i >= p.ctas, below_ok = first || i >= below_ctas;
        while (!(own_ok && below_ok)) {
          const unsigned own = own_ok ? 0u : load_acquire(my_flags + i);
          const unsigned low = below_ok ? 0u : load_acquire(below_flags + i);
          own_ok = own_ok || own >= static_cast<unsigned>(t);
          below_ok = below_ok || low >= static_cast<unsigned>(t + 1);
        }
      }
      __syncwarp();
    }
    if (!split_wait) {
      // (variant 3 waits in the copies below; the previous step's last
      // barrier already freed hs and part)
      if (V != 3) __syncthreads();
      mark(t, 1);
    }

    const T* prev = t == 0 ? static_cast<const T*>(a.h0) + static_cast<size_t>(l) * seq
                           : mine + static_cast<size_t>(t - 1) * seq;
    const T* below_t = !first ? below + static_cast<size_t>(t) * seq : nullptr;
    const T* xs_t = xs + (t & 1) * xs_size;
    // Element (batch row n, input k) of the staged chunk. Variant 2: wgmma's
    // no-swizzle K-major canonical layout, 8 x 8 core matrices (8 rows x 16
    // bytes of K) of 128 contiguous bytes, consecutive along K (LBO 128
    // bytes), 8-row groups kpad * 16 bytes apart (SBO); else [n][KS].
    auto hs_at = [&](int n, int k) -> T* {
      if constexpr (V == 2)
        return hs + (n >> 3) * (p.kpad * 8) + (k >> 3) * 64 + (n & 7) * 8 + (k & 7);
      return hs + n * KS + k;
    };
    // This thread's fixed staging source for step t (variant 1, hs_fixed).
    const T* hs_src = hs_k < p.kin ? below_t + hs_k : prev + (hs_k - p.kin);

    // --- stage h_t (below) and h_{t-1} (own) of chunk rows [r0, r1) into
    // hs (one cp.async group) ----------------------------------------------
    auto stage_hs = [&](int n0, int r0, int r1) {
      if (hs_fixed) {
        const T* src = hs_src + static_cast<size_t>(n0) * H;
        for (int n = r0 + hs_walk.n0; n < r1; n += hs_walk.dn)
          cp_async16(hs + n * KS + hs_k, src + static_cast<size_t>(n) * H);
      } else if (V == 2) {
        // The 8 lanes of a quarter warp copy rows 8g + tid % 8 of one
        // k-chunk: one 128-byte core matrix, conflict-free. (ChunkWalk's
        // consecutive k-chunks are 128 bytes apart in this layout, all in 4
        // banks: 8x the shared-memory wavefronts.) r0 is 0 or kNGroup where
        // r0 < r1, and K / 8 > kThreads / 8 (K > 256 for kpad 512 or 1024).
        const int kq = K >> 3, sub = tid & 7;
        int q = tid >> 3;
        T* dst = hs_at(r0 + sub, q * 8);
        size_t row = static_cast<size_t>(n0 + r0 + sub) * H;
        for (int n8 = r0; n8 < r1;) {
          const int k = q * 8;
          if (n8 + sub < r1) cp_async16(dst, (k < p.kin ? below_t + k : prev + (k - p.kin)) + row);
          q += kThreads / 8;
          dst += (kThreads / 8) * 64;
          if (q >= kq) {  // the next 8 rows: hs_at's (n / 8) kpad 8
            q -= kq;
            n8 += 8;
            row += static_cast<size_t>(8) * H;
            dst += p.kpad * 8 - kq * 64;
          }
        }
      } else {
        hs_walk.run(r0, r1, [&](int n, int q) {
          const int k = q * 8;
          const T* src = k < p.kin ? below_t + static_cast<size_t>(n0 + n) * H + k
                                   : prev + static_cast<size_t>(n0 + n) * H + (k - p.kin);
          cp_async16(hs_at(n, k), src);
        });
      }
      cp_async_commit();
    };

    // --- variant 3: wait in the data. Re-copies this thread's chunks of
    // rows [r0, r1) that still hold a kSentinel half (their producer has not
    // written them yet) until none does. Step 0's own part comes from h0,
    // the caller's, and never waits. A wait longer than kBwdWaitNs sets
    // flags[kLamportTimedOut] and stops waiting: wrong numbers, not a hang.
    // The usual case, every chunk in, is one pass of independent loads:
    // where a thread keeps one column chunk (kThreads a multiple of the
    // chunks of a row: every 4x512 and 8x256 layer), a strided loop the
    // compiler unrolls, so the loads are in flight together.
    auto all_in = [&](int r0, int r1) -> bool {
      uint32_t seen = 0;
      if (hs_walk.dq == 0) {
        const int k = hs_walk.q0 * 8;
        if (t == 0 && k >= p.kin) return true;
#pragma unroll 8
        for (int n = r0 + hs_walk.n0; n < r1; n += hs_walk.dn) {
          const uint4 v = *reinterpret_cast<const uint4*>(hs_at(n, k));
          seen |= sentinel_halves(v.x) | sentinel_halves(v.y) | sentinel_halves(v.z) |
                  sentinel_halves(v.w);
        }
      } else {
        hs_walk.run(r0, r1, [&](int n, int q) {
          if (t == 0 && q * 8 >= p.kin) return;
          const uint4 v = *reinterpret_cast<const uint4*>(hs_at(n, q * 8));
          seen |= sentinel_halves(v.x) | sentinel_halves(v.y) | sentinel_halves(v.z) |
                  sentinel_halves(v.w);
        });
      }
      return seen == 0u;
    };
    auto await_rows = [&](int n0, int r0, int r1) {
      if (a.mode & (kModeNoWait | kModeNoStage)) return;
      unsigned long long start = 0;
      while (!all_in(r0, r1)) {
        // re-copy the chunks still missing
        hs_walk.run(r0, r1, [&](int n, int q) {
          const int k = q * 8;
          if (t == 0 && k >= p.kin) return;
          T* dst = hs_at(n, k);
          if (has_sentinel(*reinterpret_cast<const uint4*>(dst)))
            cp_async16(dst, k < p.kin ? below_t + static_cast<size_t>(n0 + n) * H + k
                                      : prev + static_cast<size_t>(n0 + n) * H + (k - p.kin));
        });
        cp_async_commit();
        cp_async_wait_all();  // this thread's re-copies (and anything else in flight)
        if (start == 0) {
          start = global_ns();
        } else if (global_ns() - start > kBwdWaitNs) {
          atomicExch(a.flags + kLamportTimedOut, 1u);
          return;
        }
      }
    };

    // --- partial gates of the phase's n-groups (phase 0: the chunk's first
    // kNGroup rows): this warp's rows x K range, into part_k ---------------
    auto products = [&](int phase, int ntiles, float* part_k) {
      for (int t0 = ng * 4; t0 < ntiles; t0 += 4 * p.ng) {
        if ((t0 < kNGroup / 8) != (phase == 0)) continue;
        float acc[kWM][4][4];
#pragma unroll
        for (int i = 0; i < kWM; ++i)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][nt][e] = 0.0f;
#pragma unroll
        for (int jt = 0; jt < kWK; ++jt) {
          const int kcol = kg * kWarpK + jt * 16;
          uint32_t b[4][2];
#pragma unroll
          for (int pr = 0; pr < 2; ++pr) {
            b[2 * pr][0] = b[2 * pr][1] = b[2 * pr + 1][0] = b[2 * pr + 1][1] = 0;
            if (t0 + 2 * pr < ntiles) {
              const int q = lane >> 3;
              const int n = (t0 + 2 * pr) * 8 + (q >> 1) * 8 + (lane & 7);
              const int k = kcol + (q & 1) * 8;
              ldmatrix_x4(b[2 * pr][0], b[2 * pr][1], b[2 * pr + 1][0], b[2 * pr + 1][1],
                          hs + n * KS + k);
            }
          }
#pragma unroll
          for (int i = 0; i < kWM; ++i) {
            if (live & (1u << (i * kWK + jt))) {
#pragma unroll
              for (int nt = 0; nt < 4; ++nt)
                if (t0 + nt < ntiles) E::mma(acc[i][nt], wa[i][jt], b[nt][0], b[nt][1]);
            }
          }
        }
        // Pairs (variant 1): with ng == 1 every warp runs this tile group of
        // the phase (t0 = 4 * phase), so each arrive meets its sync. The
        // partner's partials sit where this warp's own would go.
        if (pair && !upper) {
          if (phase == 0) {
            named_barrier_sync<1>();
          } else {
            named_barrier_sync<2>();
          }
          const float* mate = part_k + (p.kg / 2) * kNC * RS;
#pragma unroll
          for (int i = 0; i < kWM; ++i) {
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              if (t0 + nt < ntiles)
                add_fragment(acc[i][nt], mate, RS, mg * kWarpRows + i * 16 + (lane >> 2),
                             (t0 + nt) * 8 + (lane & 3) * 2);
            }
          }
        }
        // C fragment (row, col) -> part_k[col][row]: the pointwise step
        // reads consecutive rows (units) of one batch row.
#pragma unroll
        for (int i = 0; i < kWM; ++i) {
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            if (t0 + nt < ntiles)
              store_fragment(part_k, RS, mg * kWarpRows + i * 16 + (lane >> 2),
                             (t0 + nt) * 8 + (lane & 3) * 2, acc[i][nt]);
          }
        }
        if (pair && upper) {
          if (phase == 0) {
            named_barrier_arrive<1>();
          } else {
            named_barrier_arrive<2>();
          }
        }
      }
    };

    // --- variant 2: the phase's 32 rows (phase 0: the chunk's first
    // kNGroup) x 64 rows x this warpgroup's K half, as kj wgmma into one
    // m64n32 float32 accumulator, stored to part slice warp / 4 ----------
    auto products_wgmma = [&](int phase, int nc) {
      const int r0 = phase * kNGroup;
      if (r0 >= nc) return;  // CTA-uniform
      float d[16];
#pragma unroll
      for (int e = 0; e < 16; ++e) d[e] = 0.0f;
      // k-step j: rows [r0, r0 + 32) (4 row groups), K chunks 2j, 2j + 1
      // of the warpgroup's half: 256 bytes a step.
      const uint32_t base =
          smem_addr(hs) + (r0 >> 3) * (p.kpad * 16) + (warp >> 2) * (KH / 8) * 128;
      // The k-steps' count as a constant (16 or 32): one unconditional run
      // of wgmma, so none needs its own fence.
      auto run = [&](auto steps) {
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < decltype(steps)::value; ++j)
          E::wgmma(d, wa[j / kWK][j % kWK], smem_desc(base + j * 256, 128, p.kpad * 16));
        wgmma_commit();
        wgmma_wait_all();
      };
      // Variant 4: the 128-byte-swizzled half (wavefront.cuh, "Variant 4").
      auto run_tma = [&](auto steps) {
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < decltype(steps)::value; ++j)
          E::wgmma(d, wa[j / kWK][j % kWK],
                   Sw128Desc(tma_hs + Sw128StepOffset(phase, warp >> 2, j, p.kpad)));
        wgmma_commit();
        wgmma_wait_all();
      };
      if constexpr (V == 4) {
        if (kj == 2 * kWK) {
          run_tma(Count<2 * kWK>{});
        } else {
          run_tma(Count<kWK>{});
        }
      } else if (kj == 2 * kWK) {
        run(Count<2 * kWK>{});
      } else {
        run(Count<kWK>{});
      }
      // D (row, col) -> part[warp / 4][col][row], as mma.sync's C fragments:
      // n8 block b holds d[4b .. 4b + 3].
      float* slice = part + (warp >> 2) * kNC * RS;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const float c[4] = {d[4 * b], d[4 * b + 1], d[4 * b + 2], d[4 * b + 3]};
        store_fragment(slice, RS, (warp & 3) * 16 + (lane >> 2), r0 + 8 * b + (lane & 3) * 2, c);
      }
    };

    // --- pointwise, rows [r0, r1) of chunk n0, 2 units of one batch row a
    // thread, summing `kparts` partial slices ------------------------------
    auto pointwise_rows = [&](int n0, int r0, int r1) {
      const int items = (a.mode & kModeNoPointwise) ? 0 : (r1 - r0) * UP;
      for (int idx = tid; idx < items; idx += kThreads) {
        const int n = r0 + (idx >> up_shift), u = (idx & (UP - 1)) * 2;
        if (u0 + u >= H) continue;
        const int nb = n0 + n;
        float pre[4][2];
#pragma unroll
        for (int vg = 0; vg < 4; ++vg) {
          float2 s = *reinterpret_cast<const float2*>(bias + vg * U + u);
          // (variant 0 reads p.kg itself: one register fewer than kparts)
          for (int kk = 0; kk < (V == 0 ? p.kg : kparts); ++kk) {
            const float2 v =
                *reinterpret_cast<const float2*>(part + (kk * kNC + n) * RS + vg * U + u);
            s.x += v.x;
            s.y += v.y;
          }
          pre[vg][0] = s.x;
          pre[vg][1] = s.y;
        }
        if (first) {
#pragma unroll
          for (int g = 0; g < 4; ++g) {
            if (g >= G) break;
            const float2 f =
                E::unpack(*reinterpret_cast<const uint32_t*>(xs_t + (nb * G + g) * U + u));
            pre[g][0] += f.x;
            pre[g][1] += f.y;
          }
        }
        float h[2], cv[2] = {0.0f, 0.0f};
        cell_pointwise(a, pre, a.gru ? nullptr : reinterpret_cast<float2*>(cs + nb * U + u),
                       a.gru ? E::unpack(*reinterpret_cast<const uint32_t*>(
                                   V == 4 ? prev + static_cast<size_t>(nb) * H + u0 + u
                                          : hs_at(n, p.kin + u0 + u)))
                             : float2{},
                       (static_cast<size_t>(l) * steps + t) * B + nb, u0 + u, H, h, cv);
        const int len = lens[nb];
        const size_t o = static_cast<size_t>(nb) * H + u0 + u;
        uint32_t out = t < len ? E::pack(h[0], h[1]) : 0u;
        if constexpr (V == 3) {
          out = lamport_value(out);  // never the sentinel: the value is the flag
          store_relaxed(mine + static_cast<size_t>(t) * seq + o, out);
        } else {
          *reinterpret_cast<uint32_t*>(mine + static_cast<size_t>(t) * seq + o) = out;
        }
        if (t == len - 1) {
          *reinterpret_cast<uint32_t*>(hy + o) = out;
          if (!a.gru) *reinterpret_cast<uint32_t*>(cy + o) = E::pack(cv[0], cv[1]);
        }
      }
    };

    if constexpr (V == 1) {
      // --- variant 1 (wavefront.cuh): the first half's pointwise step
      // overlaps the second half's products ---------------------------------
      for (int c = 0; c < nchunks; ++c) {
        const int n0 = c * kNC, nc = min(kNC, B - n0);
        const int half = nc < kNGroup ? nc : kNGroup;
        const bool stage = !(a.mode & kModeNoStage);
        const bool poll = !(a.mode & kModeNoWait);
        if (split_wait && c == 0) {
          if (warp == 0) {
            if (poll) await_flags(below_flags, below_ctas, static_cast<unsigned>(t + 1), lane);
            __syncwarp();
            named_barrier_arrive<3, kThreads / 2>();
          } else if (stage_below) {
            named_barrier_sync<3, kThreads / 2>();
          } else {
            named_barrier_sync<4, 32 + kThreads / 2>();
          }
        }
        for (int part_rows = 0; part_rows < 2; ++part_rows) {
          const int r0 = part_rows ? half : 0, r1 = stage ? (part_rows ? nc : half) : r0;
          stage_hs(n0, r0, r1);
        }
        if (split_wait && c == 0 && warp == 0) {
          if (poll && t > 0) await_flags(my_flags, p.ctas, static_cast<unsigned>(t), lane);
          __syncwarp();
          named_barrier_arrive<4, 32 + kThreads / 2>();
          mark(t, 1);
        }

        const int ntiles = (nc + 7) / 8;
        float* part_k = part + kg * kNC * RS;
        for (int phase = 0; phase < 2; ++phase) {
          if (phase == 0) {
            cp_async_wait_but_one();  // the first half (and xs of step t) is in
            __syncthreads();
            if (c == 0) mark(t, 2);
          } else {
            cp_async_wait_all();
            __syncthreads();  // the first half's partials are in part
            if (c == 0) {
              // Prefetch step t+1's xproj (layer 0); in by the next step's wait.
              stage_xs(t + 1);
              cp_async_commit();
            }
            if (!late) pointwise_rows(n0, 0, half);
          }
          if (!(a.mode & kModeNoMma)) products(phase, ntiles, part_k);
          if (phase == 1 && late) pointwise_rows(n0, 0, half);
        }
        __syncthreads();  // every partial of the second half is in part
        if (c == 0) mark(t, 3);
        pointwise_rows(n0, half, nc);
        __syncthreads();  // hs and part are the next chunk's
      }
    }

    if constexpr (V == 4) {
      // --- variant 4 (wavefront.cuh): each half's tensor copies complete on
      // the half's mbarrier; its products wait for those bytes alone -------
      for (int c = 0; c < nchunks; ++c) {
        const int n0 = c * kNC, nc = min(kNC, B - n0);
        const int halves = nc > kNGroup ? 2 : 1;
        const bool stage = !(a.mode & kModeNoStage);
        if (stage && warp == 0) {
          fence_proxy_async_global();  // the acquired h, to this lane's copies
          const int copies = halves * TmaCopies(p, H);
          if (lane == 0) {
            for (int h = 0; h < halves; ++h) mbar_expect_tx(tma_bar + 8 * h, TmaHalfBytes(p, H));
          }
          __syncwarp();
          if (lane < copies) {  // copies <= 32: K <= 1024 (Variant4Fits)
            const TmaCopy cp = TmaStageCopy(a, p, l, t, n0, lane);
            tma_load_3d(tma_hs + cp.dst, &maps->map[cp.map], cp.k, cp.row, cp.plane,
                        tma_bar + 8 * cp.half);
          }
        }
        for (int phase = 0; phase < halves; ++phase) {
          if (stage) {
            mbar_wait(tma_bar + 8 * phase, (tma_parity >> phase) & 1u);
            tma_parity ^= 1u << phase;
          }
          if (c == 0 && phase == 0) mark(t, 2);
          if (!(a.mode & kModeNoMma)) products_wgmma(phase, nc);
        }
        cp_async_wait_all();  // this thread's xproj copies of step t (layer 0)
        __syncthreads();
        if (c == 0) {
          mark(t, 3);
          stage_xs(t + 1);
          cp_async_commit();
        }
        pointwise_rows(n0, 0, nc);
        __syncthreads();  // part and hs are the next chunk's
      }
    }

    // Variant 0's chunks, and variants 2 and 3's (variants 1 and 4 ran their own above).
    for (int c = 0; V != 1 && V != 4 && c < nchunks; ++c) {
      const int n0 = c * kNC, nc = min(kNC, B - n0);

      // --- stage the chunk in two halves of its rows (two cp.async
      // groups), so the first n-group's products start while the second
      // half is still in flight ------------------------------------------
      const int half = nc < kNGroup ? nc : kNGroup;
      const bool stage = !(a.mode & kModeNoStage);
      for (int part_rows = 0; part_rows < 2; ++part_rows) {
        const int r0 = part_rows ? half : 0, r1 = stage ? (part_rows ? nc : half) : r0;
        stage_hs(n0, r0, r1);
      }

      const int ntiles = (nc + 7) / 8;
      float* part_k = part + kg * kNC * RS;
      for (int phase = 0; phase < 2; ++phase) {
        if (phase == 0) {
          cp_async_wait_but_one();  // the first half (and xs of step t) is in
        } else {
          cp_async_wait_all();
        }
        if constexpr (V == 3) await_rows(n0, phase ? half : 0, phase ? nc : half);
        if constexpr (V == 2) fence_proxy_async();  // the copies, to wgmma's reads
        __syncthreads();
        if (c == 0 && phase == 0) mark(t, 2);
        if (a.mode & kModeNoMma) continue;
        if constexpr (V == 2) {
          products_wgmma(phase, nc);
        } else {
          products(phase, ntiles, part_k);
        }
      }
      __syncthreads();
      if (c == 0) {
        mark(t, 3);
        // Prefetch step t+1's xproj (layer 0); in by the next step's wait.
        stage_xs(t + 1);
        cp_async_commit();
      }
      pointwise_rows(n0, 0, nc);
      __syncthreads();
    }
    mark(t, 4);

    // --- step t done: publish (variant 3: the h stores were the publication)
    if (V != 3 && tid == 0) {
      if (a.mode & kModeScFence) __threadfence();
      publish(my_flags + j, static_cast<unsigned>(t + 1));
    }
    mark(t, 5);
  }
  cp_async_wait_all();
}

// ---------------------------------------------------------------------------
// Pieces of the backward kernels.

// Zeroes the `ds_elems` staging elements and the rows' carried dc, and
// reads the rows' lengths.
template <typename T>
__device__ __forceinline__ void init_backward_smem(T* ds, int ds_elems, float* dcs, int* lens,
                                                   const int* lengths, int row0, int rows,
                                                   int steps, int tid) {
  for (int idx = tid; idx < ds_elems; idx += kThreads) ds[idx] = T(0.0f);
  for (int idx = tid; idx < rows * kBwdUnits; idx += kThreads) dcs[idx] = 0.0f;
  load_lengths(lens, lengths, row0, rows, steps, tid);
}

// The LSTM cell's backward at one (row, unit), from dh, the carried dc and
// the saved gates i, f, g, o, c_t (ct) and c_{t-1} (cp): the pre-activation
// gate gradients da and the carry dc f.
__device__ __forceinline__ void lstm_cell_backward(float dh, float dc, float ig, float fg,
                                                   float gg, float og, float ct, float cp,
                                                   float (&da)[4], float& carry) {
  const float tc = tanhf(ct);
  dc += dh * og * (1.0f - tc * tc);
  da[0] = dc * gg * ig * (1.0f - ig);
  da[1] = dc * cp * fg * (1.0f - fg);
  da[2] = dc * ig * (1.0f - gg * gg);
  da[3] = dh * tc * og * (1.0f - og);
  carry = dc * fg;
}

// ---------------------------------------------------------------------------
// The backward kernel of one LSTM (kGru false) or GRU (kGru true) layer
// (wavefront.cuh: "The backward kernel", "The GRU backward"). CTA (group s,
// block j) owns units [16j, 16j+16) of the batch rows [s*rows, (s+1)*rows).
// The GRU is a template parameter, so the LSTM's kernels compile as before.
template <typename T, bool kGru>
__device__ __forceinline__ void backward_body(const BwdArgs& a) {
  using E = Elem<T>;
  extern __shared__ __align__(16) unsigned char smem[];

  const int cta = blockIdx.x;
  const int s = cta / a.ctas_per_group, j = cta % a.ctas_per_group;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int H = a.H, B = a.B, steps = a.T, G4 = 4 * H;
  const int u0 = j * kBwdUnits, row0 = s * a.rows;
  const int rows = min(a.rows, B - row0);  // >= 1 (the plan makes no empty group)
  const int kt = a.kt, KS = a.kpad + kHsPad;

  T* ds = reinterpret_cast<T*>(smem + a.smem_ds);              // [kBwdChunk][KS]
  float* part = reinterpret_cast<float*>(smem + a.smem_part);  // [kWarps][kBwdChunk][kBwdPartStride]
  float* dcs = reinterpret_cast<float*>(smem + a.smem_dc);     // [rows][kBwdUnits]
  int* lens = reinterpret_cast<int*>(smem + a.smem_len);       // [rows]

  // --- this warp's W_hh^T block as mma A fragments: A[r][k] = W_hh[k][u0 + r]
  // (rows: the CTA's 16 units; k: gate columns [warp*16*kt, +16*kt)) ------
  // A GRU's 4H virtual gate columns are (r, z, n_x, n_h): n_x (the input
  // side's n gradient) meets no W_hh row (zero), n_h meets W_hh's n rows
  // (row k - H). H is a multiple of 8, so columns k, k+1 are in one block.
  const unsigned short* W = static_cast<const unsigned short*>(a.w_hh);
  uint32_t wa[kBwdMaxKt][4];
#pragma unroll
  for (int jt = 0; jt < kBwdMaxKt; ++jt) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = (lane >> 2) + ((q & 1) ? 8 : 0);
      const int k = (warp * kt + jt) * 16 + (lane & 3) * 2 + ((q & 2) ? 8 : 0);
      const int krow = kGru && k >= 3 * H ? k - H : k;
      const bool zero = kGru && k >= 2 * H && k < 3 * H;
      uint32_t w = 0;
      if (jt < kt && u0 + r < H && k < G4 && !zero) {
        const size_t off = static_cast<size_t>(krow) * H + u0 + r;
        w = static_cast<uint32_t>(W[off]) | (static_cast<uint32_t>(W[off + H]) << 16);
      }
      wa[jt][q] = w;
    }
  }

  init_backward_smem(ds, kBwdChunk * KS, dcs, lens, a.lengths, row0, rows, steps, tid);
  __syncthreads();

  const T* dgates_in = static_cast<const T*>(a.dgates);
  T* dgates = static_cast<T*>(a.dgates);
  const T* dy = static_cast<const T*>(a.dy);
  const T* dhy = static_cast<const T*>(a.dhy);
  const T* dcy = static_cast<const T*>(a.dcy);
  const T* c0 = static_cast<const T*>(a.c0);
  const unsigned* group_flags = a.flags + s * a.ctas_per_group;
  const ChunkWalk walk(tid, G4 / 8);  // 16-byte pieces of one row of da
  const int nchunks = (rows + kBwdChunk - 1) / kBwdChunk;
  bool waits = true;  // false after a timed-out wait (then the results are wrong, flagged)

  // t = T-1 .. 0: step t; t = -1: only the product, dh0 = W_hh^T da_0.
  for (int t = steps - 1; t >= -1; --t) {
    const bool product = t < steps - 1;
    if (product && warp == 0 && waits) {
      const unsigned need = static_cast<unsigned>(steps - 1 - t);  // step t+1 done
      for (int i = lane; i < a.ctas_per_group; i += 32) {
        const unsigned long long start = global_ns();
        if (!await_flag_or_time_out(group_flags + i, need, start, a.flags + a.ctas)) waits = false;
      }
      __syncwarp();
    }
    __syncthreads();

    for (int c = 0; c < nchunks; ++c) {
      const int n0 = c * kBwdChunk, nc = min(kBwdChunk, rows - n0);
      if (product) {
        // --- stage da_{t+1} of the chunk's rows, all 4H columns ---------
        stage_rows(ds, KS, dgates_in + (static_cast<size_t>(t + 1) * B + row0 + n0) * G4, G4, nc,
                   walk);
        cp_async_wait_all();
        __syncthreads();
        // --- this warp's partial dh^T: 16 units x nc rows over its K range
        float acc[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
        const bool two = nc > 8;
#pragma unroll
        for (int jt = 0; jt < kBwdMaxKt; ++jt) {
          if (jt < kt) {
            const int kcol = (warp * kt + jt) * 16;
            const int qq = lane >> 3;
            const int nn = (qq >> 1) * 8 + (lane & 7), kk = kcol + (qq & 1) * 8;
            uint32_t b00, b01, b10, b11;
            ldmatrix_x4(b00, b01, b10, b11, ds + nn * KS + kk);
            E::mma(acc[0], wa[jt], b00, b01);
            if (two) E::mma(acc[1], wa[jt], b10, b11);
          }
        }
        // C fragment (unit row, batch col) -> part[warp][col][row]
        float* pw = part + warp * kBwdChunk * kBwdPartStride;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          store_fragment(pw, kBwdPartStride, lane >> 2, nt * 8 + (lane & 3) * 2, acc[nt]);
        __syncthreads();
      }

      // --- pointwise: one (row, unit) a thread ----------------------------
      const int n = tid / kBwdUnits, u = tid % kBwdUnits;
      const int nl = n0 + n, nb = row0 + nl, ug = u0 + u;
      if (n < nc && ug < H) {
        float rec = 0.0f;  // (W_hh^T da_{t+1})[nb][ug]
        if (product) {
#pragma unroll
          for (int w = 0; w < kWarps; ++w) rec += part[(w * kBwdChunk + n) * kBwdPartStride + u];
        }
        const size_t o = static_cast<size_t>(nb) * H + ug;
        if (t < 0) {
          // A GRU's h0 also gets the direct path dh_0 z_0 (the carry).
          a.dh0[o] = kGru ? rec + dcs[nl * kBwdUnits + u] : rec;
        } else {
          const int len = lens[nl];
          float da[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          float carry = 0.0f;
          if (kGru) {
            if (t < len) {
              // h_t = (1 - z) n + z h_{t-1}, n = tanh(x_n + r (W_hn h_{t-1} + b_hn)):
              // carry = dh_t z (the direct path into dh_{t-1}); da = (dr, dz,
              // dn_x, dn_h) pre-activation: dn_x = dh (1 - z)(1 - n^2) feeds W_in
              // and b_in, dn_h = dn_x r feeds W_hn and b_hn.
              const size_t ot = static_cast<size_t>(t) * B * H + o;
              float dh = rec + E::to_float(dy[ot]) + dcs[nl * kBwdUnits + u];
              if (t == len - 1) dh += E::to_float(dhy[o]);
              const float* gp = a.gates + (static_cast<size_t>(t) * B + nb) * G4 + ug;
              const float rg = gp[0], zg = gp[H], ng = gp[2 * H], hn = gp[3 * H];
              const float hp = a.cseq[ot];  // h_{t-1} as the forward read it
              const float dnx = dh * (1.0f - zg) * (1.0f - ng * ng);
              da[0] = dnx * hn * rg * (1.0f - rg);
              da[1] = dh * (hp - ng) * zg * (1.0f - zg);
              da[2] = dnx;
              da[3] = dnx * rg;
              carry = dh * zg;
            }
          } else if (t < len) {
            const size_t ot = static_cast<size_t>(t) * B * H + o;
            float dh = rec + E::to_float(dy[ot]);
            float dc = dcs[nl * kBwdUnits + u];
            if (t == len - 1) {
              dh += E::to_float(dhy[o]);
              dc = E::to_float(dcy[o]);
            }
            const float* gp = a.gates + (static_cast<size_t>(t) * B + nb) * G4 + ug;
            const float ig = gp[0], fg = gp[H], gg = gp[2 * H], og = gp[3 * H];
            const float ct = a.cseq[ot];
            const float cp = t > 0 ? a.cseq[ot - static_cast<size_t>(B) * H] : E::to_float(c0[o]);
            lstm_cell_backward(dh, dc, ig, fg, gg, og, ct, cp, da, carry);
          }
          dcs[nl * kBwdUnits + u] = carry;
          T* dp = dgates + (static_cast<size_t>(t) * B + nb) * G4 + ug;
#pragma unroll
          for (int g = 0; g < 4; ++g) dp[g * H] = T(da[g]);
          if (!kGru && t == 0) a.dc0[o] = carry;
        }
      }
      __syncthreads();  // ds and part are the next chunk's
    }

    if (t >= 0 && tid == 0) publish(a.flags + cta, static_cast<unsigned>(steps - t));
  }
}

// ---------------------------------------------------------------------------
// Pieces of the stack backward's kernels (backward_stack_body and its
// pipelined variants).

// Layer l's slices of the stack backward's buffers and the flags of CTA
// (l, s, j) (wavefront.cuh, "The stack backward").
template <typename T>
struct StackLayer {
  T* dgates;                  // [T][B][4H] of layer l
  const T* dy;                // the top layer's [T][B][H]
  const T *dhy, *dcy, *c0;    // [B][H] of layer l
  const float *gates, *cseq;  // the forward's saved [T][B][4H] and [T][B][H] of layer l
  float *dh0, *dc0;           // [B][H] of layer l
  // dy of layer l (from the CTA above) and of layer l-1 (this CTA's m-tile 1).
  const float* dy_in;
  float* dy_out;
  unsigned* own_flags;  // the group's flags of layer l; this CTA's: own_flags[j]
  const unsigned* above_flag;
  unsigned* timed_out;

  __device__ __forceinline__ StackLayer(const BwdStackArgs& a, int l, int s, int j) {
    const int steps = a.T;
    const bool top = l == a.L - 1, dual = l > 0;
    const size_t seq = static_cast<size_t>(a.B) * a.H;
    const size_t gseq = static_cast<size_t>(a.B) * (4 * a.H);
    dgates = static_cast<T*>(a.dgates) + static_cast<size_t>(l) * steps * gseq;
    dy = static_cast<const T*>(a.dy);
    dhy = static_cast<const T*>(a.dhy) + static_cast<size_t>(l) * seq;
    dcy = static_cast<const T*>(a.dcy) + static_cast<size_t>(l) * seq;
    c0 = static_cast<const T*>(a.c0) + static_cast<size_t>(l) * seq;
    gates = a.gates + static_cast<size_t>(l) * steps * gseq;
    cseq = a.cseq + static_cast<size_t>(l) * steps * seq;
    dh0 = a.dh0 + static_cast<size_t>(l) * seq;
    dc0 = a.dc0 + static_cast<size_t>(l) * seq;
    dy_in = top ? nullptr : a.dyl + static_cast<size_t>(l) * steps * seq;
    dy_out = dual ? a.dyl + static_cast<size_t>(l - 1) * steps * seq : nullptr;
    own_flags = a.flags + l * kFlagStride + s * a.per_group;
    above_flag = top ? nullptr : a.flags + (l + 1) * kFlagStride + s * a.per_group + j;
    timed_out = a.flags + kMaxLayers * kFlagStride;
  }

  // cp.async of da_l[t+1] of batch rows [row, row + rows) (all 4H
  // columns, row stride G4) into dst (row stride KS), one commit group.
  __device__ __forceinline__ void stage_da(T* dst, int KS, int t, size_t gseq, int G4, int row,
                                           int rows, const ChunkWalk& walk) const {
    stage_rows(dst, KS, dgates + static_cast<size_t>(t + 1) * gseq + static_cast<size_t>(row) * G4,
               G4, rows, walk);
  }

  // The start of step t: warp 0 waits for its own layer's group (step t+1
  // done; `product`) and for the one CTA above (its step t-1 done: dy_l[t]
  // written; `needs_dy`), then the CTA barrier.
  __device__ __forceinline__ void begin_step(const BwdStackArgs& a, int t, bool product,
                                             bool needs_dy, int warp, int lane,
                                             bool& waits) const {
    if (warp == 0 && (product || needs_dy)) {
      await_inputs(a, t, product, needs_dy, lane, waits);
      __syncwarp();
    }
    __syncthreads();
  }

  // Warp 0's waits of begin_step. `waits` is per lane, false after a
  // timeout (the branch to __syncwarp stays warp-uniform).
  __device__ __forceinline__ void await_inputs(const BwdStackArgs& a, int t, bool product,
                                               bool needs_dy, int lane, bool& waits) const {
    const int steps = a.T;
    const unsigned long long start = global_ns();
    if (product && waits) {
      const unsigned need = static_cast<unsigned>(steps - 1 - t);  // own step t+1 done
      for (int i = lane; i < a.per_group && waits; i += 32)
        waits = await_flag_or_time_out(own_flags + i, need, start, timed_out);
    }
    if (needs_dy && lane == 0 && waits) {
      const unsigned need = static_cast<unsigned>(steps - t + 1);  // above's step t-1 done
      waits = await_flag_or_time_out(above_flag, need, start, timed_out);
    }
  }
};

// This warp's weights of layer l as mma A fragments, slot i of wa:
//   dual:  i < 16: W_hh_l^T tile jt = i;  i >= 16: W_ih_l^T tile jt = i - 16
//   else:  W_hh_l^T tile jt = i (up to kBwdMaxKt tiles: a 1-layer stack's H <= 1024)
// A[r][k] = W[k][u0 + r] (W: [4H][H], rows = gate columns k of tile
// warp * kt + jt), as backward_body loads W_hh.
__device__ __forceinline__ void load_stack_weights(const BwdStackArgs& a, int l, bool dual,
                                                   int warp, int lane, int u0,
                                                   uint32_t (&wa)[kBwdMaxKt][4]) {
  constexpr int kHalf = kBwdMaxKt / 2;
  const int H = a.H, G4 = 4 * H, kt = a.kt;
  const unsigned short* P = static_cast<const unsigned short*>(a.params);
  const unsigned short* Whh = P + a.w_hh[l];
  const unsigned short* Wih = P + a.w_ih[l];  // read only where dual (layer l's input is H wide)
#pragma unroll
  for (int i = 0; i < kBwdMaxKt; ++i) {
    const bool second = dual && i >= kHalf;
    const int jt = second ? i - kHalf : i;
    const unsigned short* W = second ? Wih : Whh;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = (lane >> 2) + ((q & 1) ? 8 : 0);
      const int k = (warp * kt + jt) * 16 + (lane & 3) * 2 + ((q & 2) ? 8 : 0);
      uint32_t w = 0;
      if (jt < kt && u0 + r < H && k < G4) {
        const size_t off = static_cast<size_t>(k) * H + u0 + r;
        w = static_cast<uint32_t>(W[off]) | (static_cast<uint32_t>(W[off + H]) << 16);
      }
      wa[i][q] = w;
    }
  }
}

// ---------------------------------------------------------------------------
// The stack backward, a reverse wavefront over the layers (wavefront.cuh:
// "The stack backward"). CTA (layer l, group s, block j) owns units
// [16j, 16j+16) of layer l for the batch rows [s*rows, (s+1)*rows). Each
// step it stages its own layer's da_{t+1} (the group's rows, all 4H gate
// columns) and multiplies it by two m16 tiles of weights: W_hh_l^T (its
// units' dh_t) and, above layer 0, W_ih_l^T (units [16j, 16j+16) of the
// layer below's dy at t+1), so the hand-off to the layer below is 16 units
// of float32 a row, read by the one CTA (l-1, s, j).
template <typename T>
__device__ __forceinline__ void backward_stack_body(const BwdStackArgs& a) {
  using E = Elem<T>;
  extern __shared__ __align__(16) unsigned char smem[];

  const int cta = blockIdx.x;
  const int l = cta / a.ctas_per_layer, within = cta % a.ctas_per_layer;
  const int s = within / a.per_group, j = within % a.per_group;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int H = a.H, B = a.B, steps = a.T, G4 = 4 * H, L = a.L;
  const bool top = l == L - 1;
  const bool dual = l > 0;  // also computes the layer below's dy (plan: kt <= kBwdMaxKt / 2)
  const int u0 = j * kBwdUnits, row0 = s * a.rows;
  const int rows = min(a.rows, B - row0);  // >= 1 (the plan makes no empty group)
  const int kt = a.kt, KS = a.kpad + kHsPad;
  constexpr int kHalf = kBwdMaxKt / 2;

  T* ds = reinterpret_cast<T*>(smem + a.smem_ds);              // [ds_bufs][kBwdChunk][KS]
  float* part = reinterpret_cast<float*>(smem + a.smem_part);  // [kWarps][kBwdChunk][kBwdStackPartStride]
  float* dcs = reinterpret_cast<float*>(smem + a.smem_dc);     // [rows][kBwdUnits]
  int* lens = reinterpret_cast<int*>(smem + a.smem_len);       // [rows]

  // --- this warp's weights as mma A fragments (load_stack_weights) ---------
  uint32_t wa[kBwdMaxKt][4];
  load_stack_weights(a, l, dual, warp, lane, u0, wa);

  init_backward_smem(ds, a.ds_bufs * kBwdChunk * KS, dcs, lens, a.lengths, row0, rows, steps,
                     tid);
  __syncthreads();

  const size_t seq = static_cast<size_t>(B) * H;   // one step of an [.][B][H] buffer
  const size_t gseq = static_cast<size_t>(B) * G4;  // one step of an [.][B][4H] buffer
  const StackLayer<T> io(a, l, s, j);
  const int nchunks = (rows + kBwdChunk - 1) / kBwdChunk;
  const ChunkWalk walk(tid, G4 / 8);  // 16-byte pieces of one row of da
  bool waits = true;  // false after a timed-out wait (then the results are wrong, flagged)

  // t = T-1 .. 0: step t; t = -1: only the products of da_0 (dh0, and the
  // layer below's dy at 0). After step t, flag = T - t (T + 1 after t = -1).
  for (int t = steps - 1; t >= -1; --t) {
    const bool product = t < steps - 1;  // da_l[t+1] staged and multiplied
    // dy_l[t] (below the top): CTA (l+1, s, j) after its step t-1
    io.begin_step(a, t, product, !top && t >= 0, warp, lane, waits);

    // --- stage da_l[t+1] of chunk c's rows, all 4H columns, into buffer b
    auto stage = [&](int c, int b) {
      const int n0 = c * kBwdChunk;
      io.stage_da(ds + b * kBwdChunk * KS, KS, t, gseq, G4, row0 + n0, min(kBwdChunk, rows - n0),
                  walk);
    };
    if (product) stage(0, 0);

    for (int c = 0; c < nchunks; ++c) {
      const int n0 = c * kBwdChunk, nc = min(kBwdChunk, rows - n0);
      // Two buffers: chunk c+1 lands while chunk c multiplies (its buffer
      // was last read in chunk c-1, before that chunk's closing barrier).
      // One buffer: chunk c is staged here, after chunk c-1's barrier.
      const int b = a.ds_bufs > 1 ? (c & 1) : 0;
      const T* dsb = ds + b * kBwdChunk * KS;
      if (product) {
        if (a.ds_bufs > 1 && c + 1 < nchunks) {
          stage(c + 1, (c + 1) & 1);
          cp_async_wait_but_one();  // chunk c's group is in; chunk c+1's may not be
        } else {
          if (a.ds_bufs == 1 && c > 0) stage(c, 0);
          cp_async_wait_all();
        }
        __syncthreads();
        // --- this warp's partials: dh^T (acc0) and, dual, the layer below's
        // dy^T (acc1), 16 units x nc rows over its K range ---------------
        float acc0[2][4], acc1[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc0[nt][e] = acc1[nt][e] = 0.0f;
        const bool two = nc > 8;
        const int qq = lane >> 3;
        const int nn = (qq >> 1) * 8 + (lane & 7), kq = (qq & 1) * 8;
#pragma unroll
        for (int jt = 0; jt < kHalf; ++jt) {
          if (jt < kt) {
            const int kk = (warp * kt + jt) * 16 + kq;
            uint32_t b00, b01, b10, b11;
            ldmatrix_x4(b00, b01, b10, b11, dsb + nn * KS + kk);
            E::mma(acc0[0], wa[jt], b00, b01);
            if (two) E::mma(acc0[1], wa[jt], b10, b11);
            if (dual) {
              E::mma(acc1[0], wa[kHalf + jt], b00, b01);
              if (two) E::mma(acc1[1], wa[kHalf + jt], b10, b11);
            }
          }
          if (!dual && kHalf + jt < kt) {  // a 1-layer stack's H > 512: tiles 16..31
            const int kk = (warp * kt + kHalf + jt) * 16 + kq;
            uint32_t b00, b01, b10, b11;
            ldmatrix_x4(b00, b01, b10, b11, dsb + nn * KS + kk);
            E::mma(acc0[0], wa[kHalf + jt], b00, b01);
            if (two) E::mma(acc0[1], wa[kHalf + jt], b10, b11);
          }
        }
        // C fragments (unit row, batch col) -> part[warp][col][row]: rows
        // 0-15 dh, 16-31 the layer below's dy.
        float* pw = part + warp * kBwdChunk * kBwdStackPartStride;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int row = lane >> 2, col = nt * 8 + (lane & 3) * 2;
          store_fragment(pw, kBwdStackPartStride, row, col, acc0[nt]);
          if (dual) store_fragment(pw, kBwdStackPartStride, 16 + row, col, acc1[nt]);
        }
        __syncthreads();
      }

      // --- pointwise: one (row, unit) a thread ----------------------------
      const int n = tid / kBwdUnits, u = tid % kBwdUnits;
      const int nl = n0 + n, nb = row0 + nl, ug = u0 + u;
      if (n < nc && ug < H) {
        const size_t o = static_cast<size_t>(nb) * H + ug;
        float rec = 0.0f;  // (W_hh^T da_{t+1})[nb][ug]
        if (product) {
          float below = 0.0f;  // (W_ih_l^T da_{t+1})[nb][ug]: the layer below's dy at t+1
#pragma unroll
          for (int w = 0; w < kWarps; ++w) {
            const float* pr = part + (w * kBwdChunk + n) * kBwdStackPartStride;
            rec += pr[u];
            below += pr[16 + u];
          }
          if (dual) io.dy_out[static_cast<size_t>(t + 1) * seq + o] = below;
        }
        if (t < 0) {
          io.dh0[o] = rec;
        } else {
          const int len = lens[nl];
          float da[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          float carry = 0.0f;
          if (t < len) {
            const size_t ot = static_cast<size_t>(t) * seq + o;
            // ld.global.cg: the hand-off is read from L2, never from L1.
            float dh = rec + (top ? E::to_float(io.dy[ot]) : __ldcg(io.dy_in + ot));
            float dc = dcs[nl * kBwdUnits + u];
            if (t == len - 1) {
              dh += E::to_float(io.dhy[o]);
              dc = E::to_float(io.dcy[o]);
            }
            const float* gp = io.gates + static_cast<size_t>(t) * gseq + static_cast<size_t>(nb) * G4 + ug;
            const float ig = gp[0], fg = gp[H], gg = gp[2 * H], og = gp[3 * H];
            const float ct = io.cseq[ot];
            const float cp = t > 0 ? io.cseq[ot - seq] : E::to_float(io.c0[o]);
            lstm_cell_backward(dh, dc, ig, fg, gg, og, ct, cp, da, carry);
          }
          dcs[nl * kBwdUnits + u] = carry;
          T* dp = io.dgates + static_cast<size_t>(t) * gseq + static_cast<size_t>(nb) * G4 + ug;
#pragma unroll
          for (int g = 0; g < 4; ++g) dp[g * H] = T(da[g]);
          if (t == 0) io.dc0[o] = carry;
        }
      }
      __syncthreads();  // ds and part are the next chunk's
    }

    if (tid == 0) publish(io.own_flags + j, static_cast<unsigned>(steps - t));
  }
}


// ---------------------------------------------------------------------------
// The stack backward's pipelined variants (BwdStackArgs::variant 1 and 2;
// wavefront.cuh, "Variants"): the same step as backward_stack_body, in
// chunks of kRows batch rows (16 or 32), with `part` double-buffered
// (part[c & 1]) so that chunk c's pointwise step shares the barrier
// interval of chunk c+1's products. Per chunk i of a step (n chunks), one
// iteration i = 0 .. n does
//   [1 ds buffer, i > 0: barrier R_i (products i-1 done: ds free);
//    stage chunk i; pointwise i-1, behind the staging]
//   wait for chunk i's cp.async group; barrier S_i
//   [2 ds buffers: stage chunk i+1 (chunk 0 before the loop) into the
//    buffer products i-1 read before S_i]
//   products i -> part[i & 1]
//   [2 ds buffers: pointwise i-1 from part[(i-1) & 1]]
// then (2 ds buffers) one barrier before publishing. Part[i & 1] is
// written after S_i and read until S_{i+1} (2 buffers) or R_{i+1} (1),
// and written again only after S_{i+2}. The global inputs of chunk i's
// pointwise (saved gates, c, dy, dhy, dcy) are loaded in iteration i and
// used in iteration i+1, so their latency hides behind the products. The
// partials are float2 (dh, the layer below's dy) per unit: [warp][row]
// [kBwdStackPartStride], unit u at 2u, 8 64-bit loads a thread instead of
// 16 32-bit ones.
struct BwdPre {  // one (row, unit)'s pointwise inputs (valid: t >= 0, in range, t < len)
  float ig, fg, gg, og, ct, cp, dy, dhy, dcy;
};

template <typename T, int kRows>
__device__ __forceinline__ void backward_stack_pipelined_body(const BwdStackArgs& a) {
  using E = Elem<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kNt = kRows / 8;          // n-tiles of 8 rows a chunk
  constexpr int kPer = kRows / 16;        // (row, unit) pairs a thread a chunk
  constexpr int kHalf = kBwdMaxKt / 2;
  constexpr int kPS = kBwdStackPartStride;

  const int cta = blockIdx.x;
  const int l = cta / a.ctas_per_layer, within = cta % a.ctas_per_layer;
  const int s = within / a.per_group, j = within % a.per_group;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int H = a.H, B = a.B, steps = a.T, G4 = 4 * H, L = a.L;
  const bool top = l == L - 1;
  const bool dual = l > 0;
  const int u0 = j * kBwdUnits, row0 = s * a.rows;
  const int rows = min(a.rows, B - row0);
  const int kt = a.kt, KS = a.kpad + kHsPad;
  const int bufs = a.ds_bufs;

  T* ds = reinterpret_cast<T*>(smem + a.smem_ds);              // [ds_bufs][kRows][KS]
  float* part = reinterpret_cast<float*>(smem + a.smem_part);  // [2][kWarps][kRows][kPS]
  float* dcs = reinterpret_cast<float*>(smem + a.smem_dc);     // [rows][kBwdUnits]
  int* lens = reinterpret_cast<int*>(smem + a.smem_len);       // [rows]

  uint32_t wa[kBwdMaxKt][4];
  load_stack_weights(a, l, dual, warp, lane, u0, wa);

  init_backward_smem(ds, bufs * kRows * KS, dcs, lens, a.lengths, row0, rows, steps, tid);
  __syncthreads();

  const size_t seq = static_cast<size_t>(B) * H;
  const size_t gseq = static_cast<size_t>(B) * G4;
  const StackLayer<T> io(a, l, s, j);
  const int nchunks = (rows + kRows - 1) / kRows;
  const ChunkWalk walk(tid, G4 / 8);
  const int pn = tid / kBwdUnits, pu = tid % kBwdUnits;  // pointwise: rows pn + 16 r, unit pu
  const int ug = u0 + pu;
  bool waits = true;

  for (int t = steps - 1; t >= -1; --t) {
    const bool product = t < steps - 1;
    io.begin_step(a, t, product, !top && t >= 0, warp, lane, waits);

    auto stage = [&](int c, int b) {
      const int n0 = c * kRows;
      io.stage_da(ds + b * kRows * KS, KS, t, gseq, G4, row0 + n0, min(kRows, rows - n0), walk);
    };
    // Chunk c's pointwise inputs for this thread's rows (loaded a chunk ahead).
    auto load_pre = [&](int c, BwdPre* pre) {
#pragma unroll
      for (int r = 0; r < kPer; ++r) {
        const int nl = c * kRows + pn + 16 * r, nb = row0 + nl;
        BwdPre& p = pre[r];
        p = BwdPre{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (t >= 0 && c < nchunks && nl < rows && ug < H && t < lens[nl]) {
          const size_t o = static_cast<size_t>(nb) * H + ug;
          const size_t ot = static_cast<size_t>(t) * seq + o;
          const float* gp =
              io.gates + static_cast<size_t>(t) * gseq + static_cast<size_t>(nb) * G4 + ug;
          p.ig = gp[0];
          p.fg = gp[H];
          p.gg = gp[2 * H];
          p.og = gp[3 * H];
          p.ct = io.cseq[ot];
          p.cp = t > 0 ? io.cseq[ot - seq] : E::to_float(io.c0[o]);
          p.dy = top ? E::to_float(io.dy[ot]) : __ldcg(io.dy_in + ot);  // the hand-off: from L2
          if (t == lens[nl] - 1) {
            p.dhy = E::to_float(io.dhy[o]);
            p.dcy = E::to_float(io.dcy[o]);
          }
        }
      }
    };
    // Chunk c's pointwise step from part[c & 1] and `pre`.
    auto pointwise = [&](int c, const BwdPre* pre) {
      const float* pb = part + (c & 1) * (kWarps * kRows * kPS);
#pragma unroll
      for (int r = 0; r < kPer; ++r) {
        const int n = pn + 16 * r, nl = c * kRows + n, nb = row0 + nl;
        if (nl >= rows || ug >= H) continue;
        const size_t o = static_cast<size_t>(nb) * H + ug;
        float rec = 0.0f;
        if (product) {
          float below = 0.0f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) {
            const float2 v = *reinterpret_cast<const float2*>(pb + (w * kRows + n) * kPS + 2 * pu);
            rec += v.x;
            below += v.y;
          }
          if (dual) io.dy_out[static_cast<size_t>(t + 1) * seq + o] = below;
        }
        if (t < 0) {
          io.dh0[o] = rec;
          continue;
        }
        const int len = lens[nl];
        const BwdPre& p = pre[r];
        float da[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        float carry = 0.0f;
        if (t < len) {
          float dh = rec + p.dy;
          float dc = dcs[nl * kBwdUnits + pu];
          if (t == len - 1) {
            dh += p.dhy;
            dc = p.dcy;
          }
          lstm_cell_backward(dh, dc, p.ig, p.fg, p.gg, p.og, p.ct, p.cp, da, carry);
        }
        dcs[nl * kBwdUnits + pu] = carry;
        T* dp = io.dgates + static_cast<size_t>(t) * gseq + static_cast<size_t>(nb) * G4 + ug;
#pragma unroll
        for (int g = 0; g < 4; ++g) dp[g * H] = T(da[g]);
        if (t == 0) io.dc0[o] = carry;
      }
    };
    // Chunk c's products from ds buffer b into part[c & 1].
    auto products = [&](int c, int b) {
      const int nc = min(kRows, rows - c * kRows);
      const T* dsb = ds + b * kRows * KS;
      float acc0[kNt][4], acc1[kNt][4];
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc0[nt][e] = acc1[nt][e] = 0.0f;
      const int qq = lane >> 3;
      const int nn = (qq >> 1) * 8 + (lane & 7), kq = (qq & 1) * 8;
#pragma unroll
      for (int jt = 0; jt < kHalf; ++jt) {
        if (jt < kt) {
          const int kk = (warp * kt + jt) * 16 + kq;
#pragma unroll
          for (int h = 0; h < kNt / 2; ++h) {
            if (16 * h < nc) {
              uint32_t b00, b01, b10, b11;
              ldmatrix_x4(b00, b01, b10, b11, dsb + (16 * h + nn) * KS + kk);
              E::mma(acc0[2 * h], wa[jt], b00, b01);
              if (16 * h + 8 < nc) E::mma(acc0[2 * h + 1], wa[jt], b10, b11);
              if (dual) {
                E::mma(acc1[2 * h], wa[kHalf + jt], b00, b01);
                if (16 * h + 8 < nc) E::mma(acc1[2 * h + 1], wa[kHalf + jt], b10, b11);
              }
            }
          }
        }
        if (!dual && kHalf + jt < kt) {
          const int kk = (warp * kt + kHalf + jt) * 16 + kq;
#pragma unroll
          for (int h = 0; h < kNt / 2; ++h) {
            if (16 * h < nc) {
              uint32_t b00, b01, b10, b11;
              ldmatrix_x4(b00, b01, b10, b11, dsb + (16 * h + nn) * KS + kk);
              E::mma(acc0[2 * h], wa[kHalf + jt], b00, b01);
              if (16 * h + 8 < nc) E::mma(acc0[2 * h + 1], wa[kHalf + jt], b10, b11);
            }
          }
        }
      }
      // C fragment (unit row, batch col) -> float2 (dh, dy below) at
      // part[c & 1][warp][col][2 * row] (conflict-free 64-bit stores).
      float* pw = part + (c & 1) * (kWarps * kRows * kPS) + warp * kRows * kPS;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        const int row = lane >> 2, col = nt * 8 + (lane & 3) * 2;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int rr = row + ((e & 2) ? 8 : 0), cc = col + (e & 1);
          *reinterpret_cast<float2*>(pw + cc * kPS + 2 * rr) =
              make_float2(acc0[nt][e], acc1[nt][e]);
        }
      }
    };

    BwdPre cur[kPer], nxt[kPer];
    if (product && bufs > 1) stage(0, 0);
    for (int i = 0; i <= nchunks; ++i) {
      if (bufs == 1 && i > 0) __syncthreads();  // R_i: chunk i-1's products done (ds free)
      if (product && bufs == 1 && i < nchunks) stage(i, 0);
      load_pre(i, nxt);
      if (bufs == 1 && i > 0) pointwise(i - 1, cur);
      if (product && i < nchunks) cp_async_wait_all();  // chunk i (the only group in flight)
      __syncthreads();  // S_i: chunk i staged; part[(i-1) & 1] written; products i-1 done
      // Two buffers: chunk i+1 lands in the buffer products i-1 read (before S_i)
      // while chunk i multiplies.
      if (product && bufs > 1 && i + 1 < nchunks) stage(i + 1, (i + 1) & 1);
      if (product && i < nchunks) products(i, bufs > 1 ? (i & 1) : 0);
      if (bufs > 1 && i > 0) pointwise(i - 1, cur);
#pragma unroll
      for (int r = 0; r < kPer; ++r) cur[r] = nxt[r];
    }
    if (bufs > 1) __syncthreads();  // every pointwise store before the publish

    if (tid == 0) publish(io.own_flags + j, static_cast<unsigned>(steps - t));
  }
}

}  // namespace rnnfuse_wf

// The kernels, one a body and element type: NAME_f16 and NAME_bf16 run
// BODY<T, the rest>.
#define RF_KERNEL(NAME, ARGS, ...)                                       \
  extern "C" __global__ void __launch_bounds__(rnnfuse_wf::kThreads, 1) \
      NAME(const __grid_constant__ rnnfuse_wf::ARGS a) {                 \
    rnnfuse_wf::__VA_ARGS__(a);                                          \
  }
#define RF_KERNELS(NAME, ARGS, BODY, ...)                       \
  RF_KERNEL(NAME##_f16, ARGS, BODY<__half, ##__VA_ARGS__>)      \
  RF_KERNEL(NAME##_bf16, ARGS, BODY<__nv_bfloat16, ##__VA_ARGS__>)

RF_KERNELS(rnnfuse_wf_forward, Args, wavefront_body, 0)
// Variant 1 of the forward step (Args::variant = 1; wavefront.cuh).
RF_KERNELS(rnnfuse_wf_forward_v1, Args, wavefront_body, 1)
// Variant 2: wgmma products (sm_90a; wavefront.cuh, "Variant 2").
RF_KERNELS(rnnfuse_wf_forward_v2, Args, wavefront_body, 2)
// Variant 3: the h values are their own flags (wavefront.cuh, "Variant 3").
RF_KERNELS(rnnfuse_wf_forward_v3, Args, wavefront_body, 3)
// Variant 4: variant 2 staged by tensor copies (wavefront.cuh, "Variant 4"):
// the tensor maps are a second parameter, so the other kernels' stay as they were.
#define RF_TMA_KERNEL(NAME, T)                                                  \
  extern "C" __global__ void __launch_bounds__(rnnfuse_wf::kThreads, 1) NAME( \
      const __grid_constant__ rnnfuse_wf::Args a,                              \
      const __grid_constant__ rnnfuse_wf::StageMaps maps) {                    \
    rnnfuse_wf::wavefront_body<T, 4>(a, &maps);                                \
  }
RF_TMA_KERNEL(rnnfuse_wf_forward_v4_f16, __half)
RF_TMA_KERNEL(rnnfuse_wf_forward_v4_bf16, __nv_bfloat16)
// Independent layers: a bidirectional layer's directions (Args::independent;
// wavefront.cuh, "Independent layers").
RF_KERNELS(rnnfuse_wf_forward_ind, Args, wavefront_body, 0, true)
RF_KERNELS(rnnfuse_wf_backward, BwdArgs, backward_body, false)
// The GRU backward (wavefront.cuh, "The GRU backward").
RF_KERNELS(rnnfuse_wf_backward_gru, BwdArgs, backward_body, true)
RF_KERNELS(rnnfuse_wf_backward_stack, BwdStackArgs, backward_stack_body)
// The stack backward's variants 1 (16-row chunks) and 2 (32-row chunks).
RF_KERNELS(rnnfuse_wf_backward_stack_v1, BwdStackArgs, backward_stack_pipelined_body, 16)
RF_KERNELS(rnnfuse_wf_backward_stack_v2, BwdStackArgs, backward_stack_pipelined_body, 32)
