"""rnnfuse.reasons: Reason and CallPath records."""

from __future__ import annotations

import pickle

from rnnfuse.reasons import FUSED_PATH, CallPath, PathKind, Reason


def test_a_reason_is_its_message_and_keeps_its_rule():
    r = Reason("units", "lstm_2 has 16 units")
    assert r == "lstm_2 has 16 units" and r.rule == "units"
    p = r.prefixed("group 1: ")
    assert (str(p), p.rule) == ("group 1: lstm_2 has 16 units", "units")
    back = pickle.loads(pickle.dumps(r))
    assert type(back) is Reason and back.rule == "units" and back == r


def test_call_paths_print_as_before_and_pickle():
    assert FUSED_PATH == "fused" and FUSED_PATH.kind is PathKind.FUSED
    assert FUSED_PATH.reason is None
    p = CallPath("layers", Reason("no_device", "no GPU"))
    assert p == "layers: no GPU" and p.kind is PathKind.LAYERS and p.reason.rule == "no_device"
    back = pickle.loads(pickle.dumps(p))
    assert back == p and back.reason.rule == "no_device" and back.kind is PathKind.LAYERS
