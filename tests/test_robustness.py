"""What goes wrong, and what must hold when it does.

- `optimize` never changes the original variables' values;
- a group whose fused layer cannot be built keeps its layers (FusionWarning)
  while the other groups still fuse;
- an interrupted fit leaves the original model exactly at the last finished
  step (the variables are the same objects);
- corrupt files and unregistered custom classes give one clear error
  (`rnnfuse.model_files.read_model`);
- property test: random small stacks through optimize -> fit one step ->
  save -> load -> predict equal.
"""

from __future__ import annotations

import contextlib
import zipfile

import keras
import numpy as np
import pytest
from builders import failing_to_build, fused_layers, max_abs_diff, random_inputs, stack_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rnnfuse
from rnnfuse import FusionWarning
from rnnfuse.model_files import read_model

L = keras.layers


def _two_group_model() -> keras.Model:
    inp = keras.Input((5, 3))
    x = L.GRU(4, return_sequences=True, name="gru_a")(inp)
    x = L.GRU(4, return_sequences=True, name="gru_b")(x)
    x = L.Dense(4, name="mid")(x)
    x = L.LSTM(4, return_sequences=True, name="lstm_a")(x)
    x = L.LSTM(4, name="lstm_b")(x)
    return keras.Model(inp, L.Dense(2, name="head")(x))


# -- optimize leaves the original alone -------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        _two_group_model,
        lambda: stack_model("lstm", 3, masked=True, head=True, dropout_first=0.2),
        lambda: stack_model("gru", 2, initial_state=True, last_return_state=True),
        lambda: keras.Sequential(
            [keras.Input((4, 3)),
             L.Bidirectional(L.LSTM(3, return_sequences=True)),
             L.Dropout(0.1),
             L.Bidirectional(L.LSTM(3))]
        ),
    ],
    ids=["two_groups", "masked_dropout", "states", "bidirectional_absorbed_dropout"],
)
def test_optimize_never_changes_original_variable_values(build):
    model = build()
    values = {v.path: v.numpy().copy() for v in model.weights}
    names = [v.path for v in model.weights]
    fast = rnnfuse.optimize(model)
    assert fused_layers(fast)
    rnnfuse.restore(fast)
    assert [v.path for v in model.weights] == names
    for v in model.weights:
        np.testing.assert_array_equal(v.numpy(), values[v.path])


# -- a group that cannot be built ------------------------------------------------


def test_a_group_that_fails_to_build_keeps_its_layers_and_the_rest_fuse(monkeypatch, tmp_path):
    failing_to_build(monkeypatch, "gru_a", RuntimeError("packing exploded"))
    model = _two_group_model()
    with pytest.warns(FusionWarning, match=r"gru_a -> gru_b.*RuntimeError: packing exploded"):
        fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    assert [l.name for l in fused.fused_layers] == ["lstm_a", "lstm_b"]
    kept = {l.name: l for l in fast.layers}
    assert kept["gru_a"] is model.get_layer("gru_a")
    assert kept["gru_b"] is model.get_layer("gru_b")
    x = np.random.default_rng(0).standard_normal((2, 5, 3)).astype("float32")
    assert max_abs_diff(fast(x), model(x)) <= 1e-6
    # The partly fused model still saves, loads and restores.
    fast.save(tmp_path / "partial.keras")
    fast.save(tmp_path / "partial_fused.keras", fused=True)
    monkeypatch.undo()
    loaded = keras.models.load_model(tmp_path / "partial.keras")
    assert not fused_layers(loaded)
    assert max_abs_diff(loaded(x), model(x)) <= 1e-6
    loaded = keras.models.load_model(tmp_path / "partial_fused.keras")
    assert len(fused_layers(loaded)) == 1
    assert max_abs_diff(loaded(x), model(x)) <= 1e-6
    assert max_abs_diff(rnnfuse.restore(fast)(x), model(x)) == 0.0


# -- interrupted training ----------------------------------------------------------


class _InterruptAfter(keras.callbacks.Callback):
    def __init__(self, steps: int):
        super().__init__()
        self.steps = steps

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.steps:
            raise KeyboardInterrupt


def test_an_interrupted_fit_leaves_the_original_at_the_last_finished_step(emulated_cudnn, tmp_path):
    model = stack_model("rnn_tanh", 2, head=True, steps=4, units=4, input_size=3)
    reference = stack_model("rnn_tanh", 2, head=True, steps=4, units=4, input_size=3)
    reference.set_weights(model.get_weights())
    fast = rnnfuse.optimize(model)
    # Eager steps (no trace to wait for); the interrupt lands between steps
    # exactly as it does between compiled steps.
    fast.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", run_eagerly=True)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", run_eagerly=True)
    rng = np.random.default_rng(1)
    x, y = random_inputs(model, 16, rng), rng.standard_normal((16, 3)).astype("float32")
    with pytest.raises(KeyboardInterrupt):
        fast.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0,
                 callbacks=[_InterruptAfter(2)])
    assert emulated_cudnn, "the fused path did not run"
    # Exactly two finished steps, as if training had been asked for two.
    reference.fit(x[:8], y[:8], batch_size=4, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.weights, reference.weights):
        assert np.all(np.isfinite(a.numpy()))
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)
    assert {id(v) for v in fast.trainable_variables} == {id(v) for v in model.trainable_variables}
    # The original, saved now, holds those weights.
    model.save(tmp_path / "interrupted.keras")
    again = keras.models.load_model(tmp_path / "interrupted.keras")
    assert max_abs_diff(again(x), reference(x)) <= 1e-5


# -- bad files and unknown classes ---------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    fast = rnnfuse.optimize(stack_model("gru", 2, head=True))
    path = tmp_path_factory.mktemp("good") / "good.keras"
    fast.save(path)
    return path


def _truncated(path, out):
    data = path.read_bytes()
    out.write_bytes(data[: len(data) // 2])


def _garbage(path, out):
    out.write_bytes(np.random.default_rng(0).bytes(4096))


def _no_config(path, out):
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("metadata.json", "{}")


def _bad_json(path, out):
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.namelist():
            data = src.read(item)
            dst.writestr(item, data[: len(data) // 3] if item == "config.json" else data)


def _bad_weights(path, out):
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.namelist():
            data = src.read(item)
            dst.writestr(item, b"\0" * len(data) if item == "model.weights.h5" else data)


@pytest.mark.parametrize(
    "damage, words",
    [
        (_truncated, "not a .keras archive"),
        (_garbage, "not a .keras archive"),
        (_no_config, r"not a \.keras model \(config.json, model.weights.h5 missing\)"),
        (_bad_json, "is corrupt"),
        (_bad_weights, "could not load"),
    ],
    ids=["truncated", "garbage", "no_config", "bad_json", "bad_weights"],
)
def test_a_corrupt_keras_file_is_a_clear_error(saved, tmp_path, damage, words):
    bad = tmp_path / "bad.keras"
    damage(saved, bad)
    with pytest.raises(ValueError, match=words) as info:
        read_model(bad)
    message = str(info.value)
    assert str(bad) in message and "Fix:" in message


def test_paths_that_hold_no_model_are_clear_errors(saved, tmp_path):
    with pytest.raises(FileNotFoundError, match="no file at"):
        read_model(tmp_path / "missing.keras")
    with pytest.raises(ValueError, match="is a directory"):
        read_model(tmp_path)
    weights = tmp_path / "w.weights.h5"
    keras.models.load_model(saved).save_weights(weights)
    with pytest.raises(ValueError, match="holds weights only"):
        read_model(weights)
    assert fused_layers(rnnfuse.load_model(saved))
    assert not fused_layers(read_model(saved))


@keras.saving.register_keras_serializable(package="rnnfuse_tests")
class Scale(L.Layer):
    """A custom layer rnnfuse knows nothing about."""

    def call(self, x):
        return 2.0 * x


def test_unknown_custom_layers_fuse_around_and_load_with_a_clear_error(tmp_path, monkeypatch):
    inp = keras.Input((5, 3))
    x = L.LSTM(4, return_sequences=True)(inp)
    x = L.LSTM(4, return_sequences=True)(x)
    x = Scale(name="scale")(x)
    model = keras.Model(inp, L.GRU(2)(x))
    fast = rnnfuse.optimize(model)
    assert len(fused_layers(fast)) == 1 and fast.get_layer("scale") is model.get_layer("scale")
    x_in = np.random.default_rng(2).standard_normal((2, 5, 3)).astype("float32")
    assert max_abs_diff(fast(x_in), model(x_in)) <= 1e-6
    path = tmp_path / "custom.keras"
    fast.save(path)
    # Another process, where the module defining Scale was not imported.
    monkeypatch.delitem(keras.saving.get_custom_objects(), "rnnfuse_tests>Scale")
    with pytest.raises(ValueError, match=r"'rnnfuse_tests>Scale'.*not registered.*custom_objects"):
        read_model(path)
    loaded = read_model(path, custom_objects={"rnnfuse_tests>Scale": Scale})
    assert max_abs_diff(loaded(x_in), model(x_in)) <= 1e-6


# -- property: optimize -> fit -> save -> load -> predict ---------------------------


@contextlib.contextmanager
def _emulated_cudnn():
    from cudnn_reference import emulated_cudnn_rnn

    from rnnfuse.backends import tensorflow as tf_backend

    calls = []
    with pytest.MonkeyPatch.context() as mp:
        spy = lambda **kw: calls.append(1) or emulated_cudnn_rnn(**kw)  # noqa: E731
        mp.setattr(tf_backend, "cudnn_rnn", spy)
        mp.setattr(tf_backend, "is_available", lambda: True)
        yield calls


_KIND = {"LSTM": "lstm", "GRU": "gru", "SimpleRNN": "rnn_tanh"}


# Each example trains through the emulated op (seconds on the CPU): half the
# profile's example count (ci 6, dev 12, thorough 100).
@settings(
    max_examples=max(4, settings.default.max_examples // 2),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(sorted(_KIND)),
    num_layers=st.integers(2, 3),
    units=st.integers(2, 5),
    masked=st.booleans(),
    padding=st.sampled_from(["right", "middle"]),
    functional=st.booleans(),
    last_return_sequences=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_stacks_survive_fit_save_load(
    tmp_path_factory, kind, num_layers, units, masked, padding, functional,
    last_return_sequences, seed,
):
    keras.utils.set_random_seed(seed)
    model = stack_model(
        _KIND[kind], num_layers, units=units, input_size=3, steps=3, masked=masked,
        head=True, functional=functional, last_return_sequences=last_return_sequences,
    )
    rng = np.random.default_rng(seed)
    x = random_inputs(model, 4, rng, padding=padding)
    y_shape = (4, 3, 3) if last_return_sequences else (4, 3)
    y = rng.standard_normal(y_shape).astype("float32")
    with _emulated_cudnn() as calls:
        fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
        assert len(fused_layers(fast)) == 1
        fast.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", run_eagerly=True)
        before = [v.numpy().copy() for v in model.trainable_variables]
        fast.fit(x, y, batch_size=4, epochs=1, verbose=0)
        if not masked or padding == "right":  # other masks run the layers
            assert calls, "the fused path did not run"
        after = [v.numpy() for v in model.trainable_variables]
        assert any(not np.array_equal(b, a) for b, a in zip(before, after))
        path = tmp_path_factory.mktemp("prop") / "m.keras"
        fast.save(path)
        loaded = keras.models.load_model(path)
        assert [type(l).__name__ for l in loaded.layers] == [type(l).__name__ for l in model.layers]
        assert max_abs_diff(loaded(x), fast(x)) <= 1e-6
