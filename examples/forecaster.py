"""Multi-step forecaster: three stacked GRUs, then the next 12 steps at once.

    python examples/forecaster.py [--quick]
    rnnfuse check examples/forecaster.py:build_model

A window of 48 past observations of 3 series goes through three GRU layers
(Dropout between them) and a Dense layer that predicts the next 12 values of
the first series, reshaped to [batch, 12, 1]. rnnfuse fuses the three GRUs
into one 3-layer cuDNN call (Keras' default GRU, reset_after=True, is the
variant cuDNN computes).

Exits 1 if the optimized model's outputs differ from the original's.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402  (sets KERAS_BACKEND before keras loads)
import keras  # noqa: E402
import numpy as np  # noqa: E402

WINDOW, SERIES, HORIZON, UNITS, LAYERS = 48, 3, 12, 32, 3
BATCH = 16


def build_model() -> keras.Model:
    """History [batch, 48, 3] -> forecast [batch, 12, 1]."""
    history = keras.Input((WINDOW, SERIES), name="history")
    x = history
    for i in range(LAYERS):
        last = i == LAYERS - 1
        x = keras.layers.GRU(UNITS, return_sequences=not last, name=f"gru_{i + 1}")(x)
        if not last:
            x = keras.layers.Dropout(0.1, name=f"dropout_{i + 1}")(x)
    x = keras.layers.Dense(HORIZON, name="next_steps")(x)
    forecast = keras.layers.Reshape((HORIZON, 1), name="forecast")(x)
    return keras.Model(history, forecast, name="forecaster")


def sine_windows(rng: np.random.Generator):
    """Noisy sines of random phase and period: (history, the next 12 steps)."""
    t = np.arange(WINDOW + HORIZON)[None, :, None]
    phase = rng.uniform(0, 2 * np.pi, (BATCH, 1, SERIES))
    period = rng.uniform(8, 24, (BATCH, 1, SERIES))
    series = np.sin(2 * np.pi * t / period + phase) + 0.05 * rng.standard_normal((BATCH, WINDOW + HORIZON, SERIES))
    series = series.astype("float32")
    return series[:, :WINDOW], series[:, WINDOW:, :1]


def main() -> int:
    keras.utils.set_random_seed(0)
    model = build_model()
    fast = _common.report(model)
    history, target = sine_windows(np.random.default_rng(0))
    ok = _common.check(model, fast, history)
    target = keras.ops.convert_to_tensor(target)
    loss = lambda forecast: keras.ops.mean(keras.ops.square(forecast - target))
    _common.timing(model, fast, history, loss_fn=loss)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
