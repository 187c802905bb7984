"""Activity regularizers on fused LSTM runs under the JAX backend (the
fused call through jax.experimental.rnn's reference on the CPU): the losses,
evaluate and a fit epoch match the original (tests/activity_checks.py).
JAX fuses unidirectional LSTM stacks only, so the cases are those."""

from __future__ import annotations

import pytest
from activity_checks import check_case


@pytest.mark.parametrize("name", ["issue_repro", "last_layer", "masked", "states"])
def test_activity_losses_and_training_match_the_original(name, emulated_jax_lstm):
    check_case(name, emulated_jax_lstm)
