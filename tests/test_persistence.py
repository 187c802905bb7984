"""Saving and loading optimized models (rnnfuse/persistence.py).

- `.keras` round trip: same outputs, same fused structure, fused path runs.
- `rnnfuse.restore`: a plain model of the original layers, current weights,
  loadable (and its SavedModel servable) in a process without rnnfuse.
- weight files: interchangeable between the original and the optimized
  model in both directions, on a model whose naive fused layout differs.
- `export()`: a SavedModel that serves the same numbers.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest
from builders import fused_layers, max_abs_diff, random_inputs, stack_model
from keras.src.models.functional import Functional

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


def _archive(path) -> tuple[dict, dict]:
    """(config.json without object ids, {weight path: array}) of a .keras file."""
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
        weights = {}
        with h5py.File(io.BytesIO(archive.read("model.weights.h5"))) as f:
            f.visititems(
                lambda name, item: weights.__setitem__(name, item[()])
                if isinstance(item, h5py.Dataset) else None
            )

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "shared_object_id"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return strip(config), weights


def _train(model, seed: int, *, epochs: int = 1, **compile_args):
    """Compile (adam, mse, mae) and fit `model` on small random data."""
    model.compile(**{"optimizer": "adam", "loss": "mse", "metrics": ["mae"], **compile_args})
    rng = np.random.default_rng(seed)
    x = random_inputs(model, 8, rng)
    y = rng.standard_normal((8, 3)).astype("float32")
    model.fit(x, y, batch_size=4, epochs=epochs, verbose=0)
    return x, y


@pytest.mark.parametrize("functional", [True, False], ids=["functional", "sequential"])
def test_save_writes_exactly_the_original_models_file(tmp_path, functional):
    model = stack_model("gru", 3, masked=True, head=True, functional=functional)
    fast = rnnfuse.optimize(model)
    assert isinstance(fast, OptimizedModel if functional else OptimizedSequential)
    _train(fast, 0)
    fast.save(tmp_path / "fast.keras")
    # The original, compiled alike and holding the same (trained) optimizer,
    # saved by Keras itself.
    model.compile(optimizer=fast.optimizer, loss="mse", metrics=["mae"])
    model.save(tmp_path / "original.keras")
    got, want = _archive(tmp_path / "fast.keras"), _archive(tmp_path / "original.keras")
    assert "rnnfuse" not in json.dumps(got[0])
    assert got[0] == want[0]
    assert sorted(got[1]) == sorted(want[1])
    assert any(name.startswith("optimizer/") for name in got[1])
    for name, value in want[1].items():
        np.testing.assert_array_equal(got[1][name], value, err_msg=name)


def test_save_leaves_jit_compile_to_the_original_layers(emulated_cudnn, tmp_path, monkeypatch):
    """Keras compiles a SimpleRNN stack with XLA on a GPU; the fused model
    cannot be (its cuDNN call), but the file is the original's, XLA on."""
    import tensorflow as tf

    model = stack_model("rnn_tanh", 2, head=True)
    fast = rnnfuse.optimize(model)
    # jit_compile="auto" as on a machine with a GPU (Keras turns XLA off on
    # CPU-only machines before it asks the layers).
    gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda *a: [gpu])
    fast.compile(optimizer="sgd", loss="mse")
    model.compile(optimizer="sgd", loss="mse")
    assert fast.jit_compile is False and model.jit_compile is True
    fast.save(tmp_path / "m.keras")
    assert _archive(tmp_path / "m.keras")[0]["compile_config"]["jit_compile"] is True
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert not fused_layers(loaded) and loaded.jit_compile is True


def test_the_fused_format_is_opt_in_and_keeps_the_fused_structure(emulated_cudnn, tmp_path):
    model = stack_model("gru", 3, masked=True, head=True)
    fast = rnnfuse.optimize(model)
    x = random_inputs(model, 4, np.random.default_rng(0))
    expected = np.asarray(fast(x))
    fast.compile(optimizer="adam", loss="mse")
    fast.save(tmp_path / "fast.keras", fused=True)
    config = _archive(tmp_path / "fast.keras")[0]
    # The first words Keras shows where the file is loaded without rnnfuse.
    assert next(iter(config["config"])) == "rnnfuse"
    assert "rnnfuse.load_model(path)" in config["config"]["rnnfuse"]
    loaded = keras.models.load_model(tmp_path / "fast.keras")
    assert type(loaded) is type(fast) and loaded.compiled
    (fused,) = fused_layers(loaded)
    assert [l.name for l in fused.fused_layers] == [
        l.name for l in fused_layers(fast)[0].fused_layers
    ]
    calls = len(emulated_cudnn)
    np.testing.assert_allclose(np.asarray(loaded(x)), expected, atol=1e-6)
    assert len(emulated_cudnn) > calls and fused.last_path == "fused"
    assert loaded.output_names == model.output_names


_OLD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fused_format_0.1.0")


def test_a_file_in_the_fused_format_of_0_1_0_still_loads():
    """tests/data/fused_format_0.1.0.keras: an optimized, trained GRU stack
    saved by rnnfuse 0.1.0 (before save() wrote the original's file; its
    config names rnnfuse.persistence, where the classes lived)."""
    want = np.load(_OLD + ".npz")
    loaded = keras.models.load_model(_OLD + ".keras")
    assert isinstance(loaded, OptimizedSequential) and len(fused_layers(loaded)) == 1
    np.testing.assert_allclose(np.asarray(loaded(want["x"])), want["y"], atol=1e-6)
    assert int(loaded.optimizer.iterations.numpy()) == int(want["iterations"]) == 2
    # rnnfuse.load_model fuses the original layers again, optimizer state kept.
    fast = rnnfuse.load_model(_OLD + ".keras")
    assert isinstance(fast, OptimizedSequential) and len(fused_layers(fast)) == 1
    np.testing.assert_allclose(np.asarray(fast(want["x"])), want["y"], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(fast.optimizer.variables[2]), want["optimizer"])
    assert int(fast.optimizer.iterations.numpy()) == 2


@pytest.mark.parametrize("fused", [False, True], ids=["portable", "fused_format"])
def test_rnnfuse_load_model_fuses_again_and_resumes_training(tmp_path, fused):
    model = stack_model("lstm", 3, head=True)
    fast = rnnfuse.optimize(model)
    x, y = _train(fast, 1)
    fast.save(tmp_path / "m.keras", fused=fused)
    again = rnnfuse.load_model(tmp_path / "m.keras")
    assert isinstance(again, OptimizedModel) and len(fused_layers(again)) == 1
    assert again.compiled and again.get_compile_config()["loss"] == "mse"
    for a, b in zip(again.optimizer.variables, fast.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # One more epoch from the file and from memory: the same weights.
    fast.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    again.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(again.weights, fast.weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    as_saved = rnnfuse.load_model(tmp_path / "m.keras", fuse=False)
    assert type(as_saved) is (OptimizedModel if fused else Functional)


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


# -- in a process without rnnfuse ---------------------------------------------

# Loads each artifact of the jobs file in a process where `import rnnfuse`
# fails, and writes what it computed (outputs, optimizer state, a further
# epoch's weights) or the error Keras raised.
_ELSEWHERE = textwrap.dedent(
    """
    import sys
    sys.modules["rnnfuse"] = None  # `import rnnfuse` raises ImportError
    import json, os
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras, numpy as np
    jobs_path = sys.argv[1]
    results = {}
    for name, job in json.load(open(jobs_path)).items():
        out = os.path.join(os.path.dirname(jobs_path), name)
        try:
            x = np.load(job["x"])
            if job["kind"] == "keras":
                model = keras.models.load_model(job["path"])
                arrays = {"y": np.asarray(model(x))}
                arrays.update({f"opt{i}": np.asarray(v) for i, v in enumerate(model.optimizer.variables)})
                if "y_train" in job:
                    model.fit(x, np.load(job["y_train"]), batch_size=4, epochs=1, verbose=0, shuffle=False)
                    arrays.update({f"w{i}": np.asarray(v) for i, v in enumerate(model.weights)})
                results[name] = {"classes": [type(l).__name__ for l in model.layers],
                                 "iterations": int(model.optimizer.iterations.numpy())}
            elif job["kind"] == "saved_model":
                import tensorflow as tf
                served = tf.saved_model.load(job["path"])  # keep it: it owns the variables
                arrays = {"y": np.asarray(served.serve(x))}
                results[name] = {}
            elif job["kind"] == "onnx":
                import onnxruntime
                session = onnxruntime.InferenceSession(job["path"], providers=["CPUExecutionProvider"])
                arrays = {"y": session.run(None, {session.get_inputs()[0].name: x})[0]}
                results[name] = {}
            np.savez(out + ".npz", **arrays)
        except Exception as err:
            results[name] = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:1500]}"}
    assert all(not m.startswith("rnnfuse") for m in sys.modules if sys.modules[m] is not None)
    print("RESULTS " + json.dumps(results))
    """
)


@contextlib.contextmanager
def _emulated_cudnn():
    """The emulated_cudnn fixture, for module-scoped fixtures."""
    from cudnn_reference import emulated_cudnn_rnn

    from rnnfuse.backends import tensorflow as tf_backend

    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tf_backend, "cudnn_rnn", lambda **kw: calls.append(1) or emulated_cudnn_rnn(**kw))
        mp.setattr(tf_backend, "is_available", lambda: True)
        yield calls


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory) -> dict:
    """Artifacts of optimized models, loaded by a process without rnnfuse.

    Returns {"results": the process's results by job, "want": what this
    process computed for each job, "folder": where the arrays are}.
    """
    folder = tmp_path_factory.mktemp("elsewhere")
    jobs, want = {}, {}
    rng = np.random.default_rng(21)

    def save_x(name, x):
        np.save(folder / f"{name}.x.npy", x)
        return str(folder / f"{name}.x.npy")

    # A masked Sequential GRU stack, trained through its fused path.
    # Eager steps: a traced step of the emulated kernel costs tens of seconds.
    seq = stack_model("gru", 2, units=3, masked=True, head=True, functional=False)
    with _emulated_cudnn() as calls:
        fast = rnnfuse.optimize(seq, tune=False)  # no timing on the emulated kernel
        x, y = _train(fast, 2, run_eagerly=True)
        assert calls, "the fused path did not run"
        fast.save(folder / "seq.keras")
        fast.save(folder / "seq_fused.keras", fused=True)
        want["seq"] = {"y": np.asarray(seq(x)), "opt": _optimizer_values(fast)}
        np.save(folder / "seq.y.npy", y)
        fast.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
        want["seq"]["w"] = [np.asarray(v) for v in seq.weights]
    jobs["seq"] = {"kind": "keras", "path": str(folder / "seq.keras"), "x": save_x("seq", x),
                   "y_train": str(folder / "seq.y.npy")}
    jobs["seq_fused"] = {"kind": "keras", "path": str(folder / "seq_fused.keras"), "x": jobs["seq"]["x"]}
    # A Functional LSTM stack's ModelCheckpoint files, one per epoch.
    func = stack_model("lstm", 3, units=3, head=True)
    x = random_inputs(func, 8, rng)
    outputs = []
    with _emulated_cudnn():
        fast = rnnfuse.optimize(func, tune=False)
        fast.compile(optimizer="adam", loss="mse", run_eagerly=True)
        fast.fit(x, rng.standard_normal((8, 3)).astype("float32"), batch_size=4, epochs=2,
                 verbose=0, callbacks=[
                     keras.callbacks.LambdaCallback(
                         on_epoch_end=lambda epoch, logs: outputs.append(np.asarray(func(x)))),
                     keras.callbacks.ModelCheckpoint(str(folder / "ckpt_{epoch}.keras")),
                 ])
    for epoch in (1, 2):
        name = f"ckpt_{epoch}"
        jobs[name] = {"kind": "keras", "path": str(folder / f"{name}.keras"), "x": save_x(name, x)}
        want[name] = {"y": outputs[epoch - 1], "iterations": 2 * epoch,
                      "classes": [type(l).__name__ for l in func.layers]}
    # Its SavedModel and the masked GRU stack's ONNX file: export() where the
    # fused kernel would run (emulated) and the original's export, both.
    with _emulated_cudnn() as calls:
        fast = rnnfuse.optimize(func, tune=False)
        fast.export(str(folder / "saved"), verbose=False)
        func.export(str(folder / "saved_original"), verbose=False)
        want["saved"] = {"y": np.asarray(func(x)), "fused_calls": len(calls)}
    jobs["saved"] = {"kind": "saved_model", "path": str(folder / "saved"), "x": jobs["ckpt_2"]["x"]}
    x = random_inputs(seq, 3, rng)
    seq(x)  # Keras' ONNX export asks for a model that has been called
    with _emulated_cudnn() as calls:
        fast = rnnfuse.optimize(seq, tune=False)
        fast(x)
        calls.clear()
        fast.export(str(folder / "seq.onnx"), format="onnx", verbose=False)
        assert not calls
    seq.export(str(folder / "seq_original.onnx"), format="onnx", verbose=False)
    jobs["onnx"] = {"kind": "onnx", "path": str(folder / "seq.onnx"), "x": save_x("onnx", x)}
    want["onnx"] = {"y": np.asarray(seq(x))}
    # The fused format of rnnfuse 0.1.0 (every optimized model's .keras then).
    jobs["old"] = {"kind": "keras", "path": _OLD + ".keras", "x": save_x("old", np.load(_OLD + ".npz")["x"])}
    (folder / "jobs.json").write_text(json.dumps(jobs))
    (folder / "elsewhere.py").write_text(_ELSEWHERE)
    proc = subprocess.run(
        [sys.executable, str(folder / "elsewhere.py"), str(folder / "jobs.json")],
        capture_output=True, text=True, timeout=300, cwd=str(folder),
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULTS ")][-1]
    return {"results": json.loads(line[len("RESULTS "):]), "want": want, "folder": folder}


def _computed(elsewhere, name: str) -> dict:
    result = elsewhere["results"][name]
    assert "error" not in result, result["error"]
    return dict(np.load(elsewhere["folder"] / f"{name}.npz"))


def test_a_saved_model_loads_trains_on_and_keeps_its_optimizer_without_rnnfuse(elsewhere):
    got, want = _computed(elsewhere, "seq"), elsewhere["want"]["seq"]
    assert elsewhere["results"]["seq"]["classes"] == ["Embedding", "GRU", "GRU", "Dense"]
    np.testing.assert_allclose(got["y"], want["y"], atol=1e-6)
    opt = [got[f"opt{i}"] for i in range(len(want["opt"]))]
    for a, b in zip(opt, want["opt"]):
        np.testing.assert_array_equal(a, b)
    # The next epoch there equals the next epoch of the optimized model here.
    for i, w in enumerate(want["w"]):
        np.testing.assert_allclose(got[f"w{i}"], w, atol=1e-5)


@pytest.mark.parametrize("epoch", [1, 2])
def test_every_model_checkpoint_file_loads_without_rnnfuse(elsewhere, epoch):
    name = f"ckpt_{epoch}"
    got, want = _computed(elsewhere, name), elsewhere["want"][name]
    assert elsewhere["results"][name]["classes"] == want["classes"]
    assert want["classes"].count("LSTM") == 3
    assert elsewhere["results"][name]["iterations"] == want["iterations"]
    np.testing.assert_allclose(got["y"], want["y"], atol=1e-6)


def test_without_rnnfuse_a_fused_format_file_says_it_needs_rnnfuse(elsewhere):
    error = elsewhere["results"]["seq_fused"]["error"]
    assert "Could not locate class 'OptimizedSequential'" in error
    assert "rnnfuse's fused format" in error and "rnnfuse.load_model(path)" in error
    # A 0.1.0 file carries no such note: Keras' own error, which names the
    # module rnnfuse.persistence in the config it prints.
    old = elsewhere["results"]["old"]["error"]
    assert "Could not locate class 'OptimizedSequential'" in old
    assert "'module': 'rnnfuse.persistence'" in old


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


DIRECTIONS = ["original_to_optimized", "optimized_to_original"]


def _either_way(make, direction):
    """(source model, target model, source, target): two fresh `make()`
    models, the one on `direction`'s optimized side optimized."""
    source_model, target_model = make(), make()
    if direction == "original_to_optimized":
        return source_model, target_model, source_model, rnnfuse.optimize(target_model)
    return source_model, target_model, rnnfuse.optimize(source_model), target_model


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_weights_files_are_interchangeable(tmp_path, direction):
    source_model, target_model, source, target = _either_way(_interleaved_model, direction)
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
    fast.save(tmp_path / "fast.keras", fused=True)
    for archive in ("orig.keras", "fast.keras"):
        _perturb(model, 10)
        fast.load_weights(tmp_path / archive)
        for v, e in zip(model.weights, expected):
            np.testing.assert_array_equal(v.numpy(), e)


# -- export --------------------------------------------------------------------


def _saved_model_ops(folder) -> collections.Counter:
    """Op types in a SavedModel's graph and in every function it holds."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((folder / "saved_model.pb").read_bytes())
    graph = proto.meta_graphs[0].graph_def
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return collections.Counter(n.op for n in nodes)


def test_export_is_the_original_models_saved_model_and_serves_without_rnnfuse(elsewhere):
    # Traced where the fused kernel would run, yet no fused call in it.
    assert elsewhere["want"]["saved"]["fused_calls"] == 0
    folder = elsewhere["folder"]
    assert _saved_model_ops(folder / "saved") == _saved_model_ops(folder / "saved_original")
    np.testing.assert_allclose(
        _computed(elsewhere, "saved")["y"], elsewhere["want"]["saved"]["y"], atol=1e-6
    )


def test_onnx_export_is_the_original_models_and_runs_in_onnxruntime(elsewhere):
    import onnx

    def ops(path) -> collections.Counter:
        """Op types in the graph and its subgraphs (loop bodies); tf2onnx may
        order the same nodes differently."""
        count, graphs = collections.Counter(), [onnx.load(str(path)).graph]
        while graphs:
            for node in graphs.pop().node:
                count[node.op_type] += 1
                graphs += [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
        return count

    folder = elsewhere["folder"]
    assert ops(folder / "seq.onnx") == ops(folder / "seq_original.onnx")
    np.testing.assert_allclose(_computed(elsewhere, "onnx")["y"], elsewhere["want"]["onnx"]["y"],
                               atol=1e-5)


def test_export_fused_true_traces_the_fused_path(emulated_cudnn, tmp_path):
    import tensorflow as tf

    model = stack_model("rnn_tanh", 2, units=3, input_size=2, steps=3, head=True)
    fast = rnnfuse.optimize(model, tune=False)
    x = random_inputs(model, 3, np.random.default_rng(12))
    fast.export(str(tmp_path / "saved"), verbose=False, fused=True)
    assert emulated_cudnn, "the export did not trace the fused path"
    served = tf.saved_model.load(str(tmp_path / "saved"))
    np.testing.assert_allclose(np.asarray(served.serve(x)), np.asarray(model(x)), atol=2e-5)
    with pytest.raises(ValueError, match=r"format='onnx'.*Fix: leave fused out"):
        fast.export(str(tmp_path / "m.onnx"), format="onnx", fused=True)


# -- optimizer state in weight files --------------------------------------------


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
    # Read again (each list's order kept), and after the lists change.
    assert [id(v) for v in fast.weights] == [id(v) for v in model.weights]
    model.get_layer("side").trainable = False
    assert [v.path for v in fast.trainable_variables] == [
        v.path for v in model.trainable_variables
    ]
    assert [id(v) for v in fast.non_trainable_weights] == [
        id(v) for v in model.non_trainable_weights
    ] != []


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_weights_files_carry_the_optimizer_state_both_ways(tmp_path, direction):
    source_model, target_model, source, target = _either_way(_branchy_model, direction)
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
