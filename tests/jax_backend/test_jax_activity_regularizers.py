"""Activity regularizers on fused LSTM runs under the JAX backend (the
fused call through the emulated cuDNN core on the CPU): the losses,
evaluate and a fit epoch match the original (tests/activity_checks.py).
"""

from __future__ import annotations

import pytest
from activity_checks import check_case


@pytest.mark.parametrize("name", ["issue_repro", "last_layer", "masked", "states"])
def test_activity_losses_and_training_match_the_original(name, emulated_core):
    check_case(name, emulated_core.calls)
