"""The forward step's variant 1 (csrc/wavefront.cu, `wavefront_body<T, 1>`;
wavefront.cuh, "Variant 1") on the CPU (no GPU needed).

- the library carries the variant's kernels, and refuses a variant it does
  not have, with the reason, before touching the driver;
- `emulate_chunk` walks one chunk of a CTA's variant-1 step in numpy,
  float64, with the kernel's index arithmetic: the fixed staging (each
  thread's column chunk and rows), the warp grid (m, k, n) of the real plan
  (`plan_layers`), the n-group tiles of each phase, the C fragment -> `part`
  stores ([kg][kNC][R + 4] floats, flat, NaN until written), the pairs (the
  warps k >= kg/2 store and arrive, warps k - kg/2 wait, add their mate's
  partials, store), the named barriers' counts, and the pointwise step's
  sums of `kparts` slices for rows [0, half) (read while the second half's
  products may still be storing) and [half, nc). The sums must equal
  W @ h for every (row, gate unit) and the first half's reads must not
  depend on when the second half's stores land;
- the split wait's roles: where it applies every warp copies only the layer
  below's h or only its own, warp 0 copies the layer below's, and the named
  barriers' thread counts (3: kThreads/2, 4: 32 + kThreads/2) are the warps
  that take part.
What this cannot check: the hardware (mma, ldmatrix, cp.async, bar.arrive /
bar.sync); bench/bench_wavefront.py check --variant 1 does, on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from rnnfuse.backends.cuda import build, library

H200 = library.H200
K_WARPS, K_THREADS, K_NC, K_NGROUP, K_PART_PAD, K_WARP_K = 8, 256, 64, 32, 4, 256


@pytest.fixture
def lib(wavefront_host):
    """The library's host (plans, argument checks) around a stand-in cubin:
    conftest."""
    return library.load(wavefront_host)


def test_the_cubin_carries_the_variant_kernels(built_wavefront, monkeypatch):
    # The cubin's bytes, not the library's: the host names every kernel it loads.
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(built_wavefront[1]))
    data = build.build_cubin().read_bytes()
    for variant in (1, 3, 4):
        assert f"rnnfuse_wf_forward_v{variant}_f16".encode() in data
        assert f"rnnfuse_wf_forward_v{variant}_bf16".encode() in data
    assert b"rnnfuse_wf_forward_variant" in library.load(built_wavefront[0]).path.read_bytes()


@pytest.mark.parametrize("variant", [-1, 6])
def test_an_unknown_variant_is_refused_with_the_reason(lib, variant):
    with pytest.raises(library.WavefrontError,
                       match=rf"variant must be 0, 1, 2, 3, 4 \(.*\) or 5 \(.*not {variant}"):
        lib.forward(0, "float16", "lstm", 1, 8, 1, 1, 3, xproj=0, params=0, h0=0, c0=0,
                    lengths=None, y=0, hy=0, cy=0, workspace=0, variant=variant)


def staged(K, kin, r0, r1, fixed):
    """The (row, column) hs cells one staging half writes: the fixed walk
    (variant 1 where kThreads % (K / 8) == 0) or variant 0's walker."""
    per_row = K // 8
    dn, dq = K_THREADS // per_row, K_THREADS % per_row
    cells = []
    for tid in range(K_THREADS):
        n0, q0 = tid // per_row, tid % per_row
        if fixed:
            assert dq == 0
            cells += [(n, q0 * 8) for n in range(r0 + n0, r1, dn)]
            continue
        n, q = r0 + n0, q0
        while n < r1:
            cells.append((n, q * 8))
            q += dq
            n += dn
            if q >= per_row:
                q -= per_row
                n += 1
    return cells


def emulate_chunk(p, nc, rng):
    """One chunk (nc rows) of a CTA with layer plan `p` in variant 1: returns
    (the pointwise sums [nc, R], W [R, kpad], hs [nc, kpad])."""
    mg, kg, ng, U = p["mg"], p["kg"], p["ng"], p["units"]
    R, kpad, RS = 4 * U, p["kpad"], 4 * U + K_PART_PAD
    W = rng.standard_normal((R, kpad))
    hs = np.full((K_NC, kpad), np.nan)  # rows >= nc: stale, never read
    hs[:nc] = rng.standard_normal((nc, kpad))
    part = np.full(kg * K_NC * RS, np.nan)  # NaN: stale; `written`: stored this chunk
    written = np.zeros(part.shape, dtype=bool)
    ntiles, half = (nc + 7) // 8, min(nc, K_NGROUP)
    pair = ng == 1 and kg >= 2
    kparts = kg // 2 if pair else kg

    def warp_grid(w):
        return w % mg, (w // mg) % kg, w // (mg * kg)

    def products(w, phase):
        """(t0, acc) of warp w's tile groups in this phase; acc[row 0-31][col 0-31]."""
        m, k, n = warp_grid(w)
        out = []
        for t0 in range(n * 4, ntiles, 4 * ng):
            if (t0 < K_NGROUP // 8) != (phase == 0):
                continue
            rows = slice(32 * m, 32 * m + 32)
            ks = slice(K_WARP_K * k, K_WARP_K * k + K_WARP_K)
            acc = np.zeros((32, 32))
            cols = min(32, (ntiles - t0) * 8)
            acc[:, :cols] = W[rows, ks] @ hs[t0 * 8:t0 * 8 + cols, ks].T
            out.append((t0, acc))
        return out

    def fragment_cells(w, t0):
        """(flat part offset within a slice, acc row, acc col) of warp w's C fragments."""
        m = warp_grid(w)[0]
        for lane in range(32):
            for i in range(2):
                for nt in range(4):
                    if t0 + nt >= ntiles:
                        continue
                    row = m * 32 + i * 16 + (lane >> 2)
                    col = (t0 + nt) * 8 + (lane & 3) * 2
                    for dr, dc in ((0, 0), (0, 1), (8, 0), (8, 1)):
                        yield (col + dc) * RS + row + dr, row + dr - 32 * m, col + dc - t0 * 8

    def run_phase(phase):
        upper = [w for w in range(K_WARPS) if warp_grid(w)[1] >= kg // 2]
        if pair:  # warp (m, k >= kg/2) = warps 4-7, as `late` assumes
            assert upper == [4, 5, 6, 7]
        order = upper + [w for w in range(K_WARPS) if w not in upper] if pair else range(K_WARPS)
        arrived = synced = 0
        for w in order:  # pairs: every upper warp stores before any lower one reads
            m, k, _ = warp_grid(w)
            for t0, acc in products(w, phase):
                if pair and k < kg // 2:
                    synced += 32
                    mate = (k + kg // 2) * K_NC * RS
                    for off, r, c in fragment_cells(w, t0):
                        assert written[mate + off], "read before its store"
                        acc[r, c] += part[mate + off]
                for off, r, c in fragment_cells(w, t0):
                    part[k * K_NC * RS + off] = acc[r, c]
                    written[k * K_NC * RS + off] = True
                if pair and k >= kg // 2:
                    arrived += 32
        if pair and (arrived or synced):  # bar.arrive / bar.sync of kThreads threads
            assert arrived + synced == K_THREADS and arrived == synced

    def pointwise(r0, r1):
        pre = np.zeros((r1 - r0, R))
        for n in range(r0, r1):
            for j in range(R):
                offs = [(kk * K_NC + n) * RS + j for kk in range(kparts)]
                assert written[offs].all(), "a partial read before its store"
                pre[n - r0, j] = part[offs].sum()
        return pre

    run_phase(0)
    first_early = pointwise(0, half)  # warps 0-3: before the second half's products
    run_phase(1)
    first_late = pointwise(0, half)  # warps 4-7: after theirs
    np.testing.assert_array_equal(first_early, first_late)
    return np.concatenate([first_late, pointwise(half, nc)]), W, hs[:nc]


SHAPES = [  # kind, layers, units, batch, input size
    ("lstm", 4, 512, 64, 512),   # the headline: layers 1-3 kg 4 ng 1 (pairs), layer 0 ng 2
    ("lstm", 4, 512, 100, 512),  # a chunk of 64 and one of 36
    ("lstm", 8, 256, 33, 256),
    ("lstm", 1, 1024, 32, 1024),
    ("gru", 4, 512, 16, 512),
    ("lstm", 3, 384, 1, 100),    # K = 768: the walker, not the fixed staging
    ("lstm", 2, 64, 3, 5),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_variant_one_sums_every_partial_once(lib, shape):
    kind, layers, units, batch, inputs = shape
    plans = lib.plan_layers(kind, layers, units, batch, 10, inputs, **H200)
    assert isinstance(plans, list), plans
    rng = np.random.default_rng(len(plans) * batch)
    for l, p in enumerate(plans):
        K = (0 if l == 0 else units) + units
        for c in range((batch + K_NC - 1) // K_NC):
            nc = min(K_NC, batch - c * K_NC)
            half = min(nc, K_NGROUP)
            fixed = K_THREADS % (K // 8) == 0
            want = sorted((n, k) for n in range(nc) for k in range(0, K, 8))
            got = sorted(staged(K, K - units, 0, half, fixed) + staged(K, K - units, half, nc,
                                                                       fixed))
            assert got == want, (l, c)
            sums, W, hs = emulate_chunk(p, nc, rng)
            np.testing.assert_allclose(sums, hs @ W.T, rtol=1e-12, atol=1e-9)


def test_the_headline_uses_the_pairs_and_the_fixed_staging(lib):
    plans = lib.plan_layers("lstm", 4, 512, 64, 1000, 512, **H200)
    for l, p in enumerate(plans):
        K = (0 if l == 0 else 512) + 512
        assert K_THREADS % (K // 8) == 0  # fixed staging in every layer
        assert (p["ng"] == 1 and p["kg"] >= 2) == (l > 0)  # pairs above layer 0


def split_wait_roles(K, kin):
    """Variant 1's split wait for a layer of K inputs, kin of them the layer
    below's: None where it does not apply, else each warp's role ("below":
    it copies only the layer below's h, "own": only its own layer's)."""
    per_row = K // 8
    if kin == 0 or K_THREADS % per_row != 0 or (per_row // 2) % 32 != 0:
        return None
    roles = []
    for w in range(K_WARPS):
        below = {(tid % per_row) * 8 < kin for tid in range(32 * w, 32 * w + 32)}
        assert len(below) == 1, f"warp {w} copies both halves of K"
        roles.append("below" if below.pop() else "own")
    return roles


@pytest.mark.parametrize("units", [256, 512])
def test_the_split_wait_barriers_count_their_warps(units):
    roles = split_wait_roles(2 * units, units)
    assert roles is not None and roles[0] == "below"  # warp 0 polls, then copies below h
    # barrier 3: warp 0 arrives, the other below warps sync (kThreads / 2 in all);
    # barrier 4: warp 0 arrives, the own warps sync (32 + kThreads / 2).
    assert 32 * roles.count("below") == K_THREADS // 2
    assert 32 + 32 * roles.count("own") == 32 + K_THREADS // 2


@pytest.mark.parametrize("K, kin", [(512, 0), (1024, 0), (768, 384), (256, 128), (128, 64)])
def test_the_split_wait_is_off_where_a_warp_would_copy_both_halves(K, kin):
    assert split_wait_roles(K, kin) is None
