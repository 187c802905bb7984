"""Activity regularizers on fused runs under the torch backend (the real
fused kernels on the CPU): `fast.losses` equals `model.losses`, and evaluate
and a fit epoch match the original (tests/activity_checks.py)."""

from __future__ import annotations

import pytest
from activity_checks import CASES, assert_losses_match, assert_training_matches, data, twins
from builders import fused_layers

import rnnfuse


@pytest.mark.parametrize("name", sorted(CASES))
def test_activity_losses_and_training_match_the_original(name, torch_calls):
    model, reference = twins(name)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert [len(f.fused_layers) for f in fused_layers(fast)] == CASES[name][1]
    x, y = data(model, padded=name == "masked")
    assert_losses_match(model, fast, x)
    assert_training_matches(model, reference, fast, x, y)
    if CASES[name][1]:
        assert torch_calls, "the fused kernel did not run"
