"""analyze/optimize at the public boundary: errors, sharing, no side effects."""

from __future__ import annotations

import logging
import re

import keras
import numpy as np
import pytest

import rnnfuse
from builders import fused_layers, max_abs_diff, random_inputs, stack_model

L = keras.layers


# -- bad input ---------------------------------------------------------------


@pytest.mark.parametrize("fn", [rnnfuse.analyze, rnnfuse.optimize])
@pytest.mark.parametrize(
    "bad, words",
    [
        (42, "builtins.int"),
        ("model.keras", "load it first"),
        (L.LSTM(3), "wrap the layer in a model"),
    ],
)
def test_not_a_model_is_a_type_error_naming_the_type(fn, bad, words):
    with pytest.raises(TypeError) as err:
        fn(bad)
    assert "expects a keras.Model; received" in str(err.value)
    assert words in str(err.value)


@pytest.mark.parametrize("fn", [rnnfuse.analyze, rnnfuse.optimize])
def test_unbuilt_model_is_a_value_error_saying_how_to_build(fn):
    model = keras.Sequential([L.LSTM(4, return_sequences=True), L.LSTM(4)])
    with pytest.raises(ValueError, match="is not built.*keras.Input"):
        fn(model)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_min_layers_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="min_layers must be a positive integer"):
        rnnfuse.optimize(stack_model("lstm", 2), min_layers=bad)


def test_fused_rnn_refuses_layers_that_do_not_stack():
    a = L.LSTM(4, return_sequences=True)
    b = L.GRU(4)
    b(a(np.zeros((1, 3, 2), "float32")))
    with pytest.raises(ValueError, match="cannot stack.*one kind of cell"):
        rnnfuse.FusedRNN([a, b])
    with pytest.raises(ValueError, match="needs at least one layer"):
        rnnfuse.FusedRNN([])
    with pytest.raises(ValueError, match="cannot fuse layer.*unroll"):
        rnnfuse.FusedRNN([L.LSTM(4, unroll=True)])


@pytest.mark.parametrize(
    "batch, steps, words",
    [(-1, 5, "batch_size must be a positive integer; received -1"),
     (0, 5, "batch_size must be a positive integer; received 0"),
     (2, 0, "steps must be a positive integer; received 0"),
     ("a", "b", "batch_size must be a positive integer; received 'a' (str)"),
     (2, 1.5, "steps must be a positive integer; received 1.5"),
     (True, 5, "received True")],
)
def test_tune_shape_must_be_positive_integers(batch, steps, words):
    with pytest.raises(ValueError, match="Fix: e.g. rnnfuse.TuneShape") as err:
        rnnfuse.TuneShape(batch, steps)
    assert words in str(err.value)
    assert rnnfuse.TuneShape(np.int64(4), 7) == rnnfuse.TuneShape(4, 7)


def test_tune_as_a_bare_tuple_says_to_use_tune_shape():
    with pytest.raises(ValueError, match=r"received the tuple \(4, 5\). Fix: tune=rnnfuse.TuneShape\(4, 5\)"):
        rnnfuse.optimize(stack_model("lstm", 2), tune=(4, 5), cache=False)


@pytest.mark.parametrize("bad", ["yes", "AUTO", True])
def test_a_tune_word_that_is_not_one_of_its_values_names_them(bad):
    with pytest.raises(ValueError, match=r'tune must be "auto", False or None \(the static rule '
                                         r"table\), a sample batch .*TuneShape\(batch_size, steps\); "
                                         rf"received {re.escape(repr(bad))}\. Fix: tune=\"auto\""):
        rnnfuse.optimize(stack_model("lstm", 2), tune=bad, cache=False)


@pytest.mark.parametrize("bad", [123, 1.5, ["plans.json"], object()])
def test_cache_of_the_wrong_type_names_what_was_received(bad):
    with pytest.raises(TypeError, match="cache must be None .*received .*Fix: e.g. cache="):
        rnnfuse.optimize(stack_model("lstm", 2), cache=bad)


def test_cache_under_a_regular_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a regular file, not a folder"):
        rnnfuse.optimize(stack_model("lstm", 2), cache=tmp_path / "file" / "plans.json")


@pytest.mark.parametrize(
    "layers, words",
    [(None, "received NoneType None"),
     ("lstm", "received str 'lstm'"),
     ([1, 2], "layers[0] is int 1, not a Keras layer"),
     (L.LSTM(3), "received the single layer")],
)
def test_fused_rnn_layers_must_be_a_list_of_layers(layers, words):
    with pytest.raises(TypeError, match="Fix: ") as err:
        rnnfuse.FusedRNN(layers)
    assert words in str(err.value)


def test_fused_rnn_dropout_layers_must_be_dropout_layers():
    a, b = L.LSTM(4, return_sequences=True), L.LSTM(4)
    with pytest.raises(TypeError, match=r"entry 0 is float 0.5.*keras.layers.Dropout\(0.5\)"):
        rnnfuse.FusedRNN([a, b], dropout_layers=[0.5])
    with pytest.raises(TypeError, match="one entry per gap"):
        rnnfuse.FusedRNN([a, b], dropout_layers=0.5)
    assert rnnfuse.FusedRNN([a, b], dropout_layers=[L.Dropout(0.5)]).absorbed_dropout


# -- the new model -------------------------------------------------------------


def test_optimize_returns_new_model_with_same_interface_and_layers():
    model = stack_model("lstm", 3, initial_state=True, last_return_state=True, head=True)
    fast = rnnfuse.optimize(model)
    assert fast is not model
    assert len(fast.inputs) == len(model.inputs)
    assert fast.output_names == model.output_names
    (fused,) = fused_layers(fast)
    assert [l.name for l in fused.fused_layers] == ["lstm_0", "lstm_1", "lstm_2"]
    originals = {id(l) for l in model.layers}
    for layer in fast.layers:
        if not isinstance(layer, (rnnfuse.FusedRNN, L.InputLayer)):
            assert id(layer) in originals
    for layer in fused.fused_layers:
        assert id(layer) in originals


def test_output_names_stay_when_the_run_ends_at_a_model_output():
    model = stack_model("gru", 3)
    fast = rnnfuse.optimize(model)
    assert fast.output_names == model.output_names == ["gru_2"]


def test_a_fused_layer_is_named_apart_from_the_layers_it_holds():
    model = stack_model("gru", 3)  # the run ends at the model's output
    fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    assert fused.name == "fused_gru_0_to_gru_2"
    assert fused.name not in {l.name for l in fused.fused_layers}
    assert fast.output_names == model.output_names == ["gru_2"]
    lines = []
    fast.summary(print_fn=lambda line, **kwargs: lines.append(line))
    assert "fused_gru_0_to_gru_2 (FusedRNN) runs gru_0 -> gru_1 -> gru_2 (GRU)" in "\n".join(lines)


def test_variables_are_shared_not_copied():
    model = stack_model("gru", 3, head=True)
    fast = rnnfuse.optimize(model)
    assert {id(v) for v in fast.weights} == {id(v) for v in model.weights}
    assert len(fast.trainable_variables) == len(model.trainable_variables)


def test_assigning_an_original_variable_changes_the_fused_output(emulated_cudnn):
    model = stack_model("lstm", 3, last_return_sequences=True)
    fast = rnnfuse.optimize(model)
    x = random_inputs(model, 2, np.random.default_rng(0))
    before = np.asarray(fast(x))
    kernel = model.get_layer("lstm_1").cell.recurrent_kernel
    kernel.assign(kernel.numpy() * 2.0)
    after = np.asarray(fast(x))
    assert emulated_cudnn, "the fused path did not run"
    assert np.max(np.abs(after - before)) > 1e-3
    assert max_abs_diff(after, model(x)) <= 2e-5


def test_training_the_optimized_model_trains_the_original(emulated_cudnn, tmp_path):
    model = stack_model("lstm", 2, head=True)
    fast = rnnfuse.optimize(model)
    fast.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    rng = np.random.default_rng(1)
    x, y = random_inputs(model, 8, rng), rng.standard_normal((8, 3)).astype("float32")
    before = [v.numpy().copy() for v in model.trainable_variables]
    fast.fit(x, y, epochs=1, batch_size=8, verbose=0)
    assert emulated_cudnn, "the fused path did not run"
    changed = [not np.allclose(b, v.numpy()) for b, v in zip(before, model.trainable_variables)]
    assert all(changed)
    # The original's save() writes the trained weights as a plain Keras file.
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    for v, w in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(v.numpy(), w.numpy())
    assert not any(isinstance(l, rnnfuse.FusedRNN) for l in loaded._flatten_layers())


def test_optimize_does_not_change_the_original_model():
    model = stack_model("gru", 3, masked=True, head=True)
    config = model.get_config()
    layers = list(model.layers)
    values = [v.numpy().copy() for v in model.weights]
    x = random_inputs(model, 3, np.random.default_rng(2))
    expected = np.asarray(model(x))
    rnnfuse.optimize(model)
    assert model.get_config() == config
    assert model.layers == layers
    for v, before in zip(model.weights, values):
        np.testing.assert_array_equal(v.numpy(), before)
    np.testing.assert_array_equal(np.asarray(model(x)), expected)
    # analyzing again finds the same groups: the rewrite left no trace.
    assert len(rnnfuse.analyze(model).groups) == 1


def test_nested_models_are_rewritten_and_originals_kept():
    inner = keras.Sequential(
        [keras.Input((5, 3)), L.GRU(4, return_sequences=True), L.GRU(4, return_sequences=True)],
        name="enc",
    )
    inp = keras.Input((5, 3))
    out = L.Dense(2)(L.GRU(4)(inner(inp)))
    model = keras.Model(inp, out)
    fast = rnnfuse.optimize(model)
    assert len(fused_layers(fast)) == 1
    assert len(fused_layers(model)) == 0
    assert not any(isinstance(l, rnnfuse.FusedRNN) for l in inner.layers)
    x = random_inputs(model, 2, np.random.default_rng(3))
    assert max_abs_diff(fast(x), model(x)) <= 1e-6


def test_optimize_with_no_groups_still_returns_a_new_equal_model():
    model = keras.Sequential([keras.Input((4, 2)), L.LSTM(3), L.Dense(1)])
    fast = rnnfuse.optimize(model)
    assert fast is not model
    assert fast.layers == model.layers
    x = np.ones((1, 4, 2), "float32")
    np.testing.assert_array_equal(fast(x), model(x))


def test_compile_arguments_are_carried_over():
    model = stack_model("lstm", 2, head=True)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    fast = rnnfuse.optimize(model)
    assert fast.compiled
    assert fast.get_compile_config()["loss"] == "mse"


# -- per-call decisions ----------------------------------------------------------


def test_without_a_gpu_the_original_layers_run_exactly():
    model = stack_model("lstm", 3, masked=True, last_return_sequences=True)
    fast = rnnfuse.optimize(model)
    x = random_inputs(model, 3, np.random.default_rng(4))
    np.testing.assert_array_equal(np.asarray(fast(x)), np.asarray(model(x)))
    (fused,) = fused_layers(fast)
    assert fused.last_path == "layers: the fused kernel needs a CUDA GPU and tensorflow sees none"


def test_bfloat16_runs_the_original_layers(emulated_cudnn):
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = stack_model("gru", 2)
    keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model)
    x = random_inputs(model, 2, np.random.default_rng(5))
    np.testing.assert_array_equal(np.asarray(fast(x)), np.asarray(model(x)))
    (fused,) = fused_layers(fast)
    assert "bfloat16" in fused.last_path
    assert not emulated_cudnn


def test_mixed_float16_runs_the_fused_op_in_float16(emulated_cudnn):
    keras.config.set_dtype_policy("mixed_float16")
    model = stack_model("lstm", 2, last_return_sequences=True)
    keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model)
    x = random_inputs(model, 2, np.random.default_rng(6))
    out = fast(x)
    assert out.dtype == "float16"
    assert emulated_cudnn[0]["params"].dtype.name == "float16"
    assert emulated_cudnn[0]["input"].dtype.name == "float16"
    assert max_abs_diff(out, model(x)) <= 1e-2


def test_fused_rnn_config_round_trip():
    model = stack_model("gru", 2)
    (fused,) = fused_layers(rnnfuse.optimize(model))
    clone = rnnfuse.FusedRNN.from_config(fused.get_config())
    assert [type(l).__name__ for l in clone.fused_layers] == ["GRU", "GRU"]
    assert clone.name == fused.name
    out = clone(np.zeros((2, 7, 5), "float32"))
    assert tuple(out.shape) == (2, 6)


def test_summary_lists_the_original_layers_inside_each_fused_layer():
    inp = keras.Input((10, 3), name="x")
    x = keras.layers.LSTM(4, return_sequences=True, name="enc_a")(inp)
    x = keras.layers.Dropout(0.1, name="between")(x)
    x = keras.layers.LSTM(4, return_sequences=True, name="enc_b")(x)
    x = keras.layers.GRU(5, return_sequences=True, name="dec_a")(x)
    x = keras.layers.GRU(5, name="dec_b")(x)
    model = keras.Model(inp, keras.layers.Dense(2, name="head")(x))
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert len(fused_layers(fast)) == 2
    assert fast.count_params() == model.count_params()
    lines = []
    fast.summary(expand_nested=True, print_fn=lambda line, **kw: lines.append(line))
    text = "\n".join(lines)
    for name, cls, shape in [
        ("enc_a", "LSTM", "(None, 10, 4)"),
        ("between", "Dropout", "(None, 10, 4)"),
        ("enc_b", "LSTM", "(None, 10, 4)"),
        ("dec_a", "GRU", "(None, 10, 5)"),
        ("dec_b", "GRU", "(None, 5)"),
    ]:
        layer = model.get_layer(name)
        [row] = [l for l in text.splitlines() if f"└ {name} ({cls})" in l]
        assert shape in row and f"{layer.count_params():,}" in row
    assert f"Total params: {model.count_params():,}" in text
    # The same list that Keras' summary reads, in call order.
    assert [l.name for l in fused_layers(fast)[0].layers] == ["enc_a", "between", "enc_b"]


def test_optimize_warns_once_when_nothing_runs_fused_here(caplog):
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("needs a machine without a GPU")
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.GRU(4, return_sequences=True),
                              keras.layers.GRU(4)], name="two_grus")
    with caplog.at_level(logging.WARNING, logger="rnnfuse"):
        rnnfuse.optimize(model)
    [record] = [r for r in caplog.records if r.name == "rnnfuse"]
    assert "optimize('two_grus'): none of its 1 fusion group(s) will run fused" in record.getMessage()
    assert "needs a CUDA GPU" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rnnfuse"):
        rnnfuse.optimize(model, plan=rnnfuse.PER_LAYER)
    assert "plan was forced to per-layer" in caplog.records[0].getMessage()


def test_online_turns_the_fits_race_on_and_must_be_a_bool(monkeypatch):
    from rnnfuse.tuning import first_batch

    monkeypatch.setattr(first_batch, "can_time_here", lambda *args, **kwargs: True)
    model = stack_model("gru", 2, steps=6)
    assert rnnfuse.optimize(model, online=True, cache=False)._rnnfuse_autotune.online is True
    assert rnnfuse.optimize(model, cache=False)._rnnfuse_autotune.online is False
    with pytest.raises(ValueError, match="online must be True or False; received 'yes'"):
        rnnfuse.optimize(model, online="yes")
