"""Online tuning under TensorFlow on the CPU: each candidate's step is a
traced function of its own (the emulated CudnnRNNV3 runs the fused plans),
the device is faked and each step's seconds come from a fake clock."""

from __future__ import annotations

import numpy as np
import pytest

import rnnfuse
from builders import fused_layers, max_abs_diff, race_online, stack_model
from rnnfuse.plan import Plan
from rnnfuse.tuning import first_batch, online, tuner

ENV = {"device": "FakeGPU", "tensorflow": "2.21.0", "cudnn": "9", "backend": "tensorflow",
       "rnnfuse": "0.1.0"}
MEDIANS = {"per-layer": 3.0, "fused": 2.0, "split 2+2": 1.0}


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))

    def no_offline_timing(*args, **kwargs):
        raise AssertionError("timed apart from the fit")

    monkeypatch.setattr(tuner, "_steps", no_offline_timing)


def test_the_candidates_race_as_traced_training_steps_and_the_fastest_is_committed(
    fake_gpu, emulated_cudnn, monkeypatch
):
    model = stack_model("lstm", 4, units=6, steps=9, last_return_sequences=True)
    fast = rnnfuse.optimize(model, cache=False)
    ran, commits = [], []
    race_online(fast, MEDIANS, ran)
    real_commit = online.OnlineFit._commit

    def commit(self, *args, **kwargs):
        commits.append(self.race.committed)
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(online.OnlineFit, "_commit", commit)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 9, 5)).astype("float32")
    y = rng.standard_normal((16, 9, 6)).astype("float32")
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=2, epochs=3, verbose=0)  # 24 steps
    (layer,) = fused_layers(fast)
    assert set(ran) == set(MEDIANS) and commits == ["split 2+2"]
    assert layer.plan == Plan((2, 2))
    (record,) = first_batch.decisions(fast)
    assert record["source"] == "measured: online, on the fit's own steps"
    # The race's cost, in its record: every step it ran beyond the winner's.
    race = record["race"]
    assert race["steps"] == len(ran)
    assert race["first_ms"] == {name: 1e3 * t for name, t in MEDIANS.items()}
    assert race["overhead_ms"] == pytest.approx(1e3 * sum(MEDIANS[n] - 1.0 for n in ran))
    assert fast._rnnfuse_autotune.seconds >= race["overhead_ms"] / 1e3
    assert not isinstance(fast.train_function, online.OnlineFit)
    assert max_abs_diff(fast.predict(x, verbose=0), model.predict(x, verbose=0)) <= 2e-5
