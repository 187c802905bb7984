"""Activity regularizers on fused runs under the torch backend (the real
fused kernels on the CPU): `fast.losses` equals `model.losses`, and evaluate
and a fit epoch match the original (tests/activity_checks.py)."""

from __future__ import annotations

import pytest
from activity_checks import CASES, check_case


@pytest.mark.parametrize("name", sorted(CASES))
def test_activity_losses_and_training_match_the_original(name, torch_calls):
    check_case(name, torch_calls)
