"""Speech acoustic model: a convolutional front end, a bidirectional LSTM
stack and a CTC head.

    python examples/speech_encoder.py [--quick]
    rnnfuse inspect examples/speech_encoder.py:build_model --plot speech.png

Log-mel frames [batch, time, 40] go through two strided Conv1D layers (4x
fewer frames), then three `Bidirectional(LSTM)` layers whose directions are
concatenated, then a Dense layer of per-frame character logits (index 0 is
the CTC blank). rnnfuse fuses the three bidirectional layers into one
bidirectional 3-layer cuDNN call. The training step uses `keras.ops.ctc_loss`.

Exits 1 if the optimized model's outputs differ from the original's.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402  (sets KERAS_BACKEND before keras loads)
import keras  # noqa: E402
import numpy as np  # noqa: E402

MELS, FILTERS, UNITS, LAYERS, CHARS = 40, 32, 32, 3, 28
BATCH, FRAMES, LABEL_LEN = 8, 64, 6


def build_model() -> keras.Model:
    """Frames [batch, time, 40] -> character logits [batch, time / 4, 29]."""
    frames = keras.Input((None, MELS), name="log_mel")
    x = keras.layers.Conv1D(FILTERS, 5, strides=2, padding="same", activation="relu", name="conv_1")(frames)
    x = keras.layers.Conv1D(FILTERS, 5, strides=2, padding="same", activation="relu", name="conv_2")(x)
    for i in range(LAYERS):
        x = keras.layers.Bidirectional(
            keras.layers.LSTM(UNITS, return_sequences=True), name=f"bilstm_{i + 1}"
        )(x)
    logits = keras.layers.Dense(CHARS + 1, name="ctc_logits")(x)  # + blank (0)
    return keras.Model(frames, logits, name="speech_encoder")


def main() -> int:
    keras.utils.set_random_seed(0)
    model = build_model()
    fast = _common.report(model)
    rng = np.random.default_rng(0)
    frames = rng.standard_normal((BATCH, FRAMES, MELS)).astype("float32")
    ok = _common.check(model, fast, frames)
    labels = keras.ops.convert_to_tensor(rng.integers(1, CHARS + 1, (BATCH, LABEL_LEN)).astype("int32"))
    label_len = keras.ops.full((BATCH,), LABEL_LEN, "int32")
    out_len = keras.ops.full((BATCH,), FRAMES // 4, "int32")
    loss = lambda logits: keras.ops.mean(
        keras.ops.ctc_loss(labels, logits, label_len, out_len, mask_index=0)
    )
    _common.timing(model, fast, frames, loss_fn=loss)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
