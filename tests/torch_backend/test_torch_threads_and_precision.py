"""Per-call state of the torch backend: call modes and cuDNN's TF32 flag.

- `call_mode()` is a property of the calls made in its block, in its thread:
  two threads running two optimized models under different modes each get
  their own, and nothing is left changed.
- Stacks Keras runs in its loop (SimpleRNN, RNN(cell), masked layers) run
  cuDNN with TF32 off where Keras' loop computes exact float32, in the
  forward call and its backward; the user's flag is back afterwards.
  The CPU has no TF32: the tests make the backend take
  that path on the CPU and watch the flag.
"""

from __future__ import annotations

import contextvars
import os
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
import torch

import rnnfuse
from builders import fused_layers, max_abs_diff, stack_model
from rnnfuse.backends import torch as torch_backend

L = keras.layers


# -- call modes in threads -------------------------------------------------------


def test_two_threads_keep_their_own_call_mode_and_leave_nothing_changed(monkeypatch):
    seen: list[tuple[str, int]] = []
    real = torch_backend.torch_rnn

    def spy(mode, *args):
        # Padded calls: (x, hx, params, has_biases, num_layers, ...).
        packed = isinstance(args[1], torch.Tensor) and args[1].dtype == torch.int64
        num_layers = (args[2:] if packed else args[1:])[3]
        seen.append((threading.current_thread().name, num_layers))
        time.sleep(0.01)  # let the other thread run in between
        return real(mode, *args)

    monkeypatch.setattr(torch_backend, "torch_rnn", spy)
    fused_whole = rnnfuse.optimize(stack_model("gru", 3), plan=rnnfuse.FUSED)
    split = rnnfuse.optimize(stack_model("lstm", 3), plan=rnnfuse.Plan((2, 1)))
    assert [len(f.fused_layers) for f in fused_layers(split)] == [2, 1]
    x = np.random.default_rng(0).standard_normal((2, 7, 5)).astype("float32")
    barrier = threading.Barrier(2)
    errors = []

    def run(model, mode, hold):
        try:
            with torch_backend.call_mode(mode):
                barrier.wait()
                for _ in range(3):
                    model(x)
                    assert torch_backend.get_call_mode() == mode
                time.sleep(hold)  # leave the blocks in the other order
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)

    a = threading.Thread(target=run, args=(fused_whole, "one", 0.3), name="one")
    b = threading.Thread(target=run, args=(split, "per_level", 0.0), name="per_level")
    a.start(); b.start(); a.join(); b.join()  # noqa: E702
    assert not errors, errors
    by_thread = {name: [n for t, n in seen if t == name] for name in ("one", "per_level")}
    assert by_thread["one"] == [3] * 3  # one call for the whole stack
    # per level: the 2-layer piece in two calls, the 1-layer piece in one.
    assert by_thread["per_level"] == [1, 1, 1] * 3
    assert torch_backend.get_call_mode() == "auto"
    assert torch_backend.device_environment()["calls"] == "auto"


def test_call_mode_is_not_seen_by_a_thread_started_inside_the_block():
    seen = []
    with torch_backend.call_mode("per_level"):
        t = threading.Thread(target=lambda: seen.append(torch_backend.get_call_mode()))
        t.start(); t.join()  # noqa: E702
        assert torch_backend.get_call_mode() == "per_level"
    assert seen == ["auto"] and torch_backend.get_call_mode() == "auto"


def test_set_call_mode_holds_in_this_thread_under_blocks():
    seen = []

    def body():
        torch_backend.set_call_mode("one")
        with torch_backend.call_mode("per_level"):
            assert torch_backend.get_call_mode() == "per_level"
        assert torch_backend.get_call_mode() == "one"
        t = threading.Thread(target=lambda: seen.append(torch_backend.get_call_mode()))
        t.start(); t.join()  # noqa: E702

    contextvars.copy_context().run(body)
    assert seen == ["auto"]  # a new thread starts from RNNFUSE_TORCH_CALLS
    assert torch_backend.get_call_mode() == "auto"  # set only in body's context
    with pytest.raises(ValueError, match="unknown mode 'split'"):
        with torch_backend.call_mode("split"):
            pass


def test_a_bad_rnnfuse_torch_calls_warns_and_import_rnnfuse_still_works():
    """RNNFUSE_TORCH_CALLS=bogus must not make `import rnnfuse` fail with
    "set_call_mode(mode): unknown mode 'bogus'" (no variable named)."""
    env = {**os.environ, "KERAS_BACKEND": "torch", "RNNFUSE_TORCH_CALLS": "bogus"}
    code = "import rnnfuse.backends.torch as t; print(t.get_call_mode())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "auto"
    assert "RNNFUSE_TORCH_CALLS='bogus'" in done.stderr
    assert "'auto', 'one', 'per_level'" in done.stderr


@pytest.mark.parametrize("value, mode", [("", "auto"), ("per_level", "per_level"), ("one", "one")])
def test_rnnfuse_torch_calls_sets_the_process_default(monkeypatch, value, mode):
    monkeypatch.setenv("RNNFUSE_TORCH_CALLS", value)
    assert torch_backend._mode_from_environment() == mode


# -- TF32 ---------------------------------------------------------------------------


class _FlagAtBackward(torch.autograd.Function):
    """Identity whose backward records cuDNN's TF32 flag (runs just before
    the cuDNN call's own backward would)."""

    log: list = []

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        _FlagAtBackward.log.append(torch.backends.cudnn.allow_tf32)
        return g


@pytest.fixture
def tf32_watch(monkeypatch):
    """Takes the exact-float32 path as on a GPU; records the flag per call."""
    forward: list[bool] = []
    real_needs = torch_backend.needs_exact_float32
    real_rnn = torch_backend.torch_rnn

    def needs(stack, x, mask):
        # As on CUDA in float32 with the defaults (matmul TF32 off, cuDNN on).
        return stack.keras_loop or (mask is not None and not stack.proj_size)

    def spy(mode, *args):
        forward.append(torch.backends.cudnn.allow_tf32)
        out = real_rnn(mode, *args)
        return (_FlagAtBackward.apply(out[0]),) + tuple(out[1:])

    monkeypatch.setattr(torch_backend, "needs_exact_float32", needs)
    monkeypatch.setattr(torch_backend, "torch_rnn", spy)
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    _FlagAtBackward.log = []
    yield forward, real_needs
    torch.backends.cudnn.allow_tf32 = old


def _loop_model(which: str) -> keras.Model:
    inp = keras.Input((7, 5))
    if which == "simple_rnn":
        x = L.SimpleRNN(6, activation="relu", return_sequences=True)(inp)
        x = L.SimpleRNN(6, activation="relu")(x)
    elif which == "rnn_cell":
        x = L.RNN(L.LSTMCell(6), return_sequences=True)(inp)
        x = L.RNN(L.LSTMCell(6))(x)
    else:
        x = L.RNN(L.StackedRNNCells([L.GRUCell(6), L.GRUCell(6)]))(inp)
    return keras.Model(inp, x)


@pytest.mark.parametrize("which", ["simple_rnn", "rnn_cell", "stacked_cells"])
def test_loop_kinds_run_cudnn_without_tf32_forward_and_backward(which, tf32_watch):
    forward, _ = tf32_watch
    model = _loop_model(which)
    fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    assert fused.stack.keras_loop
    x = torch.as_tensor(np.random.default_rng(1).standard_normal((3, 7, 5)).astype("float32"))
    y = fast(x)
    assert forward == [False]
    assert torch.backends.cudnn.allow_tf32 is True  # back after the call
    y.float().sum().backward()
    assert _FlagAtBackward.log == [False]  # off while the call's backward runs
    assert torch.backends.cudnn.allow_tf32 is True and torch_backend._EXACT_FLOAT32.holds == 0
    assert max_abs_diff(fast(x), model(x)) <= 1e-5


def test_lstm_and_gru_keep_the_user_cudnn_setting(tf32_watch):
    forward, _ = tf32_watch
    for kind in ("lstm", "gru"):
        fast = rnnfuse.optimize(stack_model(kind, 2))
        assert not fused_layers(fast)[0].stack.keras_loop
        fast(np.zeros((2, 7, 5), "float32"))
    assert forward == [True, True]


def test_masked_lstm_runs_without_tf32_like_keras_torch_loop(tf32_watch):
    forward, _ = tf32_watch
    fast = rnnfuse.optimize(stack_model("lstm", 2, masked=True))
    tokens = np.array([[3, 4, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7]], "int32")
    fast(tokens)
    assert forward == [False] and torch.backends.cudnn.allow_tf32 is True


def test_overlapping_holds_put_the_user_value_back_once():
    old = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        torch_backend._hold_exact_float32()
        torch_backend._hold_exact_float32()
        torch_backend._release_exact_float32()  # the first holder leaves first
        assert torch.backends.cudnn.allow_tf32 is False
        torch_backend._release_exact_float32()
        assert torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.backends.cudnn.allow_tf32 = old


def test_needs_exact_float32_only_on_cuda_in_float32(tf32_watch):
    _, real_needs = tf32_watch
    fused = fused_layers(rnnfuse.optimize(_loop_model("simple_rnn")))[0]
    assert not real_needs(fused.stack, torch.zeros(2, 3, 5), None)  # the CPU has no TF32


def test_a_hold_left_by_a_failed_backward_is_released_with_its_graph():
    import gc

    old = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        hold = torch_backend._Hold()
        torch_backend._hold_exact_float32()  # as _BackwardSwitch.backward on the outputs does
        hold.held = True
        # ... and the cuDNN backward raised: the switch on the inputs never ran.
        assert torch.backends.cudnn.allow_tf32 is False
        del hold
        gc.collect()
        assert torch.backends.cudnn.allow_tf32 is True and torch_backend._EXACT_FLOAT32.holds == 0
    finally:
        torch.backends.cudnn.allow_tf32 = old
