// rnnfuse's persistent wavefront kernel: the shared definitions of the
// device code (wavefront.cu) and its host launcher (wavefront_host.cc).
//
// What runs: the forward pass of a unidirectional stack of L LSTM or GRU
// (Keras' reset_after=True, cuDNN's) layers of H units, in float16 or
// bfloat16 with float32 accumulation, as ONE cooperative launch whose CTAs
// keep every layer's weights in registers for the whole sequence and run
// the layers as a wavefront: layer l works on step t while layer l+1 works
// on step t-1, so the launch is T+L-1 dependent steps long, not L*T.
// For training, the forward can also save every layer's gates and c
// (Args::gates_out, c_out; a GRU's r, z, n, W_hn h + b_hn and h_{t-1}),
// and a second kernel runs an LSTM or GRU layer's backward recurrence
// ("The backward kernel", below).
//
// The plan (wavefront_plan.h; Python asks it through the host library):
//   every CTA has 8 warps; a CTA of layer l owns U = 8*mg consecutive
//   hidden units, i.e. R = 4U "rows" (gate columns, gate-major: row
//   g*U + u; a GRU has four virtual gates r, z, n_x, n_h, where n_x holds
//   only the input weights of the n gate and n_h only its recurrent ones,
//   so reset_after's r * (W_hn h + b_hn) stays apart from W_in x + b_in),
//   against K = K_in + H inputs: the layer below's h_t (K_in = H; 0 for
//   layer 0, whose input projection x W_ih^T is one GEMM up front, passed
//   in as `xproj`) and the layer's own h_{t-1}. K is padded to
//   kpad = 256*kg. The 8 warps form a grid mg x kg x ng (= 8): warp (m, k,
//   n) holds rows [32m, 32m+32) x K [256k, 256k+256) of the CTA's weights
//   as mma.sync A fragments: 2 x 16 tiles of 16x16, 128 registers a
//   thread, loaded once; it multiplies them with the batch columns of its
//   n-groups (32 batch rows each: n-groups n, n+ng, ...).
//
// One step of one CTA (layer l, step t):
//   1. wait: warp 0 polls the flags of the CTAs it reads from with
//      ld.acquire.gpu: flags[l][*] >= t (its own layer finished step t-1)
//      and flags[l-1][*] >= t+1 (the layer below finished step t); then
//      __syncthreads;
//   2. per batch chunk of kNC = 64 rows: cp.async.cg (through L2, not L1)
//      h_t of the layer below and h_{t-1} of its own layer into `hs`
//      [64][kpad+8] (8 pad halves a row make ldmatrix conflict-free), in
//      two cp.async groups (rows 0-31, 32-63) so the first n-group's
//      products start while the second half is in flight;
//   3. each warp runs ldmatrix + mma.sync m16n8k16 over its K range and
//      stores its float32 partial sums to `part` [kg][64][R+4] (batch row
//      major: the +4 makes the fragment stores conflict-free);
//   4. pointwise, 2 units of one batch row a thread: the kg partials + the
//      biases (+ xproj for layer 0) make the gates; c stays in shared
//      memory (float32, `cs` [B][U]); h goes to the layer's sequence
//      buffer (`work` below the top, `y` at the top);
//   5. __syncthreads, then thread 0 publishes: fence.acq_rel.gpu and a
//      relaxed store flags[l][cta] = t+1 (the release CUTLASS's grid
//      barrier uses).
// Variant 1 (Args::variant = 1, opt-in; 0 is the step above): the same
// products, sums and protocol, rescheduled within a chunk:
//   a. overlap: after the first half's products and the barrier that
//      waits for the second half, the pointwise step of the first half
//      (rows [0, 32)) runs while the second half multiplies: warps 0-3 run
//      their share of it before their second-half products, warps 4-7
//      after (a warp of 0-3 and one of 4-7 share an SM sub-partition, so
//      one issues pointwise work while the other issues mma.sync); where
//      ng > 1 the warps of n-group 0, which have no second-half products,
//      run first. Then a barrier, the second half's pointwise, a barrier:
//      as many CTA barriers as variant 0.
//   b. pairs: where ng == 1 and kg >= 2, warp (m, k) with k >= kg/2 (=
//      warps 4-7) stores its partial sums to part[k] and arrives on a
//      named barrier (1: first half, 2: second half); warp (m, k - kg/2)
//      waits on it, adds those partials to its accumulators and stores the
//      pair's sum to part[k - kg/2]. The pointwise step reads kg/2 partial
//      slices instead of kg (the sum's order: bias + (p0 + p2) + (p1 + p3)
//      for kg = 4, not bias + p0 + p1 + p2 + p3; float32 either way).
//   c. staging: where kThreads is a multiple of the 16-byte chunks of an
//      hs row (K a power of two: every 4x512 and 8x256 layer), each thread
//      copies one fixed column chunk of every (kThreads / chunks)-th row,
//      from a source pointer fixed for the step: no per-copy index walk or
//      branch.
//   d. wait: lane i of warp 0 polls flags[l][i] and flags[l-1][i] in the
//      same round (both acquire loads in flight), not all of its own
//      layer's flags first: one L2 round trip where both are set.
//   e. split wait (layers above 0 where every warp copies only the layer
//      below's h or only its own: fixed staging with (K/8)/2 a multiple of
//      32, e.g. 4x512 layers 1-3): no CTA barrier at the wait. Warp 0 (a
//      below warp) polls the layer below's flags (set a wavefront step
//      earlier, usually already), releases the other below warps through
//      named barrier 3 (kThreads/2 threads), issues its copies, then polls
//      its own layer's flags and releases the own warps through named
//      barrier 4 (32 + kThreads/2): the layer below's half of K is in
//      flight while the own layer's flags are awaited. Acquire by warp 0,
//      __syncwarp, bar.arrive -> bar.sync: the same causality chain as
//      variant 0's acquire + __syncthreads.
// Variant 2 (Args::variant = 2, opt-in, sm_90a; Variant2Fits: every
// layer's CTA owns 16 units, K padded to 512 or 1024): variant 0's schedule
// with the products on wgmma. The two warpgroups (warps 0-3, 4-7) split K
// in halves of KH = kpad / 2; warp w of warpgroup g holds rows [16(w % 4),
// +16) of the CTA's R = 64 rows against K [g KH, (g + 1) KH) as wgmma's
// register A fragments (mma.sync's m16n8k16 A layout), KH / 16 k-steps in
// the same 128 registers. hs is staged in wgmma's no-swizzle K-major
// canonical layout: element (row n, input k) at (n / 8) SBO + (k / 8) 128 +
// (n % 8) 16 + (k % 8) 2 bytes, SBO = kpad * 16: 8 x 8 core matrices of
// 128 contiguous bytes, consecutive along K (LBO = 128). The 8 lanes of a
// quarter warp copy rows 8g .. 8g + 7 of one k-chunk (tid / 8 + 32 j), one
// core matrix: conflict-free (consecutive k-chunks of a row, 128 bytes
// apart, would put a warp's 32 copies in 4 banks). Per chunk half
// (32 batch rows) each warpgroup runs KH / 16 wgmma.mma_async m64n32k16
// (B from the descriptor of rows [32h, 32h + 32) and K chunks 2j, 2j + 1
// of its half: start hs + 4h SBO + (g KH / 8 + 2j) 128) into one float32
// m64n32 accumulator, then stores it to part slice g in the C-fragment
// order of mma.sync's n8 blocks; the pointwise step sums the two slices.
// Every thread fences its copies to the async proxy (fence.proxy.async)
// before the barrier that releases the products.
// Trace point 3 is after the second half's products.
// Variant 4 (Args::variant = 4, sm_90a, default via kVariantBest; Variant4Fits: variant 2's
// plans with H a multiple of 64): variant 2's wait, products and sums, with
// hs staged by the async proxy, so no proxy fence sits between the copies
// and the products and each half's products wait only for its own bytes:
//   a. layout: each half (32 batch rows) of the chunk is kpad / 64 blocks
//      of 64 inputs, 4096 bytes each (32 rows of 128 bytes, the 128-byte
//      swizzle: 16-byte piece c of row n at piece c ^ (n % 8)): element
//      (n, k) at (n / 32) 64 kpad + (k / 64) 4096 + (n % 32) 128 +
//      ((k / 8 % 8) ^ (n % 8)) 16 + (k % 8) 2 bytes from hs rounded up to 1024;
//   b. copies: after the wait's CTA barrier, lane i of warp 0 runs
//      fence.proxy.async.global (the h it acquired, written by other CTAs
//      through the generic proxy, to the async proxy's reads) and issues
//      copy i of TmaStageCopy: a 3D tensor copy (cp.async.bulk.tensor, box
//      64 inputs x 32 rows x 1 step of a [planes][B][H] map: the workspace's
//      sequences, y, or h0) completing on the half's mbarrier; lane 0 first
//      arms each half's barrier with arrive.expect_tx(TmaHalfBytes). Rows
//      past B are the copy's out-of-bounds rows: zeros, counted in the bytes;
//   c. products: every thread waits on the half's barrier (try_wait.parity,
//      a parity bit a barrier, flipped at each wait), then wgmma reads the
//      half through Sw128Desc (128-byte swizzle, SBO 1024); k-step j of
//      warpgroup g starts at Sw128StepOffset;
//   d. hs is never read or written by the generic proxy after the
//      prologue (zeroed, fenced once): the GRU's h_{t-1} comes from the
//      global h this thread wrote a step earlier (h0 at step 0). Layer 0's xproj
//      stays on cp.async (its wait before the pointwise barrier).
// A staging wait longer than kBwdWaitNs traps (a byte count the copies
// never reach would otherwise hang the launch).
// Variant 3 (Args::variant = 3, opt-in; every plan variant 0 takes):
// variant 0's schedule and arithmetic, with the h values as their own
// flags (Lamport-style, as the persistent RNNs of arXiv 1804.10223 carry
// timestamps in the data). No flag is awaited or published and no fence
// runs:
//   a. before the launch the host fills every sequence buffer (the
//      workspace's L-1 and y) with kSentinelWord, in stream order, so
//      nothing an earlier call left there reads as this call's h;
//   b. the producer's h stores are st.relaxed.gpu of two halves, and a
//      computed half equal to the sentinel (0xFFFF, a NaN) is stored as
//      0x7FFF (a NaN as well): a written element never reads as unwritten;
//   c. a consumer issues its cp.async.cg copies of the chunk at once (no
//      wait first), and after each half's cp.async wait every thread checks
//      its own 16-byte chunks in hs and re-copies those that still hold a
//      sentinel half, until none does; then the CTA barrier that releases
//      the products, as in variant 0. Step 0's own part (h0, the caller's)
//      is never checked.
// Why it is exact: every element of a sequence buffer is written once per
// launch (rows past len write 0), each half is either the sentinel or its
// final value (aligned stores of at most 64 bits are single-copy atomic
// per element; the check looks at every half), and cp.async.cg reads L2,
// so a re-copy never returns a stale L1 line. The copies are weak reads
// racing the producer's strong writes; PTX's memory model does not require
// data-race freedom, and a read returns, per element, the value of a write
// to it (here the sentinel or the h). That a re-copy soon sees the h is
// the hardware's progress, which `bench_wavefront.py check --variant 3`
// tests on the GPU. No ordering between elements is needed: nothing else
// crosses CTAs (xproj is written before the launch, c stays in the CTA).
// A wait longer than kBwdWaitNs sets flags[kLamportTimedOut] and stops
// (NaN results, not a hang).
// Layer 0 reads its slice of xproj[t] from `xs`, two [B][G][U] buffers
// that step t-1 filled by cp.async behind its own loads.
// Every layer has a whole [T, B, H] sequence buffer, so no step overwrites
// what a slower CTA may still read (no back-pressure flags needed); the
// own-layer h_{t-1} of step 0 comes from h0.
//
// Right-padded lengths: a batch row of length len runs every step (its
// results are discarded), writes 0 to its outputs at t >= len (the layer
// above reads those zeros only at steps whose results it discards too) and
// its final h (and c) at t = len-1 to hy (cy).
//
// Limits (the plan refuses the rest, and the caller runs cuDNN):
//   units H a multiple of 8; K_in + H <= 2048; L <= 8; every CTA resident
//   at once (at most one CTA per SM: sum over layers of ceil(H/U) <= SMs);
//   each CTA's shared memory (hs + part + cs + bias + lengths + xs) within
//   the device's opt-in limit. On an H200 (132 SMs, 227 KiB) that is, for
//   LSTM and GRU alike, 4 layers of 512 units at any batch up to 256,
//   8 layers of 256, or 1 layer of 1024.
//
// Independent layers (Args::independent = 1; PlanDirections): the L
// "layers" of one launch read no layer below: each is planned and run as
// layer 0 (K = H; its own slice l of xproj [L][T][B][G*H]; its sequence in
// y [L][T][B][H]; no flags of another layer awaited), on its own CTA set,
// with its own h0/c0/hy/cy slice l, and its weights at PlanOffsets'
// independent layout (every layer's W_ih has input_size columns). This is
// a bidirectional layer's two directions in one launch (L = 2: forward,
// then backward): the binding reverses direction 1's xproj within each
// row's length before the launch and its output after it (a row reverses
// within its own length, as cuDNN's), so the kernel runs both directions
// forward in time, concurrently, with both weight sets resident. Its own
// kernels (rnnfuse_wf_forward_ind_f16 / _bf16: wavefront_body<T, 0, true>),
// so the stack kernels compile as before; variant 0 only.

#pragma once

#include <stdint.h>

namespace rnnfuse_wf {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kWM = 2;        // m-subtiles of 16 rows a warp holds
constexpr int kWK = 16;       // k-tiles of 16 a warp holds
constexpr int kWarpRows = 16 * kWM;   // 32
constexpr int kWarpK = 16 * kWK;      // 256
constexpr int kNC = 64;       // batch rows per staged chunk
constexpr int kNGroup = 32;   // batch rows per n-group (4 n-tiles of 8)
constexpr int kHsPad = 8;     // halves of padding per hs row
constexpr int kPartPad = 4;   // floats of padding per part row ([n][R + 4]: conflict-free)
constexpr int kMaxLayers = 8;
constexpr int kFlagStride = 256;  // flags per layer (>= CTAs of a layer)

// Debug modes (Args::mode bits), for timing what a step's parts cost.
// Results are wrong in every mode but 0.
constexpr int kModeNoWait = 1;  // never wait for flags
constexpr int kModeNoMma = 2;   // skip the matrix products
constexpr int kModeScFence = 4;  // __threadfence (fence.sc) before publishing
constexpr int kModeNoStage = 8;  // never load h into shared memory
constexpr int kModeNoPointwise = 16;  // skip the pointwise step (no outputs)

constexpr int kVariants = 5;  // Args::variant in [0, kVariants)
// The host's own choice (not an Args::variant): variant 4 where it takes the
// plan, else variant 0.
constexpr int kVariantBest = 5;
// Variant 3: what the sequence buffers hold until a step's h lands (every
// half 0xFFFF, a NaN in float16 and bfloat16), and the flag word a wait
// that timed out sets (variant 3 uses no other flag).
constexpr unsigned kSentinelWord = 0xFFFFFFFFu;
constexpr int kLamportTimedOut = 0;

struct LayerPlan {
  int ctas;        // CTAs of this layer
  int mg, kg, ng;  // warp grid (mg * kg * ng == kWarps)
  int units;       // U = 8 * mg hidden units a CTA owns
  int kin;         // K of the input part (0 for layer 0, else H)
  int kpad;        // K padded to kWarpK * kg
  int smem_hs, smem_part, smem_cs, smem_bias, smem_len, smem_xs, smem_total;
  long long w_ih, w_hh, b_in, b_rec;  // element offsets into params
};

struct Args {
  LayerPlan layer[kMaxLayers];
  int cta_start[kMaxLayers + 1];
  int gru;  // 0: LSTM (gates i, f, c, o), 1: GRU (r, z, n), cuDNN's order
  int L, H, B, T;
  int mode;
  int variant;  // 0: the step above; 1-4: variants 1-4 (see above)
  int independent;  // 1: the layers read no layer below ("Independent layers";
                    // the host launches the _ind kernels for it)
  const void* xproj;   // [T][B][G*H]: x W_ih^T of layer 0, no bias
  const void* params;  // rnnfuse's canonical flat buffer (see host)
  const void* h0;      // [L][B][H]
  const void* c0;      // [L][B][H] (LSTM)
  const int* lengths;  // [B], each in [1, T]
  void* y;             // [T][B][H]
  void* hy;            // [L][B][H]
  void* cy;            // [L][B][H] (LSTM)
  void* work;          // [L-1][T][B][H]
  unsigned* flags;     // [L][kFlagStride], zero at launch
  // Optional timeline (null: off): CTA 0 and the top layer's first CTA
  // record %globaltimer (ns) at kTracePoints points of each of the first
  // trace_steps steps, and clock64 at the first and last point:
  // trace[(which * trace_steps + t) * kTraceSlots + point].
  unsigned long long* trace;
  int trace_steps;
  // Optional, for training (null: off): the forward saves what the
  // backward reads, in float32: every layer's activated gates i, f, g, o
  // (gates_out [L][T][B][4H], PyTorch's gate-major columns g*H + unit)
  // and cell states (c_out [L][T][B][H]). A GRU saves, in the same
  // buffers, r, z, n and W_hn h_{t-1} + b_hn (gates_out's four blocks of
  // H) and h_{t-1} as the step read it (c_out). Steps at t >= len hold
  // values the backward never reads.
  float* gates_out;
  float* c_out;
};

// ---------------------------------------------------------------------------
// The backward kernel (one LSTM layer a launch; layers run top to bottom,
// the torch binding does the large GEMMs between them). It runs the
// reverse recurrence of the layer
//   dh_t  = dy_t + W_hh^T da_{t+1}   (+ dhy at t = len-1)
//   dc_t  = dc carried from t+1 (dcy at t = len-1) + dh_t o (1 - tanh^2 c_t)
//   da_t  = the pre-activation gate gradients [4H] (i, f, g, o)
//   carry = dc_t f_t;  dc0 = carry after t = 0;  dh0 = W_hh^T da_0
// for t = T-1 .. 0 and writes da [T][B][4H] (zero at t >= len), dh0, dc0.
//
// The split: a CTA owns kBwdUnits = 16 consecutive units (one m16 tile:
// the product is dh^T [units x batch] = W_hh^T [units x 4H] . da^T) and a
// group of `rows` batch rows; batch rows are independent, so a CTA waits
// only for the CTAs of its own group (which together write all 4H gate
// gradients of those rows). Its 8 warps split K = 4H: warp w holds W_hh^T
// rows of its 16 units against gate columns [w*16*kt, (w+1)*16*kt) as
// mma.sync A fragments in registers (kt <= kBwdMaxKt k-tiles, 4 registers
// each), loaded once. Each step (per chunk of kBwdChunk rows of the group):
// wait for the group's flags (step t+1 done), cp.async da_{t+1} of those
// rows [chunk][4H] from L2 into shared memory, multiply, sum the 8 warps'
// partials in shared memory, then one (row, unit) a thread: the pointwise
// backward from the forward's saved float32 gates and c (gates_out,
// c_out), dc carried in shared memory in float32, da written in the
// element type; then publish, as in the forward.
//
// The GRU backward (kernels rnnfuse_wf_backward_gru_f16 / _bf16,
// backward_body<T, true>; the same BwdArgs, plan and launch):
// with the forward's saved r, z, n, hn = W_hn h_{t-1} + b_hn and h_{t-1}
// (gates_out, c_out), for t = T-1 .. 0
//   dh_t  = dy_t + W_hh^T' da_{t+1} + carry_{t+1}   (+ dhy at t = len-1)
//   dn_x  = dh_t (1 - z)(1 - n^2),  dn_h = dn_x r
//   dr    = dn_x hn r (1 - r),      dz = dh_t (h_{t-1} - n) z (1 - z)
//   carry = dh_t z;  dh0 = W_hh^T' da_0 + carry_0
// da [T][B][4H] holds the four virtual gates (dr, dz, dn_x, dn_h): the
// input side's gradient is (dr, dz, dn_x) (dW_ih, db_ih, dx), the
// recurrent side's (dr, dz, dn_h) (dW_hh, db_hh), and W_hh^T' is W_hh^T
// over those four blocks with the n_x block zero (rows r, z, -, n). Padded
// steps (t >= len) write da = 0 and carry 0, as the LSTM's. c0, dcy and
// dc0 are not read or written.
constexpr int kBwdUnits = 16;   // units a CTA owns
constexpr int kBwdChunk = 16;   // batch rows per staged chunk (2 n-tiles)
constexpr int kBwdMaxKt = 32;   // k-tiles a warp can hold (4H <= 8 * 16 * 32: H <= 1024)
constexpr int kBwdPartStride = 20;  // floats per part row (16 units + 4: conflict-free stores)
constexpr unsigned long long kBwdWaitNs = 4000000000ull;  // a wait this long is a bug: bail out

struct BwdArgs {
  int H, B, T;
  int ctas;        // groups * ctas_per_group
  int ctas_per_group;  // ceil(H / kBwdUnits)
  int rows;        // batch rows a group (a multiple of 8)
  int kt;          // k-tiles (of 16 gate columns) a warp holds
  int kpad;        // 4H padded to kWarps * 16 * kt
  int smem_ds, smem_part, smem_dc, smem_len, smem_total;
  const void* w_hh;    // this layer's W_hh [4H][H] (element type)
  const float* gates;  // [T][B][4H]: the forward's gates_out of this layer
  const float* cseq;   // [T][B][H]: the forward's c_out of this layer
  const void* c0;      // [B][H]
  const void* dy;      // [T][B][H]: gradient of the layer's output sequence
  const void* dhy;     // [B][H]: gradient of its final h
  const void* dcy;     // [B][H]: gradient of its final c
  const int* lengths;  // [B] or null
  void* dgates;        // [T][B][4H] out (element type)
  float* dh0;          // [B][H] out
  float* dc0;          // [B][H] out (LSTM)
  unsigned* flags;     // [ctas + 1], zero at launch; flags[ctas] != 0: a wait timed out
};

// ---------------------------------------------------------------------------
// The stack backward (v2, reverse wavefront; LSTM): ONE cooperative launch
// runs every layer's backward recurrence, layer l at step t while layer
// l+1 is at step t+2 (T+2(L-1)+1 dependent steps, not L*(T+1)). Layer l's
//   dh_t = W_hh_l^T da_l[t+1] + dy_l[t]   (+ dhy at t = len-1)
// where dy_l = W_ih_{l+1}^T da_{l+1} for l < L-1 (the input dy at the top).
// A CTA (layer l, group s, block j) owns kBwdUnits = 16 units of layer l
// and the batch rows of group s; at step t it stages its own layer's
// da_l[t+1] (group rows x 4H, from L2) and multiplies it by two m16 tiles
// held in registers: W_hh_l^T (its units' dh_t) and, for l > 0, W_ih_l^T
// (units [16j, 16j+16) of the layer BELOW's dy_{l-1}[t+1], the same B
// operand), written as float32 to `dyl` [L-1][T][B][H]; CTA (l-1, s, j)
// reads exactly that slice (ld.global.cg). Warp w holds gate columns
// [w*16*kt, (w+1)*16*kt): kt <= kBwdMaxKt/2 for two tiles (H <= 512 in a
// stack of 2 or more), kt <= kBwdMaxKt for layer 0 of a 1-layer stack.
// The rest of a step is backward_body's (pointwise from the saved gates
// and c, dc carried in shared memory), in chunks of kBwdChunk rows, chunk
// c+1's cp.async in flight while chunk c multiplies (two `ds` buffers
// where they fit in shared memory).
// CTA order: layer-major, then group, then block (ctas_per_layer = groups *
// per_group). Flags: flags[l * kFlagStride + s * per_group + j] = T - t
// after step t (T + 1 after t = -1), published with fence.acq_rel.gpu + a
// relaxed store after a CTA barrier, as the forward. A CTA of layer l at
// step t waits (ld.acquire.gpu) for its own layer's group >= T-1-t (step
// t+1 done, t < T-1) and, below the top (t >= 0), for the ONE flag of CTA
// (l+1, s, j) >= T-t+1 (its step t-1 done: dy_l[t] written).
// flags[kMaxLayers * kFlagStride] != 0: a wait timed out (a bug).
//
// Variants (BwdStackArgs::variant, opt-in; the plan falls back to the next
// simpler one where the asked one's shared memory does not fit, and says
// which it chose): 0 is the step above. 1 and 2 (backward_stack_pipelined_
// body) compute the same values in the same order of float32 additions
// except the 8 warps' partials, now read as float2 (dh, dy below) pairs:
// `part` has two buffers (chunk c in part[c & 1]), so chunk c's pointwise
// step runs in the same barrier interval as chunk c+1's products (n + 3
// CTA barriers a step for n chunks, 2n + 2 with one staging buffer, not
// 3n + 1), and the pointwise's global inputs are loaded a chunk ahead.
// Variant 2 stages chunks of 2 * kBwdChunk = 32 rows (half the chunks),
// with one staging buffer where two do not fit (the headline 4 x 512).
constexpr int kBwdStackPartStride = 36;  // floats per part row (32 + 4: conflict-free stores)

struct BwdStackArgs {
  int L, H, B, T;
  int per_group;       // CTAs of a layer's group: ceil(H / kBwdUnits)
  int groups;          // batch-row groups
  int rows;            // batch rows a group (a multiple of 8)
  int ctas_per_layer;  // groups * per_group
  int kt;              // k-tiles (of 16 gate columns) a warp holds
  int kpad;            // 4H padded to kWarps * 16 * kt
  int ds_bufs;         // 2: chunk c+1 is staged while chunk c multiplies; 1 where 2 do not fit
  int smem_ds, smem_part, smem_dc, smem_len, smem_total;
  long long w_ih[kMaxLayers], w_hh[kMaxLayers];  // element offsets into params
  const void* params;  // rnnfuse's canonical flat buffer (element type)
  const float* gates;  // [L][T][B][4H]: the forward's gates_out
  const float* cseq;   // [L][T][B][H]: the forward's c_out
  const void* c0;      // [L][B][H]
  const void* dy;      // [T][B][H]: gradient of the top layer's output sequence
  const void* dhy;     // [L][B][H]
  const void* dcy;     // [L][B][H]
  const int* lengths;  // [B] or null
  void* dgates;        // [L][T][B][4H] out (element type)
  float* dh0;          // [L][B][H] out
  float* dc0;          // [L][B][H] out
  float* dyl;          // [L-1][T][B][H] workspace: dy of the layers below the top
  unsigned* flags;     // [kMaxLayers * kFlagStride + 1], zero at launch
  // Last, so that variant 0's parameter offsets stay as they were:
  int variant;         // 0: backward_stack_body; 1, 2: the pipelined body (see "Variants")
  int chunk;           // batch rows a staged chunk: kBwdChunk, 2 * kBwdChunk for variant 2
};

// ---------------------------------------------------------------------------
// Variant 4's staging (above: "Variant 4"), shared by the kernel and the
// host (whose C ABI hands it to the CPU tests).
#if defined(__CUDACC__)
#define RF_HD __host__ __device__ __forceinline__
#else
#define RF_HD inline
#endif
constexpr int kTmaBlockK = 64;                        // inputs a copy: one 128-byte swizzle row
constexpr int kTmaBoxBytes = kTmaBlockK * kNGroup * 2;  // a copy: 32 rows x 128 bytes
constexpr int kTmaAlign = 1024;                       // the swizzle's period: 8 rows x 128 bytes
constexpr int kMapWork = 0, kMapY = 1, kMapH0 = 2, kTmaMaps = 3;
// hs's row padding (kNC * kHsPad halves past the two halves' bytes) takes
// the rounding of a 16-byte-aligned hs up to kTmaAlign (at most kTmaAlign -
// 16 bytes) and the two mbarriers (8 bytes each) past the halves.
static_assert(kNC * kHsPad * 2 >= (kTmaAlign - 16) + 2 * 8, "hs's padding holds the barriers");

// The tensor maps (CUtensorMap, opaque), a kernel parameter of their own.
struct alignas(64) TmaMap {
  unsigned long long opaque[16];
};
struct StageMaps {
  TmaMap map[kTmaMaps];  // [planes][B][H]: work (L-1)*T planes, y T, h0 L
};

// One copy: from map `map` at (input k, batch row `row`, plane), to `dst`
// bytes past the staged chunk's base, completing on half `half`'s barrier.
struct TmaCopy {
  int map, k, row, plane, dst, half;
};

// Copies a half (the layer's K in blocks of 64) and the bytes they bring.
RF_HD int TmaCopies(const LayerPlan& p, int H) { return (p.kin + H) / kTmaBlockK; }
RF_HD int TmaHalfBytes(const LayerPlan& p, int H) { return TmaCopies(p, H) * kTmaBoxBytes; }
// Copy i (half i / TmaCopies) of the chunk of rows [n0, n0 + 64) of layer
// l at step t: inputs [0, kin) from the layer below's h_t, then the own
// layer's h_{t-1} (h0 at t = 0; y's at the top).
RF_HD TmaCopy TmaStageCopy(const Args& a, const LayerPlan& p, int l, int t, int n0, int i) {
  const int per = TmaCopies(p, a.H), half = i / per, k = (i - half * per) * kTmaBlockK;
  TmaCopy c;
  c.half = half;
  c.dst = half * (p.kpad * 64) + (k / kTmaBlockK) * kTmaBoxBytes;
  c.row = n0 + half * kNGroup;
  if (k < p.kin) {
    c.map = kMapWork;
    c.k = k;
    c.plane = (l - 1) * a.T + t;
  } else if (t == 0) {
    c.map = kMapH0;
    c.k = k - p.kin;
    c.plane = l;
  } else {
    const bool top = l == a.L - 1;
    c.map = top ? kMapY : kMapWork;
    c.k = k - p.kin;
    c.plane = (top ? 0 : l * a.T) + t - 1;
  }
  return c;
}
// Bytes past the chunk's base where k-step j (16 inputs) of warpgroup g
// starts in half `half`: inside a 128-byte row, as the swizzle's address
// bits make the wgmma read what the copy wrote.
RF_HD int Sw128StepOffset(int half, int g, int j, int kpad) {
  const int k = g * (kpad / 2) + 16 * j;
  return half * (kpad * 64) + (k >> 6) * kTmaBoxBytes + (k & 63) * 2;
}
// wgmma's descriptor of a K-major operand with the 128-byte swizzle: start
// address, LBO 1 (unused for K-major swizzled), SBO 1024 (next 8 rows),
// base offset 0 (the blocks are kTmaAlign-aligned), layout 1 (128B).
RF_HD unsigned long long Sw128Desc(unsigned start) {
  return static_cast<unsigned long long>((start >> 4) & 0x3FFF) | (1ull << 16) |
         (static_cast<unsigned long long>(1024 >> 4) << 32) | (1ull << 62);
}

constexpr int kTracePoints = 6;  // start, waited, staged, multiplied, pointwise, published
constexpr int kTraceSlots = 8;   // + clock64 at start and published

}  // namespace rnnfuse_wf
