"""The training path of rnnfuse's wavefront kernel (TensorFlow), on the CPU.

The two kernels (the forward saving gates and c, the backward recurrence)
run on a Hopper GPU only (tests/gpu/test_gpu_wavefront.py); here their
TensorFlow step-by-step versions (`reference_forward_saving`,
`recurrence_reference`: same inputs, outputs and layouts as the ops) stand
in, in float64, so everything around them is checked exactly: the
layer-by-layer backward's GEMMs (dx, dW_ih, dW_hh, both biases), the
lengths (no gradient at t >= length, the final states' gradient entering at
length - 1), the initial states, the `tf.custom_gradient` wiring to the
flat buffer and from `run_trainable` to the Keras variables (against the
emulated cuDNN's gradient), and the refusals. The two TF references are
also checked against the torch binding's (which the GPU tests check
against the kernels), where torch is installed. The same for the reverse-wavefront
backward (v2, `backward="stack"`): `stack_recurrence_reference` in the
kernel's place, the GEMMs of `backward_stack_wavefront` against the
float64 tape, the op wrapper's arguments, and the "auto" choice (v2 where
its plan accepts the stack, else v1 with the reason; a bad value is a
ValueError).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from builders import answering, built_stack, spy_each
from rnnfuse.backends.base import StackCall
from rnnfuse.backends.cuda import library
from rnnfuse.backends.tensorflow import wavefront_op, wavefront_training as wt

TF_KERNELS = dict(saving=wt.reference_forward_saving, recurrence=wt.recurrence_reference)
# The reverse-wavefront path (v2) with the TF stand-in of its one launch.
STACK_KERNELS = dict(saving=wt.reference_forward_saving,
                     recurrence=wt.stack_recurrence_reference, backward="stack")


def _params(layers, units, inputs, rng):
    """A canonical flat buffer (float64) of an LSTM stack."""
    sizes = [4 * units * ((inputs if l == 0 else units) + units) for l in range(layers)]
    n = sum(sizes) + 8 * units * layers
    return tf.constant(rng.uniform(-0.5, 0.5, n), tf.float64)


def _inputs(layers, units, batch, steps, inputs, with_lengths, seed=0):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.standard_normal((steps, batch, inputs)), tf.float64)
    h0 = tf.constant(rng.standard_normal((layers, batch, units)) * 0.5, tf.float64)
    c0 = tf.constant(rng.standard_normal((layers, batch, units)) * 0.5, tf.float64)
    lengths = None
    if with_lengths:
        lengths = rng.integers(1, steps + 1, batch).astype(np.int32)
        lengths[0] = steps
        lengths = tf.constant(lengths)
    return x, _params(layers, units, inputs, rng), h0, c0, lengths


def _grads(fn, leaves, upstream):
    with tf.GradientTape() as tape:
        tape.watch(leaves)
        out = fn(*leaves)
        loss = sum(tf.reduce_sum(o * u) for o, u in zip(out, upstream))
    return out, tape.gradient(loss, leaves)


def _close(a, b, rtol, atol):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


@pytest.mark.parametrize("shape", [(1, 8, 3, 7, 5), (2, 16, 4, 9, 5), (3, 8, 5, 6, 3),
                                   (4, 8, 2, 4, 6)])
@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("kernels", [TF_KERNELS, STACK_KERNELS], ids=["layer", "stack"])
def test_the_gradients_are_a_tapes_of_the_float64_reference(shape, with_lengths, kernels):
    """Per layer (v1: one recurrence a layer, then the GEMMs of
    `backward_stack`) and backward="stack" (v2: one recurrence for every
    layer, then the GEMMs of `backward_stack_wavefront`), with TensorFlow
    stand-ins for the kernels."""
    x, params, h0, c0, lengths = _inputs(*shape, with_lengths)
    rng = np.random.default_rng(1)
    want_out = wt.reference_forward(x, params, h0, c0, lengths)
    upstream = [tf.constant(rng.standard_normal(t.shape)) for t in want_out]
    leaves = [x, params, h0, c0]
    _, want = _grads(lambda *a: wt.reference_forward(*a, lengths), leaves, upstream)
    out, got = _grads(lambda *a: wt.trainable_forward(*a, lengths, **kernels), leaves,
                      upstream)
    for a, b in zip(out, want_out):
        _close(a, b, 0, 1e-12)
    for name, a, b in zip(["dx", "dparams", "dh0", "dc0"], got, want):
        assert a is not None, name
        _close(a, b, 1e-10, 1e-12)


def _gru_params(layers, units, inputs, rng):
    """A canonical flat buffer (float64) of a GRU stack (r, z, n)."""
    sizes = [3 * units * ((inputs if l == 0 else units) + units) for l in range(layers)]
    return tf.constant(rng.uniform(-0.5, 0.5, sum(sizes) + 6 * units * layers), tf.float64)


@pytest.mark.parametrize("shape", [(1, 8, 3, 7, 5), (3, 8, 5, 6, 3)])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_a_grus_gradients_are_a_tapes_of_the_float64_reference(shape, with_lengths):
    """A GRU's per-layer backward (its four virtual gates through
    `_gru_backward_stack`'s GEMMs) against a tape of the float64 reference
    forward (`reference_forward_saving`, plain TensorFlow ops)."""
    x, _, h0, _, lengths = _inputs(*shape, with_lengths)
    params = _gru_params(shape[0], shape[1], shape[4], np.random.default_rng(2))
    leaves = [x, params, h0]

    def reference(x, params, h0):
        return wt.reference_forward_saving(x, params, h0, None, lengths, kind="gru")[:2]

    want_out = reference(*leaves)
    rng = np.random.default_rng(1)
    upstream = [tf.constant(rng.standard_normal(t.shape)) for t in want_out]
    _, want = _grads(reference, leaves, upstream)
    out, got = _grads(lambda *a: wt.trainable_forward(*a, None, lengths, kind="gru",
                                                      **TF_KERNELS)[:2], leaves, upstream)
    for a, b in zip(out, want_out):
        _close(a, b, 0, 1e-12)
    for name, a, b in zip(["dx", "dparams", "dh0"], got, want):
        assert a is not None, name
        _close(a, b, 1e-10, 1e-12)


def test_the_gradient_is_not_the_reference_with_a_wrong_gemm(monkeypatch):
    """The check above can fail: dW_hh read against h_t instead of h_{t-1}
    (the recurrence's input shifted by one step) is caught."""
    x, params, h0, c0, _ = _inputs(2, 8, 3, 5, 4, False)
    leaves = [x, params, h0, c0]
    upstream = [tf.ones_like(t) for t in wt.reference_forward(x, params, h0, c0)]
    _, want = _grads(lambda *a: wt.reference_forward(*a), leaves, upstream)
    real_concat = tf.concat

    def shifted(values, axis, *a, **k):  # [h0, out[:-1]] becomes out
        if (axis == 0 and len(values) == 2 and values[0].shape.rank == 3
                and values[0].shape[0] == 1):
            return real_concat([values[1], values[1][-1:]], axis)
        return real_concat(values, axis, *a, **k)

    monkeypatch.setattr(wt.tf, "concat", shifted)
    _, got = _grads(lambda *a: wt.trainable_forward(*a, **TF_KERNELS), leaves, upstream)
    assert not np.allclose(got[1], want[1], rtol=1e-6)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10, atol=1e-12)  # dx is still right


def test_no_gradient_past_a_length_and_the_final_states_enter_at_its_end():
    x, params, h0, c0, _ = _inputs(2, 8, 3, 6, 4, False)
    lengths = tf.constant([6, 2, 4], tf.int32)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y, hy, cy = wt.trainable_forward(x, params, h0, c0, lengths, **TF_KERNELS)
        loss = tf.reduce_sum(hy[-1]) + tf.reduce_sum(y[5])
    dx = tape.gradient(loss, x).numpy()
    assert np.all(dx[2:, 1] == 0) and np.any(dx[:2, 1] != 0)
    assert np.all(dx[4:, 2] == 0) and np.any(dx[3, 2] != 0)


def test_the_saved_tensors_have_the_kernels_layout():
    x, params, h0, c0, lengths = _inputs(3, 8, 2, 5, 4, True)
    y, hy, cy, (hseq, gates, cseq) = wt.reference_forward_saving(x, params, h0, c0, lengths)
    assert hseq.shape == (2, 5, 2, 8) and gates.shape == (3, 5, 2, 32)
    assert cseq.shape == (3, 5, 2, 8)
    ref_y, ref_h, ref_c = wt.reference_forward(x, params, h0, c0, lengths)
    _close(y, ref_y, 0, 1e-12)
    _close(hy, ref_h, 0, 1e-12)
    _close(cy, ref_c, 0, 1e-12)
    # c at each row's last step is its final c; the gates are activations.
    last = lengths.numpy() - 1
    _close(cseq.numpy()[-1, last, np.arange(2)], ref_c[-1], 0, 1e-12)
    assert tf.reduce_min(gates) >= -1 and tf.reduce_max(gates) <= 1
    # the layers below the top are 0 past each length, as the kernel writes them
    assert np.all(hseq.numpy()[:, last[1] + 1:, 1] == 0)


def test_the_recurrence_writes_zero_gate_gradients_past_each_length():
    steps, batch, units = 5, 3, 8
    rng = np.random.default_rng(1)
    rand = lambda *s: tf.constant(rng.standard_normal(s))  # noqa: E731
    gates = tf.constant(rng.uniform(0, 1, (steps, batch, 4 * units)))
    lengths = tf.constant([5, 1, 3], tf.int32)
    dgates, dh0, dc0 = wt.recurrence_reference(
        rand(4 * units, units), gates, rand(steps, batch, units), rand(batch, units),
        rand(steps, batch, units), rand(batch, units), rand(batch, units), lengths)
    dgates = dgates.numpy()
    assert dgates.shape == (steps, batch, 4 * units)
    assert np.all(dgates[1:, 1] == 0) and np.all(dgates[3:, 2] == 0)
    assert np.all(dgates[0] != 0) and dh0.shape == dc0.shape == (batch, units)


def test_the_references_are_the_torch_bindings():
    """Same numbers as rnnfuse/backends/torch/wavefront.py's references (the
    ones the GPU tests check against the kernels), in float64 with lengths."""
    torch = pytest.importorskip("torch")
    from rnnfuse.backends.torch import wavefront as torch_wf

    x, params, h0, c0, lengths = _inputs(3, 8, 4, 6, 5, True)
    t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    want = torch_wf.reference_forward_saving(t(x), t(params), t(h0), t(c0), t(lengths))
    got = wt.reference_forward_saving(x, params, h0, c0, lengths)
    for a, b in zip(tf.nest.flatten(got), [*want[:3], *want[3]]):
        _close(a, b.numpy(), 0, 1e-13)
    _, gates, cseq = got[3]
    rng = np.random.default_rng(2)
    dy, dhy, dcy = (rng.standard_normal(s) for s in [(6, 4, 8), (4, 8), (4, 8)])
    w_hh = tf.reshape(params[4 * 8 * 5: 4 * 8 * 13], [32, 8])
    args = [w_hh, gates[0], cseq[0], c0[0], tf.constant(dy), tf.constant(dhy), tf.constant(dcy),
            lengths]
    got = wt.recurrence_reference(*args)
    want = torch_wf.recurrence_reference(*(t(a) for a in args))
    for a, b in zip(got, want):
        _close(a, b.numpy(), 0, 1e-13)


def test_the_gru_references_are_the_torch_bindings():
    """The GRU's references, likewise (the torch binding's GRU forward
    reference is checked against autograd of PyTorch's own GRU on the CPU,
    tests/torch_backend/test_torch_wavefront_training.py)."""
    torch = pytest.importorskip("torch")
    from rnnfuse.backends.torch import wavefront as torch_wf

    x, _, h0, _, lengths = _inputs(3, 8, 4, 6, 5, True)
    params = _gru_params(3, 8, 5, np.random.default_rng(4))
    t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    want = torch_wf.reference_forward_saving(t(x), t(params), t(h0), None, t(lengths),
                                             kind="gru")
    got = wt.reference_forward_saving(x, params, h0, None, lengths, kind="gru")
    for a, b in zip(tf.nest.flatten([got[:2], got[3]]), [*want[:2], *want[3]]):
        _close(a, b.numpy(), 0, 1e-13)
    _, gates, hprev = got[3]
    rng = np.random.default_rng(2)
    dy, dhy = (rng.standard_normal(s) for s in [(6, 4, 8), (4, 8)])
    w_hh = tf.reshape(params[3 * 8 * 5: 3 * 8 * 13], [24, 8])
    got = wt.recurrence_reference(w_hh, gates[0], hprev[0], None, tf.constant(dy),
                                  tf.constant(dhy), None, lengths, kind="gru")
    want = torch_wf.recurrence_reference(t(w_hh), t(gates[0]), t(hprev[0]), None, t(dy), t(dhy),
                                         None, t(lengths), kind="gru")
    for a, b in zip(got[:2], want[:2]):
        _close(a, b.numpy(), 0, 1e-13)
    assert got[2] is None and want[2] is None


def test_the_backward_kernels_inputs_are_the_ops(monkeypatch):
    """`backward_stack` hands the op (here a spy) each layer's own slices, in
    the element type: W_hh [4H, H], gates [T, B, 4H] and c [T, B, H] of the
    layer, c0 and the final states' gradients of the layer."""
    x, params, h0, c0, lengths = _inputs(2, 8, 3, 4, 5, True)
    y, _, _, saved = wt.reference_forward_saving(x, params, h0, c0, lengths)
    seen = []

    def spy(w_hh, gates, cseq, c0_l, dy, dhy, dcy, lens):
        seen.append((w_hh, gates, cseq, c0_l, dhy, lens))
        return wt.recurrence_reference(w_hh, gates, cseq, c0_l, dy, dhy, dcy, lens)

    dhy = tf.constant(np.arange(2 * 3 * 8, dtype=np.float64).reshape(2, 3, 8))
    wt.backward_stack(params, x, h0, c0, lengths, y, saved, None, dhy, None, recurrence=spy)
    assert len(seen) == 2
    views = wt._layer_views(params, 2, 8, 5)
    for (w_hh, gates, cseq, c0_l, dhy_l, lens), l in zip(seen, [1, 0]):
        _close(w_hh, views[l][1], 0, 0)
        _close(gates, saved[1][l], 0, 0)
        _close(cseq, saved[2][l], 0, 0)
        _close(c0_l, c0[l], 0, 0)
        _close(dhy_l, dhy[l], 0, 0)
        _close(lens, lengths, 0, 0)


def test_training_calls_it_cannot_run_say_why(monkeypatch):
    from rnnfuse.backends.cuda import library

    assert "LSTM and GRU" in library.backward_reason("simple_rnn", 64, 8, 10)
    reason = wavefront_op.training_reason("lstm", 2, 64, 8, 10, 64, "float16")
    assert isinstance(reason, str) and reason  # no GPU or no op here
    assert "float16" in wavefront_op.training_reason("lstm", 2, 64, 8, 10, 64, "float32")
    with pytest.raises(ValueError, match="c0"):
        wt.trainable_forward(tf.zeros([2, 1, 3]), tf.zeros([1]), tf.zeros([1, 1, 8]), None)
    with pytest.raises(ValueError, match="LSTM stacks only"):
        wt.trainable_forward(tf.zeros([2, 1, 3]), tf.zeros([1]), tf.zeros([1, 1, 8]), None,
                             kind="gru", backward="stack")


def _stack(layers, units, inputs):
    return built_stack("lstm", layers, units, inputs, dtype="float64")


def test_run_trainable_refuses_the_cpu_and_an_unknown_batch():
    stack = _stack(1, 8, 4)
    with pytest.raises(NotImplementedError):
        wavefront_op.run_trainable(tf.zeros([2, 3, 4], tf.float16), StackCall(stack))

    @tf.function(input_signature=[tf.TensorSpec([None, 3, 4], tf.float16)])
    def traced(x):
        return wavefront_op.run_trainable(x, StackCall(stack)).outputs

    with pytest.raises(NotImplementedError, match="static batch"):
        traced.get_concrete_function()


@pytest.mark.parametrize("reverse", [False, True])
def test_run_trainable_gives_the_keras_variables_cudnns_gradient(monkeypatch, emulated_cudnn,
                                                                  reverse):
    """With the TF kernels in place of the GPU's: the gradients of the
    sequences, the initial states and the Keras variables equal those of the
    backend's own run_stack on (emulated) cuDNN, with a mask and states."""
    from rnnfuse.backends import tensorflow as tf_backend

    monkeypatch.setattr(wt, "forward_saving", wt.reference_forward_saving)
    monkeypatch.setattr(wt, "backward_layer", wt.recurrence_reference)
    monkeypatch.setattr(wavefront_op, "stack_training_reason", lambda *a, **k: None)
    stack = _stack(2, 8, 4)
    variables = [w for level in stack.cells for cell in level for w in cell.weights]
    rng = np.random.default_rng(3)
    x = tf.constant(rng.standard_normal((3, 6, 4)))
    h = [tf.constant(rng.standard_normal((3, 8))) for _ in range(2)]
    c = [tf.constant(rng.standard_normal((3, 8))) for _ in range(2)]
    mask = tf.constant(np.arange(6)[None, :] < np.array([6, 3, 5])[:, None])

    def grads(run):
        with tf.GradientTape() as tape:
            tape.watch([x, *h, *c])
            out = run(x, StackCall(stack, initial_h=h, initial_c=c, mask=mask, reverse=reverse))
            loss = (tf.reduce_sum(out.outputs ** 2) + tf.reduce_sum(out.final_h)
                    + tf.reduce_sum(out.final_c ** 2))
        return out, tape.gradient(loss, [x, *h, *c] + variables)

    out, got = grads(wavefront_op.run_trainable)
    assert out.kernel.name == wavefront_op.TRAINING_KERNEL_NAME
    _, want = grads(tf_backend.run_stack)  # kernel "cudnn", StackCall's default
    assert len(emulated_cudnn) == 1
    for a, b in zip(got, want):
        assert a is not None
        _close(a, b, 1e-9, 1e-12)


def test_the_gradient_is_the_same_inside_a_tf_function():
    """Traced (graph-mode tf.custom_gradient, as a training step runs it):
    the same gradients as eagerly, only y's upstream given (the final states'
    arrive as None or zeros)."""
    x, params, h0, c0, lengths = _inputs(2, 8, 3, 5, 4, True)
    leaves = [x, params, h0, c0]

    def grads(*leaves):
        with tf.GradientTape() as tape:
            tape.watch(leaves)
            y, _, _ = wt.trainable_forward(*leaves, lengths, **TF_KERNELS)
            loss = tf.reduce_sum(y ** 2)
        return tape.gradient(loss, list(leaves))

    def want(*leaves):
        with tf.GradientTape() as tape:
            tape.watch(leaves)
            loss = tf.reduce_sum(wt.reference_forward(*leaves, lengths)[0] ** 2)
        return tape.gradient(loss, list(leaves))

    traced = tf.function(grads)(*leaves)
    for a, b, c in zip(traced, grads(*leaves), want(*leaves)):
        _close(a, b, 1e-12, 1e-14)
        _close(a, c, 1e-10, 1e-12)


def test_the_backends_training_call_on_the_wavefront_kernel_runs_run_trainable(monkeypatch,
                                                                             emulated_cudnn):
    """`run_stack(kernel="wavefront", training=True)` (what FusedRNN asks where
    the backend trains on the kernel): run_trainable where training_reason
    accepts the call, with its gradient; else cuDNN, with the reason."""
    from rnnfuse.backends import tensorflow as tf_backend

    stack = _stack(2, 8, 4)
    x = tf.constant(np.random.default_rng(4).standard_normal((3, 5, 4)))
    fallback = tf_backend.run_stack(x, StackCall(stack, kernel="wavefront", training=True))
    assert fallback.kernel.name == "CudnnRNNV3" and "wavefront" in fallback.kernel.note
    assert "float16" in fallback.kernel.note  # float64 here: the forward's first reason
    variables = [w for level in stack.cells for cell in level for w in cell.weights]

    def grads(**kw):
        with tf.GradientTape() as tape:
            run = tf_backend.run_stack(x, StackCall(stack, **kw))
            loss = tf.reduce_sum(run.outputs ** 2) + tf.reduce_sum(run.final_c)
        return run.kernel, tape.gradient(loss, variables)

    want_kernel, want = grads(kernel="cudnn")
    monkeypatch.setattr(wt, "forward_saving", wt.reference_forward_saving)
    monkeypatch.setattr(wt, "backward_layer", wt.recurrence_reference)
    monkeypatch.setattr(wavefront_op, "stack_training_reason", lambda *a, **k: None)
    kernel, got = grads(kernel="wavefront", training=True)
    assert kernel.name == wavefront_op.TRAINING_KERNEL_NAME and kernel.note is None
    for a, b in zip(got, want):
        _close(a, b, 1e-9, 1e-12)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_backends_kernel_reason_for_training_is_training_reason(monkeypatch, kind):
    """`kernel_reason("wavefront", group, shape, training=True)` (what the
    tuner asks before timing a training candidate): the forward's checks,
    then the backward's (LSTM or GRU; its plan, here faked)."""
    from builders import stack_model

    from rnnfuse.backends import tensorflow as tf_backend
    from rnnfuse.backends.cuda import library
    from rnnfuse.backends.tensorflow import op_build
    from rnnfuse.passes import build_layer_graph, plan_fusion

    asked = []
    monkeypatch.setattr(op_build, "load_wavefront_op", lambda: object())
    monkeypatch.setattr(library, "device_reason", lambda *a, **k: None)
    def fake_backward(kind, units, batch, steps, ordinal=0):
        asked.append((kind, units, batch, steps))
        return "the backward's limit"

    monkeypatch.setattr(library, "backward_reason", fake_backward)
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = stack_model(kind, 2, units=8, input_size=5, steps=7)
    finally:
        keras.config.set_dtype_policy("float32")
    (group,) = plan_fusion(build_layer_graph(model), model_name=model.name).groups
    assert tf_backend.kernel_reason("wavefront", group, (4, 7, 5)) is None
    assert asked == []
    reason = tf_backend.kernel_reason("wavefront", group, (4, 7, 5), training=True)
    assert asked == [(kind, 8, 4, 7)]
    assert reason == "the backward's limit"  # a GRU's backward plan is asked too


# -- the reverse-wavefront backward (v2) and the "auto" choice ------------------------------


def test_the_stack_gradient_is_not_the_reference_with_a_wrong_recurrence():
    """The float64 check of the stack path can fail: a stack recurrence
    that hands layer l-1 the dy of W_hh^l instead of W_ih^l gives wrong
    gradients of the layers below."""
    x, params, h0, c0, _ = _inputs(2, 8, 3, 5, 8, False)
    leaves = [x, params, h0, c0]
    upstream = [tf.ones_like(t) for t in wt.reference_forward(x, params, h0, c0)]
    _, want = _grads(lambda *a: wt.reference_forward(*a), leaves, upstream)

    def wrong(params, input_size, *rest):
        views = wt._layer_views(params, 2, 8, input_size)
        swapped = tf.concat([tf.reshape(views[0][0], [-1]), tf.reshape(views[0][1], [-1]),
                             tf.reshape(views[1][1], [-1]), tf.reshape(views[1][1], [-1]),
                             params[4 * 8 * 16 * 2:]], 0)
        return wt.stack_recurrence_reference(swapped, input_size, *rest)

    _, got = _grads(lambda *a: wt.trainable_forward(*a, saving=wt.reference_forward_saving,
                                                    recurrence=wrong, backward="stack"),
                    leaves, upstream)
    assert not np.allclose(got[0], want[0], rtol=1e-6)


def test_the_stack_recurrence_reference_is_the_layer_by_layer_recurrence():
    """`stack_recurrence_reference` (the stack kernel's contract) gives the
    dgates, dh0, dc0 of `backward_stack`'s layer-by-layer recurrence in
    float64, zero past each length in every layer."""
    x, params, h0, c0, lengths = _inputs(3, 8, 4, 6, 5, True)
    y, _, _, saved = wt.reference_forward_saving(x, params, h0, c0, lengths)
    rng = np.random.default_rng(3)
    dy, dhy, dcy = (tf.constant(rng.standard_normal(t.shape)) for t in (y, h0, c0))
    layer_calls = []

    def recording(*args, **kw):
        out = wt.recurrence_reference(*args, **kw)
        layer_calls.insert(0, out)  # called from the top layer down
        return out

    wt.backward_stack(params, x, h0, c0, lengths, y, saved, dy, dhy, dcy, recurrence=recording)
    dgates, dh0, dc0 = wt.stack_recurrence_reference(params, 5, saved[1], saved[2], c0, dy, dhy,
                                                     dcy, lengths)
    assert dgates.shape == (3, 6, 4, 32) and dh0.shape == dc0.shape == (3, 4, 8)
    for l, (dg, dh, dc) in enumerate(layer_calls):
        _close(dgates[l], dg, 1e-12, 1e-14)
        _close(dh0[l], dh, 1e-12, 1e-14)
        _close(dc0[l], dc, 1e-12, 1e-14)
    for b, n in enumerate(lengths.numpy().tolist()):
        assert np.all(dgates.numpy()[:, n:, b] == 0)


def test_the_stack_recurrence_reference_is_the_torch_bindings():
    """Same numbers as the torch binding's `stack_recurrence_reference` (the
    one the GPU tests check against the reverse-wavefront kernel)."""
    torch = pytest.importorskip("torch")
    from rnnfuse.backends.torch import wavefront as torch_wf

    x, params, h0, c0, lengths = _inputs(3, 8, 4, 6, 5, True)
    _, _, _, (_, gates, cseq) = wt.reference_forward_saving(x, params, h0, c0, lengths)
    rng = np.random.default_rng(2)
    upstream = [tf.constant(rng.standard_normal(s)) for s in [(6, 4, 8), (3, 4, 8), (3, 4, 8)]]
    args = [gates, cseq, c0, *upstream, lengths]
    got = wt.stack_recurrence_reference(params, 5, *args)
    t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    want = torch_wf.stack_recurrence_reference(t(params), 5, *(t(a) for a in args))
    for a, b in zip(got, want):
        _close(a, b.numpy(), 0, 1e-13)


def test_the_stack_kernels_wrapper_passes_the_ops_inputs(monkeypatch):
    """`backward_stack_kernel` hands RnnfuseWavefrontBackwardStack (here a
    spy) the whole buffer, the saved tensors, input_size, lengths as the
    ops take them ([0] for None) and `check`."""
    x, params, h0, c0, lengths = _inputs(2, 8, 3, 4, 5, True)
    y, _, _, saved = wt.reference_forward_saving(x, params, h0, c0, lengths)
    seen = []

    class Op:
        @staticmethod
        def rnnfuse_wavefront_backward_stack(**kw):
            seen.append(kw)
            lens = kw["sequence_lengths"] if kw["sequence_lengths"].shape[0] else None
            return wt.stack_recurrence_reference(kw["params"], kw["input_size"], kw["gates"],
                                                 kw["cseq"], kw["c0"], kw["dy"], kw["dhy"],
                                                 kw["dcy"], lens)

    monkeypatch.setattr(wt, "_op", lambda: Op)
    wt.backward_stack_wavefront(params, x, h0, c0, lengths, y, saved, None, None, None)
    wt.backward_stack_kernel(params, 5, saved[1], saved[2], c0, y, h0, c0, None, check=True,
                             variant=2)
    (first, second) = seen
    assert second["kernel_variant"] == 2
    assert first["input_size"] == 5 and first["check"] is False
    assert first["kernel_variant"] == library.STACK_BACKWARD_VARIANT
    _close(first["params"], params, 0, 0)
    _close(first["gates"], saved[1], 0, 0)
    _close(first["cseq"], saved[2], 0, 0)
    _close(first["sequence_lengths"], lengths, 0, 0)
    assert np.all(first["dy"].numpy() == 0) and first["dy"].shape == y.shape
    assert second["check"] is True and second["sequence_lengths"].shape == (0,)


def test_an_unknown_backward_is_refused():
    with pytest.raises(ValueError, match=r"backward must be one of .*received 'both'"):
        wt.trainable_forward(tf.zeros([2, 1, 3]), tf.zeros([1]), tf.zeros([1, 1, 8]),
                             tf.zeros([1, 1, 8]), backward="both")


def test_auto_is_the_layer_backward_without_the_op():
    """Here (no GPU, no op) "auto" never asks the library: v1, with why."""
    choice = wt.backward_choice(tf.zeros([5, 2, 3]), tf.zeros([2, 2, 8]))
    assert (choice.backward, choice.requested) == ("layer", "auto")
    assert "op is not loaded" in choice.reason and "per-layer" in choice.note
    forced = wt.backward_choice(tf.zeros([5, 2, 3]), tf.zeros([2, 2, 8]), "stack")
    assert (forced.backward, forced.reason) == ("stack", None)


@pytest.fixture
def ran_backward(monkeypatch):
    """Which of the two backward passes ran: a spy around each (they still run)."""
    return spy_each(monkeypatch, wt, ("backward_stack", "backward_stack_wavefront"))


@pytest.mark.parametrize("refusal", [None, "L x ceil(H/16) CTAs do not fit the SMs"])
def test_auto_runs_the_stack_backward_where_its_plan_accepts_the_stack(monkeypatch,
                                                                       ran_backward, refusal):
    """Where the op is loaded (faked), "auto" asks
    `library.backward_stack_reason` for this stack and runs the reverse
    wavefront where it accepts, else the per-layer backward with the
    refusal as the reason; the gradients are the float64 tape's either way."""
    from rnnfuse.backends.cuda import library

    asked = []
    monkeypatch.setattr(wt, "op_unavailable", lambda: None)
    monkeypatch.setattr(library, "backward_stack_reason", answering(refusal, asked))
    x, params, h0, c0, lengths = _inputs(3, 8, 4, 6, 5, True)
    choice = wt.backward_choice(x, h0)
    assert asked == [("lstm", 3, 8, 4, 6, 0)]
    assert (choice.backward, choice.reason) == ("stack" if refusal is None else "layer",
                                                refusal)
    recurrence = wt.stack_recurrence_reference if refusal is None else wt.recurrence_reference
    leaves = [x, params, h0, c0]
    upstream = [tf.ones_like(t) for t in wt.reference_forward(x, params, h0, c0, lengths)]
    _, want = _grads(lambda *a: wt.reference_forward(*a, lengths), leaves, upstream)
    _, got = _grads(lambda *a: wt.trainable_forward(*a, lengths,
                                                    saving=wt.reference_forward_saving,
                                                    recurrence=recurrence), leaves, upstream)
    assert ran_backward == ["backward_stack_wavefront" if refusal is None else "backward_stack"]
    for a, b in zip(got, want):
        _close(a, b, 1e-10, 1e-12)


@pytest.mark.parametrize("backward", ["layer", "stack"])
def test_run_trainable_names_the_backward_that_ran(monkeypatch, emulated_cudnn, ran_backward,
                                                  backward):
    """run_trainable's KernelRun says which backward ran ("auto"'s choice,
    here faked), and either gives the Keras variables cuDNN's gradient."""
    from rnnfuse.backends import tensorflow as tf_backend
    from rnnfuse.backends.cuda import library

    monkeypatch.setattr(wt, "forward_saving", wt.reference_forward_saving)
    monkeypatch.setattr(wt, "backward_layer", wt.recurrence_reference)
    monkeypatch.setattr(wt, "backward_stack_kernel", wt.stack_recurrence_reference)
    monkeypatch.setattr(wavefront_op, "stack_training_reason", lambda *a, **k: None)
    monkeypatch.setattr(wt, "op_unavailable", lambda: None)
    monkeypatch.setattr(library, "backward_stack_reason",
                        lambda *a: None if backward == "stack" else "refused")
    stack = _stack(3, 8, 4)
    variables = [w for level in stack.cells for cell in level for w in cell.weights]
    x = tf.constant(np.random.default_rng(5).standard_normal((3, 6, 4)))
    mask = tf.constant(np.arange(6)[None, :] < np.array([6, 3, 5])[:, None])

    def grads(run):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = run(x, StackCall(stack, mask=mask))
            loss = tf.reduce_sum(out.outputs ** 2) + tf.reduce_sum(out.final_c)
        return out.kernel, tape.gradient(loss, [x] + variables)

    ran, got = grads(wavefront_op.run_trainable)
    assert ran.name == wavefront_op.TRAINING_KERNEL_NAME and ran.note is None
    assert ran.algorithm == f"backward={backward}"
    assert ran_backward == [{"layer": "backward_stack", "stack": "backward_stack_wavefront"}[
        backward]]
    _, want = grads(tf_backend.run_stack)  # kernel "cudnn", StackCall's default
    for a, b in zip(got, want):
        _close(a, b, 1e-9, 1e-12)


def test_the_gru_reference_forward_is_the_saving_reference_in_float64():
    """`reference_forward(kind="gru")` (a tf.scan: the GPU tests' float64
    reference) gives the saving reference's y and hy, with lengths."""
    x, _, h0, _, lengths = _inputs(2, 8, 4, 6, 5, True)
    params = _gru_params(2, 8, 5, np.random.default_rng(5))
    y, hy, cy = wt.reference_forward(x, params, h0, None, lengths, kind="gru")
    want = wt.reference_forward_saving(x, params, h0, None, lengths, kind="gru")
    assert cy is None
    _close(y, want[0], 0, 1e-13)
    _close(hy, want[1], 0, 1e-13)
