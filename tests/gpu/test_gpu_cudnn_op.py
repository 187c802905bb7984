"""rnnfuse's own cuDNN RNN op (RnnfuseCudnnRnn) on a real GPU.

- standard algorithm vs Keras' per-layer path: every cell kind, uni- and
  bidirectional, masks (right-padded), initial and returned states; float32
  (TF32 off: tests/gpu/conftest.py) outputs within 1e-5 relative, gradients
  within 1e-4; mixed_float16 / mixed_bfloat16 within 2e-2 / 6e-2;
- persistent algorithms (forward and backward) vs a float64 reference;
- ProjectedLSTM stacks (uni/bidirectional) vs a float64 reference and vs
  PyTorch's nn.LSTM(proj_size=...) with the same weights;
- the canonical flat layout agrees with cudnnGetRNNWeightParams (the op
  checks every matrix and bias size cuDNN reports; the numbers above check
  the order);
- between-level dropout in the op: the mask read back from a probe stack,
  one mask for both passes (a gradient built from the forward output);
- proof that the op ran: the traced graph holds RnnfuseCudnnRnn (and
  RnnfuseCudnnRnnBackprop under a tape), and `last_path.kernel` says so, so a
  silent fallback to CudnnRNNV3 or to the layers fails.

Run on the GPU machine:

    python -m pytest -q -s tests/gpu/test_gpu_cudnn_op.py
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import KINDS, fused_layers, kernels_ran, random_inputs, stack_model, traced_op_types
from rnnfuse.backends import tensorflow as tf_backend
from rnnfuse.backends.tensorflow import op_build
from rnnfuse.layers import ProjectedLSTM
from rnnfuse.plan import FUSED, Plan
from rnnfuse.reasons import KernelRun

pytestmark = pytest.mark.gpu

if os.environ.get("RNNFUSE_GPU_DRYRUN"):
    pytest.skip("rnnfuse's op needs a real GPU", allow_module_level=True)

L = keras.layers
REPORT = {}
KERAS_SEED = 7  # tests/conftest.py seeds each test with it
# The op's math types as the low bits of its `algorithm` input (algo 0: standard).
_MATH_CODES = {"default": 0, "tensor_op": 1, "tensor_op_allow_conversion": 2, "fma": 3}


def teardown_module(module):
    out = os.environ.get("RNNFUSE_REPORT_DIR")
    if out:
        with open(os.path.join(out, "cudnn_op_errors.json"), "w") as f:
            json.dump(REPORT, f, indent=1, sort_keys=True)


def _rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


def _loss(out):
    flat = [tf.cast(t, tf.float32) for t in keras.tree.flatten(out)]
    return sum(tf.reduce_sum(t * (1.0 + 0.1 * tf.range(tf.shape(t)[-1], dtype=t.dtype)) + t**2) for t in flat)


def _run(model, inputs, variables=None):
    variables = variables or model.trainable_variables
    with tf.GradientTape() as tape:
        out = model(inputs, training=True)
        loss = _loss(out)
    grads = tape.gradient(loss, variables)
    return (
        [np.asarray(t) for t in keras.tree.flatten(out)],
        [np.asarray(tf.convert_to_tensor(g)) for g in grads],  # Embedding: IndexedSlices
    )


def _assert_op_ran(fast, inputs):
    def step(*xs):
        with tf.GradientTape() as tape:
            out = fast(list(xs) if len(xs) > 1 else xs[0], training=True)
            loss = _loss(out)
        return tape.gradient(loss, fast.trainable_variables)

    xs = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    types = traced_op_types(step, *[tf.convert_to_tensor(x) for x in xs])
    assert "RnnfuseCudnnRnn" in types, sorted(t for t in types if "Cudnn" in t or "Rnn" in t)
    assert "RnnfuseCudnnRnnBackprop" in types
    assert "CudnnRNNV3" not in types
    assert kernels_ran(fast) == {"RnnfuseCudnnRnn"}


def _float64_twin(model_fn, model):
    twin = model_fn("float64")
    twin.set_weights([w.astype("float64") for w in model.get_weights()])
    return twin


def test_op_builds_and_loads():
    module = op_build.load_op()
    assert module is not None, op_build.load_failure()
    print("op library:", op_build.library_path())
    assert tf_backend.op_loaded()
    assert tf_backend.tuned_algorithms()[1:] == ("persistent_static+tc", "persistent_dynamic+tc")


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("kind", KINDS)
def test_standard_float32_matches_keras_per_layer(kind, bidirectional):
    def build(dtype=None):
        inp = keras.Input((9, 5))
        x = inp
        for i in range(3):
            layer = {"lstm": L.LSTM, "gru": L.GRU}.get(kind)
            # Random (not zero) biases: with zero biases a ReLU level whose
            # input row and state are all zero has a pre-activation of exactly
            # 0, where TensorFlow's ReLU derivative is 0 and cuDNN's is not
            # (the likely cause of an 8.6% gradient difference seen for the
            # unidirectional relu stack, Keras matching float64 to 2e-7).
            cell = layer(6, return_sequences=True, dtype=dtype) if layer else L.SimpleRNN(
                6, return_sequences=True, activation="tanh" if kind == "rnn_tanh" else "relu",
                bias_initializer="random_normal", dtype=dtype,
            )
            x = L.Bidirectional(cell, dtype=dtype)(x) if bidirectional else cell(x)
        return keras.Model(inp, x)

    model = build()
    fast = rnnfuse.optimize(model, plan=FUSED)
    assert len(fused_layers(fast)) == 1
    x = np.random.default_rng(1).standard_normal((4, 9, 5)).astype("float32")
    (want,), gwant = _run(model, x)
    (got,), ggot = _run(fast, x, model.trainable_variables)
    _assert_op_ran(fast, x)
    out_err = _rel(got, want)
    grad_err = max(_rel(g, w) for g, w in zip(ggot, gwant))
    key = f"standard f32 {kind} {'bi' if bidirectional else 'uni'}"
    REPORT[key] = [out_err, grad_err]
    print(kind, bidirectional, "out", out_err, "grad", grad_err)
    assert out_err <= 1e-5
    if kind == "rnn_relu" and grad_err > 1e-4:
        # ReLU's kink: a pre-activation within rounding of 0 takes another
        # branch in one of the two float32 runs; judge both against float64.
        twin = _float64_twin(lambda dt: build(dt), model)
        _, g64 = _run(twin, x.astype("float64"))
        fused64 = max(_rel(g, w) for g, w in zip(ggot, g64))
        keras64 = max(_rel(g, w) for g, w in zip(gwant, g64))
        REPORT[key] += [fused64, keras64]
        assert fused64 <= max(1e-4, 2 * keras64)
    else:
        assert grad_err <= 1e-4


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_masks_initial_and_returned_states(kind):
    model = stack_model(kind, 3, units=8, input_size=5, steps=7, masked=False,
                        initial_state=True, last_return_state=True, last_return_sequences=True)
    fast = rnnfuse.optimize(model, plan=FUSED)
    rng = np.random.default_rng(3)
    inputs = random_inputs(model, 4, rng)
    (want), gwant = _run(model, inputs)
    got, ggot = _run(fast, inputs, model.trainable_variables)
    _assert_op_ran(fast, inputs)
    err = max(_rel(g, w) for g, w in zip(got, want))
    gerr = max(_rel(g, w) for g, w in zip(ggot, gwant))
    REPORT[f"states {kind}"] = [err, gerr]
    assert err <= 1e-5 and gerr <= 1e-4

    masked = stack_model(kind, 2, units=8, input_size=5, steps=9, masked=True,
                         last_return_sequences=True)
    fast = rnnfuse.optimize(masked, plan=FUSED)
    tokens = random_inputs(masked, 5, np.random.default_rng(4), padding="right")
    (want,), gwant = _run(masked, tokens)
    (got,), ggot = _run(fast, tokens, masked.trainable_variables)
    err, gerr = _rel(got, want), max(_rel(g, w) for g, w in zip(ggot, gwant))
    REPORT[f"mask {kind}"] = [err, gerr]
    assert err <= 1e-5 and gerr <= 1e-4
    assert kernels_ran(fast) == {"RnnfuseCudnnRnn"}


@pytest.mark.parametrize("policy,tol", [("mixed_float16", 2e-2), ("mixed_bfloat16", 6e-2)])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_half_precision_matches_keras(kind, bidirectional, policy, tol):
    def build(dtype):
        keras.config.set_dtype_policy(dtype)
        inp = keras.Input((20, 16))
        x = inp
        for _ in range(2):
            layer = (L.LSTM if kind == "lstm" else L.GRU)(32, return_sequences=True)
            x = L.Bidirectional(layer)(x) if bidirectional else layer(x)
        model = keras.Model(inp, x)
        keras.config.set_dtype_policy("float32")
        return model

    model = build(policy)
    fast = rnnfuse.optimize(model, plan=FUSED)
    (fused,) = fused_layers(fast)
    x = np.random.default_rng(5).standard_normal((8, 20, 16)).astype("float32")
    (got,), ggot = _run(fast, x, model.trainable_variables)
    assert fused.last_path == "fused", fused.last_path
    assert kernels_ran(fast) == {"RnnfuseCudnnRnn"}
    (want,), gwant = _run(model, x)
    twin = _float64_twin(build, model)
    (exact,), gexact = _run(twin, x.astype("float64"))
    err = _rel(got, want)
    gerr = max(_rel(g, w) for g, w in zip(ggot, gwant))
    # Both against float64: which side is off, if any.
    fast64 = (_rel(got, exact), max(_rel(g, w) for g, w in zip(ggot, gexact)))
    keras64 = (_rel(want, exact), max(_rel(g, w) for g, w in zip(gwant, gexact)))
    REPORT[f"{policy} {kind} {'bi' if bidirectional else 'uni'}"] = dict(
        fused_vs_keras=[err, gerr], fused_vs_f64=fast64, keras_vs_f64=keras64,
        grad_norms=[float(np.max(np.abs(g))) for g in ggot], keras_grad_norms=[float(np.max(np.abs(g))) for g in gwant],
    )
    print(policy, kind, bidirectional, err, gerr, fast64, keras64)
    assert fast64[0] <= tol and fast64[1] <= 5 * tol
    assert err <= 2 * tol


ALGOS = ["persistent_static", "persistent_dynamic", "persistent_static_small_h"]


@pytest.mark.parametrize("dtype", ["float32", "mixed_float16"])
@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_persistent_algorithms_match_float64_in_both_passes(kind, algorithm, dtype):
    def build(policy):
        keras.config.set_dtype_policy(policy)
        inp = keras.Input((30, 32))
        x = inp
        for _ in range(2):
            x = (L.LSTM if kind == "lstm" else L.GRU)(64, return_sequences=True)(x)
        model = keras.Model(inp, x)
        keras.config.set_dtype_policy("float32")
        return model

    model = build(dtype)
    name = algorithm + ("+tc" if dtype != "float32" else "")
    fast = rnnfuse.optimize(model, plan=Plan((2,), name))
    twin = _float64_twin(build, model)
    x = np.random.default_rng(6).standard_normal((16, 30, 32)).astype("float32")
    try:
        (got,), ggot = _run(fast, x, model.trainable_variables)
    except tf.errors.OpError as err:  # cuDNN refused: an op error, not an abort
        REPORT[f"{name} {kind} {dtype}"] = f"refused: {err.message[:200]}"
        pytest.skip(f"cuDNN refused {name} here: {err.message[:200]}")
    assert fused_layers(fast)[0].last_path.kernel == KernelRun("RnnfuseCudnnRnn", name, None)
    (want,), gwant = _run(twin, x.astype("float64"))
    err = _rel(got, want)
    gerr = max(_rel(g, w) for g, w in zip(ggot, gwant))
    REPORT[f"{name} {kind} {dtype}"] = [err, gerr]
    print(name, kind, dtype, err, gerr)
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert err <= tol and gerr <= 10 * tol


def _projected(policy, bidirectional=False, layers=2, units=32, proj=8):
    keras.config.set_dtype_policy(policy)
    inp = keras.Input((25, 12))
    x = inp
    for i in range(layers):
        layer = ProjectedLSTM(units, proj, return_sequences=True, use_cudnn=False if policy == "float64" else "auto")
        x = L.Bidirectional(layer)(x) if bidirectional else layer(x)
    model = keras.Model(inp, x)
    keras.config.set_dtype_policy("float32")
    return model


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
def test_projected_lstm_stack_runs_cudnn_projection(bidirectional):
    model = _projected("float32", bidirectional)
    fast = rnnfuse.optimize(model, plan=FUSED)
    (fused,) = fused_layers(fast)
    twin = _projected("float64", bidirectional)
    twin.set_weights([w.astype("float64") for w in model.get_weights()])
    x = np.random.default_rng(8).standard_normal((6, 25, 12)).astype("float32")
    (got,), ggot = _run(fast, x, model.trainable_variables)
    assert fused.last_path == "fused", fused.last_path
    _assert_op_ran(fast, x)
    (want,), gwant = _run(twin, x.astype("float64"))
    err = _rel(got, want)
    gerr = max(_rel(g, w) for g, w in zip(ggot, gwant))
    REPORT[f"projected f32 {'bi' if bidirectional else 'uni'} vs f64"] = [err, gerr]
    assert err <= 1e-5 and gerr <= 1e-4


_TORCH_SCRIPT = """
import sys, numpy as np, torch
d = np.load(sys.argv[1])
n = int(d["layers"])
ref = torch.nn.LSTM(int(d["input"]), int(d["units"]), num_layers=n, proj_size=int(d["proj"]), batch_first=True).double()
with torch.no_grad():
    for i in range(n):
        getattr(ref, f"weight_ih_l{i}").copy_(torch.from_numpy(d[f"k{i}"].T.copy()))
        getattr(ref, f"weight_hh_l{i}").copy_(torch.from_numpy(d[f"r{i}"].T.copy()))
        getattr(ref, f"bias_ih_l{i}").copy_(torch.from_numpy(d[f"b{i}"]))
        getattr(ref, f"bias_hh_l{i}").zero_()
        getattr(ref, f"weight_hr_l{i}").copy_(torch.from_numpy(d[f"p{i}"].T.copy()))
    y = ref(torch.from_numpy(d["x"]))[0].numpy()
np.save(sys.argv[2], y)
"""


def test_projected_lstm_matches_pytorch_lstmp(tmp_path):
    """Same weights in PyTorch's nn.LSTM(proj_size=8) (float64, CPU, in a
    separate process so its CUDA libraries never meet TensorFlow's)."""
    import subprocess
    import sys

    model = _projected("float32", False, layers=2)
    fast = rnnfuse.optimize(model, plan=FUSED)
    x = np.random.default_rng(9).standard_normal((6, 25, 12)).astype("float32")
    got = np.asarray(fast(x))
    assert kernels_ran(fast) == {"RnnfuseCudnnRnn"}
    arrays = {"x": x.astype(np.float64), "layers": 2, "input": 12, "units": 32, "proj": 8}
    layers = [l for l in model.layers if isinstance(l, ProjectedLSTM)]
    for i, layer in enumerate(layers):
        cell = layer.cell
        for key, v in zip("krbp", (cell.kernel, cell.recurrent_kernel, cell.bias, cell.projection_kernel)):
            arrays[f"{key}{i}"] = np.asarray(v, np.float64)
    np.savez(tmp_path / "in.npz", **arrays)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npy")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0:
        if "No module named 'torch'" in proc.stderr:
            pytest.skip("torch is not installed")
        raise AssertionError(proc.stderr[-2000:])
    want = np.load(tmp_path / "out.npy")
    err = _rel(got, want)
    REPORT["projected vs torch"] = err
    assert err <= 1e-5


def test_cudnn_refusals_are_op_errors_not_aborts():
    """Each algorithm on a shape cuDNN may refuse: the original model's
    result, or an OpError that leaves the process working (the default
    algorithm then still runs and matches)."""
    model = stack_model("lstm", 2, units=2048, input_size=16, steps=5, last_return_sequences=True)
    x = random_inputs(model, 3, np.random.default_rng(0))
    want = np.asarray(model(x))
    outcomes = {}
    for name in ALGOS:
        fast = rnnfuse.optimize(model, plan=Plan((2,), name))
        try:
            got = np.asarray(fast(x))
        except tf.errors.OpError as err:
            outcomes[name] = type(err).__name__ + ": " + err.message[:120]
            continue
        outcomes[name] = "ran"
        assert fused_layers(fast)[0].last_path.kernel == KernelRun("RnnfuseCudnnRnn", name, None)
        assert _rel(got, want) <= 1e-3, (name, _rel(got, want))
    REPORT["refusals"] = outcomes
    after = rnnfuse.optimize(model, plan=FUSED)
    assert _rel(np.asarray(after(x)), want) <= 1e-3, outcomes
    assert kernels_ran(after) == {"RnnfuseCudnnRnn"}, outcomes


def test_fit_trains_with_the_op_in_mixed_bfloat16():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = stack_model("lstm", 3, units=32, input_size=8, steps=20, head=True)
    keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model, plan=FUSED)
    fast.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(1).standard_normal((64, 20, 8)).astype("float32")
    y = np.random.default_rng(2).standard_normal((64,) + tuple(fast.output.shape[1:])).astype("float32")
    hist = fast.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    assert kernels_ran(fast) == {"RnnfuseCudnnRnn"}


@pytest.mark.parametrize("go_backwards", [False, True])
def test_single_projected_lstm_layer_runs_the_op(go_backwards):
    """ProjectedLSTM's own TensorFlow fast path is one RnnfuseCudnnRnn call
    (no mask, not under XLA) and matches the float64 generic loop."""
    def build(policy):
        keras.config.set_dtype_policy(policy)
        inp = keras.Input((25, 12))
        layer = ProjectedLSTM(32, 8, return_sequences=True, go_backwards=go_backwards,
                              use_cudnn=False if policy == "float64" else "auto")
        model = keras.Model(inp, layer(inp))
        keras.config.set_dtype_policy("float32")
        return model, layer

    model, layer = build("float32")
    twin, _ = build("float64")
    twin.set_weights([w.astype("float64") for w in model.get_weights()])
    x = np.random.default_rng(10).standard_normal((6, 25, 12)).astype("float32")
    (got,), ggot = _run(model, x)
    assert layer.last_path == "cudnn_op"
    (want,), gwant = _run(twin, x.astype("float64"))
    err = _rel(got, want)
    gerr = max(_rel(g, w) for g, w in zip(ggot, gwant))
    REPORT[f"single ProjectedLSTM go_backwards={go_backwards}"] = [err, gerr]
    assert err <= 1e-5 and gerr <= 1e-4
    types = traced_op_types(lambda t: model(t, training=True), tf.constant(x))
    assert "RnnfuseCudnnRnn" in types


def test_half_precision_gradient_parts_against_float32():
    """One LSTM layer through the op directly: each gradient (dx, dh0, dc0,
    dparams) in float16/bfloat16 against the float32 op, per math type.
    float16 must agree; the bfloat16 numbers are recorded."""
    from rnnfuse.backends.tensorflow import cudnn_op

    module = op_build.load_op()
    steps, batch, n, units = 20, 8, 16, 32
    rng = np.random.default_rng(11)
    size = cudnn_op.flat_size("lstm", 2, 1, units, n)
    arrays = [
        rng.standard_normal((steps, batch, n)),
        0.5 * rng.standard_normal((2, batch, units)),
        0.5 * rng.standard_normal((2, batch, units)),
        0.2 * rng.standard_normal((size,)),
    ]
    weights = tf.constant(rng.standard_normal((steps, batch, units)), tf.float32)

    def grads(dtype, math):
        xs = [tf.constant(a, dtype) for a in arrays]
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y, h, c, _ = module.rnnfuse_cudnn_rnn(
                input=xs[0], input_h=xs[1], input_c=xs[2], params=xs[3],
                sequence_lengths=tf.fill([batch], steps), rnn_mode="lstm",
                num_layers=2, num_units=units, input_size=n,
                algorithm=tf.constant(_MATH_CODES[math], tf.int32),
            )
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights) + tf.reduce_sum(tf.cast(h, tf.float32))
        return [np.asarray(tf.cast(t, tf.float32)) for t in [y] + tape.gradient(loss, xs)]

    ref = grads(tf.float32, "fma")
    names = ["y", "dx", "dh0", "dc0", "dparams"]
    parts = {}
    for dtype in (tf.float16, tf.bfloat16):
        for math in ("default", "tensor_op", "tensor_op_allow_conversion"):
            try:
                got = grads(dtype, math)
            except tf.errors.OpError as err:
                parts[f"{dtype.name} {math}"] = f"refused: {err.message[:150]}"
                continue
            parts[f"{dtype.name} {math}"] = {k: _rel(g, r) for k, g, r in zip(names, got, ref)}
    REPORT["gradient parts vs float32"] = parts
    print(json.dumps(parts, indent=1))
    assert all(v <= 2e-2 for v in parts["float16 tensor_op"].values())


def _dropout_probe(module, algorithm, rate, units=64, steps=20, batch=8, seed=1234):
    """A 2-level relu stack built so the dropout mask can be read back.

    Level 0 is a positive relu layer (its outputs y1 >= 0); level 1 has the
    identity as input kernel, no recurrence and a 0.5 bias, so its output
    is x2 + 0.5 with x2 = dropout(y1) = mask * y1 / (1 - rate). From one
    traced call (the way `fit` runs it) this returns y1 (the same level 0
    without dropout), x2 of two calls, and the params gradient of
    sum(y2 * v) from the first call, with v.
    """
    from rnnfuse.plan import Algorithm
    from rnnfuse.backends.tensorflow import cudnn_op

    rng = np.random.default_rng(21)
    h = units
    w0 = 0.1 * rng.random((h, h))
    r0 = 0.02 * rng.random((h, h))
    flat = np.concatenate([
        w0.ravel(), r0.ravel(),                      # W(p0) = [W, R]
        np.eye(h).ravel(), np.zeros(h * h),          # W(p1) = [I, 0]
        np.zeros(h), np.full(h, 0.05),               # B(p0) = [b_in, b_rec]
        np.zeros(h), np.full(h, 0.5),                # B(p1)
    ]).astype("float32")
    assert flat.size == cudnn_op.flat_size("rnn_relu", 2, 1, h, h)
    x = tf.constant(rng.random((steps, batch, h)), tf.float32)
    v = tf.constant(rng.standard_normal((steps, batch, h)), tf.float32)
    lengths = tf.fill([batch], steps)
    params = tf.constant(flat)
    algo = Algorithm.parse(algorithm)

    @tf.function
    def step(p):
        with tf.GradientTape() as tape:
            tape.watch(p)
            y, _, _ = cudnn_op.run_op(
                module, x, tf.zeros([2, batch, h]), tf.zeros([0]), p, lengths, kind="rnn_relu",
                num_layers=2, num_directions=1, units=h, input_size=h, algorithm=algo,
                dropout=rate, seed=seed,
            )
            loss = tf.reduce_sum(y * v)
        return y, tape.gradient(loss, p)

    y_a, grad = step(params)
    y_b, _ = step(params)
    level0 = flat[: 2 * h * h].tolist() + flat[4 * h * h : 4 * h * h + 2 * h].tolist()
    y1, _, _ = cudnn_op.run_op(
        module, x, tf.zeros([1, batch, h]), tf.zeros([0]), tf.constant(level0, tf.float32),
        lengths, kind="rnn_relu", num_layers=1, num_directions=1, units=h, input_size=h,
        algorithm=algo,
    )
    return (np.asarray(y1), np.asarray(y_a) - 0.5, np.asarray(y_b) - 0.5,
            np.asarray(grad), np.asarray(v))


@pytest.mark.parametrize("algorithm", ["standard", "persistent_static", "persistent_dynamic"])
def test_between_level_dropout_runs_in_the_op_with_one_mask_for_both_passes(algorithm):
    """cuDNN's dropout inside RnnfuseCudnnRnn: kept values are y1 / (1 - rate),
    about `rate` of them are dropped, a second step draws another mask, and
    the backward pass uses the forward's mask: the gradient of level 1's
    input kernel is sum_t,b v x2^T with x2 read from the forward's output."""
    module = op_build.load_op()
    rate, h = 0.3, 64
    try:
        y1, x2_a, x2_b, grad, v = _dropout_probe(module, algorithm, rate, units=h)
    except tf.errors.OpError as err:
        REPORT[f"dropout {algorithm}"] = f"refused: {err.message[:200]}"
        raise
    assert (y1 > 1e-3).all()  # level 0 positive: a zero in x2 is a dropped unit
    dropped = np.abs(x2_a) < 1e-6
    kept = ~dropped
    np.testing.assert_allclose(x2_a[kept], y1[kept] / (1 - rate), rtol=1e-5)
    share = float(dropped.mean())
    assert abs(share - rate) < 0.03, share
    assert (dropped != (np.abs(x2_b) < 1e-6)).mean() > 0.2  # a new mask per step
    # Level 1's input kernel sits after W(p0) (2 h*h) in the flat buffer.
    d_identity = grad[2 * h * h : 3 * h * h].reshape(h, h)
    want = np.einsum("tbi,tbj->ij", v.astype("float64"), x2_a.astype("float64"))
    err = _rel(d_identity, want)
    # Its recurrent kernel sees h2(t-1) = y2(t-1) = x2(t-1) + 0.5 (h2(-1) = 0).
    d_rec = grad[3 * h * h : 4 * h * h].reshape(h, h)
    h_prev = np.concatenate([np.zeros_like(x2_a[:1]), x2_a[:-1] + 0.5]).astype("float64")
    rec_err = _rel(d_rec, np.einsum("tbi,tbj->ij", v.astype("float64"), h_prev))
    REPORT[f"dropout {algorithm}"] = dict(share=share, dW=err, dR=rec_err)
    print("dropout", algorithm, share, err, rec_err)
    assert err <= 1e-4 and rec_err <= 1e-4


def test_keras_stack_with_absorbed_dropout_trains_on_the_op():
    """LSTM -> Dropout -> LSTM fused: the training step runs RnnfuseCudnnRnn
    (not CudnnRNNV3), inference is the original's, and `fit` trains."""
    inp = keras.Input((30, 16))
    x = L.LSTM(64, return_sequences=True)(inp)
    x = L.Dropout(0.25, seed=5)(x)
    x = L.LSTM(64)(x)
    model = keras.Model(inp, L.Dense(1)(x))
    fast = rnnfuse.optimize(model, plan=FUSED)
    xs = np.random.default_rng(12).standard_normal((32, 30, 16)).astype("float32")
    _assert_op_ran(fast, xs)
    assert _rel(fast(xs, training=False), model(xs, training=False)) <= 1e-5
    a, b = fast(xs, training=True), fast(xs, training=True)
    assert _rel(a, b) > 1e-3  # dropout is on, with new masks per call
    fast.compile(optimizer="adam", loss="mse")
    ys = np.random.default_rng(13).standard_normal((32, 1)).astype("float32")
    hist = fast.fit(xs, ys, batch_size=8, epochs=4, verbose=0)
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    assert kernels_ran(fast) == {"RnnfuseCudnnRnn"}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_one_traced_step_runs_each_algorithm_as_a_step_traced_for_it_alone(dtype):
    """The algorithm as the op's runtime input (the fused calls' `algorithm`
    argument, what the tuner's shared steps pass): one traced function, called with each
    algorithm's code, gives that algorithm's outputs and gradients exactly
    as a function traced with the algorithm fixed, and traces once."""
    from rnnfuse.plan import Algorithm
    from rnnfuse.backends.tensorflow import cudnn_op
    from rnnfuse.passes import build_layer_graph, plan_fusion
    from rnnfuse.tuning import tuner

    keras.config.set_dtype_policy("mixed_float16" if dtype == "float16" else "float32")
    model = stack_model("lstm", 3, units=64, input_size=16, steps=30)
    (group,) = plan_fusion(build_layer_graph(model), model_name=model.name).groups
    x = tf.cast(tf.random.stateless_normal((8, 30, 16), seed=(1, 2)), dtype)
    variables = tuner._group_variables(group)

    def grads_of(run):
        with tf.GradientTape() as tape:
            y = run(x, True)
            loss = _loss(y)
        return [y] + tape.gradient(loss, variables)

    shared_run = tuner._runner(group, Plan((3,)))

    @tf.function
    def shared(code):
        return grads_of(lambda t, training: shared_run(t, training, algorithm=code))

    algorithms = [None, "persistent_static+tc", "persistent_dynamic+tc"]
    got, want = {}, {}
    for a in algorithms:
        code = cudnn_op.algorithm_code(None if a is None else Algorithm.parse(a), dtype)
        got[a] = [np.asarray(tf.cast(t, tf.float32)) for t in shared(tf.constant(code, tf.int32))]
        layer = rnnfuse.FusedRNN([v.layer for v in group.views], plan=Plan((3,), a))
        alone = tf.function(lambda: grads_of(lambda t, training: layer(t, training=training)))
        want[a] = [np.asarray(tf.cast(t, tf.float32)) for t in alone()]
        assert layer.last_path.kernel.algorithm == (a or "standard")
    assert shared.experimental_get_tracing_count() == 1
    errors = {str(a): max(_rel(g, w) for g, w in zip(got[a], want[a])) for a in algorithms}
    between = max(_rel(g, w) for g, w in zip(want["persistent_static+tc"], want[None]))
    REPORT[f"runtime algorithm {dtype}"] = dict(shared_vs_alone=errors, persistent_vs_standard=between)
    print("runtime algorithm", dtype, errors, "persistent vs standard", between)
    assert all(e <= 1e-6 for e in errors.values()), errors


def test_the_tuner_traces_one_step_per_piece_set_on_the_gpu(monkeypatch):
    """Tuning a 4-layer run on the GPU: the fused plans that differ only in
    their algorithm share one runner (one trace), and every algorithm is
    still timed."""
    from rnnfuse.passes import build_layer_graph, plan_fusion
    from rnnfuse.tuning import tuner

    runners = []
    real_runner = tuner._runner
    monkeypatch.setattr(tuner, "_runner", lambda group, plan, *a, **k: (
        runners.append(plan.name) or real_runner(group, plan, *a, **k)))
    model = stack_model("gru", 4, units=64, input_size=16, steps=40)
    (group,) = plan_fusion(build_layer_graph(model), model_name=model.name).groups
    (result,) = tuner.tune_plans([group], lambda g: (32, 40, 16), progress=False,
                                 check_gradients=lambda *a: 0.0)
    assert result.source == "measured"
    timed = set(result.timings)
    assert {"per-layer", "fused", "fused @persistent_static+tc", "fused @persistent_dynamic+tc"} <= timed
    # One runner for the original layers, one per piece set timed.
    piece_sets = {name.split(" @")[0] for name in timed if name != "per-layer"}
    assert len(runners) == 1 + len(piece_sets), (runners, sorted(timed))
    assert {r.split(" @")[0] for r in runners} == {"per-layer", *piece_sets}
