"""Optimized models under tf.distribute.MirroredStrategy, on two CPU devices.

The CPU is split into two logical devices, which must happen before
TensorFlow initializes its devices, so the run happens in a fresh Python
process (the script below). The fused path runs there through the emulated
CudnnRNNV3 (tests/cudnn_reference.py), as on a GPU. Checked:

- `optimize` inside the strategy's scope (and, second case, outside it, on a
  model built inside it: the optimized model takes the original's strategy),
  then compile and fit;
- every trainable variable of the optimized model is the original's, and a
  MirroredVariable whose two replica copies are equal after training;
- the weights and the loss curve equal single-device training on the same
  global batches (MirroredStrategy sums the replicas' gradients).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    import keras
    import numpy as np

    tests_dir = sys.argv[1]
    sys.path.insert(0, tests_dir)
    import rnnfuse
    from cudnn_reference import emulated_cudnn_rnn
    from rnnfuse.backends import tensorflow as tf_backend

    calls = []
    tf_backend.cudnn_rnn = lambda **kw: calls.append(1) or emulated_cudnn_rnn(**kw)
    tf_backend.is_available = lambda: True

    def build():
        return keras.Sequential([
            keras.Input((4, 3)),
            keras.layers.SimpleRNN(4, return_sequences=True),
            keras.layers.SimpleRNN(4),
            keras.layers.Dense(1),
        ])

    def compile_(m, **kw):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **kw)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 4, 3)).astype("float32")
    y = rng.standard_normal((16, 1)).astype("float32")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def case(where):
        calls.clear()
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = build()
            if where == "inside":
                fast = rnnfuse.optimize(model)
                compile_(fast)
        if where == "outside":
            fast = rnnfuse.optimize(model)
            compile_(fast)
        initial = model.get_weights()
        history = fast.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        replicas = {}
        for v in model.trainable_variables:
            copies = strategy.experimental_local_results(v.value)
            replicas[v.path] = {
                "count": len(copies),
                "spread": max(float(np.max(np.abs(c.numpy() - copies[0].numpy())))
                              for c in copies),
            }
        reference = build()
        reference.set_weights(initial)
        compile_(reference, run_eagerly=True)
        expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return {
            "replicas_in_sync": strategy.num_replicas_in_sync,
            "strategy": type(fast.distribute_strategy).__name__,
            "fused": type(fast.layers[0]).__name__,
            "shared": sorted(id(v) for v in fast.trainable_variables)
                      == sorted(id(v) for v in model.trainable_variables),
            "fused_calls": len(calls),
            "replicas": replicas,
            "loss": history.history["loss"],
            "expected_loss": expected.history["loss"],
            "weight_diff": max(float(np.max(np.abs(a - b)))
                               for a, b in zip(model.get_weights(), reference.get_weights())),
            "moved": max(float(np.max(np.abs(a - b)))
                         for a, b in zip(model.get_weights(), initial)),
        }

    print("RESULT " + json.dumps({w: case(w) for w in ("inside", "outside")}))
    """
)


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory) -> dict:
    """Both cases' results, from one run of the script."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("tf.distribute is TensorFlow's")
    script = tmp_path_factory.mktemp("mirrored") / "mirrored.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, str(script), tests_dir],
        capture_output=True, text=True, timeout=400, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_mirrored_fit_trains_the_same_variables_on_every_replica(mirrored, where):
    result = mirrored[where]
    assert result["replicas_in_sync"] == 2
    assert result["strategy"] == "MirroredStrategy"
    assert result["fused"] == "FusedRNN"
    assert result["shared"]
    assert result["fused_calls"] >= 2, "the fused path did not run on both replicas"
    assert len(result["replicas"]) == 8  # 2 x (kernel, recurrent, bias) + dense
    for path, rep in result["replicas"].items():
        assert rep["count"] == 2, path
        assert rep["spread"] == 0.0, path
    assert result["moved"] > 1e-3
    np.testing.assert_allclose(result["loss"], result["expected_loss"], rtol=1e-5)
    assert result["weight_diff"] <= 1e-5
