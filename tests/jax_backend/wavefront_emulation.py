"""The wavefront kernel's FFI targets, emulated in jax.numpy for the CPU.

`Emulation` stands in for `rnnfuse.backends.jax.wavefront.ffi_call`: it
takes what the binding passes to `jax.ffi.ffi_call` (target, result
shapes, operands, attributes), checks every operand and result against
the handlers' contracts (csrc/jax_wavefront_*.cc), records the call, and
returns what the kernel returns, computed from the operands alone:

- the forwards: cuDNN's equations (tests/cudnn_reference.py, the NumPy
  reference the TensorFlow and torch packing tests use, here with
  `xp=jax.numpy`) on the projected layer-0 input (layer 0's W_ih is read
  as the identity: the kernel never reads it), h rounded to the element
  type between steps as the kernel writes it; the saving forward also
  returns the gates, c (a GRU's r, z, n, W_hn h + b_hn and h_{t-1}) and
  the layers' sequences at the workspace's end, as
  rnnfuse/backends/torch/wavefront.py's `reference_forward_saving` does;
- the backwards: that module's `recurrence_reference` and
  `stack_recurrence_reference`, step by step in float32.

Everything is jax.numpy, so the emulation runs inside jit like the real
call (no host callback).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cudnn_reference import cudnn_rnn
from rnnfuse.backends.jax import wavefront

GATES = {0: 4, 1: 3}


def _check(cond, message):
    if not cond:
        raise AssertionError(message)


def _kind(gru) -> str:
    return "gru" if int(gru) else "lstm"


def _alive(lengths, steps, batch):
    lens = jnp.full((batch,), steps, jnp.int32) if lengths.shape[0] == 0 else lengths
    return lens, jnp.arange(steps)[:, None] < lens[None, :]


def _views(params, layers, units, input_size, gates):
    out, off = [], 0
    for layer in range(layers):
        n = input_size if layer == 0 else units
        out.append((params[off: off + gates * units * n].reshape(gates * units, n),
                    params[off + gates * units * n: off + gates * units * (n + units)].reshape(
                        gates * units, units)))
        off += gates * units * (n + units)
    return out, off


def forward(xproj, params, h0, c0, lengths, *, gru, input_size, save):
    """The forward targets' results (y, hy, cy, workspace tail or None, gates, cseq)."""
    kind = _kind(gru)
    g = GATES[int(gru)]
    steps, batch, gh = xproj.shape
    layers, _, units = h0.shape
    dt = xproj.dtype
    lens, alive = _alive(lengths, steps, batch)
    views, nb = _views(params, layers, units, input_size, g)
    f32 = jnp.float32
    inp = xproj
    seqs, hys, cys, gates_all, cseq_all = [], [], [], [], []
    for layer, (w_ih, w_hh) in enumerate(views):
        b = params[nb + 2 * gh * layer: nb + 2 * gh * (layer + 1)].astype(f32)
        b_ih, b_hh = b[:gh], b[gh:]
        if layer == 0:
            xp = inp.astype(f32) + b_ih  # projected already: the kernel adds the bias
        else:
            xp = inp.astype(f32) @ w_ih.astype(f32).T + b_ih
        h, hy = h0[layer], h0[layer]
        c = c0[layer].astype(f32) if kind == "lstm" else None
        cy = c0[layer] if kind == "lstm" else None
        outs, gts, cs = [], [], []
        for t in range(steps):
            hh = h.astype(f32) @ w_hh.astype(f32).T + b_hh
            if kind == "lstm":
                a_i, a_f, a_g, a_o = jnp.split(xp[t] + hh, 4, axis=1)
                i, f, gg, o = (jax.nn.sigmoid(a_i), jax.nn.sigmoid(a_f), jnp.tanh(a_g),
                               jax.nn.sigmoid(a_o))
                c = f * c + i * gg
                h_new = (o * jnp.tanh(c)).astype(dt)
                gts.append(jnp.concatenate([i, f, gg, o], axis=1))
                cs.append(c)
            else:
                xr, xz, xn = jnp.split(xp[t], 3, axis=1)
                hr, hz, hn = jnp.split(hh, 3, axis=1)
                r, z = jax.nn.sigmoid(xr + hr), jax.nn.sigmoid(xz + hz)
                n = jnp.tanh(xn + r * hn)
                h_new = ((1 - z) * n + z * h.astype(f32)).astype(dt)
                gts.append(jnp.concatenate([r, z, n, hn], axis=1))
                cs.append(h.astype(f32))
            a = alive[t][:, None]
            last = (t == lens - 1)[:, None]
            out = jnp.where(a, h_new, jnp.zeros_like(h_new))
            hy = jnp.where(last, h_new, hy)
            if kind == "lstm":
                cy = jnp.where(last, c.astype(dt), cy)
            outs.append(out)
            h = out
        seq = jnp.stack(outs)
        seqs.append(seq)
        hys.append(hy)
        cys.append(cy)
        gates_all.append(jnp.stack(gts))
        cseq_all.append(jnp.stack(cs))
        inp = seq
    y, hy = seqs[-1], jnp.stack(hys)
    cy = jnp.stack(cys) if kind == "lstm" else jnp.zeros((0,), dt)
    hseq = jnp.stack(seqs[:-1]) if layers > 1 else jnp.zeros((0, steps, batch, units), dt)
    return y, hy, cy, hseq, jnp.stack(gates_all), jnp.stack(cseq_all)


def inference_forward(xproj, params, h0, c0, lengths, *, gru, input_size):
    """The inference target through cudnn_reference (the shared NumPy
    reference, with jax.numpy): layer 0's W_ih read as the identity."""
    steps, batch, gh = xproj.shape
    eye = jnp.eye(gh, dtype=xproj.dtype).reshape(-1)
    params = jnp.concatenate([eye, params[gh * input_size:]])
    lens, _ = _alive(lengths, steps, batch)
    kind = _kind(gru)
    y, hy, cy = cudnn_rnn(jnp, xproj, h0, c0 if kind == "lstm" else None, params, lens, kind,
                          False)
    return y, hy, (cy if kind == "lstm" else jnp.zeros((0,), xproj.dtype))


def recurrence(w_hh, gates, cseq, c0, dy, dhy, dcy, lengths, *, gru, dtype=None):
    """One layer's backward recurrence (recurrence_reference); `dtype`: the
    element type where dy is not in it (the stack's float32 hand-off)."""
    f32 = jnp.float32
    steps, batch, units = dy.shape
    dt = dy.dtype if dtype is None else dtype
    lens, alive = _alive(lengths, steps, batch)
    if int(gru):
        w_r, w_z, w_n = jnp.split(w_hh.astype(f32), 3, axis=0)
        w = jnp.concatenate([w_r, w_z, jnp.zeros_like(w_n), w_n])
    else:
        w = w_hh.astype(f32)
    carry = jnp.zeros((batch, units), f32)
    rec = jnp.zeros_like(carry)
    dgates = [None] * steps
    for t in reversed(range(steps)):
        a = alive[t][:, None]
        last = (t == lens - 1)[:, None]
        if int(gru):
            dh = rec + dy[t].astype(f32) + carry + jnp.where(last, dhy.astype(f32), 0.0)
            r, z, n, hn = jnp.split(gates[t], 4, axis=1)
            dnx = dh * (1 - z) * (1 - n * n)
            da = jnp.concatenate([dnx * hn * r * (1 - r), dh * (cseq[t] - n) * z * (1 - z),
                                  dnx, dnx * r], axis=1)
            carry = jnp.where(a, dh * z, 0.0)
        else:
            dh = rec + dy[t].astype(f32) + jnp.where(last, dhy.astype(f32), 0.0)
            dc = jnp.where(last, dcy.astype(f32), carry)
            i, f, g, o = jnp.split(gates[t], 4, axis=1)
            c_prev = cseq[t - 1] if t > 0 else c0.astype(f32)
            tc = jnp.tanh(cseq[t])
            dc = dc + dh * o * (1 - tc * tc)
            da = jnp.concatenate([dc * g * i * (1 - i), dc * c_prev * f * (1 - f),
                                  dc * i * (1 - g * g), dh * tc * o * (1 - o)], axis=1)
            carry = jnp.where(a, dc * f, 0.0)
        da = jnp.where(a, da, 0.0).astype(dt)
        dgates[t] = da
        rec = da.astype(f32) @ w
    dh0 = rec + carry if int(gru) else rec
    return jnp.stack(dgates), dh0, (jnp.zeros((0,), f32) if int(gru) else carry)


def stack_recurrence(params, gates, cseq, c0, dy, dhy, dcy, lengths, *, input_size):
    """Every LSTM layer's recurrence (stack_recurrence_reference): dy of the
    layers below the top kept in float32."""
    layers, steps, batch, units = cseq.shape
    views, _ = _views(params, layers, units, input_size, 4)
    dgates, dh0, dc0 = [None] * layers, [None] * layers, [None] * layers
    grad = dy
    for layer in reversed(range(layers)):
        dgates[layer], dh0[layer], dc0[layer] = recurrence(
            views[layer][1], gates[layer], cseq[layer], c0[layer], grad, dhy[layer], dcy[layer],
            lengths, gru=0, dtype=dy.dtype)
        if layer > 0:
            # In float32, as the kernel hands it on; recurrence reads dy as float32.
            grad = dgates[layer].astype(jnp.float32) @ views[layer][0].astype(jnp.float32)
    return jnp.stack(dgates), jnp.stack(dh0), jnp.stack(dc0)


class Emulation:
    """`wavefront.ffi_call`'s stand-in (see the module docstring); `calls`
    lists (target, attributes) in trace order."""

    def __init__(self):
        self.calls = []

    def __call__(self, target, results, *operands, **attrs):
        _check(target in wavefront.TARGETS, f"unknown target {target}")
        for value in attrs.values():
            _check(isinstance(value, np.int32), f"{target}: attributes are int32, not {value!r}")
        self.calls.append((target, {k: int(v) for k, v in attrs.items()}))
        out = getattr(self, "_" + target.removeprefix("rnnfuse_wf_ffi_"))(*operands, **attrs)
        _check(len(out) == len(results), f"{target}: {len(results)} results, expected {len(out)}")
        for got, want in zip(out, results):
            if want.shape != got.shape or want.dtype != got.dtype:
                raise AssertionError(f"{target}: result {want.shape} {want.dtype} where the "
                                     f"handler writes {got.shape} {got.dtype}")
        return tuple(out)

    @staticmethod
    def _check_forward(xproj, params, h0, c0, lengths, gru, input_size):
        steps, batch, gh = xproj.shape
        layers, b, units = h0.shape
        _check(gh == GATES[int(gru)] * units and b == batch, "xproj and h0 disagree")
        _check(params.dtype == xproj.dtype == h0.dtype, "params and h0 in xproj's type")
        _check(c0.shape == (h0.shape if not int(gru) else (0,)), f"c0 {c0.shape}")
        _check(lengths.dtype == jnp.int32 and lengths.shape in ((0,), (batch,)), "lengths")
        return steps, batch, layers, units

    def _workspace(self, xproj, h0, hseq):
        steps, batch, _ = xproj.shape
        layers, _, units = h0.shape
        elem = jnp.dtype(xproj.dtype).itemsize
        words = wavefront.workspace_bytes(layers, units, batch, steps, elem) // elem
        flags = jnp.zeros((words - hseq.size,), xproj.dtype)
        return jnp.concatenate([flags, hseq.reshape(-1)])

    def _forward(self, xproj, params, h0, c0, lengths, *, gru, input_size, variant):
        self._check_forward(xproj, params, h0, c0, lengths, gru, input_size)
        y, hy, cy = inference_forward(xproj, params, h0, c0, lengths, gru=gru,
                                      input_size=int(input_size))
        layers, _, units = h0.shape
        empty = jnp.zeros(((layers - 1),) + y.shape, y.dtype)
        return y, hy, cy, self._workspace(xproj, h0, empty)

    def _forward_saving(self, xproj, params, h0, c0, lengths, *, gru, input_size, variant):
        self._check_forward(xproj, params, h0, c0, lengths, gru, input_size)
        y, hy, cy, hseq, gates, cseq = forward(xproj, params, h0, c0, lengths, gru=gru,
                                               input_size=int(input_size), save=True)
        return y, hy, cy, self._workspace(xproj, h0, hseq), gates, cseq

    def _backward_stack(self, params, gates, cseq, c0, dy, dhy, dcy, lengths, *, input_size,
                        variant):
        layers, steps, batch, units = cseq.shape
        _check(gates.dtype == cseq.dtype == jnp.float32, "gates and cseq are float32")
        _check(dy.shape == (steps, batch, units), "dy is the top layer's [T, B, H]")
        _check(c0.shape == dhy.shape == dcy.shape == (layers, batch, units), "states [L, B, H]")
        dgates, dh0, dc0 = stack_recurrence(params, gates, cseq, c0, dy, dhy, dcy, lengths,
                                            input_size=int(input_size))
        nbytes = wavefront.backward_stack_workspace_bytes(layers, units, batch, steps)
        return dgates, dh0, dc0, jnp.zeros((nbytes,), jnp.uint8)

    def _backward_layer(self, w_hh, gates, cseq, c0, dy, dhy, dcy, lengths, *, gru):
        steps, batch, units = dy.shape
        _check(w_hh.shape == (GATES[int(gru)] * units, units), f"w_hh {w_hh.shape}")
        _check(gates.shape == (steps, batch, 4 * units) and gates.dtype == jnp.float32, "gates")
        _check(c0.shape == dcy.shape == ((batch, units) if not int(gru) else (0,)), "c0, dcy")
        dgates, dh0, dc0 = recurrence(w_hh, gates, cseq, c0, dy, dhy, dcy, lengths, gru=gru)
        return dgates, dh0, dc0, jnp.zeros((wavefront.backward_layer_workspace_bytes(),),
                                           jnp.uint8)


def install(monkeypatch, limit: int | None = None) -> Emulation:
    """The JAX binding on a fresh `Emulation`: no FFI library to register,
    every device and backward check passing, the backend available. With
    `limit`, a fake on-chip plan: a stack of more than `limit` layers x units
    is refused with a reason; each check's shape is kept in `.asked`."""
    from rnnfuse.backends import jax as jax_backend
    from rnnfuse.backends.cuda import library

    emulation = Emulation()
    emulation.asked = []

    def limits(kind, num_layers, units, batch, steps, input_size, ordinal=0):
        emulation.asked.append((kind, num_layers, units, batch, steps, input_size))
        if limit is not None and num_layers * units > limit:
            return f"{num_layers} layers of {units} units do not fit on chip"
        return None

    monkeypatch.setattr(wavefront, "ffi_call", emulation)
    monkeypatch.setattr(wavefront, "register", lambda: None)
    monkeypatch.setattr(library, "device_reason", limits)
    monkeypatch.setattr(library, "backward_reason", lambda *a, **k: None)
    monkeypatch.setattr(library, "backward_stack_reason", lambda *a, **k: None)
    monkeypatch.setattr(jax_backend, "is_available", lambda: True)
    return emulation


def targets(calls) -> list[str]:
    """The short names of the targets in `calls` ((target, ...) pairs)."""
    return [call[0].removeprefix("rnnfuse_wf_ffi_") for call in calls]

