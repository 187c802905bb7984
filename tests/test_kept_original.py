"""A group whose plan keeps the original layers runs their own calls under
TensorFlow too. A TensorFlow step is traced once and its graph then runs
every step, so what matters is what the graphs hold: the original layers'
calls and no fused kernel, in the traced steps of `fit`, `train_on_batch`,
`predict_on_batch` and a direct call (the device faked, a fake clock
choosing the plans; the torch twin, where every step runs eagerly and the
wrapper's work itself is pinned: torch_backend/test_torch_kept_original.py).
"""

from __future__ import annotations

import numpy as np
import pytest

import rnnfuse
from builders import fused_layers, max_abs_diff, spy_on, stack_model
from rnnfuse.tuning import first_batch, per_shape, tuner

ENV = {"device": "FakeGPU", "tensorflow": "2.21.0", "cudnn": "9", "backend": "tensorflow",
       "rnnfuse": "0.1.0"}


@pytest.fixture
def fake_gpu(monkeypatch):
    """A device to 'time' on; the candidates' steps are never built."""
    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))
    monkeypatch.setattr(per_shape, "device_environment", lambda: dict(ENV))
    monkeypatch.setattr(tuner, "_steps", lambda group, plans, *a, **k: {p.name: None for p in plans})


def test_a_kept_original_groups_traced_steps_hold_the_original_calls_and_no_fused_kernel(
        fake_gpu, emulated_cudnn, monkeypatch):
    model = stack_model("gru", 3, steps=6)
    fast = rnnfuse.optimize(model, cache=False)
    state = fast._rnnfuse_autotune
    state.environment = dict(ENV)
    medians = {"per-layer": 1.0, "fused": 5.0}
    state.measure = lambda steps, on_step=None: {n: {"median": medians.get(n, 5.0)} for n in steps}
    state.check_gradients = lambda *args: 1e-6
    state.fit_share = None  # a tiny fit times everything (the budget: test_budget.py)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, *model.input_shape[1:])).astype("float32")
    y = np.asarray(model.predict(x, verbose=0))
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=4, epochs=1, verbose=0)
    fast.predict(x, batch_size=4, verbose=0)
    (layer,) = fused_layers(fast)
    assert state.decided and all(r.plan.per_layer for r in state.decided.values())
    layer_calls = []
    for member in layer.fused_layers:
        spy_on(monkeypatch, member, "call", layer_calls, member.name)
    names = [m.name for m in layer.fused_layers]
    emulated_cudnn.clear()
    # New traces of every entry point (a trace records the calls it makes).
    for make in ("make_train_function", "make_predict_function"):
        getattr(fast, make)(force=True)
    paths = []
    for run in (lambda: fast.fit(x, y, batch_size=4, epochs=1, verbose=0),
                lambda: fast.train_on_batch(x[:4], y[:4]),
                lambda: fast.predict_on_batch(x[:4]),
                lambda: fast(x[:4], training=True)):
        layer_calls.clear()
        run()
        assert layer_calls[:3] == names, "a step without the original layers' calls"
        paths.append(str(layer.last_path))
    assert emulated_cudnn == [], "a fused kernel in a kept-original group's graph"
    assert all("original layers" in p for p in paths), paths
    assert max_abs_diff(fast.predict_on_batch(x[:4]), model.predict_on_batch(x[:4])) <= 1e-6
