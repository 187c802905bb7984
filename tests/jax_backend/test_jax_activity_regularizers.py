"""Activity regularizers on fused LSTM runs under the JAX backend (the
fused call through jax.experimental.rnn's reference on the CPU): the losses,
evaluate and a fit epoch match the original (tests/activity_checks.py).
JAX fuses unidirectional LSTM stacks only, so the cases are those."""

from __future__ import annotations

import pytest
from activity_checks import CASES, assert_losses_match, assert_training_matches, data, twins
from builders import fused_layers

import rnnfuse


@pytest.mark.parametrize("name", ["issue_repro", "last_layer", "masked", "states"])
def test_activity_losses_and_training_match_the_original(name, emulated_jax_lstm):
    model, reference = twins(name)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert [len(f.fused_layers) for f in fused_layers(fast)] == CASES[name][1]
    x, y = data(model, padded=name == "masked")
    assert_losses_match(model, fast, x)
    assert_training_matches(model, reference, fast, x, y)
    if CASES[name][1]:
        assert emulated_jax_lstm, "the fused call did not run"
