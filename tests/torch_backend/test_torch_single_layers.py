"""Lone LSTM/GRU layers and encoder-decoder links as groups of one under
the torch backend (PyTorch's real fused kernels on the CPU): the static
plan fuses them, and outputs, states and gradients match the original
(tests/single_layer_checks.py)."""

from __future__ import annotations

import pytest
from builders import fused_layers
from single_layer_checks import MODELS, assert_fused_matches, assert_groups_of_one, build

import rnnfuse


@pytest.mark.parametrize("name", sorted(MODELS))
def test_groups_of_one_fuse_and_match_the_original(name, torch_calls):
    model = build(name)
    assert_groups_of_one(name, model)
    # The default: no GPU to time on, so torch's static plan (fuse whole).
    result = rnnfuse.optimize(model, return_result=True)
    assert {r.plan.name for r in result.plans} == {"fused"}
    fast = result.model
    assert [tuple(l.name for l in f.fused_layers) for f in fused_layers(fast)] == MODELS[name][1]
    assert_fused_matches(model, fast, tol=2e-5, grad_tol=1e-4)
    assert len(torch_calls) >= len(MODELS[name][1]), "the fused kernel did not run"
    assert {c["num_layers"] for c in torch_calls} == {1}
