"""The Python side of rnnfuse's cuDNN op, on the CPU.

The op's kernels are GPU-only, so here `cudnn_op.call_op` (the one place that
calls the op) is replaced by the CudnnRNNV3 reference of
tests/cudnn_reference.py (same flat layout, same time-major contract). That
checks everything around the kernel: argument checks, attributes (algorithm
and math type), states, masks, packing (projections included) and the
fallback decisions.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import KINDS, fused_layers, max_abs_diff, random_inputs, stack_model
from rnnfuse.backends import tensorflow as tf_backend
from rnnfuse.backends.base import StackSpec
from rnnfuse.reasons import KernelRun
from rnnfuse.backends.tensorflow import cudnn_op
from rnnfuse.layers import ProjectedLSTM
from rnnfuse.layers.projected_lstm import ProjectedLSTMCell
from rnnfuse.plan import FUSED, Algorithm, Plan


def _kernel(model):
    """The KernelRun of `model`'s last fused call (its last FusedRNN's)."""
    return fused_layers(model)[-1].last_path.kernel


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_flat_size_is_what_pack_params_builds(kind, bidirectional):
    from builders import rnn_layer

    dirs = 2 if bidirectional else 1
    cells = []
    width = 5
    for _ in range(3):
        level = []
        for _ in range(dirs):
            layer = rnn_layer(kind, 6)
            layer.build((None, None, width))
            level.append(layer.cell)
        cells.append(tuple(level))
        width = 6 * dirs
    spec = StackSpec(kind, 6, tuple(cells))
    assert int(tf_backend.pack_params(spec, "float32").shape[0]) == cudnn_op.flat_size(kind, 3, dirs, 6, 5)


def test_projection_layout_appends_the_transposed_projection_per_pseudo_layer():
    cells = []
    for n in (5, 3):
        cell = ProjectedLSTMCell(6, proj_size=3)
        cell.build((None, n))
        cells.append((cell,))
    spec = StackSpec("lstm", 6, tuple(cells), proj_size=3)
    flat = tf_backend.pack_params(spec, "float32").numpy()
    assert flat.size == cudnn_op.flat_size("lstm", 2, 1, 6, 5, proj_size=3)
    c0 = cells[0][0]
    w = 4 * 6 * 5
    r = 4 * 6 * 3
    np.testing.assert_array_equal(flat[:w], np.asarray(c0.kernel).T.reshape(-1))
    np.testing.assert_array_equal(flat[w : w + r], np.asarray(c0.recurrent_kernel).T.reshape(-1))
    np.testing.assert_array_equal(flat[w + r : w + r + 18], np.asarray(c0.projection_kernel).T.reshape(-1))


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(kind="lstmp"), "kind must be one of"),
        (dict(num_directions=3), "num_directions must be 1 or 2"),
        (dict(kind="gru", proj_size=2), "proj_size=2 needs kind='lstm'"),
        (dict(proj_size=6), "0 < proj_size < units"),
        (dict(input_size=4), "x has 5 features; input_size is 4"),
    ],
)
def test_run_op_names_the_bad_argument(kwargs, needle):
    args = dict(kind="lstm", num_layers=1, num_directions=1, units=6, input_size=5)
    args.update(kwargs)
    x = tf.zeros([7, 2, 5])
    h = tf.zeros([1, 2, 6])
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("+", r"\+")):
        cudnn_op.run_op(object(), x, h, h, tf.zeros([10]), tf.fill([2], 7), **args)


def test_run_op_checks_dtypes_and_param_size():
    x = tf.zeros([7, 2, 5], tf.float64)
    args = dict(kind="gru", num_layers=1, num_directions=1, units=6, input_size=5)
    with pytest.raises(ValueError, match="not float64"):
        cudnn_op.run_op(object(), x, x, x, x, tf.fill([2], 7), **args)
    x = tf.zeros([7, 2, 5])
    with pytest.raises(ValueError, match="h has dtype float16"):
        cudnn_op.run_op(object(), x, tf.zeros([1, 2, 6], tf.float16), x, x, tf.fill([2], 7), **args)
    with pytest.raises(ValueError, match="params has 10 elements; this stack needs 234"):
        cudnn_op.run_op(object(), x, tf.zeros([1, 2, 6]), x, tf.zeros([10]), tf.fill([2], 7), **args)


def test_math_type_follows_dtype_and_tf32():
    enabled = tf.config.experimental.tensor_float_32_execution_enabled()
    try:
        tf.config.experimental.enable_tensor_float_32_execution(False)
        assert cudnn_op.math_type_for(Algorithm.parse("persistent_static+tc"), "float32") == "fma"
        tf.config.experimental.enable_tensor_float_32_execution(True)
        assert cudnn_op.math_type_for(Algorithm.parse("standard"), "float32") == "default"
        assert cudnn_op.math_type_for(Algorithm.parse("standard+tc"), "float32") == "tensor_op"
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(enabled)
    assert cudnn_op.math_type_for(Algorithm.parse("standard"), "float16") == "tensor_op"
    assert cudnn_op.math_type_for(Algorithm.parse("standard+tcc"), "bfloat16") == "tensor_op_allow_conversion"


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_relu"])
def test_fused_stack_runs_the_op_with_the_plans_algorithm(kind, graph, emulated_op):
    model = stack_model(kind, 3, last_return_sequences=True)
    fast = rnnfuse.optimize(model, plan=Plan((3,), "persistent_dynamic+tc"))
    x = random_inputs(model, 3, np.random.default_rng(0))
    out = tf.function(lambda t: fast(t))(x) if graph else fast(x)
    assert max_abs_diff(out, model(x)) <= 2e-5
    call = emulated_op[-1]
    algorithm, math = cudnn_op.decode_algorithm_code(tf.get_static_value(call["algorithm"]))
    assert (algorithm, call["num_layers"], call["rnn_mode"]) == ("persistent_dynamic", 3, kind)
    assert math in ("tensor_op", "fma")  # fma where TF32 is off
    assert _kernel(fast) == KernelRun("RnnfuseCudnnRnn", "persistent_dynamic+tc", None)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_masked_call_runs_the_standard_algorithm(kind, emulated_op):
    # cuDNN's persistent algorithms refuse padded sequence lengths
    # (CUDNN_STATUS_NOT_SUPPORTED): never ask for one.
    model = stack_model(kind, 3, masked=True, last_return_sequences=True)
    fast = rnnfuse.optimize(model, plan=Plan((3,), "persistent_static+tc"))
    x = random_inputs(model, 3, np.random.default_rng(0))
    assert max_abs_diff(fast(x), model(x)) <= 2e-5
    assert cudnn_op.decode_algorithm_code(tf.get_static_value(emulated_op[-1]["algorithm"]))[0] == "standard"
    assert _kernel(fast).algorithm == "standard" and "masked call" in _kernel(fast).note


def test_bidirectional_states_go_in_cudnn_order(emulated_op):
    model = stack_model("lstm", 2, initial_state=True, last_return_state=True)
    fast = rnnfuse.optimize(model, plan=FUSED)
    x = random_inputs(model, 2, np.random.default_rng(1))
    for got, want in zip(keras.tree.flatten(fast(x)), keras.tree.flatten(model(x))):
        assert max_abs_diff(got, want) <= 2e-5
    assert emulated_op[-1]["input_h"].shape == (2, 2, 6)


@pytest.mark.parametrize("merge_mode", ["sum", "ave"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_sum_and_ave_below_the_top_reach_the_op_with_the_doubled_kernel(kind, merge_mode, emulated_op):
    """The op's params check (cudnn_op.flat_size: 2R inputs above level 0)
    accepts the doubled input kernels; outputs and gradients are the
    original's."""
    from builders import rnn_layer

    inp = keras.Input((7,), dtype="int32")
    x = keras.layers.Embedding(11, 5, mask_zero=True)(inp)
    x = keras.layers.Bidirectional(rnn_layer(kind, 6, return_sequences=True), merge_mode=merge_mode)(x)
    out = keras.layers.Bidirectional(rnn_layer(kind, 6, return_sequences=True))(x)
    model = keras.Model(inp, out)
    fast = rnnfuse.optimize(model, plan=FUSED)
    x = random_inputs(model, 3, np.random.default_rng(5))
    grads = []
    for m in (model, fast):
        with tf.GradientTape() as tape:
            y = m(x)
            loss = tf.reduce_sum(y**2)
        grads.append((y, tape.gradient(loss, model.trainable_variables)))
    assert max_abs_diff(grads[1][0], grads[0][0]) <= 2e-5
    for a, b in zip(grads[0][1], grads[1][1]):
        assert max_abs_diff(tf.convert_to_tensor(a), tf.convert_to_tensor(b)) <= 2e-4
    call = emulated_op[-1]
    assert (call["num_layers"], call["direction"], call["input_size"]) == (2, "bidirectional", 5)
    assert call["params"].shape[0] == cudnn_op.flat_size(kind, 2, 2, 6, 5)
    assert _kernel(fast).name == "RnnfuseCudnnRnn"


def test_absorbed_dropout_reaches_the_op_with_its_rate_and_whole_seed(emulated_op, emulated_cudnn):
    inp = keras.Input((7, 5))
    x = keras.layers.LSTM(6, return_sequences=True)(inp)
    x = keras.layers.Dropout(0.25, seed=(3 << 31) + 11)(x)
    model = keras.Model(inp, keras.layers.LSTM(6)(x))
    fast = rnnfuse.optimize(model, plan=FUSED)
    x = random_inputs(model, 2, np.random.default_rng(4))
    fast(x, training=True)
    call = emulated_op[-1]
    assert (call["dropout"], call["seed"], call["num_layers"]) == (0.25, (3 << 31) + 11, 2)
    assert _kernel(fast).name == "RnnfuseCudnnRnn"
    fast(x, training=False)
    assert emulated_op[-1]["dropout"] == 0.0
    assert emulated_cudnn == []


def test_float64_uses_cudnnrnnv3(emulated_op, emulated_cudnn):
    model = stack_model("gru", 2, dtype="float64")
    fast = rnnfuse.optimize(model, plan=FUSED)
    fast(random_inputs(model, 2, np.random.default_rng(2)))
    assert _kernel(fast).name == "CudnnRNNV3"
    assert "not float64" in _kernel(fast).note
    assert emulated_op == [] and emulated_cudnn


def test_bfloat16_and_projections_fall_back_to_the_layers_without_the_op(emulated_cudnn):
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = stack_model("lstm", 2)
    finally:
        keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model, plan=FUSED)
    fast(random_inputs(model, 2, np.random.default_rng(3)))
    (fused,) = fused_layers(fast)
    assert fused.last_path.startswith("layers: bfloat16 needs rnnfuse's cuDNN op")
    assert emulated_cudnn == []


def test_projected_stack_runs_the_op_and_matches(emulated_op, monkeypatch):
    """A ProjectedLSTM stack reaches the op with proj_size (the emulator has
    no projection, so only the call is checked)."""
    inp = keras.Input((7, 5))
    x = ProjectedLSTM(6, 3, return_sequences=True)(inp)
    x = ProjectedLSTM(6, 3)(x)
    model = keras.Model(inp, x)
    fast = rnnfuse.optimize(model, plan=FUSED)
    seen = {}

    def fake(module, **kw):
        seen.update(kw)
        t, b = kw["input"].shape[0], kw["input"].shape[1]
        return tf.zeros([t, b, 3]), tf.zeros([2, b, 3]), tf.zeros([2, b, 6]), tf.zeros([0], tf.uint8)

    monkeypatch.setattr(cudnn_op, "call_op", fake)
    out = fast(np.zeros((2, 7, 5), "float32"))
    assert out.shape == (2, 3)
    assert (seen["proj_size"], seen["num_units"], tuple(seen["input_h"].shape), tuple(seen["input_c"].shape)) == (3, 6, (2, 2, 3), (2, 2, 6))
    assert seen["params"].shape[0] == cudnn_op.flat_size("lstm", 2, 1, 6, 5, proj_size=3)


def test_what_the_op_does_not_run_has_a_reason():
    assert cudnn_op.op_unsupported_reason("float32") is None
    assert cudnn_op.op_unsupported_reason("bfloat16") is None
    assert cudnn_op.op_unsupported_reason("float16", dropout=0.2) is None
    assert "dropout below 1, not 1" in cudnn_op.op_unsupported_reason("float16", dropout=1.0)
    assert "not float64" in cudnn_op.op_unsupported_reason("float64")


def test_algorithm_codes_round_trip_and_follow_the_math_type():
    for algo in range(4):
        for math in ("default", "tensor_op", "tensor_op_allow_conversion"):
            a = Algorithm(algo, math)
            for dtype in ("float16", "bfloat16", "float32"):
                name, got_math = cudnn_op.decode_algorithm_code(cudnn_op.algorithm_code(a, dtype))
                assert (name, got_math) == (a.algorithm_name, cudnn_op.math_type_for(a, dtype))
    assert cudnn_op.algorithm_code(None, "float16") == cudnn_op.algorithm_code(Algorithm(), "float16")


def _group_and_input(kind="lstm", layers=3):
    from rnnfuse.passes import build_layer_graph, plan_fusion
    from rnnfuse.tuning import tuner

    model = stack_model(kind, layers, units=6, input_size=5, steps=7)
    (group,) = plan_fusion(build_layer_graph(model), model_name=model.name).groups
    return group, tuner._input_batch((2, 7, 5), "float32"), tuner._group_variables(group)


def test_shared_steps_trace_once_and_pass_the_algorithm_at_run_time(emulated_op):
    from rnnfuse.tuning import tuner

    group, x, variables = _group_and_input()
    algorithms = [None, "persistent_static+tc", "persistent_dynamic+tc"]
    # Inference steps (the emulated op has no backprop op; the GPU suite
    # checks gradients through the shared step).
    steps = tf_backend.timed_steps(lambda: tuner._runner(group, Plan((3,))), x, variables, False,
                                   algorithms, "float32")
    assert set(steps) == set(algorithms)
    values = {a: float(steps[a]()) for a in algorithms}
    assert len(emulated_op) == 1  # one trace (the fake op runs at trace time)
    assert tf.get_static_value(emulated_op[0]["algorithm"]) is None  # a runtime input
    alone = float(tf_backend.timed_step(tuner._runner(group, Plan((3,), algorithms[1])), x,
                                        variables, False)())
    assert all(v == pytest.approx(alone, rel=1e-6) for v in values.values()), (values, alone)
    # A step built without the runtime value runs the plan's own algorithm.
    assert tf.get_static_value(emulated_op[-1]["algorithm"]) == cudnn_op.algorithm_code(
        Algorithm.parse(algorithms[1]), "float32")


def test_a_masked_call_ignores_the_runtime_algorithm(emulated_op):
    group, x, _ = _group_and_input()
    from rnnfuse.tuning import tuner

    run = tuner._runner(group, Plan((3,)))
    mask = tf.constant([[True] * 7, [True] * 4 + [False] * 3])
    tf.function(lambda: run(x, False, mask=mask, algorithm=tf.constant(9, tf.int32)))()
    assert tf.get_static_value(emulated_op[-1]["algorithm"]) == cudnn_op.algorithm_code(None, "float32")


def test_the_tuner_builds_one_step_per_piece_set_where_the_backend_shares(emulated_op, monkeypatch):
    from rnnfuse.tuning import tuner

    group, _, _ = _group_and_input(layers=4)
    runners = []
    real_runner = tuner._runner
    monkeypatch.setattr(tuner, "_runner", lambda g, plan, *a, **k: (
        runners.append(plan.name) or real_runner(g, plan, *a, **k)))
    plans = [Plan(()), Plan((4,)), Plan((4,), "persistent_static+tc"), Plan((2, 2)),
             Plan((2, 2), "persistent_dynamic+tc"), Plan((1, 3), "persistent_static+tc")]
    steps = tuner._steps(group, plans, (2, 7, 5), "float32", False)
    assert list(steps) == [p.name for p in plans]
    assert sorted(runners) == sorted(["per-layer", "fused", "split 2+2", "split 1+3 @persistent_static+tc"])
    values = [float(s()) for s in steps.values()]
    assert all(v == pytest.approx(values[0], rel=1e-5) for v in values), values


def test_two_models_tuned_and_called_in_two_threads_each_run_their_own_plan(emulated_op, monkeypatch):
    """Thread A times model A's candidates (the tuner's shared step, whose
    algorithm is a runtime input) while thread B traces and calls model B on
    its own plan: B's trace happens while A is inside its shared step's
    trace, and every op call of each thread carries its own algorithm."""
    import threading

    from rnnfuse.tuning import tuner

    group_a, _, _ = _group_and_input("lstm", 3)
    model_b = stack_model("gru", 2, units=7, input_size=4, steps=6, last_return_sequences=True)
    fast_b = rnnfuse.optimize(model_b, plan=Plan((2,), "persistent_static+tc"))
    x_b = random_inputs(model_b, 2, np.random.default_rng(8))
    want_b = cudnn_op.algorithm_code(Algorithm.parse("persistent_static+tc"), "float32")
    a_inside, b_done = threading.Event(), threading.Event()
    seen, errors, result_a = [], [], []
    recording = cudnn_op.call_op

    def call_op(module, **kw):
        code = tf.get_static_value(kw["algorithm"])
        seen.append((threading.current_thread().name, kw["rnn_mode"], None if code is None else int(code)))
        if threading.current_thread().name == "A" and code is None and not a_inside.is_set():
            a_inside.set()  # inside A's shared step: let B trace now
            assert b_done.wait(30), "thread B did not trace while A was tracing"
        return recording(module, **kw)

    monkeypatch.setattr(cudnn_op, "call_op", call_op)
    medians = {"per-layer": 3.0, "fused": 2.0, "fused @persistent_static+tc": 2.0,
               "fused @persistent_dynamic+tc": 1.0}

    def tune_a():
        try:
            result_a.extend(tuner.tune_plans(
                [group_a], lambda g: (2, 7, 5), training=False, progress=False,
                environment={"device": "FakeGPU", "backend": "tensorflow"},
                measure=lambda steps: {n: {"median": medians[n]} for n in steps},
            ))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def call_b():
        try:
            assert a_inside.wait(30), "thread A never reached its shared step"
            out = tf.function(lambda t: fast_b(t))(x_b)
            assert max_abs_diff(out, model_b(x_b)) <= 2e-5
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
        finally:
            b_done.set()

    threads = [threading.Thread(target=tune_a, name="A"), threading.Thread(target=call_b, name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [r.plan.name for r in result_a] == ["fused @persistent_dynamic+tc"]
    b_calls = [code for thread, mode, code in seen if thread == "B"]
    a_calls = [(mode, code) for thread, mode, code in seen if thread == "A"]
    assert b_calls and all(code == want_b for code in b_calls), seen
    assert ("lstm", None) in a_calls and all(mode == "lstm" for mode, _ in a_calls), seen
    assert fused_layers(fast_b)[0].last_path.kernel.algorithm == "persistent_static+tc"
