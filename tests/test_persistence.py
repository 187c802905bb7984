"""Saving and loading optimized models (rnnfuse/persistence.py).

- `.keras` round trip: same outputs, same fused structure, fused path runs.
- `rnnfuse.restore`: a plain model of the original layers, current weights,
  loadable (and its SavedModel servable) in a process without rnnfuse.
- weight files: interchangeable between the original and the optimized
  model in both directions, on a model whose naive fused layout differs.
- `export()`: a SavedModel that serves the same numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import warnings

import h5py
import keras
import numpy as np
import pytest
from builders import fused_layers, max_abs_diff, random_inputs, stack_model

import rnnfuse
from rnnfuse.optimized import OptimizedModel, OptimizedSequential

L = keras.layers


def _interleaved_model() -> keras.Model:
    """[lstm, lstm, dense, lstm]: fusing the first two shifts Keras' names.

    The original's weights file names the last LSTM ``layers/lstm_2``; in the
    optimized model's own layer list it would be ``layers/lstm``.
    """
    inp = keras.Input((5, 3))
    x = L.LSTM(4, return_sequences=True)(inp)
    x = L.LSTM(4, return_sequences=True)(x)
    x = L.Dense(4)(x)
    x = L.LSTM(4)(x)
    return keras.Model(inp, L.Dense(2)(x))


def _h5_paths(path) -> set[str]:
    with h5py.File(path) as f:
        names = []
        f.visit(names.append)
    return {n for n in names if "/vars/" in n}


def _values(model) -> list[np.ndarray]:
    return [v.numpy().copy() for v in model.weights]


def _perturb(model, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(rng.standard_normal(v.shape).astype(v.dtype))


# -- .keras ------------------------------------------------------------------


@pytest.mark.parametrize("functional", [True, False], ids=["functional", "sequential"])
def test_keras_file_round_trip_keeps_outputs_and_fused_structure(
    emulated_cudnn, tmp_path, functional
):
    model = stack_model("gru", 3, masked=True, head=True, functional=functional)
    fast = rnnfuse.optimize(model)
    assert isinstance(fast, OptimizedModel if functional else OptimizedSequential)
    x = random_inputs(model, 4, np.random.default_rng(0))
    expected = np.asarray(fast(x))
    path = tmp_path / "fast.keras"
    fast.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is type(fast)
    assert [type(l).__name__ for l in loaded.layers] == [type(l).__name__ for l in fast.layers]
    (fused,) = fused_layers(loaded)
    assert [l.name for l in fused.fused_layers] == [
        l.name for l in fused_layers(fast)[0].fused_layers
    ]
    calls = len(emulated_cudnn)
    np.testing.assert_allclose(np.asarray(loaded(x)), expected, atol=1e-6)
    assert len(emulated_cudnn) > calls and fused.last_path == "fused"
    if functional:
        assert loaded.output_names == model.output_names


def test_keras_file_keeps_the_compile_state(tmp_path):
    model = stack_model("lstm", 2, head=True)
    fast = rnnfuse.optimize(model)
    fast.compile(optimizer="adam", loss="mse", metrics=["mae"])
    fast.save(tmp_path / "c.keras")
    loaded = keras.models.load_model(tmp_path / "c.keras")
    assert loaded.compiled and loaded.get_compile_config()["loss"] == "mse"


# -- restore -------------------------------------------------------------------


@pytest.mark.parametrize("functional", [True, False], ids=["functional", "sequential"])
def test_restore_gives_the_original_layers_with_current_weights(functional):
    model = stack_model("lstm", 3, head=True, functional=functional)
    inner = keras.Sequential([keras.Input((7, 5)), model], name="outer")
    fast = rnnfuse.optimize(inner)
    _perturb(fast, 1)  # "training": the shared variables change
    plain = rnnfuse.restore(fast)
    assert type(plain).__module__.startswith("keras.")
    assert not fused_layers(plain)
    assert "rnnfuse" not in json.dumps(plain.get_config())
    restored_inner = plain.layers[0]
    assert restored_inner is not model  # a rebuilt sub-model...
    real = lambda m: [l for l in m.layers if not isinstance(l, L.InputLayer)]  # noqa: E731
    assert real(restored_inner) == real(model)  # ...of the very same layers
    assert {id(v) for v in plain.weights} == {id(v) for v in model.weights}
    x = random_inputs(model, 3, np.random.default_rng(2))
    assert max_abs_diff(plain(x), model(x)) == 0.0


def test_restore_puts_absorbed_dropout_and_initial_state_back():
    inp = keras.Input((6, 3))
    h, c = keras.Input((4,)), keras.Input((4,))
    x = L.LSTM(4, return_sequences=True)(inp, initial_state=[h, c])
    x = L.Dropout(0.25, seed=3)(x)
    out = L.LSTM(4)(x)
    model = keras.Model([inp, h, c], out)
    fast = rnnfuse.optimize(model)
    assert fused_layers(fast) and fused_layers(fast)[0].absorbed_dropout
    plain = rnnfuse.restore(fast)
    assert [type(l).__name__ for l in plain.layers] == [type(l).__name__ for l in model.layers]
    rng = np.random.default_rng(4)
    args = [rng.standard_normal(s).astype("float32") for s in [(2, 6, 3), (2, 4), (2, 4)]]
    assert max_abs_diff(plain(args), model(args)) == 0.0


def test_restore_rejects_what_it_cannot_rebuild():
    with pytest.raises(TypeError, match="expects a Sequential or Functional"):
        rnnfuse.restore(L.LSTM(3))


_NO_RNNFUSE = textwrap.dedent(
    """
    import os, sys
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras, numpy as np, tensorflow as tf
    keras_path, saved_path, x_path = sys.argv[1:4]
    x = np.load(x_path)
    model = keras.models.load_model(keras_path)
    served = tf.saved_model.load(saved_path)
    assert "rnnfuse" not in sys.modules, "rnnfuse was imported"
    np.save(x_path + ".keras.npy", np.asarray(model(x)))
    np.save(x_path + ".saved.npy", np.asarray(served.serve(x)))
    """
)


def test_restored_model_and_export_load_without_rnnfuse(tmp_path):
    model = stack_model("rnn_tanh", 2, units=3, input_size=2, steps=3, head=True)
    fast = rnnfuse.optimize(model)
    _perturb(fast, 5)
    x = random_inputs(model, 3, np.random.default_rng(6))
    expected = np.asarray(fast(x))
    rnnfuse.restore(fast).save(tmp_path / "plain.keras")
    fast.export(str(tmp_path / "saved"), verbose=False)
    np.save(tmp_path / "x.npy", x)
    script = tmp_path / "load.py"
    script.write_text(_NO_RNNFUSE)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "plain.keras"),
         str(tmp_path / "saved"), str(tmp_path / "x.npy")],
        capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "x.npy.keras.npy"), expected, atol=1e-6)
    np.testing.assert_allclose(np.load(tmp_path / "x.npy.saved.npy"), expected, atol=1e-6)


# -- weight files ----------------------------------------------------------------


def test_weights_file_of_the_optimized_model_has_the_original_layout(tmp_path):
    model = _interleaved_model()
    fast = rnnfuse.optimize(model)
    assert len(fused_layers(fast)) == 1
    model.save_weights(tmp_path / "orig.weights.h5")
    fast.save_weights(tmp_path / "fast.weights.h5")
    paths = _h5_paths(tmp_path / "orig.weights.h5")
    assert "layers/lstm_2/cell/vars/0" in paths
    assert _h5_paths(tmp_path / "fast.weights.h5") == paths


@pytest.mark.parametrize("direction", ["original_to_optimized", "optimized_to_original"])
def test_weights_files_are_interchangeable(tmp_path, direction):
    source_model, target_model = _interleaved_model(), _interleaved_model()
    if direction == "original_to_optimized":
        source, target = source_model, rnnfuse.optimize(target_model)
    else:
        source, target = rnnfuse.optimize(source_model), target_model
    _perturb(source_model, 7)
    path = tmp_path / "w.weights.h5"
    source.save_weights(path)
    target.load_weights(path)
    for a, b in zip(source_model.weights, target_model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    x = np.random.default_rng(8).standard_normal((2, 5, 3)).astype("float32")
    assert max_abs_diff(target(x), source(x)) <= 1e-6


def test_load_weights_reads_both_kinds_of_keras_archive(tmp_path):
    model = _interleaved_model()
    fast = rnnfuse.optimize(model)
    _perturb(model, 9)
    expected = _values(model)
    model.save(tmp_path / "orig.keras")
    fast.save(tmp_path / "fast.keras")
    for archive in ("orig.keras", "fast.keras"):
        _perturb(model, 10)
        fast.load_weights(tmp_path / archive)
        for v, e in zip(model.weights, expected):
            np.testing.assert_array_equal(v.numpy(), e)


# -- export --------------------------------------------------------------------


def test_export_traced_here_serves_the_same_outputs(emulated_cudnn, tmp_path):
    import tensorflow as tf

    model = stack_model("rnn_tanh", 2, units=3, input_size=2, steps=3, head=True)
    fast = rnnfuse.optimize(model)
    x = random_inputs(model, 3, np.random.default_rng(12))
    fast.export(str(tmp_path / "saved"), verbose=False)
    assert emulated_cudnn, "the export did not trace the fused path"
    served = tf.saved_model.load(str(tmp_path / "saved"))
    np.testing.assert_allclose(np.asarray(served.serve(x)), np.asarray(model(x)), atol=2e-5)


# -- optimizer state in weight files (issue 15, item 1) -------------------------


def _branchy_model() -> keras.Model:
    """A run whose layers are not neighbours in the original's layer list.

    The original lists a/side/b/side2; the optimized model's own list would
    put the fused a+b after side, so without care its optimizer slots would
    be numbered in another order than the original's.
    """
    inp = keras.Input((5, 3), name="seq")
    a = L.LSTM(4, return_sequences=True, name="a")(inp)
    side = L.Dense(2, name="side")(inp)
    b = L.GRU(4, return_sequences=True, name="b")(a)
    b = L.GRU(4, return_sequences=True, name="b2")(b)
    side2 = L.Dense(2, name="side2")(side)
    out = L.Dense(1, name="head")(L.Concatenate()([b, side2]))
    model = keras.Model(inp, out)
    return model


def _trained(model, seed: int):
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 5, 3)).astype("float32")
    y = rng.standard_normal((8, 5, 1)).astype("float32")
    model.fit(x, y, epochs=2, batch_size=4, verbose=0)
    return x, y


def _optimizer_values(model) -> list[np.ndarray]:
    return [np.asarray(v.numpy()).copy() for v in model.optimizer.variables]


def _fresh(model):
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def test_optimized_model_lists_variables_in_the_original_order():
    model = _branchy_model()
    fast = rnnfuse.optimize(model)
    assert fused_layers(fast)
    assert [v.path for v in fast.trainable_variables] == [
        v.path for v in model.trainable_variables
    ]
    assert [id(v) for v in fast.weights] == [id(v) for v in model.weights]


@pytest.mark.parametrize("direction", ["original_to_optimized", "optimized_to_original"])
def test_weights_files_carry_the_optimizer_state_both_ways(tmp_path, direction):
    source_model, target_model = _branchy_model(), _branchy_model()
    if direction == "original_to_optimized":
        source, target = source_model, rnnfuse.optimize(target_model)
    else:
        source, target = rnnfuse.optimize(source_model), target_model
    x, y = _trained(source, 1)
    path = tmp_path / "w.weights.h5"
    source.save_weights(path)
    optimizer_paths = {p for p in _h5_paths(path) if p.startswith("optimizer/")}
    assert len(optimizer_paths) == len(source.optimizer.variables) > 2
    _fresh(target)
    with warnings_as_errors():
        target.load_weights(path)
    for a, b in zip(source_model.weights, target_model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(_optimizer_values(source), _optimizer_values(target)):
        np.testing.assert_array_equal(a, b)
    # Resuming training continues from the same Adam state: same next step.
    source.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    target.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    for a, b in zip(source_model.weights, target_model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)


def test_model_checkpoint_weights_only_resumes_the_original(tmp_path):
    model = _branchy_model()
    fast = rnnfuse.optimize(model)
    path = tmp_path / "ckpt.weights.h5"
    fast.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 5, 3)).astype("float32")
    y = rng.standard_normal((8, 5, 1)).astype("float32")
    checkpoint = keras.callbacks.ModelCheckpoint(str(path), save_weights_only=True)
    fast.fit(x, y, epochs=2, batch_size=4, verbose=0, callbacks=[checkpoint])
    again = _fresh(_branchy_model())
    with warnings_as_errors():
        again.load_weights(path)
    assert int(again.optimizer.iterations.numpy()) == 4
    for a, b in zip(_optimizer_values(fast), _optimizer_values(again)):
        np.testing.assert_array_equal(a, b)


@contextlib.contextmanager
def warnings_as_errors():
    """Keras warns (and skips the optimizer) when its state does not fit."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Skipping variable loading.*")
        yield


_LOAD_PROJECTED = textwrap.dedent(
    """
    import os, sys
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if sys.argv[2] == "import":
        sys.path.insert(0, sys.argv[3])
        import rnnfuse  # noqa: F401 - registers rnnfuse>ProjectedLSTM
    import keras
    try:
        keras.models.load_model(sys.argv[1])
    except Exception as err:
        print("FAILED", type(err).__name__, " ".join(str(err).split())[:300])
    else:
        print("LOADED")
    """
)


def test_a_restored_model_holding_projected_lstm_needs_rnnfuse_imported(tmp_path):
    """What docs/deployment.md says: restore() removes FusedRNN, not rnnfuse's
    own layers; a ProjectedLSTM model loads only with rnnfuse imported."""
    from rnnfuse.layers import ProjectedLSTM

    model = keras.Sequential(
        [keras.Input((4, 3)), ProjectedLSTM(6, 3, return_sequences=True), ProjectedLSTM(6, 3)]
    )
    rnnfuse.restore(rnnfuse.optimize(model)).save(tmp_path / "p.keras")
    script = tmp_path / "load.py"
    script.write_text(_LOAD_PROJECTED)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    results = {}
    for how in ("plain", "import"):
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "p.keras"), how, root],
            capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path),
        )
        results[how] = proc.stdout.strip().splitlines()[-1]
    assert results["plain"].startswith("FAILED"), results
    assert results["import"] == "LOADED", results
