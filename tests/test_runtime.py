"""rnnfuse.rules.runtime: the checks a FusedRNN call makes before its fused
call, one test per rule, in registry order."""

from __future__ import annotations

import types

from rnnfuse.backends.base import Capabilities, NoFusedKernel
from rnnfuse.rules import runtime


class _Fake(NoFusedKernel):
    """A backend whose answers each test sets."""

    def __init__(self, fused=True, available=True, unsupported=None):
        super().__init__("fake")
        self.capabilities = Capabilities(
            fused_kernel=fused, absorbs_dropout=False, jit_compiles_fused_call=False,
            tunes_one_call_per_layer=False,
        )
        self._available, self._unsupported = available, unsupported

    def is_available(self):
        return self._available

    def unsupported_reason(self, stack, dtype):
        return self._unsupported


FORWARD = [types.SimpleNamespace(go_backwards=False)]
BACKWARD = [types.SimpleNamespace(go_backwards=True)]


def _rule(backend, views=FORWARD, mask=None):
    reason = runtime.runtime_reason(backend, None, "float32", views, mask)
    return None if reason is None else reason.rule


def test_a_call_that_passes_every_rule_runs_fused():
    assert _rule(_Fake()) is None
    assert _rule(_Fake(), BACKWARD) is None  # go_backwards only matters under a mask


def test_each_rule_in_order():
    assert _rule(_Fake(fused=False, available=False)) == "no_fused_kernel"
    assert _rule(_Fake(available=False, unsupported="x")) == "no_device"
    assert _rule(_Fake(unsupported="float64 is not run")) == "unsupported_config"
    assert _rule(_Fake(), BACKWARD, mask=object()) == "go_backwards_mask"


def test_the_reasons_read_well():
    why = runtime.runtime_reason(_Fake(unsupported="float64 is not run"), None, "float64", FORWARD, None)
    assert str(why) == "float64 is not run"
    assert str(runtime.not_implemented("jax", NotImplementedError("dropout"))) == (
        "the jax backend cannot run this call: dropout"
    )
    assert runtime.plan_per_layer().rule == "plan_per_layer"
