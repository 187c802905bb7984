"""rnnfuse's wavefront kernel as the TensorFlow op `RnnfuseWavefront`, on a
real Hopper GPU, after the TensorFlow staging of ../shared/gpu:

    python3 -m pytest -q -s tests/gpu/test_gpu_wavefront.py

The op (built on first use like the cuDNN op) runs fused LSTM/GRU stacks
from the live Keras variables; its outputs and final states are compared
with rnnfuse's cuDNN op on the same canonical buffer (the standard
algorithm) and with a float64 NumPy reference, as ||out - ref|| / ||ref||.
A shape over the kernel's limits raises NotImplementedError (the fused
layer's cue to run cuDNN), a gradient through the raw op is a clear error,
and through `run_differentiable` it is cuDNN's.

As a tuner candidate: an optimized 4x512 float16 LSTM's `predict` at batch
64, T=1000, tuned on this GPU, chooses the wavefront plan; the predict step
holds and ran the op (its FusedRNN's path names RnnfuseWavefront, with no
fallback note: a silent fallback fails), matches the original model within
float16 rounding, and is faster than the original's predict (the ratio is
a GPU_REPORT line); the same model at batch 8 keeps cuDNN or the original.
The kernel's exactness over randomized shapes is tested through torch
(test_gpu_wavefront_torch.py), which needs no TensorFlow.

Training (`wavefront_op.run_trainable`: the forward kernel saving gates and
c, the default backward ("auto": the reverse wavefront's one launch,
`RnnfuseWavefrontBackwardStack`, where its plan accepts the stack, as at
the headline; else the backward kernel per layer, as at 7 x 320; the
launches are counted, so a silent fallback fails), the GEMMs in
TensorFlow): outputs, final
states and the gradients of the inputs, initial states and every Keras
variable against a tape of the float64 reference and rnnfuse's cuDNN op's
gradient (bench_wavefront's GRAD_TOL, or twice cuDNN's own error), at the
headline 4x512 B64 T1000 float16, a bfloat16 stack with lengths and small
odd shapes; each op alone against its TF step-by-step reference (the
saving op's y, hseq, gates and c; the backward ops' dgates, dh0, dc0), so
a failure names the op; a GRU stack the same way (its per-layer
backward, one launch a layer counted; the saving and backward ops with
rnn_mode "gru" against their references); refusals (over the forward's
limits, the backward op's own Unimplemented error); a gradient through the raw training ops is a
clear error; and a tf.function training step at the headline shape timed
against the cuDNN op (a GPU_REPORT line, not asserted). As a training
candidate (the last test): the same model's `fit` chooses the wavefront
plan, its traced train step runs the training ops (no fallback note), its
gradients match the original layers' within float16 rounding, and `fit`
is faster than the original's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import built_stack, fused_layers, traced_op_types
from gpu_report import report
from gpu_timing import median_seconds, predict_medians
from gpu_wavefront_checks import assert_batch_8_keeps_cudnn_or_the_original, assert_fit_is_faster, fit_at_the_headline, float16_lstm
from rnnfuse.backends import tensorflow as tf_backend
from rnnfuse.backends.base import StackCall
from rnnfuse.backends.tensorflow import op_build, wavefront_op
from rnnfuse.tuning import first_batch
from rnnfuse.tuning.cache import PlanCache

pytestmark = [pytest.mark.cudnn_op, pytest.mark.real_gpu_only]
TOL = {"float16": 1e-3, "bfloat16": 8e-3}


@pytest.fixture(autouse=True)
def _op_loaded():
    op_build.reset_for_tests()
    if op_build.load_wavefront_op() is None:
        pytest.fail(f"the wavefront op did not load: {op_build.wavefront_load_failure()}")
    yield


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _reference(stack, x, mask):
    """float64 NumPy forward of the stack (Keras gate order), cuDNN's padding rules."""
    x = x.astype(np.float64)
    batch, steps, _ = x.shape
    lengths = mask.sum(1) if mask is not None else np.full(batch, steps)
    inp, hs = x, []
    for (cell,) in stack.cells:
        k, r, b = (np.asarray(v, np.float64) for v in (cell.kernel, cell.recurrent_kernel, cell.bias))
        h = np.zeros((batch, stack.units))
        c = np.zeros_like(h)
        out = np.zeros((batch, steps, stack.units))
        for t in range(steps):
            if stack.kind == "lstm":
                z = inp[:, t] @ k + h @ r + b
                i, f, g, o = np.split(z, 4, axis=1)
                c_new = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
                h_new = _sigmoid(o) * np.tanh(c_new)
            else:  # reset_after: bias rows are (input, recurrent), gates z, r, h
                xz, xr, xh = np.split(inp[:, t] @ k + b[0], 3, axis=1)
                hz, hr, hh = np.split(h @ r + b[1], 3, axis=1)
                zg, rg = _sigmoid(xz + hz), _sigmoid(xr + hr)
                h_new = zg * h + (1 - zg) * np.tanh(xh + rg * hh)
                c_new = c
            alive = (t < lengths)[:, None]
            h, c = np.where(alive, h_new, h), np.where(alive, c_new, c)
            out[:, t] = np.where(alive, h_new, 0)
        inp = out
        hs.append(h)
    return inp, np.stack(hs)


def _rel(a, b):
    a, b = np.asarray(tf.cast(a, tf.float64)), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize(
    "kind, layers, units, batch, steps, dtype, masked",
    [
        ("lstm", 4, 512, 64, 50, "float16", False),
        ("lstm", 3, 256, 20, 40, "bfloat16", True),
        ("gru", 4, 512, 32, 30, "float16", True),
        ("gru", 2, 128, 3, 17, "bfloat16", False),
    ],
)
def test_the_op_matches_float64_and_the_cudnn_op(kind, layers, units, batch, steps, dtype, masked):
    rng = np.random.default_rng(layers * 1000 + units + batch)
    stack = built_stack(kind, layers, units, units)
    for (cell,) in stack.cells:  # random biases too (Keras initialises them to 0 / 1)
        cell.bias.assign(rng.uniform(-0.3, 0.3, cell.bias.shape).astype("float32"))
    x = rng.standard_normal((batch, steps, units)).astype("float32")
    mask = None
    if masked:
        lengths = rng.integers(1, steps + 1, batch)
        mask = np.arange(steps)[None, :] < lengths[:, None]
    xt = tf.cast(tf.constant(x), dtype)
    with tf.device("GPU:0"):
        y, h, c, ran = wavefront_op.run_stack(xt, StackCall(stack, mask=mask))
        y_cudnn, h_cudnn, _, ran_cudnn = tf_backend.run_stack(xt, StackCall(stack, mask=mask))
    assert ran.name == wavefront_op.KERNEL_NAME and ran_cudnn.name == "RnnfuseCudnnRnn"
    # The reference sees the weights and inputs the kernel saw (rounded).
    for (cell,) in stack.cells:
        for v in (cell.kernel, cell.recurrent_kernel, cell.bias):
            v.assign(tf.cast(tf.cast(v, dtype), tf.float32))
    ref_y, ref_h = _reference(stack, np.asarray(tf.cast(xt, tf.float32)), mask)
    tol = max(TOL[dtype], 2 * _rel(y_cudnn, ref_y))
    assert _rel(y, ref_y) <= tol and _rel(h, ref_h) <= max(TOL[dtype], 2 * _rel(h_cudnn, ref_h))
    assert (c is None) == (kind == "gru")


def test_a_stack_over_the_limits_raises_not_implemented():
    stack = built_stack("lstm", 8, 512, 512)
    with pytest.raises(NotImplementedError, match="do not fit on chip"):
        wavefront_op.run_stack(tf.zeros([64, 10, 512], tf.float16), StackCall(stack))


def test_float32_and_training_calls_are_refused():
    stack = built_stack("lstm", 2, 64, 64)
    with pytest.raises(NotImplementedError, match="float16 and bfloat16"):
        wavefront_op.run_stack(tf.zeros([4, 5, 64]), StackCall(stack))
    with pytest.raises(NotImplementedError, match="no dropout"):
        wavefront_op.run_stack(tf.zeros([4, 5, 64], tf.float16), StackCall(stack, dropout=0.2))


def test_a_gradient_through_the_raw_op_is_a_clear_error():
    stack = built_stack("gru", 2, 64, 64)
    x = tf.Variable(tf.zeros([4, 5, 64], tf.float16))
    with tf.GradientTape() as tape:
        # The loss inside the tape (outside it the tape sees no path, and
        # gives None whatever the op's gradient is).
        loss = tf.reduce_sum(wavefront_op.run_stack(x, StackCall(stack)).outputs)
    with pytest.raises(ValueError, match="inference kernel"):
        tape.gradient(loss, x)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_backends_wavefront_call_has_cudnns_gradient(kind):
    """kernel="wavefront" through the backend: the op runs the forward
    pass, the gradient (inputs and every variable) is cuDNN's."""
    stack = built_stack(kind, 3, 256, 128)
    rng = np.random.default_rng(5)
    x = tf.constant(rng.standard_normal((16, 40, 128)), tf.float16)
    weights = tf.constant(rng.standard_normal((16, 40, 256)), tf.float32)
    variables = [v.value for (cell,) in stack.cells for v in cell.trainable_weights]
    grads, kernels = [], []
    for kernel in ("wavefront", "cudnn"):
        with tf.GradientTape() as tape:
            tape.watch(x)
            run = tf_backend.run_stack(x, StackCall(stack, kernel=kernel))
            loss = tf.reduce_sum(tf.cast(run.outputs, tf.float32) * weights)
        kernels.append(run.kernel)
        grads.append(tape.gradient(loss, [x, *variables]))
    assert kernels[0].name == wavefront_op.KERNEL_NAME and kernels[0].note is None
    assert kernels[1].name == "RnnfuseCudnnRnn"
    for got, want in zip(*grads):
        assert got is not None and _rel(got, np.asarray(tf.cast(want, tf.float64))) <= 1e-3


# -- the tuner candidate, through predict ------------------------------------------------


def test_predict_of_a_4x512_float16_lstm_at_batch_64_runs_the_wavefront_kernel(tmp_path):
    model = float16_lstm(4, 512, 1000)
    x = np.random.default_rng(0).standard_normal((256, 1000, 512)).astype("float32")
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    (layer,) = fused_layers(fast)
    y = fast.predict(x, batch_size=64, verbose=0)  # four full batches: one trace
    (record,) = first_batch.decisions(fast)
    print("GPU_REPORT decision", json.dumps(record, default=str))
    assert record["mode"] == "inference" and record["input"] == [64, 1000, 512]
    assert record["chosen"] == "fused on wavefront", record
    # The traced predict step ran the op, no fallback (a note would say why).
    ran = layer.last_path.kernel
    assert ran.name == wavefront_op.KERNEL_NAME and ran.note is None, layer.last_path
    assert wavefront_op.KERNEL_NAME in traced_op_types(
        lambda t: fast(t, training=False), tf.constant(x[:64]))
    want = model.predict(x, batch_size=64, verbose=0)
    rel = _rel(y, want)
    assert rel <= 2e-3 and float(np.max(np.abs(np.asarray(y, np.float64) - want))) <= 2e-2
    medians = predict_medians({"original": model, "optimized": fast}, x, 64)
    original_s, fast_s = medians["original"], medians["optimized"]
    assert layer.last_path.kernel.name == wavefront_op.KERNEL_NAME
    report("wavefront_predict_tf", {
        "shape": "4x512 LSTM B64 T1000 float16", "chosen": record["chosen"],
        "timings_ms": record["timings_ms"], "predict_original_ms": 1e3 * original_s,
        "predict_optimized_ms": 1e3 * fast_s, "speedup": original_s / fast_s, "rel_diff": rel,
    })
    assert fast_s < original_s, (fast_s, original_s)


def test_predict_at_batch_8_keeps_cudnn_or_the_original(tmp_path):
    """Batch 8, where cuDNN's persistent kernel is faster (docs/kernel.md's
    crossover): the wavefront plan is timed and not chosen."""
    assert_batch_8_keeps_cudnn_or_the_original(tmp_path, "wavefront_predict_tf_b8")


# -- training: the kernel's forward AND backward (run_trainable) ---------------------------

# ||grad - ref64|| / ||ref64|| bounds, bench/bench_wavefront.py's GRAD_TOL (the
# recurrence's rounding compounds over T backward steps); each tensor must
# also be within twice rnnfuse's cuDNN op's own error, or this.
GRAD_TOL = {"float16": 5e-3, "bfloat16": 4e-2}

TRAINING_CASES = [
    # layers, units, batch, steps, inputs, dtype, lengths
    (4, 512, 64, 1000, 512, "float16", False),  # the headline
    (3, 256, 20, 60, 128, "bfloat16", True),
    (1, 64, 3, 7, 5, "float16", False),  # small and odd
    (3, 384, 33, 40, 100, "float16", True),
    (7, 320, 8, 30, 64, "float16", True),  # the stack backward refuses it (140 CTAs), v1 runs it
    # A GRU: the per-layer backward (the reverse wavefront is LSTM only).
    (4, 512, 64, 1000, 512, "float16", False, "gru"),  # the headline
    (3, 256, 20, 60, 128, "bfloat16", True, "gru"),
    (1, 64, 3, 7, 5, "float16", False, "gru"),
    (3, 384, 33, 40, 100, "float16", True, "gru"),
]
# The backward "auto" (run_trainable's) must run where the case names one:
# the reverse wavefront at the headline, the per-layer backward where the
# stack backward's plan refuses the stack. The other cases run what the
# choice says, and the launches must agree with it.
EXPECTED_BACKWARD = {TRAINING_CASES[0]: "stack", TRAINING_CASES[4]: "layer",
                     **{c: "layer" for c in TRAINING_CASES if c[-1] == "gru"}}


@pytest.fixture
def backward_calls(monkeypatch):
    """Counts the backward ops' launches (the kernels still run): the stack
    backward's one launch, and the per-layer backward's, one a layer."""
    from rnnfuse.backends.tensorflow import wavefront_training as wt

    calls = {"stack": 0, "layer": 0}
    for name, key in (("backward_stack_kernel", "stack"), ("backward_layer", "layer")):
        real = getattr(wt, name)

        def spy(*args, _real=real, _key=key, **kw):
            calls[_key] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(wt, name, spy)
    return calls


def _training_inputs(layers, units, batch, steps, inputs, dtype, with_lengths, kind="lstm", *,
                     seed):
    """A stack with random biases and its weights rounded to `dtype` (what the
    kernels see, so the float64 reference sees the same), inputs, initial
    states (a GRU's c: None), upstream gradients and a mask."""
    rng = np.random.default_rng(seed)
    stack = built_stack(kind, layers, units, inputs)
    for (cell,) in stack.cells:
        cell.bias.assign(rng.uniform(-0.3, 0.3, cell.bias.shape).astype("float32"))
        for v in (cell.kernel, cell.recurrent_kernel, cell.bias):
            v.assign(tf.cast(tf.cast(v, dtype), tf.float32))

    def rand(*shape, scale=1.0):
        return tf.cast(tf.constant(rng.standard_normal(shape) * scale, tf.float32), dtype)

    x = rand(batch, steps, inputs)
    h = [rand(batch, units, scale=0.5) for _ in range(layers)]
    c = [rand(batch, units, scale=0.5) for _ in range(layers)]
    upstream = (rand(batch, steps, units), rand(layers, batch, units), rand(layers, batch, units))
    if kind == "gru":
        c, upstream = None, upstream[:2]
    mask = None
    if with_lengths:
        lengths = rng.integers(1, steps + 1, batch)
        lengths[0] = steps
        mask = tf.constant(np.arange(steps)[None, :] < lengths[:, None])
    return stack, x, h, c, upstream, mask


def _training_grads(run, stack, x, h, c, upstream, mask):
    """(outputs, final h, final c) and the gradients of x, the initial states
    and every Keras variable, for sum(out * upstream)."""
    variables = [v.value for (cell,) in stack.cells for v in cell.trainable_weights]
    c = c or []  # a GRU has no c
    with tf.GradientTape() as tape:
        tape.watch([x, *h, *c])
        out = run(x, StackCall(stack, initial_h=h, initial_c=c or None, mask=mask))
        tensors = (out.outputs, out.final_h, out.final_c)[:len(upstream)]
        loss = sum(tf.reduce_sum(tf.cast(t, tf.float64) * tf.cast(u, tf.float64))
                   for t, u in zip(tensors, upstream))
    return out.kernel, tensors, tape.gradient(loss, [x, *h, *c, *variables])


def _reference_run(x, call):
    """The stack in float64 (wavefront_training.reference_forward) on the same
    rounded weights, as a StackRun-like tuple."""
    from rnnfuse.backends.tensorflow import wavefront_training

    stack, initial_h, initial_c, mask = call.stack, call.initial_h, call.initial_c, call.mask
    lengths = None if mask is None else tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
    y, hy, cy = wavefront_training.reference_forward(
        tf.transpose(tf.cast(x, tf.float64), [1, 0, 2]), tf_backend.pack_params(stack, "float64"),
        tf.cast(tf.stack(initial_h), tf.float64),
        None if initial_c is None else tf.cast(tf.stack(initial_c), tf.float64), lengths,
        kind=stack.kind)

    class Run:
        outputs, final_h, final_c, kernel = tf.transpose(y, [1, 0, 2]), hy, cy, None

    return Run


def _names(layers, kind="lstm"):
    if kind == "gru":
        return (["y", "hy", "dx"] + [f"dh0_{l}" for l in range(layers)]
                + [f"{w}{l}" for l in range(layers) for w in ("kernel", "recurrent", "bias")])
    return (["y", "hy", "cy", "dx"] + [f"dh0_{l}" for l in range(layers)]
            + [f"dc0_{l}" for l in range(layers)]
            + [f"{w}{l}" for l in range(layers) for w in ("kernel", "recurrent", "bias")])


@pytest.mark.parametrize("case", TRAINING_CASES, ids=lambda c: "-".join(map(str, c)))
def test_run_trainables_gradients_match_float64_and_the_cudnn_op(case, backward_calls):
    """Outputs, final states, dx, dh0, dc0 and every Keras variable's gradient
    of `run_trainable` (the forward kernel saving, the default backward:
    the reverse wavefront's one launch where its plan accepts the stack,
    else the backward kernel per layer; then the GEMMs) against a tape of
    the float64 reference and rnnfuse's cuDNN op's gradient: within
    GRAD_TOL or twice cuDNN's own error, per tensor. Which backward ran is
    asserted from the launches (a silent fallback fails), and named by
    the KernelRun's algorithm."""
    from rnnfuse.backends.tensorflow import wavefront_training as wt

    layers, units, batch, steps, inputs, dtype = case[:6]
    kind = case[7] if len(case) > 7 else "lstm"
    stack, x, h, c, upstream, mask = _training_inputs(*case, seed=sum(case[:5]))
    choice = wt.backward_choice(tf.zeros([steps, batch, inputs], dtype),
                                tf.zeros([layers, batch, units], dtype), kind=kind)
    if case in EXPECTED_BACKWARD:
        assert choice.backward == EXPECTED_BACKWARD[case], choice
    if choice.backward == "layer":
        assert "reverse-wavefront" in choice.reason, choice
    with tf.device("GPU:0"):
        ran, out, got = _training_grads(wavefront_op.run_trainable, stack, x, h, c, upstream,
                                        mask)
    assert ran.algorithm == f"backward={choice.backward}", ran
    assert backward_calls == ({"stack": 1, "layer": 0} if choice.backward == "stack"
                              else {"stack": 0, "layer": layers}), backward_calls
    with tf.device("GPU:0"):
        ran_cudnn, out_cudnn, cudnn = _training_grads(
            tf_backend.run_stack, stack, x, h, c, upstream, mask)  # kernel "cudnn": the default
        out_ref, ref = tf.function(
            lambda: _training_grads(_reference_run, stack, x, h, c, upstream, mask)[1:])()
    assert ran.name == wavefront_op.TRAINING_KERNEL_NAME and ran.note is None
    assert ran_cudnn.name == "RnnfuseCudnnRnn"
    err, cud_err = {}, {}
    names = _names(layers, kind)
    assert len(names) == len(out) + len(got) == len(out_ref) + len(ref), names
    for name, a, b, w in zip(names, [*out, *got], [*out_cudnn, *cudnn], [*out_ref, *ref]):
        assert a is not None and w is not None, name
        err[name], cud_err[name] = _rel(a, w), _rel(b, w)
    bad = {n: (err[n], cud_err[n]) for n in err
           if not (np.isfinite(err[n]) and err[n] <= max(GRAD_TOL[dtype], 2 * cud_err[n]))}
    report(f"wavefront_grad_tf_{'-'.join(map(str, case))}", {
        "backward": choice.backward, "worst": max(err.values()),
        "cudnn_worst": max(cud_err.values()),
        "ratio_to_cudnn": max(err[n] / max(cud_err[n], 1e-12) for n in err), "failing": bad})
    assert not bad, bad


def _saving_inputs(layers, units, batch, steps, inputs, dtype, seed, kind="lstm"):
    """Time-major x, a flat buffer, h0, c0 and lengths (row 0 full length)."""
    rng = np.random.default_rng(seed)
    stack = built_stack(kind, layers, units, inputs)
    for (cell,) in stack.cells:
        cell.bias.assign(rng.uniform(-0.3, 0.3, cell.bias.shape).astype("float32"))
    def rand(*shape):
        return tf.cast(tf.constant(rng.standard_normal(shape) * 0.5, tf.float32), dtype)

    lengths = rng.integers(1, steps + 1, batch).astype(np.int32)
    lengths[0] = steps
    return (rand(steps, batch, inputs), tf_backend.pack_params(stack, dtype),
            rand(layers, batch, units), rand(layers, batch, units), tf.constant(lengths))


def _alive_rows(t, lengths):
    """[T, B, 1] float: 1 where t < length."""
    return (np.arange(t)[:, None] < np.asarray(lengths)[None, :])[..., None]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_saving_op_returns_what_the_reference_saves(dtype, kind):
    """RnnfuseWavefrontSaving's y, hy, cy, hseq (a view of its workspace),
    gates and c (a GRU's r, z, n, W_hn h + b_hn and h_{t-1}) against the TF
    step-by-step reference of the same kernel (float32 arithmetic on the
    same inputs), at t < length (past a length the saved values are never
    read)."""
    from rnnfuse.backends.tensorflow import wavefront_training as wt

    x, params, h0, c0, lengths = _saving_inputs(3, 64, 8, 20, 32, dtype, seed=11, kind=kind)
    with tf.device("GPU:0"):
        got = wt.forward_saving(x, params, h0, c0, lengths, kind=kind)
        want = wt.reference_forward_saving(x, params, h0, c0, lengths, kind=kind)
    alive = _alive_rows(20, lengths)
    tol = TOL[dtype]
    names = ["y", "hy", "cy"] if kind == "lstm" else ["y", "hy"]
    for name, a, b in zip(names, got[:3], want[:3]):
        assert _rel(a, b) <= tol, (name, _rel(a, b))
    hseq, gates, cseq = got[3]
    assert hseq.shape == (2, 20, 8, 64) and gates.shape == (3, 20, 8, 256)
    assert gates.dtype == tf.float32 and cseq.dtype == tf.float32 and hseq.dtype == x.dtype
    assert _rel(hseq, want[3][0]) <= tol
    assert _rel(np.asarray(gates) * alive, np.asarray(want[3][1]) * alive) <= tol
    assert _rel(np.asarray(cseq) * alive, np.asarray(want[3][2]) * alive) <= tol


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_backward_op_matches_the_recurrence_reference(dtype, kind):
    """RnnfuseWavefrontBackward on one layer's saved tensors and random
    upstream gradients, with lengths, against `recurrence_reference` (a
    GRU's: rnn_mode "gru", dgates (dr, dz, dn_x, dn_h), no dc0)."""
    from rnnfuse.backends.tensorflow import wavefront_training as wt

    x, params, h0, c0, lengths = _saving_inputs(1, 64, 8, 20, 32, dtype, seed=12, kind=kind)
    rng = np.random.default_rng(13)
    def rand(*shape):
        return tf.cast(tf.constant(rng.standard_normal(shape), tf.float32), dtype)

    g = 4 if kind == "lstm" else 3
    with tf.device("GPU:0"):
        _, _, _, (_, gates, cseq) = wt.reference_forward_saving(x, params, h0, c0, lengths,
                                                                kind=kind)
        w_hh = tf.reshape(params[g * 64 * 32: g * 64 * 96], [g * 64, 64])
        dcy = rand(8, 64) if kind == "lstm" else None
        args = (w_hh, gates[0], cseq[0], c0[0] if kind == "lstm" else None, rand(20, 8, 64),
                rand(8, 64), dcy, lengths)
        got = wt.backward_layer(*args, kind=kind)
        want = wt.recurrence_reference(*args, kind=kind)
    assert got[0].dtype == x.dtype and got[1].dtype == tf.float32
    assert got[0].shape == (20, 8, 256) and (got[2] is None) == (kind == "gru")
    alive = _alive_rows(20, lengths)
    assert np.all(np.asarray(tf.cast(got[0], tf.float32)) * (1 - alive) == 0)  # 0 past lengths
    for name, a, b in zip(["dgates", "dh0", "dc0"][:3 if kind == "lstm" else 2], got, want):
        assert _rel(a, b) <= GRAD_TOL[dtype], (name, _rel(a, b))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_stack_backward_op_matches_the_stack_recurrence_reference(dtype):
    """RnnfuseWavefrontBackwardStack (check=True: a timed-out wait would be
    an error) on a 3-layer stack's saved tensors and random upstream
    gradients, with lengths, against `stack_recurrence_reference`."""
    from rnnfuse.backends.tensorflow import wavefront_training as wt

    x, params, h0, c0, lengths = _saving_inputs(3, 64, 8, 20, 32, dtype, seed=14)
    rng = np.random.default_rng(15)
    def rand(*shape):
        return tf.cast(tf.constant(rng.standard_normal(shape), tf.float32), dtype)

    with tf.device("GPU:0"):
        _, _, _, (_, gates, cseq) = wt.reference_forward_saving(x, params, h0, c0, lengths)
        args = (params, 32, gates, cseq, c0, rand(20, 8, 64), rand(3, 8, 64), rand(3, 8, 64),
                lengths)
        got = wt.backward_stack_kernel(*args, check=True)
        want = wt.stack_recurrence_reference(*args)
    assert got[0].dtype == x.dtype and got[1].dtype == tf.float32
    assert got[0].shape == (3, 20, 8, 256) and got[1].shape == (3, 8, 64)
    alive = _alive_rows(20, lengths)[None]
    assert np.all(np.asarray(tf.cast(got[0], tf.float32)) * (1 - alive) == 0)  # 0 past lengths
    for name, a, b in zip(["dgates", "dh0", "dc0"], got, want):
        assert _rel(a, b) <= GRAD_TOL[dtype], (name, _rel(a, b))


def test_the_stack_backward_op_names_the_limit_it_refuses():
    """The op itself: 7 x 320 (140 CTAs on 132 SMs) is an Unimplemented error
    naming the limit; a buffer of the wrong size is an InvalidArgument."""
    from rnnfuse.backends.tensorflow import wavefront_training as wt

    L, T, B, H, I = 7, 3, 2, 320, 64
    f16 = lambda *s: tf.zeros(s, tf.float16)  # noqa: E731
    f32 = lambda *s: tf.zeros(s, tf.float32)  # noqa: E731
    params = f16(4 * H * (I + H) + (L - 1) * 4 * H * 2 * H + L * 8 * H)
    args = (f32(L, T, B, 4 * H), f32(L, T, B, H), f16(L, B, H), f16(T, B, H), f16(L, B, H),
            f16(L, B, H), None)
    with tf.device("GPU:0"):
        with pytest.raises(tf.errors.UnimplementedError, match="reverse-wavefront"):
            wt.backward_stack_kernel(params, I, *args)
        with pytest.raises(tf.errors.InvalidArgumentError, match="canonical flat buffer"):
            wt.backward_stack_kernel(params[1:], I, *args)


def test_training_calls_the_kernels_cannot_run_are_refused():
    with pytest.raises(NotImplementedError, match="do not fit on chip"):
        wavefront_op.run_trainable(tf.zeros([64, 10, 512], tf.float16),
                                   StackCall(built_stack("lstm", 8, 512, 512)))
    with pytest.raises(NotImplementedError, match="do not fit on chip"):
        wavefront_op.run_trainable(tf.zeros([64, 10, 512], tf.float16),
                                   StackCall(built_stack("gru", 8, 512, 512)))
    assert wavefront_op.training_reason("lstm", 4, 512, 64, 1000, 512, "float16") is None
    assert wavefront_op.training_reason("gru", 4, 512, 64, 1000, 512, "float16") is None


def test_the_backward_op_names_the_limit_it_refuses():
    """The op itself (Python checks the plan first): 100 units are not a
    multiple of 8, an Unimplemented error naming the limit."""
    from rnnfuse.backends.tensorflow import wavefront_training

    t, b, u = 3, 2, 100
    f16 = lambda *s: tf.zeros(s, tf.float16)  # noqa: E731
    f32 = lambda *s: tf.zeros(s, tf.float32)  # noqa: E731
    with tf.device("GPU:0"), pytest.raises(tf.errors.UnimplementedError, match="multiple of 8"):
        wavefront_training.backward_layer(f16(4 * u, u), f32(t, b, 4 * u), f32(t, b, u),
                                          f16(b, u), f16(t, b, u), f16(b, u), f16(b, u), None)


def test_a_gradient_through_the_raw_training_ops_is_a_clear_error():
    from rnnfuse.backends.tensorflow import wavefront_training

    x = tf.Variable(tf.zeros([5, 4, 64], tf.float16))
    params = tf_backend.pack_params(built_stack("lstm", 1, 64, 64), "float16")
    h0 = tf.zeros([1, 4, 64], tf.float16)
    with tf.GradientTape() as tape:
        y = wavefront_training.forward_saving(x, params, h0, h0, None)[0]
        loss = tf.reduce_sum(y)
    with pytest.raises(ValueError, match="no gradient of its own"):
        tape.gradient(loss, x)


def _median_ms(fn, reps=10):
    return 1e3 * median_seconds(fn, reps, warmup=2)  # traced and warm


def test_a_training_step_at_the_headline_shape_is_timed_against_the_cudnn_op():
    """A tf.function training step (forward + the gradients of x and every
    variable) of the 4x512 float16 LSTM at batch 64, T=1000, on run_trainable
    (its default backward: the reverse wavefront) and on rnnfuse's cuDNN op:
    a GPU_REPORT line (docs/benchmarks.md has the measured steps).
    Reported, not asserted."""
    stack, x, _, _, (dy, _, _), _ = _training_inputs(4, 512, 64, 1000, 512, "float16", False,
                                                     seed=7)
    variables = [v.value for (cell,) in stack.cells for v in cell.trainable_weights]
    ran = []

    def step(run):
        @tf.function
        def fn(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = run(x, StackCall(stack))
                loss = tf.reduce_sum(tf.cast(out.outputs, tf.float32) * tf.cast(dy, tf.float32))
            ran.append(out.kernel)
            grads = tape.gradient(loss, [x, *variables])
            return tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads])

        return lambda: float(fn(x))  # the float waits for the step

    with tf.device("GPU:0"):
        ours = _median_ms(step(wavefront_op.run_trainable))
        cudnn = _median_ms(step(tf_backend.run_stack))  # kernel "cudnn", StackCall's default
    assert ran[0].name == wavefront_op.TRAINING_KERNEL_NAME
    assert ran[-1].name == "RnnfuseCudnnRnn"
    assert ran[0].algorithm == "backward=stack", ran[0]  # the default, at the headline
    report("wavefront_train_step_tf", {
        "shape": "4x512 LSTM B64 T1000 float16", "backward": ran[0].algorithm,
        "wavefront_train_step_ms": ours,
        "cudnn_op_train_step_ms": cudnn, "speedup_vs_cudnn": cudnn / ours})


# -- the tuner candidate, through fit ----------------------------------------------------


def test_fit_of_a_4x512_float16_lstm_at_batch_64_trains_on_the_training_ops(tmp_path):
    """The training decision chooses the wavefront plan (its saving forward
    and backward ops), the traced train step runs them, the gradients match
    the original layers' within float16 rounding, and fit is faster."""
    model, fast, layer, record, x, y, rng = fit_at_the_headline(
        tmp_path, wavefront_op.TRAINING_KERNEL_NAME)
    batch = tf.constant(x[:64])
    upstream = tf.constant(rng.standard_normal((64, 1000, 512)), tf.float32)
    variables = model.trainable_variables

    def grads(m):
        with tf.GradientTape() as tape:
            out = tf.cast(m(batch, training=True), tf.float32)
            loss = tf.reduce_sum(out * upstream)
        return [np.asarray(g, np.float64) for g in tape.gradient(loss, variables)]

    got = grads(fast)
    assert layer.last_path.kernel.name == wavefront_op.TRAINING_KERNEL_NAME, layer.last_path
    want = grads(model)
    rel = max(float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(got, want))
    assert_fit_is_faster("wavefront_fit_tf", model, fast, x, y, record, rel)
