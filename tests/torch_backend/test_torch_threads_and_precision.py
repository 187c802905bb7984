"""Per-call state of the torch backend: call modes.

- `call_mode()` is a property of the calls made in its block, in its thread:
  two threads running two optimized models under different modes each get
  their own, and nothing is left changed (issue 15, item 10).
"""

from __future__ import annotations

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


def test_set_call_mode_is_the_process_default_under_blocks(monkeypatch):
    monkeypatch.setattr(torch_backend, "_default_mode", "auto")
    torch_backend.set_call_mode("one")
    with torch_backend.call_mode("per_level"):
        assert torch_backend.get_call_mode() == "per_level"
    assert torch_backend.get_call_mode() == "one"
    with pytest.raises(ValueError, match="unknown mode 'split'"):
        with torch_backend.call_mode("split"):
            pass
