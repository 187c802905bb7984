"""What the wavefront kernel's GPU tests share across backends: the float16
LSTM stacks they tune, spies that count the kernels' real launches, and the
tuner's training decision at the headline shape, checked the same way on
TensorFlow and torch.

    >>> sorted(new_launch_counts())
    ['layer', 'stack']
"""

from __future__ import annotations

import json

import keras
import numpy as np

import rnnfuse
from builders import fused_layers, stack_model
from gpu_report import report
from gpu_timing import median_seconds
from rnnfuse.tuning import first_batch
from rnnfuse.tuning.cache import PlanCache


def float16_lstm(layers: int, units: int, steps: int) -> keras.Model:
    """A mixed_float16 LSTM stack, inputs as wide as its units, returning sequences."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        return stack_model("lstm", layers, units=units, input_size=units, steps=steps,
                           last_return_sequences=True)
    finally:
        keras.config.set_dtype_policy("float32")


def new_launch_counts() -> dict:
    return {"stack": 0, "layer": 0}


def count_backward_launches(monkeypatch, calls: dict) -> dict:
    """Counts the library's backward launches in `calls` (they still run):
    "stack", the reverse wavefront's one a call; "layer", one a layer."""
    from rnnfuse.backends.cuda import library

    for name, key in (("backward_stack", "stack"), ("backward", "layer")):
        real = getattr(library.WavefrontLibrary, name)

        def spy(self, *args, _real=real, _key=key, **kw):
            calls[_key] += 1
            return _real(self, *args, **kw)

        monkeypatch.setattr(library.WavefrontLibrary, name, spy)
    return calls


def record_first_shapes(monkeypatch, owner, name: str, calls: list) -> list:
    """Appends the shape of each call's first argument to `calls` (the call still runs)."""
    real = getattr(owner, name)

    def spy(*args):
        calls.append(tuple(args[0].shape))
        return real(*args)

    monkeypatch.setattr(owner, name, spy)
    return calls


def predict_and_report(name: str, shape, fast, x, batch_size: int):
    """`fast.predict` (its first call tunes), its one decision printed and
    reported as `name` (with `shape` unless None): (outputs, decision record)."""
    y = fast.predict(x, batch_size=batch_size, verbose=0)
    (record,) = first_batch.decisions(fast)
    print("GPU_REPORT decision", json.dumps(record, default=str))
    report(name, {**({} if shape is None else {"shape": shape}), "chosen": record["chosen"],
                  "timings_ms": record["timings_ms"], "rejected": record["rejected"]})
    return y, record


def assert_batch_8_keeps_cudnn_or_the_original(tmp_path, name: str) -> None:
    """A 2x512 float16 LSTM's predict at batch 8, where cuDNN's persistent
    kernel is faster: the wavefront plan is timed and not chosen."""
    model = float16_lstm(2, 512, 1000)
    x = np.random.default_rng(1).standard_normal((16, 1000, 512)).astype("float32")
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    (layer,) = fused_layers(fast)
    _, record = predict_and_report(name, None, fast, x, 8)
    assert "fused on wavefront" in record["timings_ms"], record
    assert layer.plan.kernel != "wavefront" and "wavefront" not in record["chosen"], record


def torch_variable_gradients(run, x, upstream, variables) -> list:
    """float64 gradients of sum(run(x, training=True) * upstream) with
    respect to `variables` (Keras variables; an optimized model trains the
    original's)."""
    import torch

    y = run(x, training=True).float()
    grads = torch.autograd.grad((y * upstream).sum(), [v.value for v in variables])
    return [g.double() for g in grads]


def fit_at_the_headline(tmp_path, training_kernel: str):
    """The 4x512 float16 LSTM at batch 64, T=1000, optimized and fit one
    epoch: the training decision chose the wavefront plan, and the fused
    layer's last call ran `training_kernel`'s default backward (the reverse
    wavefront) with no fallback note. Returns (model, fast, layer, record,
    x, y, rng), both models compiled."""
    model = float16_lstm(4, 512, 1000)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((256, 1000, 512)).astype("float32")
    y = (0.1 * rng.standard_normal((256, 1000, 512))).astype("float32")
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    (layer,) = fused_layers(fast)
    fast.compile(optimizer="sgd", loss="mse")
    model.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=64, epochs=1, verbose=0)
    (record,) = first_batch.decisions(fast)
    print("GPU_REPORT decision", json.dumps(record, default=str))
    assert record["mode"] == "training" and record["chosen"] == "fused on wavefront", record
    ran = layer.last_path.kernel
    assert ran.name == training_kernel and ran.note is None, layer.last_path
    assert ran.algorithm == "backward=stack", layer.last_path  # the default, at the headline
    return model, fast, layer, record, x, y, rng


def assert_fit_is_faster(name: str, model, fast, x, y, record, grad_rel: float, *,
                         sync=lambda: None) -> None:
    """Times a `fit` epoch of each (median of 3 after a traced one), reports
    it as `name`, and holds the gradients within float16 rounding
    (`grad_rel` <= 2e-2) and the optimized fit to faster."""

    def fit_s(m):
        return median_seconds(lambda: m.fit(x, y, batch_size=64, epochs=1, verbose=0), 3,
                              sync=sync)

    original_s = fit_s(model)
    fast_s = fit_s(fast)
    report(name, {
        "shape": "4x512 LSTM B64 T1000 float16", "chosen": record["chosen"],
        "timings_ms": record["timings_ms"], "rejected": record["rejected"],
        "fit_original_ms": 1e3 * original_s, "fit_optimized_ms": 1e3 * fast_s,
        "speedup": original_s / fast_s, "grad_rel_diff": grad_rel,
    })
    assert grad_rel <= 2e-2, grad_rel
    assert fast_s < original_s, (fast_s, original_s)
