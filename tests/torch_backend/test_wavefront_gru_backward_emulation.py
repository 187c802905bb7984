"""The GRU case of the per-layer backward kernel (`backward_body<T, true>`,
csrc/wavefront.cu, kernels rnnfuse_wf_backward_gru_*), emulated on the CPU in
float64.

`emulate` follows the kernel's index arithmetic: each warp's W_hh^T
fragments as the kernel loads them (the mma A layout: lane -> unit rows
lane/4 (+8), gate-column pairs 2*(lane%4) (+8); a GRU's virtual gate
columns (r, z, n_x, n_h) read W_hh rows (r, z, none, n)), the k-tile
products of each warp over the staged da_{t+1} (its kt tiles, the padded
columns zero), the warps' partial sums, and the pointwise step line by
line (the carry in `dcs`, dh0 from the last product plus the carry, da 0
and carry 0 past a length). Its dgates and dh0 must equal
`wavefront._gru_recurrence_reference` (the kernel's contract, which
test_torch_wavefront_training.py checks against autograd of the float64
GRU). What this cannot check: the hardware (mma, ldmatrix, cp.async, the
flags), which the LSTM's identical code exercises on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rnnfuse.backends.torch import wavefront

K_WARPS, K_UNITS, K_MAX_KT = 8, 16, 32


def fragments(w_hh: np.ndarray, H: int, j: int, warp: int, kt: int) -> np.ndarray:
    """The A tile rows of CTA block j, warp `warp` as backward_body loads
    them: [16 units, 16 * kt gate columns] (wa[jt][q], two halves each)."""
    u0, G4 = j * K_UNITS, 4 * H
    a = np.zeros((K_UNITS, 16 * kt))
    for jt in range(K_MAX_KT):
        for lane in range(32):
            for q in range(4):
                r = (lane >> 2) + (8 if q & 1 else 0)
                k = (warp * kt + jt) * 16 + (lane & 3) * 2 + (8 if q & 2 else 0)
                krow = k - H if k >= 3 * H else k
                zero = 2 * H <= k < 3 * H
                if jt < kt and u0 + r < H and k < G4 and not zero:
                    col = jt * 16 + (k - (warp * kt + jt) * 16)
                    a[r, col] = w_hh[krow, u0 + r]  # W[off]
                    a[r, col + 1] = w_hh[krow + 1, u0 + r]  # W[off + H]: the pair's upper half
    return a


def emulate(w_hh, gates, hprev, dy, dhy, lengths):
    """backward_body for a GRU layer; returns (dgates [T, B, 4H], dh0)."""
    steps, batch, H = dy.shape
    G4 = 4 * H
    kt = (G4 + K_WARPS * 16 - 1) // (K_WARPS * 16)
    kpad = K_WARPS * 16 * kt
    ctas = (H + K_UNITS - 1) // K_UNITS
    tiles = [[fragments(w_hh, H, j, w, kt) for w in range(K_WARPS)] for j in range(ctas)]
    lens = np.full(batch, steps) if lengths is None else np.minimum(lengths, steps)
    dgates = np.full((steps, batch, G4), np.nan)
    dh0 = np.full((batch, H), np.nan)
    dcs = np.zeros((batch, H))
    for t in range(steps - 1, -2, -1):
        product = t < steps - 1
        ds = np.zeros((batch, kpad))
        if product:
            ds[:, :G4] = dgates[t + 1]  # staged da_{t+1}, all 4H columns
            assert not np.isnan(ds).any(), "read before written"
        for j in range(ctas):
            u0 = j * K_UNITS
            rec = np.zeros((batch, K_UNITS))
            if product:  # each warp's k range, then the sum over the 8 warps
                for w in range(K_WARPS):
                    cols = ds[:, w * 16 * kt:(w + 1) * 16 * kt]
                    rec += cols @ tiles[j][w].T
            for u in range(K_UNITS):
                ug = u0 + u
                if ug >= H:
                    continue
                for nb in range(batch):
                    if t < 0:
                        dh0[nb, ug] = rec[nb, u] + dcs[nb, ug]
                        continue
                    da, carry = np.zeros(4), 0.0
                    if t < lens[nb]:
                        dh = rec[nb, u] + dy[t, nb, ug] + dcs[nb, ug]
                        if t == lens[nb] - 1:
                            dh += dhy[nb, ug]
                        rg, zg, ng, hn = (gates[t, nb, g * H + ug] for g in range(4))
                        hp = hprev[t, nb, ug]
                        dnx = dh * (1 - zg) * (1 - ng * ng)
                        da = [dnx * hn * rg * (1 - rg), dh * (hp - ng) * zg * (1 - zg), dnx,
                              dnx * rg]
                        carry = dh * zg
                    dcs[nb, ug] = carry
                    for g in range(4):
                        dgates[t, nb, g * H + ug] = da[g]
    return dgates, dh0


@pytest.mark.parametrize("shape", [(8, 3, 5, False), (40, 5, 6, True), (72, 2, 4, True)])
def test_the_gru_backward_emulation_matches_the_recurrence_reference(shape):
    """Units not a multiple of 16 (partial CTAs), several k-tiles a warp
    and column blocks straddling warps, with and without lengths."""
    H, batch, steps, with_lengths = shape
    gen = torch.Generator().manual_seed(H)
    rand = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    w_hh = (rand(3 * H, H) - 0.5) / np.sqrt(H)
    gates = torch.cat([rand(steps, batch, 3 * H), rand(steps, batch, H) - 0.5], dim=2)
    hprev, dy, dhy = rand(steps, batch, H) - 0.5, rand(steps, batch, H) - 0.5, rand(batch, H)
    lengths = None
    if with_lengths:
        lengths = torch.randint(1, steps + 1, (batch,), generator=gen)
        lengths[0] = steps
    got = emulate(w_hh.numpy(), gates.numpy(), hprev.numpy(), dy.numpy(), dhy.numpy(),
                  None if lengths is None else lengths.numpy())
    want = wavefront._gru_recurrence_reference(w_hh, gates, hprev, dy, dhy, lengths)
    np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got[1], want[1].numpy(), rtol=1e-12, atol=1e-14)


def test_the_fragments_are_w_hh_transposed_over_the_virtual_gates():
    """The loaded tiles, put side by side, are [W_r; W_z; 0; W_n]^T on the
    CTA's units: nothing of W_hh lands on the n_x block or past 4H."""
    H = 40
    w_hh = np.arange(3 * H * H, dtype=np.float64).reshape(3 * H, H) + 1
    kt = (4 * H + 127) // 128
    want = np.concatenate([w_hh[:2 * H], np.zeros((H, H)), w_hh[2 * H:]]).T  # [H, 4H]
    for j in range((H + 15) // 16):
        a = np.concatenate([fragments(w_hh, H, j, w, kt) for w in range(K_WARPS)], axis=1)
        units = min(16, H - 16 * j)
        np.testing.assert_array_equal(a[:units, :4 * H], want[16 * j:16 * j + units])
        assert not a[:units, 4 * H:].any() and not a[units:].any()
