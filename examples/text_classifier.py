"""Text classifier: a masked embedding, three stacked LSTMs, a dense head.

    python examples/text_classifier.py          # what `make demo` runs
    rnnfuse inspect examples/text_classifier.py:build_model

`Embedding(mask_zero=True)` turns token id 0 into padding; Keras passes the
mask to every LSTM. rnnfuse fuses the three LSTMs into one layer (the
Dropout layers between them, one rate for every gap, become cuDNN's
between-layer dropout); a
right-padded mask becomes per-sequence lengths for the fused call. The last
LSTM returns only its final output, which the fused layer reproduces.

Exits 1 if the optimized model's outputs differ from the original's.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402  (sets KERAS_BACKEND before keras loads)
import keras  # noqa: E402
import numpy as np  # noqa: E402

VOCAB, EMBED, UNITS, CLASSES = 1000, 16, 32, 4
BATCH, STEPS = 8, 24


def build_model() -> keras.Model:
    """The classifier: tokens [batch, time] -> class logits [batch, 4]."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, EMBED, mask_zero=True, name="embed")(tokens)
    x = keras.layers.LSTM(UNITS, return_sequences=True, name="lstm_1")(x)
    x = keras.layers.Dropout(0.1, name="between_1")(x)
    x = keras.layers.LSTM(UNITS, return_sequences=True, name="lstm_2")(x)
    x = keras.layers.Dropout(0.1, name="between_2")(x)
    x = keras.layers.LSTM(UNITS, name="lstm_3")(x)
    logits = keras.layers.Dense(CLASSES, name="logits")(x)
    return keras.Model(tokens, logits, name="text_classifier")


def padded_batch(rng: np.random.Generator) -> np.ndarray:
    """Token ids in [1, VOCAB), each row right-padded with 0 to its length."""
    tokens = rng.integers(1, VOCAB, size=(BATCH, STEPS))
    lengths = rng.integers(STEPS // 4, STEPS + 1, size=BATCH)
    tokens[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0
    return tokens.astype("int32")


def main() -> int:
    keras.utils.set_random_seed(0)
    model = build_model()
    fast = _common.report(model)
    tokens = padded_batch(np.random.default_rng(0))
    ok = _common.check(model, fast, tokens)
    labels = keras.ops.convert_to_tensor(np.random.default_rng(1).integers(0, CLASSES, BATCH))
    loss = lambda logits: keras.ops.mean(
        keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    )
    _common.timing(model, fast, tokens, loss_fn=loss)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
