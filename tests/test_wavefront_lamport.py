"""The forward's variant 3 (csrc/wavefront.cu, `wavefront_body<T, 3>`;
wavefront.cuh, "Variant 3") on the CPU: the h values as their own flags.

- `sentinel_halves` and `lamport_value` are the kernel's bit arithmetic on
  32-bit words of two halves, checked over every value of one half against
  a spread of the other (every low half against 300 high halves and the
  reverse, as numpy uint32 arrays, which wrap as the kernel's unsigned
  arithmetic does): the check finds a 0xFFFF half exactly, and a stored
  value never holds one, stays equal otherwise and stays a NaN (float16 and
  bfloat16) where it was one;
- `run_protocol` steps a small stack's CTAs in random interleavings, one
  memory action at a time: a producer stores its h words one by one, a
  consumer copies 16-byte chunks element by element (so a chunk may be
  half written when copied), checks its chunks, re-copies those holding a
  sentinel and computes only once none does. Whatever the order, every
  output must equal the sequential recurrence; leaving out a piece of the
  design (the fill before the launch, the value's canonicalisation, the
  check of every half, the exemption of h0) must make it fail or hang.
What this cannot check: the hardware (cp.async.cg reading L2, per-element
atomicity, progress); bench/bench_wavefront.py check --variant 3 does, on
the GPU (tools/gpu/batch.sh wavefront-variant3).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

SENTINEL = 0xFFFF  # one half of wavefront.cuh's kSentinelWord
MASK = 0xFFFFFFFF


def sentinel_halves(w):
    """The kernel's sentinel_halves: nonzero iff a half of w is 0xFFFF."""
    return ((~w) - np.uint32(0x00010001)) & w & np.uint32(0x80008000)


def lamport_value(w):
    """The kernel's lamport_value: a 0xFFFF half becomes 0x7FFF."""
    lo = np.where((w & np.uint32(0xFFFF)) == np.uint32(0xFFFF), np.uint32(0x8000), np.uint32(0))
    hi = np.where(w >= np.uint32(0xFFFF0000), np.uint32(0x80000000), np.uint32(0))
    return w ^ lo ^ hi


def _grid():
    """Words (hi << 16 | lo): every lo against 300 his, every hi against 300 los."""
    rng = np.random.default_rng(0)
    some = np.unique(np.concatenate([
        np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF, 0x7C00, 0xFC00, 0x7E00, 0x3C00,
                  0xBC00, 0x7F80, 0xFF80, 0x7FC0], dtype=np.uint32),
        rng.integers(0, 1 << 16, 285, dtype=np.uint32)]))
    every = np.arange(1 << 16, dtype=np.uint32)
    a = (some[:, None] << np.uint32(16)) | every[None, :]
    b = (every[:, None] << np.uint32(16)) | some[None, :]
    return np.concatenate([a.ravel(), b.ravel()])


def test_the_sentinel_check_finds_a_sentinel_half_exactly():
    w = _grid()
    lo, hi = w & np.uint32(0xFFFF), w >> np.uint32(16)
    expected = (lo == SENTINEL) | (hi == SENTINEL)
    assert np.array_equal(sentinel_halves(w) != 0, expected)
    assert expected.sum() > 1000  # the grid holds sentinel halves in both places


def _is_nan(halves, dtype):
    if dtype == "float16":
        return np.isnan(halves.astype(np.uint16).view(np.float16))
    # bfloat16: the top half of a float32
    return np.isnan((halves.astype(np.uint32) << np.uint32(16)).view(np.float32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_stored_value_never_reads_as_unwritten_and_keeps_its_meaning(dtype):
    w = _grid()
    v = lamport_value(w)
    assert not (sentinel_halves(v) != 0).any()
    for shift in (0, 16):
        before = (w >> np.uint32(shift)) & np.uint32(0xFFFF)
        after = (v >> np.uint32(shift)) & np.uint32(0xFFFF)
        changed = before != after
        assert np.array_equal(changed, before == SENTINEL)  # only the sentinel moves
        assert (after[changed] == 0x7FFF).all()
        assert np.array_equal(_is_nan(before, dtype), _is_nan(after, dtype))
    # the sentinel itself is a NaN in both types (so a canonicalised h is too)
    assert _is_nan(np.array([SENTINEL]), dtype).all()


# --- the protocol, emulated --------------------------------------------------

L, CTAS, U, B, T = 3, 2, 4, 3, 5  # layers, CTAs a layer, units a CTA, rows, steps
H = CTAS * U
CHUNK = 8  # halves of a 16-byte copy


def cell(l, t, inputs, units, force_sentinel):
    """A toy cell on 16-bit patterns: each unit's h from all K inputs (the
    layer below's h_t, then the layer's own h_{t-1}); `force_sentinel`
    makes some raw results 0xFFFF, the value a NaN h could have."""
    out = []
    for u in units:
        acc = sum((k + 3 * u + 1) * x for k, x in enumerate(inputs)) + 7 * t + 11 * l
        raw = acc & 0xFFFF
        if force_sentinel and (u + t + l) % 3 == 0:
            raw = SENTINEL
        out.append(raw)
    return out


def canon(raw):
    return 0x7FFF if raw == SENTINEL else raw


def reference(h0, force_sentinel):
    """The stack's sequences, one step after another."""
    seq = np.zeros((L, T, B, H), dtype=np.int64)
    for t in range(T):
        for l in range(L):
            for n in range(B):
                below = list(seq[l - 1, t, n]) if l > 0 else []
                own = list(seq[l, t - 1, n]) if t > 0 else list(h0[l, n])
                seq[l, t, n] = [canon(v) for v in cell(l, t, below + own, range(H),
                                                       force_sentinel)]
    return seq


def run_protocol(seed, *, h0, force_sentinel=False, fill=True, canonicalise=True,
                 check_every_half=True, exempt_h0=True, stale=None, budget=200_000):
    """The sequences as variant 3 computes them, CTAs interleaved at random
    one memory action at a time; None if no CTA can make progress within
    `budget` actions (a hang)."""
    rng = random.Random(seed)
    mem = np.full((L, T, B, H), SENTINEL if fill else 0, dtype=np.int64)
    if stale is not None:  # what an earlier call left (when there is no fill)
        mem[...] = stale

    def cta(l, j):
        units = range(j * U, (j + 1) * U)
        for t in range(T):
            # staging: row n's K halves, below part first, in 16-byte chunks
            kin = H if l > 0 else 0
            hs = np.zeros((B, kin + H), dtype=np.int64)

            def source(n, k):
                if k < kin:
                    return ("mem", l - 1, t, n, k)
                if t == 0:
                    return ("h0", l, n, k - kin)
                return ("mem", l, t - 1, n, k - kin)

            def read(src):
                return h0[src[1], src[2], src[3]] if src[0] == "h0" else mem[src[1:]]

            chunks = [(n, q) for n in range(B) for q in range((kin + H) // CHUNK)]
            pending = chunks
            while True:
                for n, q in pending:  # cp.async: element by element, racing the producers
                    for e in range(CHUNK):
                        hs[n, q * CHUNK + e] = read(source(n, q * CHUNK + e))
                        yield
                missing = []
                for n, q in chunks:
                    if exempt_h0 and t == 0 and q * CHUNK >= kin:
                        continue
                    vals = hs[n, q * CHUNK:(q + 1) * CHUNK]
                    seen = vals if check_every_half else vals[:2]
                    if (seen == SENTINEL).any():
                        missing.append((n, q))
                if not missing:
                    break
                pending = missing
                yield
            # compute, then store two halves (one 32-bit word) at a time
            for n in range(B):
                raw = cell(l, t, list(hs[n]), units, force_sentinel)
                vals = [canon(v) if canonicalise else v for v in raw]
                for i in range(0, U, 2):
                    mem[l, t, n, units[i]] = vals[i]
                    mem[l, t, n, units[i + 1]] = vals[i + 1]
                    yield

    live = [cta(l, j) for l in range(L) for j in range(CTAS)]
    for _ in range(budget):
        if not live:
            return mem
        g = rng.choice(live)
        try:
            next(g)
        except StopIteration:
            live.remove(g)
    return None


def _h0(seed, with_sentinel=False):
    h0 = np.random.default_rng(seed).integers(0, 1 << 16, (L, B, H))
    if with_sentinel:
        h0[:, 0, 0] = SENTINEL  # a caller's h0 may hold any pattern, the sentinel too
    return h0


@pytest.mark.parametrize("force_sentinel", [False, True])
def test_every_interleaving_gives_the_sequential_result(force_sentinel):
    for seed in range(40):
        h0 = _h0(seed, with_sentinel=seed % 2 == 1)
        got = run_protocol(seed, h0=h0, force_sentinel=force_sentinel)
        assert got is not None, f"seed {seed}: no progress"
        assert np.array_equal(got, reference(h0, force_sentinel)), f"seed {seed}"


def test_without_the_fill_a_consumer_reads_an_earlier_calls_values():
    h0 = _h0(1)
    stale = reference(_h0(2), False)  # the previous call's sequences
    bad = [s for s in range(20)
           if not np.array_equal(run_protocol(s, h0=h0, fill=False, stale=stale),
                                 reference(h0, False))]
    assert bad


def test_without_canonicalisation_a_sentinel_valued_h_hangs():
    assert run_protocol(0, h0=_h0(0), force_sentinel=True, canonicalise=False,
                        budget=100_000) is None


def test_checking_part_of_a_chunk_reads_unwritten_halves():
    h0 = _h0(3)
    bad = [s for s in range(30)
           if not np.array_equal(run_protocol(s, h0=h0, check_every_half=False),
                                 reference(h0, False))]
    assert bad


def test_an_h0_holding_the_sentinel_hangs_unless_step_zero_skips_it():
    h0 = _h0(4, with_sentinel=True)
    assert run_protocol(0, h0=h0, exempt_h0=False, budget=100_000) is None
    assert np.array_equal(run_protocol(0, h0=h0), reference(h0, False))
