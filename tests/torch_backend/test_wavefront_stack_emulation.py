"""The reverse-wavefront backward kernel's index arithmetic and flag protocol,
emulated on the CPU (no GPU here).

`emulate` walks `backward_stack_body` (csrc/wavefront.cu) statement by
statement in numpy, float64: the plan's numbers, each warp's weight
fragments (the mma A layout: lane -> rows lane/4 (+8), gate-column pairs
2*(lane%4) (+8); slots 0-15 W_hh, 16-31 W_ih above layer 0), the staging
walker into `ds`, the k-tile loop, the partial sums (dh and the layer
below's dy), the dy hand-off, the pointwise step, dcs, the flags. The CTAs run one step at a time in a
random order that the flags allow (a CTA whose wait is not met yet is put
back), with every global dgates and dy hand-off poisoned with NaN until
written, so a read
that the waits do not order after its write shows up as NaN (or a
deadlock as no runnable CTA). The result must equal
`stack_recurrence_reference` (the kernel's contract, which
test_torch_wavefront_training.py checks against autograd). What this
cannot check: the hardware's semantics (mma, ldmatrix, cp.async, the
memory model), which the GPU tests and bench/bench_wavefront.py grad
check for this kernel.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from rnnfuse.backends.torch import wavefront

K_WARPS, K_THREADS, K_UNITS, K_CHUNK, K_MAX_KT, K_HS_PAD = 8, 256, 16, 16, 32, 8
K_MAX_LAYERS, K_FLAG_STRIDE = 8, 256


def plan(L, H, B, sms=132, smem=232448, variant=0):
    """PlanBackwardStack (wavefront_plan.h), the numbers the kernel reads:
    the asked variant's layout, else the next simpler one that fits (2 ->
    1 -> 0; variant 2 only where a group has more than 16 rows)."""
    per_group = (H + K_UNITS - 1) // K_UNITS
    assert L * per_group <= sms and (4 * H <= 2048 or L == 1)
    groups_max = min(sms // (L * per_group), K_FLAG_STRIDE // per_group)
    want = (B + groups_max - 1) // groups_max
    rows = (want + 7) // 8 * 8
    groups = (B + rows - 1) // rows
    kt = (4 * H + 127) // 128
    r16 = lambda n: (n + 15) // 16 * 16  # noqa: E731
    for v in range(min(max(variant, 0), 2), -1, -1):
        chunk = 2 * K_CHUNK if v == 2 else K_CHUNK
        if v == 2 and rows <= K_CHUNK:
            continue
        part_bufs = 1 if v == 0 else 2
        rest = (part_bufs * r16(K_WARPS * chunk * 36 * 4) + r16(rows * K_UNITS * 4)
                + r16(rows * 4))
        for ds_bufs in ((2, 1) if rows > chunk else (1,)):
            total = ds_bufs * r16(chunk * (128 * kt + 8) * 2) + rest
            if total <= smem:
                return dict(per_group=per_group, groups=groups, rows=rows,
                            ctas_per_layer=groups * per_group, kt=kt, kpad=128 * kt,
                            ds_bufs=ds_bufs, variant=v, chunk=chunk, smem=total)
    raise AssertionError("the plan refuses: shared memory")


def offsets(L, H, input_size):
    """PlanOffsets for an LSTM: (w_ih, w_hh) element offsets per layer."""
    w, out = 0, []
    for l in range(L):
        n = input_size if l == 0 else H
        out.append((w, w + 4 * H * n))
        w += 4 * H * n + 4 * H * H
    return out


K_HALF = K_MAX_KT // 2


class Cta:
    """One CTA's registers and shared memory, and where it is in its loop."""

    def __init__(self, a, cta):
        self.a = a
        L, H, B = a["L"], a["H"], a["B"]
        self.l = cta // a["ctas_per_layer"]
        within = cta % a["ctas_per_layer"]
        self.s, self.j = within // a["per_group"], within % a["per_group"]
        self.top = self.l == L - 1
        self.dual = self.l > 0
        self.u0, self.row0 = self.j * K_UNITS, self.s * a["rows"]
        self.rows = min(a["rows"], B - self.row0)
        assert self.rows >= 1
        self.kt, self.KS = a["kt"], a["kpad"] + K_HS_PAD
        G4 = 4 * H
        # The weight fragments (slot i of wa), then each slot's A tile (16 x 16).
        P = a["params"]
        w_ih, w_hh = offsets(L, H, a["input_size"])[self.l]
        self.tiles = np.zeros((K_MAX_KT, K_WARPS, 16, 16))
        for warp in range(K_WARPS):
            for i in range(K_MAX_KT):
                second = self.dual and i >= K_HALF
                jt = i - K_HALF if second else i
                base = w_ih if second else w_hh
                for lane in range(32):
                    for q in range(4):
                        r = (lane >> 2) + (8 if q & 1 else 0)
                        k = (warp * self.kt + jt) * 16 + (lane & 3) * 2 + (8 if q & 2 else 0)
                        lo = hi = 0.0
                        if jt < self.kt and self.u0 + r < H and k < G4:
                            off = base + k * H + self.u0 + r
                            lo, hi = P[off], P[off + H]
                        # mma A fragment: element (r, k % 16) low half, (r, k % 16 + 1) high.
                        col = (lane & 3) * 2 + (8 if q & 2 else 0)
                        self.tiles[i, warp, r, col] = lo
                        self.tiles[i, warp, r, col + 1] = hi
        self.ds = np.zeros((a["ds_bufs"], K_CHUNK, self.KS))
        self.dcs = np.zeros((self.rows, K_UNITS))
        if a["variant"] > 0:  # the pipelined body's shared memory, race-checked
            R = a["chunk"]
            self.sds = Tracked((a["ds_bufs"], R, self.KS))
            self.spart = Tracked((2, K_WARPS, R, 36))
            self.sdcs = Tracked((self.rows, K_UNITS))
            self.sdcs.write((slice(None), slice(None)), INIT, 0, 0.0)
            self.epoch = 1  # the barrier after the initialisation
            self.groups = {}  # cp.async groups in flight, per thread: [[(idx, value)], ...]
        lens = a["lengths"]
        self.lens = [min(int(lens[self.row0 + n]) if lens is not None else a["T"], a["T"])
                     for n in range(self.rows)]
        self.t = a["T"] - 1  # the next step to run (down to -1)

    def flag_base(self, layer):
        return layer * K_FLAG_STRIDE + self.s * self.a["per_group"]

    def ready(self, flags):
        """warp 0's wait of step self.t (True: it would pass)."""
        a, t, steps = self.a, self.t, self.a["T"]
        product, needs_dy = t < steps - 1, (not self.top) and t >= 0
        if product:
            b = self.flag_base(self.l)
            if any(flags[b + i] < steps - 1 - t for i in range(a["per_group"])):
                return False
        if needs_dy and flags[self.flag_base(self.l + 1) + self.j] < steps - t + 1:
            return False
        return True

    def step(self, flags, g):
        """Runs step self.t (its wait met) and publishes."""
        if self.a["variant"] > 0:
            return self.step_pipelined(flags, g)
        a, t = self.a, self.t
        H, steps = a["H"], a["T"]
        G4, l = 4 * H, self.l
        product = t < steps - 1
        dg = g["dgates"]  # [L][T][B][4H], NaN until written
        dyl = g["dyl"]    # [L-1][T][B][H], NaN until written
        per_row = G4 // 8
        nchunks = (self.rows + K_CHUNK - 1) // K_CHUNK
        def stage(c, b):
            """The walker, thread by thread (each thread's items)."""
            n0 = c * K_CHUNK
            nc = min(K_CHUNK, self.rows - n0)
            for tid in range(K_THREADS):
                st_n0, st_q0 = divmod(tid, per_row)
                st_dn, st_dq = divmod(K_THREADS, per_row)
                n, q = st_n0, st_q0
                while n < nc:
                    self.ds[b, n, q * 8:q * 8 + 8] = dg[l, t + 1, self.row0 + n0 + n,
                                                        q * 8:q * 8 + 8]
                    q += st_dq
                    n += st_dn
                    if q >= per_row:
                        q -= per_row
                        n += 1

        bufs = a["ds_bufs"]
        if product:
            stage(0, 0)
        for c in range(nchunks):
            n0 = c * K_CHUNK
            nc = min(K_CHUNK, self.rows - n0)
            part = np.zeros((K_WARPS, K_CHUNK, 32))
            b = c & 1 if bufs > 1 else 0
            if product:
                if bufs > 1 and c + 1 < nchunks:
                    stage(c + 1, (c + 1) & 1)  # lands while chunk c multiplies
                elif bufs == 1 and c > 0:
                    stage(c, 0)
                two = nc > 8
                for warp in range(K_WARPS):
                    acc0 = np.zeros((K_UNITS, K_CHUNK))
                    acc1 = np.zeros((K_UNITS, K_CHUNK))

                    def mma(acc, i, kk):
                        bt = self.ds[b, :, kk:kk + 16]  # ldmatrix x4: batch rows 0-15
                        acc[:, :8] += self.tiles[i, warp] @ bt[:8].T
                        if two:
                            acc[:, 8:] += self.tiles[i, warp] @ bt[8:].T

                    for jt in range(K_HALF):
                        if jt < self.kt:
                            kk = (warp * self.kt + jt) * 16
                            mma(acc0, jt, kk)
                            if self.dual:
                                mma(acc1, K_HALF + jt, kk)
                        if not self.dual and K_HALF + jt < self.kt:
                            mma(acc0, K_HALF + jt, (warp * self.kt + K_HALF + jt) * 16)
                    part[warp, :, :16] = acc0.T  # part[warp][col][row]
                    if self.dual:
                        part[warp, :, 16:] = acc1.T
            for tid in range(K_THREADS):
                n, u = divmod(tid, K_UNITS)
                nl, ug = n0 + n, self.u0 + u
                nb = self.row0 + nl
                if not (n < nc and ug < H):
                    continue
                rec = 0.0
                if product:
                    rec = part[:, n, u].sum()
                    below = part[:, n, 16 + u].sum()
                    assert np.isfinite(rec), (l, t, nb, ug, "da read before written")
                    if self.dual:
                        dyl[l - 1, t + 1, nb, ug] = below
                if t < 0:
                    g["dh0"][l, nb, ug] = rec
                    continue
                length = self.lens[nl]
                da = [0.0] * 4
                carry = 0.0
                if t < length:
                    if self.top:
                        dh = rec + g["dy"][t, nb, ug]
                    else:
                        dh = rec + dyl[l, t, nb, ug]
                        assert np.isfinite(dh), (l, t, nb, ug, "dy read before written")
                    dc = self.dcs[nl, u]
                    if t == length - 1:
                        dh += g["dhy"][l, nb, ug]
                        dc = g["dcy"][l, nb, ug]
                    gp = g["gates"][l, t, nb]
                    ig, fg, gg, og = gp[ug], gp[H + ug], gp[2 * H + ug], gp[3 * H + ug]
                    ct = g["cseq"][l, t, nb, ug]
                    cp = g["cseq"][l, t - 1, nb, ug] if t > 0 else g["c0"][l, nb, ug]
                    tc = np.tanh(ct)
                    dc += dh * og * (1 - tc * tc)
                    da = [dc * gg * ig * (1 - ig), dc * cp * fg * (1 - fg),
                          dc * ig * (1 - gg * gg), dh * tc * og * (1 - og)]
                    carry = dc * fg
                self.dcs[nl, u] = carry
                for gi in range(4):
                    dg[l, t, nb, gi * H + ug] = da[gi]
                if t == 0:
                    g["dc0"][l, nb, ug] = carry
        flags[self.flag_base(l) + self.j] = steps - t
        self.t -= 1


    # --- backward_stack_pipelined_body (variants 1 and 2) -------------------

    def barrier(self):
        """__syncthreads: every access after it is ordered after every one before."""
        self.epoch += 1

    def wait_groups(self, tid, keep):
        """cp.async.wait_group `keep` of thread tid: its older groups land now."""
        groups = self.groups.get(tid, [])
        while len(groups) > keep:
            for idx in groups.pop(0):
                self.sds.land(idx, tid, self.epoch)

    def step_pipelined(self, flags, g):
        """Step self.t of backward_stack_pipelined_body, barrier interval by
        barrier interval (`self.epoch`); every shared access is race-checked
        (`Tracked`), warps' accesses as the warp (ldmatrix, fragment stores),
        threads' as the thread. `self.mutate` names one deliberate bug."""
        a, t, mut = self.a, self.t, self.a.get("mutate", "")
        H, steps, l = a["H"], a["T"], self.l
        G4, R, bufs = 4 * H, a["chunk"], a["ds_bufs"]
        kper = R // 16
        product = t < steps - 1
        dg, dyl = g["dgates"], g["dyl"]
        per_row = G4 // 8
        nchunks = (self.rows + R - 1) // R
        self.last_global = -1  # latest interval of a global store by a thread other than 0
        self.barrier()  # the wait's __syncthreads

        def stage(c, b):
            n0 = c * R
            nc = min(R, self.rows - n0)
            for tid in range(K_THREADS):
                st_n0, st_q0 = divmod(tid, per_row)
                st_dn, st_dq = divmod(K_THREADS, per_row)
                n, q = st_n0, st_q0
                group = []
                while n < nc:
                    idx = (b, n, slice(q * 8, q * 8 + 8))
                    self.sds.write(idx, tid, self.epoch,
                                   dg[l, t + 1, self.row0 + n0 + n, q * 8:q * 8 + 8], landed=False)
                    group.append(idx)
                    q += st_dq
                    n += st_dn
                    if q >= per_row:
                        q -= per_row
                        n += 1
                self.groups.setdefault(tid, []).append(group)  # cp.async.commit_group

        def load_pre(c):
            """Chunk c's pointwise inputs, per thread and row r (zeros where not read)."""
            pre = {}
            for tid in range(K_THREADS):
                pn, pu = divmod(tid, K_UNITS)
                ug = self.u0 + pu
                for r in range(kper):
                    nl = c * R + pn + 16 * r
                    nb = self.row0 + nl
                    v = dict.fromkeys(("ig", "fg", "gg", "og", "ct", "cp", "dy", "dhy", "dcy"),
                                      0.0)
                    if t >= 0 and c < nchunks and nl < self.rows and ug < H and t < self.lens[nl]:
                        gp = g["gates"][l, t, nb]
                        if self.top:
                            dyv = g["dy"][t, nb, ug]
                        else:
                            dyv = dyl[l, t, nb, ug]
                            assert np.isfinite(dyv), (l, t, nb, ug, "dy read before written")
                        last = t == self.lens[nl] - 1
                        v = dict(ig=gp[ug], fg=gp[H + ug], gg=gp[2 * H + ug], og=gp[3 * H + ug],
                                 ct=g["cseq"][l, t, nb, ug],
                                 cp=g["cseq"][l, t - 1, nb, ug] if t > 0 else g["c0"][l, nb, ug],
                                 dy=dyv, dhy=g["dhy"][l, nb, ug] if last else 0.0,
                                 dcy=g["dcy"][l, nb, ug] if last else 0.0)
                    pre[tid, r] = v
            return pre

        def products(c, b):
            nc = min(R, self.rows - c * R)
            pb = 0 if mut == "one_part" else c & 1
            for warp in range(K_WARPS):
                actor = WARP + warp
                acc0 = np.zeros((K_UNITS, R))
                acc1 = np.zeros((K_UNITS, R))

                def mma(acc, i, kk):
                    for h in range(R // 16):
                        if 16 * h < nc:  # ldmatrix x4: rows 16h .. 16h+15
                            bt = self.sds.read((b, slice(16 * h, 16 * h + 16), slice(kk, kk + 16)),
                                               actor, self.epoch)
                            acc[:, 16 * h:16 * h + 8] += self.tiles[i, warp] @ bt[:8].T
                            if 16 * h + 8 < nc:
                                acc[:, 16 * h + 8:16 * h + 16] += self.tiles[i, warp] @ bt[8:].T

                for jt in range(K_HALF):
                    if jt < self.kt:
                        kk = (warp * self.kt + jt) * 16
                        mma(acc0, jt, kk)
                        if self.dual:
                            mma(acc1, K_HALF + jt, kk)
                    if not self.dual and K_HALF + jt < self.kt:
                        mma(acc0, K_HALF + jt, (warp * self.kt + K_HALF + jt) * 16)
                # float2 (dh, dy below) of unit u at [col][2u], every n-tile's columns.
                tile = np.zeros((R, 36))
                tile[:, 0:32:2], tile[:, 1:32:2] = acc0.T, acc1.T
                self.spart.write((pb, warp, slice(None), slice(0, 32)), actor, self.epoch,
                                 tile[:, :32])

        def pointwise(c, pre):
            pb = 0 if mut == "one_part" else c & 1
            for tid in range(K_THREADS):
                pn, pu = divmod(tid, K_UNITS)
                ug = self.u0 + pu
                for r in range(kper):
                    n = pn + 16 * r
                    nl = c * R + n
                    nb = self.row0 + nl
                    if nl >= self.rows or ug >= H:
                        continue
                    rec = 0.0
                    if product:
                        v = self.spart.read((pb, slice(None), n, slice(2 * pu, 2 * pu + 2)), tid,
                                            self.epoch)
                        rec, below = v[:, 0].sum(), v[:, 1].sum()
                        assert np.isfinite(rec), (l, t, nb, ug, "da read before written")
                        if self.dual:
                            dyl[l - 1, t + 1, nb, ug] = below
                            self.global_store(tid)
                    if t < 0:
                        g["dh0"][l, nb, ug] = rec
                        self.global_store(tid)
                        continue
                    length = self.lens[nl]
                    p = pre[tid, r]
                    da = [0.0] * 4
                    carry = 0.0
                    if t < length:
                        dh = rec + p["dy"]
                        dc = self.sdcs.read((nl, pu), tid, self.epoch)
                        if t == length - 1:
                            dh += p["dhy"]
                            dc = p["dcy"]
                        tc = np.tanh(p["ct"])
                        dc += dh * p["og"] * (1 - tc * tc)
                        da = [dc * p["gg"] * p["ig"] * (1 - p["ig"]),
                              dc * p["cp"] * p["fg"] * (1 - p["fg"]),
                              dc * p["ig"] * (1 - p["gg"] * p["gg"]),
                              dh * tc * p["og"] * (1 - p["og"])]
                        carry = dc * p["fg"]
                    self.sdcs.write((nl, pu), tid, self.epoch, carry)
                    for gi in range(4):
                        dg[l, t, nb, gi * H + ug] = da[gi]
                    if t == 0:
                        g["dc0"][l, nb, ug] = carry
                    self.global_store(tid)

        cur = None
        if product and bufs > 1:
            stage(0, 0)
        for i in range(nchunks + 1):
            if bufs == 1 and i > 0 and mut != "no_r":
                self.barrier()  # R_i
            if product and bufs == 1 and i < nchunks:
                stage(i, 0)
            nxt = load_pre(i)
            if bufs == 1 and i > 0:
                pointwise(i - 1, nxt if mut == "pre_next" else cur)
            if product and i < nchunks:
                for tid in range(K_THREADS):
                    self.wait_groups(tid, 0)
            if mut == "stage_early" and product and bufs > 1 and i + 1 < nchunks:
                stage(i + 1, (i + 1) & 1)  # before S_i: races products i-1
            if not (mut == "no_s" and i > 0):
                self.barrier()  # S_i
            if (mut != "stage_early" and product and bufs > 1 and i + 1 < nchunks):
                stage(i + 1, (i + 1) & 1)
            if product and i < nchunks:
                products(i, i & 1 if bufs > 1 else 0)
            if bufs > 1 and i > 0:
                pointwise(i - 1, nxt if mut == "pre_next" else cur)
            cur = nxt
        if bufs > 1 and mut != "no_final":
            self.barrier()
        # thread 0 publishes: every other thread's global stores must be behind a barrier.
        assert self.last_global < self.epoch, (l, t, "a global store races the publish")
        flags[self.flag_base(l) + self.j] = steps - t
        self.t -= 1

    def global_store(self, tid):
        if tid != 0:
            self.last_global = max(self.last_global, self.epoch)


INIT, WARP, MANY = -1, 1000, -2  # actors: the initialisation, warp w (WARP + w), readers


class Tracked:
    """A shared-memory array with a race check at barrier granularity: two
    accesses to one element by different actors (threads, or warps for
    ldmatrix and fragment stores), at least one a write, must be in
    different barrier intervals (epochs), the write's interval ending before
    the read's; a cp.async write lasts from its issue to its thread's wait."""

    def __init__(self, shape):
        self.v = np.zeros(shape)
        self.w_actor = np.full(shape, INIT)
        self.w_end = np.zeros(shape, dtype=np.int64)  # the interval the write is done in
        self.r_epoch = np.full(shape, -1, dtype=np.int64)
        self.r_actor = np.full(shape, INIT)

    def read(self, idx, actor, epoch):
        ok = (self.w_actor[idx] == actor) | (self.w_end[idx] < epoch)
        assert np.all(ok), ("race: a read of shared memory that a barrier does not order after "
                            "its write", idx, actor, epoch)
        same = (self.r_epoch[idx] == epoch) & (self.r_actor[idx] != actor)
        self.r_actor[idx] = np.where(same, MANY, actor)
        self.r_epoch[idx] = epoch
        return np.array(self.v[idx], copy=True)

    def write(self, idx, actor, epoch, value, landed=True):
        war = (self.r_epoch[idx] < epoch) | (self.r_actor[idx] == actor)
        waw = (self.w_end[idx] < epoch) | (self.w_actor[idx] == actor)
        assert np.all(war) and np.all(waw), ("race: a shared-memory write in the interval of "
                                             "another actor's access", idx, actor, epoch)
        self.v[idx] = value
        self.w_actor[idx] = actor
        self.w_end[idx] = epoch if landed else np.iinfo(np.int64).max

    def land(self, idx, actor, epoch):
        """Thread `actor`'s cp.async into idx is complete in this interval."""
        self.w_end[idx] = epoch


def _case(shape, seed_shift=0):
    """A stack's saved forward and upstream gradients, and the reference."""
    layers, units, batch, steps, inputs, with_lengths = shape
    gen = torch.Generator().manual_seed(sum(shape) + seed_shift)
    mod = torch.nn.LSTM(inputs, units, layers).double()
    params = wavefront.flat_params([w.detach() for w in mod._flat_weights])
    rand = lambda *s, scale=1.0: torch.randn(*s, generator=gen, dtype=torch.float64) * scale  # noqa: E731
    x = rand(steps, batch, inputs)
    h0, c0 = rand(layers, batch, units, scale=0.5), rand(layers, batch, units, scale=0.5)
    lengths = None
    if with_lengths:
        lengths = torch.randint(1, steps + 1, (batch,), generator=gen)
        lengths[0] = steps
    _, _, _, (_, gates, cseq) = wavefront.reference_forward_saving(x, params, h0, c0, lengths)
    dy, dhy, dcy = rand(steps, batch, units), rand(layers, batch, units), rand(layers, batch, units)
    lens = lengths.to(torch.int32) if lengths is not None else None
    args = (params, inputs, gates, cseq, c0, dy, dhy, dcy, lens)
    return args, wavefront.stack_recurrence_reference(*args)


def emulate(params, input_size, gates, cseq, c0, dy, dhy, dcy, lengths, *, seed=0, sms=132,
            smem=232448, variant=0, mutate=""):
    L, T, B, H = cseq.shape
    p = plan(L, H, B, sms, smem, variant)
    a = dict(L=L, H=H, B=B, T=T, input_size=input_size, params=params.numpy(), mutate=mutate,
             lengths=None if lengths is None else lengths.numpy(), **p)
    g = dict(dgates=np.full((L, T, B, 4 * H), np.nan), dh0=np.full((L, B, H), np.nan),
             dyl=np.full((max(L - 1, 0), T, B, H), np.nan),
             dc0=np.full((L, B, H), np.nan), gates=gates.numpy(), cseq=cseq.numpy(),
             c0=c0.numpy(), dy=dy.numpy(), dhy=dhy.numpy(), dcy=dcy.numpy())
    ctas = [Cta(a, i) for i in range(L * p["ctas_per_layer"])]
    flags = np.zeros(K_MAX_LAYERS * K_FLAG_STRIDE + 1, dtype=np.int64)
    rng = random.Random(seed)
    live = list(ctas)
    while live:
        rng.shuffle(live)
        runnable = [c for c in live if c.ready(flags)]
        assert runnable, "deadlock: no CTA's wait is met"
        c = runnable[0]
        c.step(flags, g)
        if c.t < -1:
            live.remove(c)
    return (torch.from_numpy(g["dgates"]), torch.from_numpy(g["dh0"]),
            torch.from_numpy(g["dc0"]))


@pytest.mark.parametrize("shape", [
    # layers, units, batch, steps, inputs, lengths, SMs (the plan's groups)
    (1, 8, 3, 4, 5, False, 132),
    (2, 24, 5, 4, 3, True, 132),     # units not a multiple of 16: a partial CTA
    (3, 16, 20, 3, 4, True, 3),      # one group of 20 rows: two chunks, 16 + 4 rows
    (3, 16, 20, 3, 4, True, 6),      # two groups of 16 and 4 rows
    (2, 40, 3, 1, 2, False, 132),    # one step: only the hand-offs, then dh0
    (4, 8, 2, 3, 8, True, 132),
    (2, 8, 40, 3, 3, True, 2),       # 3 chunks a group: both staging buffers in turn
    (2, 24, 33, 2, 3, False, 4),     # 3 chunks, the last of 1 row, a partial CTA
    (2, 24, 33, 3, 3, True, 4, 27000),  # 3 chunks through ONE staging buffer (shared memory)
])
def test_the_kernel_emulation_matches_the_stack_recurrence(shape):
    layers, units, batch, steps, inputs, with_lengths, sms, *smem = shape
    if smem:
        assert plan(layers, units, batch, sms, *smem)["ds_bufs"] == 1
    args, want = _case(shape[:6], seed_shift=sum(shape[6:]))
    for seed in range(2):
        got = emulate(*args, seed=seed, sms=sms, smem=smem[0] if smem else 232448)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_emulated_plan_is_the_librarys(request):
    from rnnfuse.backends.cuda import library

    try:  # the host's plans: a stand-in cubin is enough (conftest's wavefront_host)
        lib = library.load(request.getfixturevalue("wavefront_host"))
    except Exception as exc:  # noqa: BLE001 - no compiler here: test_wavefront_build says so
        pytest.skip(f"the library does not build here: {exc}")
    for L, H, B, sms in [(4, 512, 64, 132), (2, 512, 64, 132), (1, 1024, 256, 132),
                         (3, 24, 5, 132), (8, 256, 64, 132), (1, 8, 1, 132), (2, 8, 40, 2),
                         (4, 512, 256, 132), (1, 1024, 64, 132), (3, 16, 20, 6),
                         (2, 24, 33, 4)]:
        p = plan(L, H, B, sms)
        got = lib.backward_stack_plan(L, H, B, 10, sms=sms, smem=library.H200["smem"])
        assert got["rows"] == p["rows"] and got["ctas"] == L * p["ctas_per_layer"]
        assert got["smem"] == p["smem"]
    one = lib.backward_stack_plan(2, 24, 33, 10, sms=4, smem=27000)
    assert one["smem"] == plan(2, 24, 33, 4, 27000)["smem"] <= 27000
    # The variants: the same rows and CTAs, their own shared memory, or the fallback.
    shapes = [(4, 512, 64, 132, None), (2, 512, 64, 132, None), (1, 1024, 256, 132, None),
              (8, 256, 64, 132, None), (1, 8, 1, 132, None), (2, 8, 40, 2, None),
              (4, 512, 256, 132, None), (1, 1024, 64, 132, None), (3, 16, 20, 6, None),
              (2, 24, 33, 4, 27000), (2, 24, 33, 4, 45000), (2, 24, 33, 4, 90000),
              (2, 24, 70, 4, None), (3, 16, 20, 3, None)]
    for (L, H, B, sms, smem), variant in itertools.product(shapes, (1, 2)):
        smem = smem or library.H200["smem"]
        p = plan(L, H, B, sms, smem, variant)
        got = lib.backward_stack_plan(L, H, B, 10, sms=sms, smem=smem, variant=variant)
        assert (got["variant"], got["chunk"], got["smem"], got["rows"]) == (
            p["variant"], p["chunk"], p["smem"], p["rows"]), (L, H, B, sms, smem, variant)
    # At the headline: variant 1 as asked (two part buffers, +18 KiB), variant 2's
    # 32-row chunks through one staging buffer.
    h200 = library.H200
    assert lib.backward_stack_plan(4, 512, 64, 1000, **h200, variant=1) == dict(
        ctas=128, smem=172800, rows=64, variant=1, chunk=16)
    assert lib.backward_stack_plan(4, 512, 64, 1000, **h200, variant=2) == dict(
        ctas=128, smem=209664, rows=64, variant=2, chunk=32)
    assert lib.backward_stack_plan(4, 512, 64, 1000, **h200) == dict(ctas=128, smem=154368,
                                                                      rows=64)
    assert "variant is 0, 1 or 2, not 3" in lib.backward_stack_plan(4, 512, 64, 10, **h200,
                                                                    variant=3)


PIPELINED = [
    # layers, units, batch, steps, inputs, lengths, SMs, shared bytes, variant,
    # then what the plan must choose: variant, rows a chunk, staging buffers
    (3, 16, 20, 3, 4, True, 3, 232448, 1, (1, 16, 2)),   # 2 chunks, 16 + 4 rows
    (3, 16, 20, 3, 4, True, 3, 232448, 2, (2, 32, 1)),   # one 32-row chunk of 20 rows
    (2, 8, 40, 3, 3, True, 2, 232448, 1, (1, 16, 2)),    # 3 chunks: both buffers in turn
    (2, 8, 40, 3, 3, True, 2, 232448, 2, (2, 32, 2)),    # 32 + 8 rows
    (2, 24, 70, 2, 3, True, 4, 232448, 2, (2, 32, 2)),   # 3 chunks of 32, 32, 6: a partial CTA
    (2, 24, 33, 3, 3, True, 4, 45000, 1, (1, 16, 1)),    # 3 chunks through ONE staging buffer
    (2, 24, 33, 3, 3, True, 4, 90000, 2, (2, 32, 1)),    # 2 chunks through one buffer
    (2, 24, 33, 3, 3, True, 4, 27000, 1, (0, 16, 1)),    # variant 1 does not fit: variant 0
    (1, 8, 3, 4, 5, False, 132, 232448, 2, (1, 16, 1)),  # 8 rows: no 32-row chunks
    (2, 40, 3, 1, 2, False, 132, 232448, 1, (1, 16, 1)),  # one step
    (4, 8, 2, 3, 8, True, 132, 232448, 1, (1, 16, 1)),
]


@pytest.mark.parametrize("case", PIPELINED)
def test_the_pipelined_variants_emulation_matches_the_stack_recurrence(case):
    *shape, sms, smem, variant, chosen = case
    layers, units, batch = shape[:3]
    p = plan(layers, units, batch, sms, smem, variant)
    assert (p["variant"], p["chunk"], p["ds_bufs"]) == chosen
    args, want = _case(tuple(shape))
    for seed in range(2):
        got = emulate(*args, seed=seed, sms=sms, smem=smem, variant=variant)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mutate, case", [
    ("one_part", PIPELINED[2]),   # one part buffer: chunk c+1's products race chunk c's reads
    ("no_s", PIPELINED[3]),       # no barrier between the staging wait and the products
    ("no_final", PIPELINED[4]),   # the last chunk's stores race the publish
    ("no_r", PIPELINED[5]),       # one staging buffer refilled while the products read it
    ("pre_next", PIPELINED[0]),   # the pointwise reads the next chunk's inputs
    ("stage_early", PIPELINED[2]),  # chunk i+1 staged before S_i: races chunk i-1's products
])
def test_a_broken_pipelined_protocol_fails_the_emulation(mutate, case):
    *shape, sms, smem, variant, chosen = case
    args, want = _case(tuple(shape))
    with pytest.raises(AssertionError):
        got = emulate(*args, sms=sms, smem=smem, variant=variant, mutate=mutate)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
