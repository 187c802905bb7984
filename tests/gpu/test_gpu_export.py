"""What an optimized model writes on the GPU, served where rnnfuse is not.

Run on a GPU (about two minutes; see tests/gpu/conftest.py). The fused
models here run rnnfuse's own op (`RnnfuseCudnnRnn`), which every test checks
first: a SavedModel traced from them without care would hold it. One fixture
writes every artifact, then fresh Python processes in which `import rnnfuse`
fails serve them:

- on the GPU: the default `export()` of an LSTM stack (Keras runs it on
  cuDNN) and of a SimpleRNN stack (Keras' loop), each beside the original
  model's own export; the `fused=True` export, which must fail there with
  TensorFlow's "Op type not registered"; the `.keras` file of `save()` and
  each `ModelCheckpoint` file of a `fit`;
- with no GPU visible (CUDA_VISIBLE_DEVICES=""): the same default exports,
  each serving exactly where the original's export serves (the SimpleRNN
  one; not the LSTM one, whose CudnnRNNV3 has no CPU kernel, as Keras' own);
- on the GPU after `tf.load_op_library` of the op library copied beside the
  `fused=True` export: that export serves (docs/deployment.md's recipe).

With RNNFUSE_REPORT_DIR set, the numbers go to export.json there.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from builders import traced_op_types
from gpu_report import report

import rnnfuse

STEPS, FEATURES, UNITS, LAYERS, BATCH = 64, 32, 128, 3, 16

pytestmark = [
    pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow SavedModels"),
    pytest.mark.cudnn_op,  # rnnfuse's op on: what a user's optimized model runs
    pytest.mark.real_gpu_only,  # inspects the real kernels
]

_SERVE = textwrap.dedent(
    """
    import sys
    sys.modules["rnnfuse"] = None  # `import rnnfuse` raises ImportError
    import json, os
    import numpy as np, tensorflow as tf, keras
    jobs_path, library = sys.argv[1], sys.argv[2]
    tf.config.experimental.enable_tensor_float_32_execution(False)  # as in the tests
    if library != "-":
        tf.load_op_library(library)
    results = {"gpus": len(tf.config.list_logical_devices("GPU"))}
    for name, job in json.load(open(jobs_path)).items():
        try:
            x = np.load(job["x"])
            if job["kind"] == "saved_model":
                served = tf.saved_model.load(job["path"])  # keep it: it owns the variables
                y = np.asarray(served.serve(x))
                results[name] = {}
            else:
                model = keras.models.load_model(job["path"])
                y = np.asarray(model(x))
                results[name] = {"iterations": int(model.optimizer.iterations.numpy()),
                                 "classes": [type(l).__name__ for l in model.layers]}
            np.save(os.path.join(os.path.dirname(jobs_path), f"{name}.{os.path.basename(jobs_path)}.npy"), y)
        except Exception as err:
            text = " ".join(str(err).split())
            results[name] = {"error": f"{type(err).__name__}: {text[:600]}"}
    assert all(not m.startswith("rnnfuse") for m in sys.modules if sys.modules[m] is not None)
    print("RESULTS " + json.dumps(results))
    """
)


def _stack(kind: str) -> keras.Model:
    layer = {"lstm": keras.layers.LSTM, "rnn_tanh": keras.layers.SimpleRNN}[kind]
    inp = keras.Input((STEPS, FEATURES))
    x = inp
    for i in range(LAYERS):
        x = layer(UNITS, return_sequences=i < LAYERS - 1, name=f"{kind}_{i}")(x)
    return keras.Model(inp, keras.layers.Dense(4, name="head")(x))


def _ops(folder) -> collections.Counter:
    """Op types in a SavedModel's graph and every function it holds."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(folder, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    graph = proto.meta_graphs[0].graph_def
    nodes = list(graph.node) + [n for fn in graph.library.function for n in fn.node_def]
    return collections.Counter(n.op for n in nodes)


def _runs_the_op(fast, x) -> bool:
    return "RnnfuseCudnnRnn" in traced_op_types(lambda t: fast(t), x)


def _serve(folder, jobs: dict, tag: str, *, gpu: bool = True, library: str = "-") -> dict:
    """Runs _SERVE on `jobs` in a fresh process: {job: result (+ "y")}."""
    jobs_path = folder / tag
    jobs_path.write_text(json.dumps(jobs))
    script = folder / "serve.py"
    script.write_text(_SERVE)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, str(script), str(jobs_path), library],
        capture_output=True, text=True, timeout=400, env=env, cwd=str(folder),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULTS ")][-1]
    results = json.loads(line[len("RESULTS "):])
    for name, result in results.items():
        if name != "gpus" and "error" not in result:
            result["y"] = np.load(folder / f"{name}.{tag}.npy")
    return results


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """Writes every artifact, serves them (see the module doc); the facts."""
    import tensorflow as tf

    from rnnfuse.backends.tensorflow import op_build

    # No TF32 (the autouse fixture that turns it off runs after this one).
    tf.config.experimental.enable_tensor_float_32_execution(False)

    folder = tmp_path_factory.mktemp("export")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, STEPS, FEATURES)).astype("float32")
    x_path = str(folder / "x.npy")
    np.save(x_path, x)
    jobs, want, facts = {}, {}, {"runs_the_op": {}, "ops": {}}

    def job(name, kind, expected):
        jobs[name] = {"kind": kind, "path": str(folder / name), "x": x_path}
        want[name] = expected

    for kind in ("lstm", "rnn_tanh"):
        keras.utils.set_random_seed(1)
        model = _stack(kind)
        fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
        facts["runs_the_op"][kind] = _runs_the_op(fast, x)
        fast.export(str(folder / f"{kind}_fast"), verbose=False)
        model.export(str(folder / f"{kind}_original"), verbose=False)
        for which in ("fast", "original"):
            job(f"{kind}_{which}", "saved_model", np.asarray(model(x)))
        facts["ops"][kind] = {w: _ops(folder / f"{kind}_{w}") for w in ("fast", "original")}
    # The LSTM stack (model, fast) again: the fused export, with the op
    # library beside it (the serving recipe of docs/deployment.md).
    keras.utils.set_random_seed(1)
    model = _stack("lstm")
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    fast.export(str(folder / "lstm_fused"), verbose=False, fused=True)
    facts["fused_ops"] = _ops(folder / "lstm_fused")
    library = folder / "lstm_fused" / "rnnfuse_cudnn_rnn.so"
    shutil.copy(op_build.library_path(), library)
    job("lstm_fused", "saved_model", np.asarray(fast(x)))
    # .keras files: a ModelCheckpoint file per epoch of fit, then save().
    fast.compile(optimizer="adam", loss="mse")
    outputs = []
    fast.fit(x, rng.standard_normal((BATCH, 4)).astype("float32"), batch_size=8, epochs=2,
             verbose=0, callbacks=[
                 keras.callbacks.LambdaCallback(
                     on_epoch_end=lambda epoch, logs: outputs.append(np.asarray(model(x)))),
                 keras.callbacks.ModelCheckpoint(str(folder / "ckpt_{epoch}.keras")),
             ])
    facts["trained_runs_the_op"] = _runs_the_op(fast, x)
    fast.save(folder / "saved.keras")
    for epoch in (1, 2):
        job(f"ckpt_{epoch}.keras", "keras", outputs[epoch - 1])
    job("saved.keras", "keras", np.asarray(model(x)))
    again = rnnfuse.load_model(folder / "saved.keras")
    facts["load_model"] = {
        "fused_layers": sum(isinstance(l, rnnfuse.FusedRNN) for l in again.layers),
        "max_diff": _diff(again(x), model(x)),
    }
    exports = {k: v for k, v in jobs.items() if k.endswith(("_fast", "_original"))}
    facts["gpu"] = _serve(folder, jobs, "gpu.json")
    facts["cpu"] = _serve(folder, exports, "cpu.json", gpu=False)
    facts["with_library"] = _serve(
        folder, {"lstm_fused": jobs["lstm_fused"]}, "library.json", library=str(library)
    )
    facts["want"] = want
    _report(facts)
    return facts


def _diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def _report(facts: dict) -> None:
    data = {k: facts[k] for k in ("runs_the_op", "trained_runs_the_op", "load_model")}
    data["fused_export_RnnfuseCudnnRnn_ops"] = facts["fused_ops"]["RnnfuseCudnnRnn"]
    for where in ("gpu", "cpu", "with_library"):
        for name, result in facts[where].items():
            if name != "gpus":
                data[f"{where}: {name}"] = result.get("error") or {
                    "max_diff_vs_original_model": _diff(result["y"], facts["want"][name])
                }
    report("export", data)


@pytest.mark.parametrize("kind", ["lstm", "rnn_tanh"])
def test_export_is_the_originals_and_serves_on_the_gpu_without_rnnfuse(served, kind):
    assert served["runs_the_op"][kind], "the optimized model does not run rnnfuse's op"
    ops = served["ops"][kind]
    assert "RnnfuseCudnnRnn" not in ops["fast"]
    assert ops["fast"] == ops["original"]
    assert ("CudnnRNNV3" in ops["fast"]) == (kind == "lstm")  # as Keras runs each
    gpu = served["gpu"]
    assert gpu["gpus"] >= 1
    fast, original = gpu[f"{kind}_fast"], gpu[f"{kind}_original"]
    assert "error" not in fast, fast["error"]
    assert _diff(fast["y"], original["y"]) == 0.0
    assert _diff(fast["y"], served["want"][f"{kind}_fast"]) <= 1e-5


@pytest.mark.parametrize("kind", ["lstm", "rnn_tanh"])
def test_export_serves_without_a_gpu_wherever_the_originals_does(served, kind):
    cpu = served["cpu"]
    assert cpu["gpus"] == 0
    fast, original = cpu[f"{kind}_fast"], cpu[f"{kind}_original"]
    assert ("error" in fast) == ("error" in original), (fast, original)
    if kind == "rnn_tanh":  # Keras' loop: serves anywhere
        assert "error" not in fast, fast["error"]
        assert _diff(fast["y"], original["y"]) == 0.0
        assert _diff(fast["y"], served["gpu"][f"{kind}_fast"]["y"]) <= 1e-4
    else:  # CudnnRNNV3 has only a GPU kernel, in both exports
        assert "CudnnRNNV3" in fast.get("error", ""), fast


def test_fused_export_needs_the_op_library_and_serves_once_it_is_loaded(served):
    assert served["fused_ops"]["RnnfuseCudnnRnn"] >= 1
    without = served["gpu"]["lstm_fused"]
    assert "Op type not registered 'RnnfuseCudnnRnn'" in without.get("error", ""), without
    loaded = served["with_library"]["lstm_fused"]
    assert "error" not in loaded, loaded["error"]
    assert _diff(loaded["y"], served["want"]["lstm_fused"]) <= 1e-6
    assert _diff(loaded["y"], served["want"]["lstm_fast"]) <= 1e-5


@pytest.mark.parametrize("name", ["ckpt_1.keras", "ckpt_2.keras", "saved.keras"])
def test_keras_and_checkpoint_files_load_in_plain_keras_on_the_gpu(served, name):
    assert served["trained_runs_the_op"], "fit did not run rnnfuse's op"
    result = served["gpu"][name]
    assert "error" not in result, result["error"]
    assert result["classes"] == ["InputLayer", "LSTM", "LSTM", "LSTM", "Dense"]
    epochs = {"ckpt_1.keras": 1, "ckpt_2.keras": 2, "saved.keras": 2}[name]
    assert result["iterations"] == epochs * BATCH // 8  # fit's batch_size=8
    assert _diff(result["y"], served["want"][name]) <= 1e-5


def test_rnnfuse_load_model_fuses_the_saved_file_again(served):
    assert served["load_model"]["fused_layers"] == 1
    assert served["load_model"]["max_diff"] <= 1e-5
