// The wavefront kernel's plan: how many CTAs each layer gets, their warp
// grid and shared-memory layout, and why a shape is refused. Host code only
// (wavefront_host.cc; Python asks it through rnnfuse_wf_plan, which works
// without a GPU). See wavefront.cuh for what the numbers mean.
//
// The choice: one "mg" for the whole stack, the smallest in 1, 2, 4, 8
// whose CTAs all fit on the device at once (one CTA an SM) and whose
// shared memory fits every CTA: the smallest mg gives the most CTAs and
// the least work a warp per step. A layer whose K needs kg warps along K
// takes mg_l = min(mg, 8 / kg) and ng = 8 / (mg_l * kg) warps along the
// batch.

#pragma once

#include <stdio.h>

#include "wavefront.cuh"

namespace rnnfuse_wf {

inline int RoundUp16(int bytes) { return (bytes + 15) / 16 * 16; }

// The backward kernels' split of B batch rows over at most `groups_max`
// groups: the fewest rows a group (a multiple of 8), and the groups that
// makes.
inline void SplitRows(int B, int groups_max, int* rows, int* groups) {
  const int want = (B + groups_max - 1) / groups_max;
  *rows = (want + 7) / 8 * 8;
  *groups = (B + *rows - 1) / *rows;
}

// The backward kernels' k-tiles (of 16 gate columns) a warp holds: 4H
// columns over kWarps warps.
inline int WarpGateTiles(int H) { return (4 * H + kWarps * 16 - 1) / (kWarps * 16); }

// What both backward plans (BwdArgs, BwdStackArgs) set alike: the shape,
// the rows a group, the k-tiles a warp and the padded 4H.
template <typename A>
inline void SetBackwardShape(A* a, int H, int B, int T, int rows) {
  a->H = H;
  a->B = B;
  a->T = T;
  a->rows = rows;
  a->kt = WarpGateTiles(H);
  a->kpad = kWarps * 16 * a->kt;
}

// A backward kernel's shared memory: `ds_bytes` of staged da rows, then
// `part_bytes` of the warps' partials, the carried dc [rows][kBwdUnits]
// (float) and the lengths [rows] (int). Returns the total.
template <typename A>
inline int LayOutBackwardSmem(A* a, int ds_bytes, int part_bytes) {
  int off = 0;
  a->smem_ds = off;
  off += ds_bytes;
  a->smem_part = off;
  off += part_bytes;
  a->smem_dc = off;
  off += RoundUp16(a->rows * kBwdUnits * 4);
  a->smem_len = off;
  off += RoundUp16(a->rows * 4);
  a->smem_total = off;
  return off;
}

// Fills `layer` for layer l of a stack with `mg`; returns its shared bytes.
inline int PlanLayer(int gru, int l, int H, int B, int mg, LayerPlan* layer) {
  const int K = (l == 0 ? 0 : H) + H;
  int kg = 1;
  while (kg * kWarpK < K) kg *= 2;
  const int m = mg < kWarps / kg ? mg : kWarps / kg;
  LayerPlan& p = *layer;
  p.mg = m;
  p.kg = kg;
  p.ng = kWarps / (m * kg);
  p.units = 8 * m;
  p.ctas = (H + p.units - 1) / p.units;
  p.kin = l == 0 ? 0 : H;
  p.kpad = kWarpK * kg;
  const int R = 4 * p.units, G = gru ? 3 : 4;
  int off = 0;
  p.smem_hs = off;  // [kNC][kpad + kHsPad] of the element type
  off += RoundUp16(kNC * (p.kpad + kHsPad) * 2);
  p.smem_part = off;  // [kg][kNC][R + kPartPad] float
  off += RoundUp16(kg * kNC * (R + kPartPad) * 4);
  p.smem_cs = off;  // [B][U] float (LSTM)
  off += gru ? 0 : RoundUp16(p.units * B * 4);
  p.smem_bias = off;  // [R] float
  off += RoundUp16(R * 4);
  p.smem_len = off;  // [B] int
  off += RoundUp16(B * 4);
  p.smem_xs = off;  // layer 0: 2 x [B][G][U] of the element type (double-buffered xproj)
  off += l == 0 ? 2 * RoundUp16(B * G * p.units * 2) : 0;
  p.smem_total = off;
  return off;
}

// Element offsets of layer l's matrices and biases in rnnfuse's canonical
// flat buffer (unidirectional, no projection): every layer's
// [W_ih (G*H x n), W_hh (G*H x H)] first, then every layer's
// [b_in (G*H), b_rec (G*H)]; n = input_size for layer 0, H above. With
// `independent` (a bidirectional layer's directions, cuDNN's order:
// forward, then backward) n = input_size for every one.
inline void PlanOffsets(int gru, int L, int H, int input_size, Args* args,
                        int independent = 0) {
  const long long G = gru ? 3 : 4, GH = G * H;
  long long w = 0;
  for (int l = 0; l < L; ++l) {
    const long long n = l == 0 || independent ? input_size : H;
    args->layer[l].w_ih = w;
    args->layer[l].w_hh = w + GH * n;
    w += GH * n + GH * H;
  }
  for (int l = 0; l < L; ++l) {
    args->layer[l].b_in = w + 2 * GH * l;
    args->layer[l].b_rec = w + 2 * GH * l + GH;
  }
}

// Plans a stack; returns true, or false with the reason in `why`. With
// `independent`, L independent layers (wavefront.cuh, "Independent
// layers": each planned as layer 0).
inline bool Plan(int gru, int L, int H, int B, int T, int input_size, int sms, int smem_limit,
                 Args* args, int* smem_bytes, char* why, int why_len, int independent = 0) {
  if (L < 1 || L > kMaxLayers) {
    snprintf(why, why_len, "the wavefront kernel runs 1 to %d layers, not %d", kMaxLayers, L);
    return false;
  }
  if (H < 8 || H % 8 != 0) {
    snprintf(why, why_len, "the wavefront kernel needs units a multiple of 8, not %d", H);
    return false;
  }
  if (L > 1 && !independent && 2 * H > kWarpK * kWarps) {
    snprintf(why, why_len,
             "the wavefront kernel reads at most %d inputs a layer (layer below + own h); "
             "%d units need %d",
             kWarpK * kWarps, H, 2 * H);
    return false;
  }
  if (H > kWarpK * kWarps) {
    snprintf(why, why_len, "the wavefront kernel runs at most %d units, not %d",
             kWarpK * kWarps, H);
    return false;
  }
  if (B < 1 || T < 1 || input_size < 1) {
    snprintf(why, why_len, "the wavefront kernel needs batch, steps and inputs >= 1");
    return false;
  }
  // The largest mg (fewest CTAs) is the last one tried: its CTA count and
  // shared memory are what the refusal reports.
  int ctas = 0, smem = 0;
  for (int mg = 1; mg <= kWarps; mg *= 2) {
    ctas = smem = 0;
    for (int l = 0; l < L; ++l) {
      const int s = PlanLayer(gru, independent ? 0 : l, H, B, mg, &args->layer[l]);
      smem = s > smem ? s : smem;
      args->cta_start[l] = ctas;
      ctas += args->layer[l].ctas;
    }
    args->cta_start[L] = ctas;
    if (ctas <= sms && smem <= smem_limit) {
      args->gru = gru;
      args->L = L;
      args->H = H;
      args->B = B;
      args->T = T;
      args->mode = 0;
      args->independent = independent;
      PlanOffsets(gru, L, H, input_size, args, independent);
      *smem_bytes = smem;
      return true;
    }
  }
  if (ctas > sms && independent) {
    snprintf(why, why_len,
             "the layer's weights do not fit on chip for the wavefront kernel: %d directions of "
             "%d units need at least %d CTAs of one SM each, and the device has %d SMs",
             L, H, ctas, sms);
  } else if (ctas > sms) {
    snprintf(why, why_len,
             "the stack's weights do not fit on chip for the wavefront kernel: %d layers of %d "
             "units need at least %d CTAs of one SM each, and the device has %d SMs",
             L, H, ctas, sms);
  } else {
    snprintf(why, why_len,
             "the wavefront kernel's shared memory does not fit: %d layers of %d units at "
             "batch %d need %d bytes a CTA, and the device allows %d",
             L, H, B, smem, smem_limit);
  }
  return false;
}

// Whether a planned stack suits the forward's variant 2 (wavefront.cuh,
// "Variant 2"): every layer's CTA owns 16 units (R = 64 rows, wgmma's M)
// and its K is padded to 512 or 1024 (two warpgroups of 16 or 32 k-steps).
// False with the reason in `why`; the caller runs another variant.
inline bool Variant2Fits(const Args& args, char* why, int why_len) {
  for (int l = 0; l < args.L; ++l) {
    const LayerPlan& p = args.layer[l];
    if (p.units != 16 || (p.kpad != 512 && p.kpad != 1024)) {
      snprintf(why, why_len,
               "the forward's variant 2 (wgmma) runs CTAs of 16 units over 512 or 1024 inputs; "
               "layer %d's plan has %d units over %d",
               l, p.units, p.kpad);
      return false;
    }
  }
  return true;
}

// Whether a planned stack suits the forward's variant 4 (wavefront.cuh,
// "Variant 4"): variant 2's plans whose K splits into whole blocks of 64
// inputs of one source (H a multiple of 64), at most 16 a half (a copy a
// lane of one warp). False with the reason in `why`.
inline bool Variant4Fits(const Args& args, char* why, int why_len) {
  char v2[256];
  if (!Variant2Fits(args, v2, sizeof(v2))) {
    snprintf(why, why_len, "the forward's variant 4 takes variant 2's plans only: %s", v2);
    return false;
  }
  if (args.independent || args.H % kTmaBlockK != 0) {
    snprintf(why, why_len,
             "the forward's variant 4 (tensor-copy staging) runs stacks whose units are a "
             "multiple of %d (whole 128-byte rows of one source), not %d%s",
             kTmaBlockK, args.H, args.independent ? " or independent layers" : "");
    return false;
  }
  for (int l = 0; l < args.L; ++l) {
    if (2 * TmaCopies(args.layer[l], args.H) > 32) {
      snprintf(why, why_len, "the forward's variant 4 issues at most 32 copies a chunk; layer %d "
               "needs %d", l, 2 * TmaCopies(args.layer[l], args.H));
      return false;
    }
  }
  return true;
}

// The backward kernel's plan (wavefront.cuh, "The backward kernel"): one
// LSTM layer of H units at batch B. ceil(H / 16) CTAs a group of batch
// rows; as many groups as the SMs hold (the fewest rows a group, a multiple
// of 8); shared memory: one chunk of da rows, the warps' partial sums, the
// carried dc and the lengths. Returns true, or false with the reason.
inline bool PlanBackward(int H, int B, int T, int sms, int smem_limit, BwdArgs* args,
                         char* why, int why_len) {
  if (H < 8 || H % 8 != 0 || H > kWarps * 16 * kBwdMaxKt / 4) {
    snprintf(why, why_len,
             "the wavefront backward kernel needs units a multiple of 8 up to %d, not %d",
             kWarps * 16 * kBwdMaxKt / 4, H);
    return false;
  }
  if (B < 1 || T < 1) {
    snprintf(why, why_len, "the wavefront backward kernel needs batch and steps >= 1");
    return false;
  }
  const int per_group = (H + kBwdUnits - 1) / kBwdUnits;
  if (per_group > sms) {
    snprintf(why, why_len,
             "the wavefront backward kernel needs %d CTAs for %d units, and the device has %d "
             "SMs", per_group, H, sms);
    return false;
  }
  int rows = 0, groups = 0;
  SplitRows(B, sms / per_group, &rows, &groups);
  BwdArgs& a = *args;
  SetBackwardShape(&a, H, B, T, rows);
  a.ctas_per_group = per_group;
  a.ctas = groups * per_group;
  // ds: [kBwdChunk][kpad + kHsPad] of the element type; part:
  // [kWarps][kBwdChunk][kBwdPartStride] float.
  const int off = LayOutBackwardSmem(&a, RoundUp16(kBwdChunk * (a.kpad + kHsPad) * 2),
                                     RoundUp16(kWarps * kBwdChunk * kBwdPartStride * 4));
  if (off > smem_limit) {
    snprintf(why, why_len,
             "the wavefront backward kernel's shared memory does not fit: %d units at batch %d "
             "need %d bytes a CTA, and the device allows %d",
             H, B, off, smem_limit);
    return false;
  }
  return true;
}

// The stack backward's plan (wavefront.cuh, "The stack backward"): every
// layer's ceil(H / 16) CTAs a group of batch rows, as many groups as the
// SMs hold (the fewest rows a group, a multiple of 8), every CTA resident
// at once; a CTA's registers hold its 16 units' columns of W_hh and, above
// layer 0, of W_ih (two m16 tiles against 4H gate columns: H <= 512 in a
// stack of 2 or more layers; a 1-layer stack holds W_hh alone, H <= 1024).
// Shared memory: two chunks (one where two do not fit, or one is all the
// group's rows) of staged da rows [kBwdChunk][kpad + kHsPad], the warps'
// partials, the carried dc and the lengths. `input_size` places
// the matrices in the canonical buffer. `variant` (0, 1 or 2; wavefront.cuh,
// "Variants"): the kernel asked for; args->variant is the one planned (the
// next simpler one where its shared memory does not fit). Returns true, or
// false with the reason.
inline bool PlanBackwardStack(int L, int H, int B, int T, int input_size, int sms,
                              int smem_limit, BwdStackArgs* args, char* why, int why_len,
                              int variant = 0) {
  const int kmax = kWarps * 16 * kBwdMaxKt;  // gate columns one tile row of a CTA holds: 4096
  if (L < 1 || L > kMaxLayers) {
    snprintf(why, why_len, "the reverse-wavefront backward runs 1 to %d layers, not %d",
             kMaxLayers, L);
    return false;
  }
  if (H < 8 || H % 8 != 0 || 4 * H > kmax) {
    snprintf(why, why_len,
             "the reverse-wavefront backward needs units a multiple of 8 up to %d, not %d",
             kmax / 4, H);
    return false;
  }
  if (L > 1 && 4 * H > kmax / 2) {
    snprintf(why, why_len,
             "the reverse-wavefront backward holds W_hh and W_ih (2 x %d gate columns) of a "
             "layer above the first in registers, at most 2 x %d: at most %d units in a stack "
             "of 2 or more layers, not %d",
             4 * H, kmax / 2, kmax / 8, H);
    return false;
  }
  if (B < 1 || T < 1 || input_size < 1) {
    snprintf(why, why_len, "the reverse-wavefront backward needs batch, steps and inputs >= 1");
    return false;
  }
  const int per_group = (H + kBwdUnits - 1) / kBwdUnits;
  if (L * per_group > sms) {
    snprintf(why, why_len,
             "the stack's weights do not fit on chip for the reverse-wavefront backward: %d "
             "layers of %d units need %d CTAs of one SM each, and the device has %d SMs",
             L, H, L * per_group, sms);
    return false;
  }
  int groups_max = sms / (L * per_group);
  if (groups_max > kFlagStride / per_group) groups_max = kFlagStride / per_group;
  int rows = 0, groups = 0;
  SplitRows(B, groups_max, &rows, &groups);
  BwdStackArgs& a = *args;
  SetBackwardShape(&a, H, B, T, rows);
  a.L = L;
  a.per_group = per_group;
  a.groups = groups;
  a.ctas_per_layer = groups * per_group;
  Args offsets;
  PlanOffsets(0, L, H, input_size, &offsets);
  for (int l = 0; l < kMaxLayers; ++l) {
    a.w_ih[l] = l < L ? offsets.layer[l].w_ih : 0;
    a.w_hh[l] = l < L ? offsets.layer[l].w_hh : 0;
  }
  // The asked variant's layout if it fits (two staging buffers where the
  // group has 2+ chunks and they fit, else one), else the next simpler one:
  // variant 2 (32-row chunks; only where a group has more than 16 rows),
  // then 1, then 0 (wavefront.cuh, "Variants"). a.variant says which.
  if (variant < 0 || variant > 2) {
    snprintf(why, why_len, "the reverse-wavefront backward's variant is 0, 1 or 2, not %d",
             variant);
    return false;
  }
  int off = 0;
  bool fits = false;
  for (int v = variant; v >= 0 && !fits; --v) {
    const int chunk = v == 2 ? 2 * kBwdChunk : kBwdChunk;
    if (v == 2 && rows <= kBwdChunk) continue;
    const int part_bufs = v == 0 ? 1 : 2;
    for (int bufs = rows > chunk ? 2 : 1; bufs >= 1 && !fits; --bufs) {
      // ds: [ds_bufs][chunk][kpad + kHsPad] of the element type; part:
      // [part_bufs][kWarps][chunk][kBwdStackPartStride] float.
      off = LayOutBackwardSmem(&a, bufs * RoundUp16(chunk * (a.kpad + kHsPad) * 2),
                               part_bufs * RoundUp16(kWarps * chunk * kBwdStackPartStride * 4));
      a.variant = v;
      a.chunk = chunk;
      a.ds_bufs = bufs;
      fits = off <= smem_limit;
    }
  }
  if (!fits) {
    snprintf(why, why_len,
             "the reverse-wavefront backward's shared memory does not fit: %d layers of %d "
             "units at batch %d need %d bytes a CTA, and the device allows %d",
             L, H, B, off, smem_limit);
    return false;
  }
  return true;
}

}  // namespace rnnfuse_wf
