"""The forward's variant 4 (csrc/wavefront.cu, `wavefront_body<T, 4>`;
wavefront.cuh, "Variant 4") on the CPU: its tensor-copy staging.

The library hands over what the kernel computes for one chunk (wavefront.cuh's
TmaStageCopy, TmaHalfBytes, Sw128StepOffset and Sw128Desc, through
`rnnfuse_wf_tma_staging`): each copy's tensor map, coordinates, destination
and half, the bytes each half's mbarrier expects, and every k-step's wgmma
descriptor. This file runs them through the hardware's rules as the PTX ISA
and the driver API state them: a tiled 3D tensor copy of a box of 64 inputs
x 32 rows x 1 plane writes row r at 128 r bytes past its destination with
the 128-byte swizzle (address bits 4-6 XOR bits 7-9) and reads rows past
the tensor's end as zeros; wgmma reads a K-major operand with that swizzle
from (start, SBO) the same way. Then the two warpgroups' products must be
W @ [h_below, h_own] of every batch row of the chunk, every real input of
the chunk must be written exactly once, each half's expected bytes must be
its copies' bytes, and nothing may land on the barriers past the halves.
A wrong destination, coordinate, map, byte count or descriptor field fails.
What this cannot check: the hardware (the copies, the mbarrier's phases,
the proxy fence); `bench/bench_wavefront.py check --variant 4` does, on the
GPU (`WGMMA_VARIANT=4 tools/gpu/batch.sh wavefront-wgmma`).
"""

from __future__ import annotations

import numpy as np
import pytest

from rnnfuse.backends.cuda import library

K_NC, K_NGROUP, BOX_K, BOX_BYTES = 64, 32, 64, 4096
R = 64  # rows of a variant-4 CTA: 4 gates x 16 units
BASE = 3 * 1024  # the chunk's shared address (hs rounded up to 1024)
MAP_WORK, MAP_Y, MAP_H0 = 0, 1, 2


@pytest.fixture
def lib(wavefront_host):
    """The library's host (plans) around a stand-in cubin: conftest."""
    return library.load(wavefront_host)


def swizzle128(addr: np.ndarray) -> np.ndarray:
    """The 128-byte swizzle of a shared address: bits 4-6 ^= bits 7-9."""
    return addr ^ (((addr >> 7) & 7) << 4)


def sw128_offset(n: int, k: int, kpad: int) -> int:
    """wavefront.cuh's statement of the layout: element (n, k), in bytes."""
    return ((n >> 5) * (kpad * 64) + (k >> 6) * BOX_BYTES + (n & 31) * 128
            + ((((k >> 3) & 7) ^ (n & 7)) << 4) + (k & 7) * 2)


def tensor_copy(smem, written, src, c, batch):
    """A tiled 3D copy with the 128-byte swizzle: box (64 inputs, 32 rows,
    1 plane) of src [planes][B][H] at (k, row, plane) to shared BASE + dst;
    rows past B read as zeros. Returns the bytes it brings (the whole box)."""
    dst = BASE + c["dst"]
    assert dst % 1024 == 0, "a swizzled box starts on the swizzle's 1024-byte period"
    assert c["k"] % BOX_K == 0 and c["k"] + BOX_K <= src.shape[2], "a box inside one source"
    r, e = np.meshgrid(np.arange(K_NGROUP), np.arange(BOX_K), indexing="ij")
    rows = c["row"] + r
    vals = np.where(rows < batch, src[c["plane"], np.minimum(rows, batch - 1), c["k"] + e], 0.0)
    at = swizzle128(dst + r * 128 + e * 2) // 2
    smem[at] = vals
    written[at] += 1
    return BOX_BYTES


def wgmma_b(smem, desc: int) -> np.ndarray:
    """B (16 x 32) of one m64n32k16 from a K-major 128-byte-swizzled
    descriptor: (n, k) at swizzle(start + (n / 8) SBO + (n % 8) 128 + 2 k)."""
    start, lbo, sbo = (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4
    assert desc >> 62 == 1 and (desc >> 49) & 7 == 0, "128-byte swizzle, base offset 0"
    assert sbo == 1024
    n, k = np.meshgrid(np.arange(32), np.arange(16), indexing="ij")
    return smem[swizzle128(start + (n // 8) * sbo + (n % 8) * 128 + 2 * k) // 2].T


def emulate(lib, kind, layers, units, batch, steps, layer, step, chunk, rng):
    """(sum of both warpgroups' products [rows, R], expected [rows, R]) of
    one chunk of a CTA of `layer` at `step`, and the staging's bookkeeping."""
    plan = lib.plan_layers(kind, layers, units, batch, steps, units, **library.H200)
    kpad, kin = plan[layer]["kpad"], 0 if layer == 0 else units
    got = lib.tma_staging(kind, layers, units, batch, steps, units, layer=layer, step=step,
                          chunk=chunk, base=BASE, **library.H200)
    sources = {MAP_WORK: rng.standard_normal(((layers - 1) * steps, batch, units)),
               MAP_Y: rng.standard_normal((steps, batch, units)),
               MAP_H0: rng.standard_normal((layers, batch, units))}
    smem = np.zeros((BASE + 128 * kpad + 1024) // 2)  # hs starts zeroed
    written = np.zeros_like(smem, dtype=int)
    brought = [0, 0]
    for c in got["copies"]:
        brought[c["half"]] += tensor_copy(smem, written, sources[c["map"]], c, batch)
    assert brought == got["half_bytes"], "each half's barrier expects its copies' bytes"
    n0, nc = chunk * K_NC, min(K_NC, batch - chunk * K_NC)
    halves = 2 if nc > K_NGROUP else 1
    # Every real input of the staged rows once, where the layout puts it;
    # the padding inputs [K, kpad) and the barriers past the halves never.
    expect = np.zeros_like(written)
    for n in range(halves * K_NGROUP):
        for k in range(kin + units):
            expect[(BASE + sw128_offset(n, k, kpad)) // 2] = 1
    np.testing.assert_array_equal(written, expect)
    # What the step reads: h_t of the layer below, then the own h_{t-1}.
    top = layer == layers - 1
    own = (sources[MAP_H0][layer] if step == 0 else
           sources[MAP_Y][step - 1] if top else sources[MAP_WORK][layer * steps + step - 1])
    x = np.zeros((batch, kpad))
    x[:, kin:kin + units] = own
    if layer:
        x[:, :kin] = sources[MAP_WORK][(layer - 1) * steps + step]
    w = rng.standard_normal((R, kpad))
    w[:, kin + units:] = 0.0  # weight_offset: no weights past K
    out = np.zeros((halves * K_NGROUP, R))
    kh = kpad // 2
    for h in range(halves):
        for g in (0, 1):
            for j in range(kh // 16):
                b = wgmma_b(smem, got["descs"][(h, g, j)])
                out[32 * h:32 * h + 32] += (w[:, g * kh + 16 * j:g * kh + 16 * j + 16] @ b).T
    return out[:nc], x[n0:n0 + nc] @ w.T, got


CASES = [
    # kind, layers, units, batch, steps, layer, step, chunk
    ("lstm", 4, 512, 64, 5, 0, 0, 0),    # the headline's layer 0 (K 512), h0
    ("lstm", 4, 512, 64, 5, 2, 3, 0),    # a middle layer (K 1024): below and own from work
    ("lstm", 4, 512, 64, 5, 3, 4, 0),    # the top: own h_{t-1} from y
    ("lstm", 4, 512, 64, 5, 3, 0, 0),    # the top at step 0: own from h0
    ("lstm", 4, 512, 40, 3, 1, 2, 0),    # rows 40-63 past B: zeros
    ("lstm", 4, 512, 20, 3, 2, 1, 0),    # one half only
    ("lstm", 4, 512, 150, 2, 1, 1, 2),   # the third chunk (22 rows)
    ("gru", 4, 512, 128, 3, 2, 2, 1),    # a second chunk, GRU
    ("lstm", 4, 320, 64, 3, 1, 1, 0),    # K 640 padded to 1024: padding blocks stay zero
    ("lstm", 4, 320, 64, 3, 0, 2, 0),    # K 320 padded to 512
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}{c[1]}x{c[2]}-b{c[3]}-l{c[5]}t{c[6]}c{c[7]}"
                                              for c in CASES])
def test_the_copies_and_descriptors_give_the_chunks_products(lib, case):
    kind, layers, units, batch, steps, layer, step, chunk = case
    got, want, _ = emulate(lib, kind, layers, units, batch, steps, layer, step, chunk,
                           np.random.default_rng(sum(case[1:])))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)


def test_a_half_expects_its_k_blocks_bytes(lib):
    """The headline's middle layer: 16 boxes of 4096 bytes a half (8 of the
    layer below's h, 8 of its own), 32 copies in all: a lane of warp 0 each."""
    got = lib.tma_staging("lstm", 4, 512, 64, 5, 512, layer=1, step=1, chunk=0, **library.H200)
    assert got["half_bytes"] == [16 * BOX_BYTES, 16 * BOX_BYTES]
    assert len(got["copies"]) == 32
    for h in (0, 1):
        planes = sorted(c["plane"] for c in got["copies"] if c["half"] == h)
        assert planes == [0 * 5 + 1] * 8 + [1 * 5 + 0] * 8  # below h_1, own h_0 (work)


def test_the_descriptor_start_reaches_the_end_of_shared_memory(lib):
    """A chunk placed as high as 227 KiB allows: the last k-step's start
    still fits the descriptor's 14 bits of 16-byte units, where the layout
    puts that k-step's first input."""
    kpad = 1024
    base = (227 * 1024 - 128 * kpad - 1024) // 1024 * 1024
    got = lib.tma_staging("lstm", 4, 512, 64, 5, 512, layer=1, step=1, chunk=0, base=base,
                          **library.H200)
    for (h, g, j), desc in got["descs"].items():
        assert (desc & 0x3FFF) << 4 == base + sw128_offset(32 * h, g * kpad // 2 + 16 * j, kpad)


def barrier_waits(chunks_halves, steps):
    """The kernel's parity bookkeeping: (barrier, parity it waits for) of
    each wait, and the phases each barrier completed, for `steps` steps of
    chunks with the given halves (tma_parity: a bit a barrier, flipped at
    each wait)."""
    parity, waits, phases = 0, [], [0, 0]
    for _ in range(steps):
        for halves in chunks_halves:
            for h in range(halves):
                waits.append((h, (parity >> h) & 1, phases[h] & 1))
                phases[h] += 1  # its copies complete the current phase
                parity ^= 1 << h
    return waits


@pytest.mark.parametrize("chunks_halves", [(2,), (1,), (2, 1), (2, 2, 1)])
def test_each_wait_is_for_the_phase_its_copies_complete(chunks_halves):
    for _, waited, completing in barrier_waits(chunks_halves, 5):
        assert waited == completing


@pytest.mark.parametrize("shape, reason", [
    (("lstm", 4, 480, 64, 5, 480), "multiple of 64"),  # CTAs of 16 units, K 960
    (("lstm", 1, 512, 64, 5, 512), "16 units over 512 or 1024"),  # CTAs of 8 units
])
def test_shapes_the_staging_cannot_take_are_refused_with_the_reason(lib, shape, reason):
    with pytest.raises(library.WavefrontError, match=reason):
        lib.tma_staging(*shape, layer=0, step=0, chunk=0, **library.H200)
