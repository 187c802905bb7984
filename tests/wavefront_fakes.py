"""The TensorFlow wavefront ops faked at their lowest level, for the CPU
tests: `op_build.load_wavefront_op` returns `FakeWavefrontOp`, whose
`rnnfuse_wavefront` records each call and computes what the kernel
computes (the emulated cuDNN of cudnn_reference.py, from the op's own
inputs) with no gradient of its own; the kernel's on-chip plan is
`fake_limits` (a stack fits when layers x units <= `limit`); the training
ops are their TF step-by-step references (recorded in `training`).

    >>> FakeWavefrontOp(48).fake_limits("lstm", 2, 32, 4, 7, 5)
    '2 layers of 32 units do not fit on chip'
"""

from __future__ import annotations

import tensorflow as tf

from cudnn_reference import emulated_cudnn_rnn
from rnnfuse.backends.cuda import library
from rnnfuse.backends.tensorflow import op_build, wavefront_training


class FakeWavefrontOp:
    """The loaded op module: `rnnfuse_wavefront` as the real op takes it."""

    def __init__(self, limit: int):
        self.limit = limit
        self.calls, self.asked, self.training = [], [], []

    def rnnfuse_wavefront(self, *, xproj, params, input_h, input_c, sequence_lengths,
                          rnn_mode, input_size, kernel_variant):
        steps, batch, gh = (int(d) for d in xproj.shape)
        self.calls.append(dict(mode=rnn_mode, steps=steps, batch=batch,
                               lengths=int(sequence_lengths.shape[0]), variant=kernel_variant,
                               input_size=int(input_size)))
        # x W_ih0^T arrives projected: layer 0's input matrix is the identity.
        eye = tf.reshape(tf.eye(gh, dtype=xproj.dtype), [-1])
        params = tf.concat([eye, params[gh * input_size:]], axis=0)
        lengths = sequence_lengths if sequence_lengths.shape[0] else tf.fill([batch], steps)
        out, h, c, *_ = emulated_cudnn_rnn(
            input=xproj, input_h=input_h, input_c=input_c, params=params,
            sequence_lengths=lengths, rnn_mode=rnn_mode, direction="unidirectional",
            time_major=True)
        if rnn_mode == "gru":
            c = tf.zeros([0], xproj.dtype)
        return [tf.stop_gradient(t) for t in (out, h, c)]  # the op has no gradient

    def fake_limits(self, kind, num_layers, units, batch, steps, input_size, ordinal=0):
        self.asked.append((kind, num_layers, units, batch, steps, input_size))
        if num_layers * units > self.limit:
            return f"{num_layers} layers of {units} units do not fit on chip"
        return None


def _fake_backward_reason(kind, units, batch, steps, ordinal=0):
    if kind not in library.KINDS:
        return f"the wavefront backward kernel runs LSTM and GRU stacks, not {kind}"
    return None


def install(monkeypatch, limit: int) -> FakeWavefrontOp:
    """The fake op, its plan and the reference training ops, in place."""
    op = FakeWavefrontOp(limit)
    monkeypatch.setattr(op_build, "load_wavefront_op", lambda: op)
    monkeypatch.setattr(library, "device_reason", op.fake_limits)
    monkeypatch.setattr(library, "backward_reason", _fake_backward_reason)

    def saving(*args, **kwargs):
        op.training.append("forward")
        return wavefront_training.reference_forward_saving(*args, **kwargs)

    def recurrence(*args, **kwargs):
        op.training.append("backward")
        return wavefront_training.recurrence_reference(*args, **kwargs)

    monkeypatch.setattr(wavefront_training, "forward_saving", saving)
    monkeypatch.setattr(wavefront_training, "backward_layer", recurrence)
    return op
