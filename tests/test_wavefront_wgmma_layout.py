"""The forward's variant 2 (csrc/wavefront.cu, `wavefront_body<T, 2>`;
wavefront.cuh, "Variant 2") on the CPU: its wgmma layout arithmetic.

`emulate_chunk` walks one chunk of a CTA's variant-2 products in numpy with
the kernel's index arithmetic: the copies into hs in wgmma's no-swizzle
K-major canonical layout (`hs_at`), the shared-memory descriptor of each
k-step (`smem_desc`: start, LBO, SBO packed in 14-bit fields of 16 bytes),
the register A fragments each warp loads (its rows of the CTA's 64, its
warpgroup's K half), wgmma m64n32k16 as the PTX ISA defines it for those
operands (B's element (n, k) at start + (n / 8) SBO + (k / 8) LBO +
(n % 8) 16 + (k % 8) 2 bytes; A and D in mma.sync's per-warp fragment
order), and the accumulators' stores to the warpgroups' partial slices.
The two slices must sum to W @ h for every row and batch column of the
chunk, the copies must land in distinct bytes of the staging buffer, and
the descriptor's fields must hold their values at the largest offsets.
The register fragments are also checked against an independent reference,
CUTLASS's SM90 GMMA layouts (ALayout_64x16, CLayout_64xN).
What this cannot check: the hardware (wgmma's issue, the proxy fence,
cp.async); `bench/bench_wavefront.py check --variant 2` does, on the GPU
(`tools/gpu/batch.sh wavefront-wgmma`).
"""

from __future__ import annotations

import numpy as np
import pytest

from rnnfuse.backends.cuda import build, library

K_NC, K_NGROUP, K_THREADS, K_WK = 64, 32, 256, 16
R = 64  # rows of a variant-2 CTA: 4 gates x 16 units


def hs_at(n: int, k: int, kpad: int) -> int:
    """The kernel's hs_at, in elements: (n / 8) kpad 8 + (k / 8) 64 + (n % 8) 8 + k % 8."""
    return (n >> 3) * (kpad * 8) + (k >> 3) * 64 + (n & 7) * 8 + (k & 7)


def smem_desc(start: int, lbo: int, sbo: int) -> int:
    """The kernel's smem_desc: 14-bit fields of 16-byte units at bits 0, 16, 32."""
    return ((start >> 4) & 0x3FFF) | (((lbo >> 4) & 0x3FFF) << 16) | (((sbo >> 4) & 0x3FFF) << 32)


def decode(desc: int) -> tuple[int, int, int]:
    return (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4


def wgmma_b(smem: np.ndarray, desc: int) -> np.ndarray:
    """B (16 x 32) of one m64n32k16, K-major without swizzle, as the PTX ISA
    lays it out from the descriptor (`smem` in 2-byte elements)."""
    start, lbo, sbo = decode(desc)
    b = np.empty((16, 32))
    for n in range(32):
        for k in range(16):
            byte = start + (n // 8) * sbo + (k // 8) * lbo + (n % 8) * 16 + (k % 8) * 2
            assert byte % 2 == 0
            b[k, n] = smem[byte // 2]
    return b


def a_fragment_rows_cols(warp: int, lane: int, j: int, kh: int):
    """(row, k) of each register q's two halves: the kernel's weight load
    for variant 2 (rows of warp % 4, k-step j of warpgroup warp / 4)."""
    out = []
    for q in range(4):
        r = (warp & 3) * 16 + (lane >> 2) + (8 if q & 1 else 0)
        k = (warp >> 2) * kh + j * 16 + (lane & 3) * 2 + (8 if q & 2 else 0)
        out.append((r, k))
    return out


def staging_walk(tid: int, r0: int, r1: int, k: int, kpad: int):
    """(row n, k-chunk q, hs element) of each copy thread `tid` issues for
    rows [r0, r1) of a chunk (K = k inputs), the kernel's variant-2 branch
    of stage_hs, with its incremental destination. A copy with n >= r1 is
    predicated off (the kernel's `n8 + sub < r1`)."""
    kq, sub, q = k // 8, tid & 7, tid >> 3
    assert kq > K_THREADS // 8  # K > 256: one subtraction wraps q
    dst, n8 = hs_at(r0 + sub, 8 * q, kpad), r0
    while n8 < r1:
        yield n8 + sub, q, dst
        q += K_THREADS // 8
        dst += (K_THREADS // 8) * 64
        if q >= kq:
            q -= kq
            n8 += 8
            dst += kpad * 8 - kq * 64


def emulate_chunk(kpad: int, nc: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sum of the warpgroups' slices [nc, R], W [R, kpad], h [nc, kpad])."""
    kh = kpad // 2
    w = rng.standard_normal((R, kpad))
    h = rng.standard_normal((nc, kpad))
    # Staging: the kernel's two halves of the chunk's rows, each thread's
    # 16-byte chunks (n, q) in the order stage_hs walks them.
    smem = np.full(K_NC * kpad, np.nan)
    written = np.zeros(K_NC * kpad, dtype=int)
    half = min(nc, K_NGROUP)
    for r0, r1 in ((0, half), (half, nc)):
        for tid in range(K_THREADS):
            for n, q, at in staging_walk(tid, r0, r1, kpad, kpad):
                assert at == hs_at(n, 8 * q, kpad)
                if n >= r1:
                    continue
                smem[at:at + 8] = h[n, 8 * q:8 * q + 8]
                written[at:at + 8] += 1
    assert written.max() == 1 and written.sum() == nc * kpad  # distinct, every element once
    smem = np.nan_to_num(smem)  # rows >= nc: whatever a previous chunk left (never read back)
    slices = np.zeros((2, K_NC, R))  # part[g][col][row]
    for phase in (0, 1):
        r0 = phase * K_NGROUP
        if r0 >= nc:
            continue
        for g in (0, 1):
            base = (r0 >> 3) * (kpad * 16) + g * (kh // 8) * 128  # bytes (hs at 0)
            d = np.zeros((R, 32))
            for j in range(kh // 16):
                b = wgmma_b(smem, smem_desc(base + j * 256, 128, kpad * 16))
                a = np.zeros((R, 16))
                for warp in range(4 * g, 4 * g + 4):
                    for lane in range(32):
                        for r, k in a_fragment_rows_cols(warp, lane, j, kh):
                            a[r, k - g * kh - j * 16] = w[r, k]
                            a[r, k + 1 - g * kh - j * 16] = w[r, k + 1]
                d += a @ b
            # D's fragments -> part slice g: d[4b + e] of (warp, lane) is
            # (row gid + 8 (e / 2), col 8b + 2 tig + e % 2).
            for warp in range(4 * g, 4 * g + 4):
                for lane in range(32):
                    row = (warp & 3) * 16 + (lane >> 2)
                    for blk in range(4):
                        col = r0 + 8 * blk + (lane & 3) * 2
                        frag = [d[row - 0, col - r0], d[row, col + 1 - r0],
                                d[row + 8, col - r0], d[row + 8, col + 1 - r0]]
                        # store_fragment(slice, RS, row, col, frag)
                        slices[g, col, row] = frag[0]
                        slices[g, col + 1, row] = frag[1]
                        slices[g, col, row + 8] = frag[2]
                        slices[g, col + 1, row + 8] = frag[3]
    return slices.sum(axis=0)[:nc], w, h


def test_the_weight_load_is_wgmmas_register_a_layout():
    """Register q of a lane holds A's (row gid + 8 (q % 2), k 2 tig + 8 (q / 2))
    and the next k: mma.sync's m16n8k16 A fragment, which wgmma takes a warp."""
    kh = 512
    for warp in range(8):
        for lane in range(32):
            for j in (0, 5, 31):
                for q, (r, k) in enumerate(a_fragment_rows_cols(warp, lane, j, kh)):
                    gid, tig = lane // 4, lane % 4
                    assert r - 16 * (warp % 4) == gid + 8 * (q % 2)
                    assert k - (warp // 4) * kh - 16 * j == 2 * tig + 8 * (q // 2)


def cute_tv(thread: int, value: int) -> tuple[int, int]:
    """(row, col) of a warpgroup thread's value in CUTLASS's (CuTe's) SM90
    GMMA register layouts ALayout_64x16 and CLayout_64xN (mma_traits_sm90_gmma.hpp):
    ((4, 8, 4), (2, 2, N / 8)) : ((128, 1, 16), (64, 8, 512)), the offset
    column-major in (64, N)."""
    t0, t1, t2 = thread % 4, thread // 4 % 8, thread // 32
    v0, v1, v2 = value % 2, value // 2 % 2, value // 4
    off = 128 * t0 + t1 + 16 * t2 + 64 * v0 + 8 * v1 + 512 * v2
    return off % 64, off // 64


def test_the_weight_load_is_cutlasss_register_a_layout():
    """An independent reference for the A fragments: value 2q + h of a
    thread is the low (h 0) or high half of the kernel's register q."""
    for warp in range(4):
        for lane in range(32):
            for q, (r, k) in enumerate(a_fragment_rows_cols(warp, lane, 0, 512)):
                for h in (0, 1):
                    assert cute_tv(32 * warp + lane, 2 * q + h) == (r, k + h)


def test_the_accumulator_stores_are_cutlasss_c_layout():
    """The kernel's stores of d[4b + e] (store_fragment of n8 block b: e 0, 1
    at row gid, columns 2 tig + e; e 2, 3 eight rows below) put each value
    where CLayout_64x32 says wgmma left it."""
    for warp in range(4):
        for lane in range(32):
            row, col = (warp & 3) * 16 + (lane >> 2), (lane & 3) * 2
            for i in range(16):
                blk, e = divmod(i, 4)
                assert cute_tv(32 * warp + lane, i) == (row + 8 * (e >> 1), 8 * blk + col + (e & 1))


@pytest.mark.parametrize("kpad, nc", [(1024, 64), (512, 64), (1024, 40), (512, 7), (1024, 33)])
def test_the_two_slices_sum_to_the_chunks_products(kpad, nc):
    got, w, h = emulate_chunk(kpad, nc, np.random.default_rng(kpad + nc))
    np.testing.assert_allclose(got, h @ w.T, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("k, kpad", [(264, 512), (512, 512), (520, 1024), (1000, 1024), (1024, 1024)])
@pytest.mark.parametrize("r0, r1", [(0, 32), (32, 64), (0, 5), (32, 45)])
def test_the_staging_copies_each_chunk_of_its_rows_once(k, kpad, r0, r1):
    seen = [(n, q) for tid in range(K_THREADS) for n, q, _ in staging_walk(tid, r0, r1, k, kpad)
            if n < r1]
    assert sorted(seen) == [(n, q) for n in range(r0, r1) for q in range(k // 8)]


def wavefronts(byte_addresses) -> int:
    """Shared-memory wavefronts of one quarter warp's 16-byte accesses: the
    most distinct 4-byte words that fall in one of the 32 banks."""
    words: dict[int, set[int]] = {}
    for a in byte_addresses:
        for w in range(a // 4, a // 4 + 4):
            words.setdefault(w % 32, set()).add(w)
    return max(len(v) for v in words.values())


@pytest.mark.parametrize("k, kpad", [(520, 1024), (1024, 1024), (512, 512)])
def test_the_staging_writes_are_free_of_bank_conflicts(k, kpad):
    """Each quarter warp's copies of one iteration fill one 128-byte core
    matrix: one wavefront, where ChunkWalk's order (consecutive k-chunks of
    a row, 128 bytes apart in this layout) took eight."""
    walks = [list(staging_walk(tid, 0, K_NGROUP, k, kpad)) for tid in range(K_THREADS)]
    for quarter in range(K_THREADS // 8):
        lanes = walks[8 * quarter:8 * quarter + 8]
        for step in zip(*lanes):
            assert wavefronts([2 * at for _, _, at in step]) == 1
    row = [2 * hs_at(0, 8 * q, kpad) for q in range(8)]  # ChunkWalk: lanes 0-7 of row 0
    assert wavefronts(row) == 8


def test_the_descriptor_fields_hold_the_largest_offsets():
    smem_limit = 227 * 1024
    for kpad in (512, 1024):
        start = smem_limit - 256  # the furthest a k-step's start can be
        assert decode(smem_desc(start, 128, kpad * 16)) == (start, 128, kpad * 16)
    assert decode(smem_desc(0, 128, 1024 * 16))[2] == 16384  # SBO of kpad 1024: 1024 units


@pytest.fixture
def lib(wavefront_host):
    """The library's host (plans) around a stand-in cubin: conftest."""
    return library.load(wavefront_host)


def test_the_headline_plan_suits_variant_two(lib):
    """Every layer of the headline (4 x 512, batch 64) is a CTA of 16 units
    over K 512 (layer 0) or 1024 (layers 1-3): the shapes emulated above."""
    plan = lib.plan_layers("lstm", 4, 512, 64, 1000, 512, **library.H200)
    assert [(p["units"], p["kpad"]) for p in plan] == [(16, 512)] + [(16, 1024)] * 3


def test_the_cubin_carries_variant_twos_kernels(built_wavefront, monkeypatch):
    # The cubin's bytes, not the library's: the host names every kernel it loads.
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(built_wavefront[1]))
    data = build.build_cubin().read_bytes()
    assert b"rnnfuse_wf_forward_v2_f16" in data and b"rnnfuse_wf_forward_v2_bf16" in data
