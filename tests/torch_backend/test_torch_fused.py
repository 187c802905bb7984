"""optimize(model) under Keras' torch backend: the real fused kernels on the CPU.

Every test compares the optimized model with the original one (Keras' own
torch-backend layers), outputs and gradients, and checks through the
`torch_calls` spy whether the one fused `torch._VF` call ran (or did not).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import torch
from hypothesis import given

import rnnfuse
from builders import KINDS, fused_layers, lstm_dropout_lstm, max_abs_diff, random_inputs, rnn_layer, sequence_input, stack_model
from rnnfuse.backends import torch as torch_backend
from stack_cases import case_model, masked_stack_with_head, stacks

L = keras.layers


def _randomize(model, rng):
    for v in model.weights:
        v.assign(rng.uniform(-0.6, 0.6, v.shape).astype(v.dtype))


def _optimized_and_compared(model, seed, torch_calls, *, cut_first_row=False):
    """(fast, inputs): `model` randomized from `seed`, optimized, and
    compared with its optimization on random inputs (the first row's tokens
    from the fourth on padding where `cut_first_row`), `torch_calls`
    holding the optimized model's calls."""
    rng = np.random.default_rng(seed)
    _randomize(model, rng)
    fast = rnnfuse.optimize(model)
    inputs = random_inputs(model, 3, rng)
    if cut_first_row:
        inputs[0, 3:] = 0
    torch_calls.clear()
    _compare(model, fast, inputs, rng, tol=2e-5, grad_tol=1e-4)
    return fast, inputs


def _outputs_and_grads(model, inputs, loss_w):
    variables = list(model.trainable_variables)
    out = model(inputs, training=False)
    flat = [t.float() for t in keras.tree.flatten(out)]
    loss = sum((t * w[: t.shape[-1]]).sum() for t, w in zip(flat, loss_w))
    grads = torch.autograd.grad(loss, [v.value for v in variables], allow_unused=True)
    return out, {v.path: g for v, g in zip(variables, grads)}


def _compare(model, fast, inputs, rng, *, tol, grad_tol):
    loss_w = [torch.as_tensor(rng.standard_normal(64).astype("float32")) for _ in range(8)]
    expected, expected_grads = _outputs_and_grads(model, inputs, loss_w)
    got, got_grads = _outputs_and_grads(fast, inputs, loss_w)
    shapes = lambda s: keras.tree.map_structure(lambda t: tuple(t.shape), s)  # noqa: E731
    assert shapes(got) == shapes(expected)
    assert max_abs_diff(got, expected) <= tol
    assert got_grads.keys() == expected_grads.keys()
    for path, g in expected_grads.items():
        assert g is not None and got_grads[path] is not None, path
        diff = float((got_grads[path].double() - g.double()).abs().max())
        assert diff <= grad_tol, (path, diff)


@given(case=stacks(max_layers=4))
def test_optimized_stack_matches_original(case, torch_calls):
    model, rng = case_model(case)
    fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    assert fused.stack.num_levels == case["num_layers"]
    inputs = random_inputs(model, 3, rng, padding=case["padding"])
    torch_calls.clear()
    _compare(model, fast, inputs, rng, tol=2e-5, grad_tol=1e-4)

    masked = case["masked"]
    mask = (inputs != 0) if masked else None
    right_padded = mask is None or bool(torch_backend.mask_is_supported(mask))
    fused_ran = not (case["go_backwards_first"] and masked) and right_padded
    assert bool(torch_calls) == fused_ran, fused.last_path
    if fused_ran:
        assert len(torch_calls) == 1
        assert torch_calls[0]["num_layers"] == case["num_layers"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("functional", [True, False])
def test_sequential_and_functional_masked_stacks(kind, functional, torch_calls):
    model, fast = masked_stack_with_head(kind, functional)
    rng = np.random.default_rng(3)
    inputs = random_inputs(model, 4, rng)
    inputs[0, 2:] = 0  # at least one padded sequence
    torch_calls.clear()
    _compare(model, fast, inputs, rng, tol=2e-5, grad_tol=1e-4)
    assert [c["packed"] for c in torch_calls] == [True]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_padded_steps_repeat_the_last_output_like_keras_torch(kind):
    """Keras' torch backend runs masked LSTM/GRU on its generic loop.

    With zero_output_for_mask=False that loop repeats the last valid output
    at padded steps (Keras' TensorFlow cuDNN path would give zeros); the
    fused layer must do what Keras does under the backend it runs on.
    """
    model = stack_model(kind, 2, last_return_sequences=True, masked=True)
    fast = rnnfuse.optimize(model)
    tokens = np.array([[3, 4, 5, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7]], "int32")
    got = keras.ops.convert_to_numpy(fast(tokens))
    expected = keras.ops.convert_to_numpy(model(tokens))
    np.testing.assert_allclose(got, expected, atol=2e-6)
    np.testing.assert_allclose(got[0, 3:], np.repeat(got[0, 2:3], 4, axis=0), atol=0)
    assert np.abs(got[0, 3:]).max() > 0


def test_zero_output_for_mask_gives_zeros_at_padded_steps(torch_calls):
    inp = keras.Input((6,), dtype="int32")
    x = L.Embedding(11, 4, mask_zero=True)(inp)
    x = L.RNN(L.GRUCell(5), return_sequences=True)(x)
    x = L.RNN(L.GRUCell(5), return_sequences=True, zero_output_for_mask=True)(x)
    model = keras.Model(inp, x)
    fast = rnnfuse.optimize(model)
    tokens = np.array([[3, 4, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6]], "int32")
    got = keras.ops.convert_to_numpy(fast(tokens))
    assert torch_calls
    np.testing.assert_allclose(got, keras.ops.convert_to_numpy(model(tokens)), atol=2e-6)
    assert not got[0, 2:].any()


@pytest.mark.parametrize("kind", KINDS)
def test_masks_that_are_not_right_padded_run_the_original_layers(kind, torch_calls):
    model = stack_model(kind, 3, last_return_sequences=True, masked=True)
    fast = rnnfuse.optimize(model)
    tokens = random_inputs(model, 3, np.random.default_rng(4), padding="middle")
    tokens[0, 1] = 0  # a hole that is not right padding
    torch_calls.clear()
    assert max_abs_diff(fast(tokens), model(tokens)) == 0.0
    assert not torch_calls


@pytest.mark.parametrize("kind", ["lstm", "rnn_tanh"])
def test_go_backwards_first_layer(kind, torch_calls):
    model = stack_model(kind, 3, go_backwards_first=True, last_return_sequences=True)
    _optimized_and_compared(model, 2, torch_calls)
    assert len(torch_calls) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_initial_state_and_return_state(kind, torch_calls):
    model = stack_model(kind, 3, initial_state=True, last_return_state=True, last_return_sequences=True)
    fast, inputs = _optimized_and_compared(model, 6, torch_calls)
    assert len(torch_calls) == 1
    assert len(fast(inputs)) == 1 + (2 if kind == "lstm" else 1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("merge_mode", ["concat", "sum", None])
@pytest.mark.parametrize("masked", [False, True])
def test_bidirectional_stacks(kind, merge_mode, masked, torch_calls):
    inp, x = sequence_input(masked, 7, 5)
    for i in range(3):
        last = i == 2
        layer = rnn_layer(kind, 4, return_sequences=True, return_state=last)
        x = L.Bidirectional(layer, merge_mode=merge_mode if last else "concat")(x)
    model = keras.Model(inp, x)
    _optimized_and_compared(model, 9, torch_calls, cut_first_row=masked)
    assert len(torch_calls) == 1
    assert torch_calls[0]["bidirectional"] and torch_calls[0]["num_layers"] == 3


def _merged_stack(kind, merge_mode, *, masked, levels=3, units=4, layer=None):
    """`levels` Bidirectional layers; all but the top merge by `merge_mode`,
    the top concatenates and returns its states."""
    inp, x = sequence_input(masked, 7, 5)
    layer = layer or (lambda **kw: rnn_layer(kind, units, **kw))
    for i in range(levels):
        last = i == levels - 1
        inner = layer(return_sequences=True, return_state=last)
        x = L.Bidirectional(inner, merge_mode="concat" if last else merge_mode, name=f"b{i}")(x)
    return keras.Model(inp, x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("merge_mode", ["sum", "ave"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "right_padded"])
def test_sum_and_ave_below_the_top_fuse_into_one_call(kind, merge_mode, masked, torch_calls):
    """The levels above a sum/ave Bidirectional read cuDNN's [fwd,
    bwd] through their input kernel packed doubled ([W; W] or [W/2; W/2])."""
    model = _merged_stack(kind, merge_mode, masked=masked)
    report = rnnfuse.analyze(model)
    assert [g.layers for g in report.groups] == [("b0", "b1", "b2")] and report.skipped == {}
    rng = np.random.default_rng(21)
    _randomize(model, rng)
    fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    assert fused.stack.input_merges == (None, merge_mode, merge_mode)
    inputs = random_inputs(model, 3, rng)
    if masked:
        inputs[0, 3:] = 0
    torch_calls.clear()
    _compare(model, fast, inputs, rng, tol=2e-5, grad_tol=1e-4)
    assert fused.last_path == "fused"
    (call,) = torch_calls  # the optimized model's one call of all 3 levels
    assert call["num_layers"] == 3 and call["bidirectional"] and call["packed"] is masked
    assert tuple(call["params"][4 * 2].shape)[1] == 2 * 4  # level 1 w_ih reads [fwd, bwd]


@pytest.mark.parametrize("pieces", [(), (1, 2), (2, 1)])
def test_pieces_split_after_a_summing_level(pieces, torch_calls):
    """A split after a "sum" level: the piece below ends with that layer's
    own merge and the piece above reads it plainly (nothing doubled there)."""
    model = _merged_stack("gru", "sum", masked=True)
    rng = np.random.default_rng(22)
    _randomize(model, rng)
    layers = [model.get_layer(f"b{i}") for i in range(3)]
    inputs = random_inputs(model, 3, rng)
    inputs[0, 3:] = 0
    embed = model.layers[1]
    variables = [v.value for layer in layers for v in layer.trainable_variables]
    # FusedRNN's own pieces (what first-batch tuning switches to).
    fused = rnnfuse.FusedRNN(layers, plan=rnnfuse.Plan(pieces))
    torch_calls.clear()
    got = fused(embed(inputs), mask=embed.compute_mask(inputs))
    assert [c["num_layers"] for c in torch_calls] == list(pieces)
    want = model(inputs)
    assert max_abs_diff(got, want) <= 2e-5
    loss = lambda out: sum((t**2).sum() for t in keras.tree.flatten(out))  # noqa: E731
    for a, b in zip(torch.autograd.grad(loss(got), variables), torch.autograd.grad(loss(want), variables)):
        assert float((a - b).abs().max()) <= 1e-4
    if not pieces:
        return
    # A static split plan: one FusedRNN per piece.
    fast = rnnfuse.optimize(model, plan=rnnfuse.Plan(pieces))
    assert [f.stack.input_merges for f in fused_layers(fast)] == [
        tuple(None if i == 0 else "sum" for i in range(p)) for p in pieces
    ]
    torch_calls.clear()
    _compare(model, fast, inputs, rng, tol=2e-5, grad_tol=1e-4)
    assert [c["num_layers"] for c in torch_calls] == list(pieces)


def test_a_summing_bidirectional_then_a_unidirectional_run_is_two_calls(torch_calls):
    inp = keras.Input((7, 5))
    x = L.Bidirectional(L.LSTM(4, return_sequences=True), merge_mode="ave", name="b0")(inp)
    x = L.Bidirectional(L.LSTM(4, return_sequences=True), merge_mode="ave", name="b1")(x)
    x = L.LSTM(4, return_sequences=True, name="u0")(x)
    model = keras.Model(inp, L.LSTM(4, name="u1")(x))
    assert [g.layers for g in rnnfuse.analyze(model).groups] == [("b0", "b1"), ("u0", "u1")]
    rng = np.random.default_rng(23)
    _randomize(model, rng)
    fast = rnnfuse.optimize(model)
    assert [f.stack.input_merges for f in fused_layers(fast)] == [(None, "ave"), (None, None)]
    torch_calls.clear()
    _compare(model, fast, random_inputs(model, 3, rng), rng, tol=2e-5, grad_tol=1e-4)
    assert [(c["num_layers"], c["bidirectional"]) for c in torch_calls] == [(2, True), (2, False)]


@pytest.mark.parametrize("merge_mode", ["sum", "ave"])
def test_projected_bidirectional_sum_and_ave_fuse(merge_mode, torch_calls):
    from rnnfuse.layers import ProjectedLSTM

    model = _merged_stack(
        "lstm", merge_mode, masked=True,
        layer=lambda **kw: ProjectedLSTM(7, 3, **kw),
    )
    rng = np.random.default_rng(24)
    _randomize(model, rng)
    fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    assert fused.stack.proj_size == 3 and fused.stack.input_merges == (None, merge_mode, merge_mode)
    inputs = random_inputs(model, 3, rng)
    torch_calls.clear()
    _compare(model, fast, inputs, rng, tol=2e-5, grad_tol=1e-4)
    # The original ProjectedLSTM layers make their own one-level calls.
    (call,) = [c for c in torch_calls if c["num_layers"] == 3]
    assert call["packed"] and len(call["params"]) == 5 * 6
    assert tuple(call["params"][5 * 2].shape) == (4 * 7, 2 * 3)  # level 1 w_ih: [4H, 2P]


@pytest.mark.parametrize("policy, tol", [("mixed_bfloat16", 6e-2), ("mixed_float16", 1e-2)])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_mixed_precision_runs_fused_in_the_compute_dtype(policy, tol, kind, torch_calls):
    keras.config.set_dtype_policy(policy)
    try:
        model = stack_model(kind, 3, last_return_sequences=True, last_return_state=True, masked=True)
    finally:
        keras.config.set_dtype_policy("float32")
    rng = np.random.default_rng(12)
    fast = rnnfuse.optimize(model)
    inputs = random_inputs(model, 3, rng)
    torch_calls.clear()
    _compare(model, fast, inputs, rng, tol=tol, grad_tol=10 * tol)
    compute = getattr(torch, policy.split("_")[1])
    assert {p.dtype for p in torch_calls[0]["params"]} == {compute}
    out = fast(inputs)
    assert {t.dtype for t in keras.tree.flatten(out)} == {compute}
    assert all(v.value.dtype == torch.float32 for v in model.trainable_variables)


def test_without_the_backend_the_original_layers_run_exactly(monkeypatch, torch_calls):
    monkeypatch.setattr(torch_backend, "is_available", lambda: False)
    model = stack_model("lstm", 3, masked=True, head=True)
    fast = rnnfuse.optimize(model)
    x = random_inputs(model, 3, np.random.default_rng(0))
    assert max_abs_diff(fast(x), model(x)) == 0.0
    assert not torch_calls
    assert fused_layers(fast)[0].last_path.startswith("layers:")


def test_unsupported_dtype_runs_the_original_layers(torch_calls):
    model = stack_model("gru", 2, dtype="float64")
    fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    x = random_inputs(model, 2, np.random.default_rng(0)).astype("float64")
    assert max_abs_diff(fast(x), model(x)) <= 1e-12
    assert len(torch_calls) == 1 and torch_calls[0]["params"][0].dtype == torch.float64
    assert torch_backend.unsupported_reason(fused.stack, "int8") is not None


def test_assigning_an_original_variable_changes_the_fused_output(torch_calls):
    model = stack_model("lstm", 3, last_return_sequences=True)
    fast = rnnfuse.optimize(model)
    x = random_inputs(model, 2, np.random.default_rng(0))
    before = keras.ops.convert_to_numpy(fast(x))
    kernel = model.get_layer("lstm_1").cell.recurrent_kernel
    kernel.assign(keras.ops.convert_to_numpy(kernel.value.detach()) * 2.0)
    after = keras.ops.convert_to_numpy(fast(x))
    assert torch_calls
    assert np.max(np.abs(after - before)) > 1e-3
    assert max_abs_diff(after, model(x)) <= 2e-5


def _snapshot(model):
    return [keras.ops.convert_to_numpy(v.value.detach()).copy() for v in model.trainable_variables]


def _restore(model, values):
    for v, value in zip(model.trainable_variables, values):
        v.assign(value)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_fit_on_the_optimized_model_trains_the_original_like_fit_on_it(kind, torch_calls, tmp_path):
    model = stack_model(kind, 3, head=True, masked=True)
    fast = rnnfuse.optimize(model)
    rng = np.random.default_rng(1)
    x = random_inputs(model, 8, rng)
    y = rng.standard_normal((8, 3)).astype("float32")
    start = _snapshot(model)
    trained = []
    for m in (model, fast):
        _restore(model, start)
        m.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        m.fit(x, y, epochs=2, batch_size=4, verbose=0, shuffle=False)
        trained.append(_snapshot(model))
    assert torch_calls, "the fused path did not run"
    for a, b, s in zip(*trained, start):
        assert np.abs(a - s).max() > 1e-4
        np.testing.assert_allclose(b, a, atol=1e-5)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert max_abs_diff(loaded(x), model(x)) <= 1e-6


def test_absorbed_dropout_goes_to_the_fused_call_when_training(torch_calls):
    model = lstm_dropout_lstm(5, 0.25, 6, 3)
    fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    assert fused.absorbed_dropout
    data = np.random.default_rng(0).standard_normal((2, 6, 3)).astype("float32")
    assert max_abs_diff(fast(data, training=False), model(data, training=False)) <= 2e-6
    assert torch_calls[-1]["dropout"] == 0.0
    fast(data, training=True)
    assert torch_calls[-1]["dropout"] == 0.25 and torch_calls[-1]["train"]


def test_an_eager_call_skips_keras_layer_call_with_its_semantics(monkeypatch, torch_calls):
    """An eager call on a plain tensor runs `call` without Keras'
    `Layer.__call__`, with what it does: the training flag Keras would pass
    (from the outer call, or given, None included), the same outputs; a
    masked input or a hook (global or the layer's) takes Keras' own
    `__call__` (the hook runs)."""
    model = lstm_dropout_lstm(5, 0.25, 6, 3)
    fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    entered, trainings = [], []
    keras_call, call = keras.layers.Layer.__call__, type(fused).call
    monkeypatch.setattr(keras.layers.Layer, "__call__",
                        lambda self, *a, **k: (entered.append(self), keras_call(self, *a, **k))[1])
    monkeypatch.setattr(type(fused), "call",
                        lambda self, *a, **k: (trainings.append(k.get("training")),
                                               call(self, *a, **k))[1])
    data = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 6, 3)).astype("float32"))
    class Outer(keras.layers.Layer):  # calls the layer without a training flag
        def call(self, x, training=None):
            return fused(x)

    outer = Outer()
    calls = [lambda t: fast(data, training=t), lambda t: fused(data, training=t),
             lambda t: fused(data), lambda t: outer(data, training=t)]
    real, runs = type(fused)._calls_bare, {}
    for bare in (False, True):
        monkeypatch.setattr(type(fused), "_calls_bare", real if bare else (lambda *_: False))
        trainings.clear()
        entered.clear()
        outs = []
        for run in calls:
            for training in (True, False, None):
                torch.manual_seed(1)
                outs.append(run(training))
        runs[bare] = (outs, list(trainings), fused in entered)
    (bare_outs, bare_flags, bare_entered), (outs, flags, keras_entered) = runs[True], runs[False]
    assert not bare_entered and keras_entered and bare_flags == flags
    assert all(torch.equal(a, b) for a, b in zip(bare_outs, outs))
    assert 0.25 in {c["dropout"] for c in torch_calls}
    entered.clear()
    masked = data.clone()
    masked._keras_mask = torch.ones((2, 6), dtype=torch.bool)
    fused(masked)
    hooked = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: hooked.append(1))
    fused(data)
    handle.remove()
    fused.register_forward_hook(lambda *_: hooked.append(2))
    fused(data)
    assert entered == [fused] * 3 and hooked[0] == 1 and hooked[-1] == 2


def test_input_dropout_of_first_layer_matches_keras_in_training(torch_calls):
    model = stack_model("gru", 2, dropout_first=0.4, last_return_sequences=True)
    fast = rnnfuse.optimize(model)
    x = random_inputs(model, 4, np.random.default_rng(5))
    # Keras' torch backend draws an unseeded layer's dropout mask from
    # PyTorch's global RNG (a seeded one from the cell's seed generator).
    generator = model.layers[1].cell.seed_generator
    state = keras.ops.convert_to_numpy(generator.state.value).copy()
    torch.manual_seed(7)
    expected = model(x, training=True)
    generator.state.assign(state)
    torch.manual_seed(7)
    got = fast(x, training=True)
    assert torch_calls
    assert max_abs_diff(got, expected) <= 2e-5
    torch.manual_seed(8)
    assert max_abs_diff(fast(x, training=True), expected) > 1e-3  # a new mask
    assert max_abs_diff(fast(x, training=False), model(x, training=False)) <= 2e-5


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_relu"])
def test_rnn_of_cells_and_stacked_cells(kind, torch_calls):
    cell = {"lstm": L.LSTMCell, "gru": L.GRUCell, "rnn_relu": L.SimpleRNNCell}[kind]
    kwargs = {"activation": "relu"} if kind == "rnn_relu" else {}
    inp = keras.Input((6, 3))
    x = L.RNN(L.StackedRNNCells([cell(4, **kwargs), cell(4, **kwargs)]), return_sequences=True)(inp)
    x = L.RNN(cell(4, **kwargs), return_sequences=True)(x)
    model = keras.Model(inp, x)
    _optimized_and_compared(model, 3, torch_calls)
    assert len(torch_calls) == 1 and torch_calls[0]["num_layers"] == 3


def test_analyze_reports_groups_and_reasons_under_torch():
    inp = keras.Input((6, 3))
    x = L.LSTM(4, return_sequences=True)(inp)
    x = L.LSTM(4, return_sequences=True)(x)
    x = L.LSTM(4, return_sequences=True, recurrent_dropout=0.2)(x)
    report = rnnfuse.analyze(keras.Model(inp, x))
    assert len(report.groups) == 1
    assert len(report.groups[0].layers) == 2
    assert any("recurrent_dropout" in str(r) for r in report.skipped.values())


def test_saved_optimized_model_loads_and_runs_fused(torch_calls, tmp_path):
    model = stack_model("gru", 3, masked=True, head=True)
    rng = np.random.default_rng(13)
    _randomize(model, rng)
    fast = rnnfuse.optimize(model)
    x = random_inputs(model, 3, rng)
    x[0, 2:] = 0
    path = tmp_path / "fast.keras"
    fast.save(path, fused=True)
    loaded = keras.models.load_model(path)
    assert len(fused_layers(loaded)) == 1
    torch_calls.clear()
    assert max_abs_diff(loaded(x), model(x)) <= 2e-5
    assert len(torch_calls) == 1


def test_not_implemented_from_the_torch_backend_runs_the_original_layers(monkeypatch):
    """FusedRNN catches NotImplementedError from run_stack."""
    import keras

    from rnnfuse import FusedRNN, PathKind

    def refuse(*args, **kwargs):
        raise NotImplementedError("not this call")

    monkeypatch.setattr(torch_backend, "run_stack", refuse)
    a = keras.layers.GRU(4, return_sequences=True)
    b = keras.layers.GRU(4)
    x = np.random.default_rng(0).standard_normal((2, 5, 3)).astype("float32")
    expected = keras.ops.convert_to_numpy(b(a(x)))
    fused = FusedRNN([a, b])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(fused(x)), expected)
    assert fused.last_path.kind is PathKind.LAYERS
    assert fused.last_path.reason.rule == "not_implemented"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("return_state", [False, True])
def test_zero_output_for_mask_last_output_is_the_last_steps(kind, return_state, torch_calls):
    """Keras' loop returns the last time step's output: zero for a padded row
    (the fused call's final state is the last valid step's)."""
    inp = keras.Input((6,), dtype="int32")
    x = L.Embedding(11, 4, mask_zero=True)(inp)
    x = rnn_layer(kind, 5, return_sequences=True)(x)
    x = rnn_layer(kind, 5, zero_output_for_mask=True, return_state=return_state)(x)
    model = keras.Model(inp, x)
    fast = rnnfuse.optimize(model)
    tokens = np.array([[3, 4, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6]], "int32")
    torch_calls.clear()
    got, expected = fast(tokens), model(tokens)
    assert torch_calls, "the fused call did not run"
    assert max_abs_diff(got, expected) <= 2e-6
    output = keras.ops.convert_to_numpy(keras.tree.flatten(got)[0])
    assert not output[0].any() and output[1].any()


def test_jit_compile_true_is_kept_torch_compile_traces_the_fused_layers():
    fast = rnnfuse.optimize(stack_model("gru", 2, head=True))
    fast.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert fast.jit_compile is True
    assert all(layer.supports_jit for layer in fused_layers(fast))


def test_keras_shape_builds_run_the_original_layers(torch_calls):
    """Keras' torch `fit` first runs the model on "meta" tensors for its
    output shapes: the fused layer answers with the original layers' own
    call, as the original model does, and runs no fused kernel (which could
    fail there, sending Keras to a full eager run on the device)."""
    from keras.src.backend.torch.core import compute_output_spec

    model = stack_model("lstm", 3, steps=7, units=5, input_size=4)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    (layer,) = fused_layers(fast)
    spec = compute_output_spec(fast, keras.KerasTensor((None, 7, 4)))
    assert torch_calls == [], "no fused call on meta tensors"
    assert tuple(spec.shape) == tuple(model.compute_output_spec(keras.KerasTensor((None, 7, 4))).shape)
    # Where an op has no meta kernel, Keras runs real tensors in the scope.
    from keras.src.backend.common.symbolic_scope import SymbolicScope

    with SymbolicScope(), torch.no_grad():
        fast(torch.ones(2, 7, 4))
    assert torch_calls == [], "no fused call in a symbolic scope"
    fast(np.ones((2, 7, 4), "float32"))
    assert len(torch_calls) == 1 and layer.last_path.kind.name == "FUSED"
