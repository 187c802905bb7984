"""Random fusable stacks for the equivalence property of every backend
(test_equivalence.py, torch_backend/test_torch_fused.py): a hypothesis
strategy of stack descriptions, and the model each describes.

    >>> case = dict(kind="gru", num_layers=2, units=3, input_size=2, last_return_sequences=False,
    ...             last_return_state=False, go_backwards_first=False, initial_state=False,
    ...             masked=False, padding="none", seed=0)
    >>> model, rng = case_model(case)
    >>> [layer.name for layer in model.layers[1:]]
    ['gru_0', 'gru_1']
"""

from __future__ import annotations

import keras
import numpy as np
from hypothesis import strategies as st

import rnnfuse
from builders import KINDS, fused_layers, stack_model


@st.composite
def stacks(draw, max_layers: int = 5, mixed: bool = False):
    """A `stack_model` description with its inputs' padding and a seed;
    `mixed` (whether it runs in mixed_float16) where asked for."""
    kind = draw(st.sampled_from(KINDS))
    masked = draw(st.booleans())
    initial_state = draw(st.booleans()) and not masked
    case = dict(
        kind=kind,
        num_layers=draw(st.integers(2, max_layers)),
        units=draw(st.integers(1, 8)),
        input_size=draw(st.integers(1, 6)),
        last_return_sequences=draw(st.booleans()),
        last_return_state=draw(st.booleans()),
        go_backwards_first=draw(st.booleans()),
        initial_state=initial_state,
        masked=masked,
        padding=draw(st.sampled_from(["right", "middle", "none"])),
    )
    if mixed:
        case["mixed"] = draw(st.booleans())
    case["seed"] = draw(st.integers(0, 2**16))
    return case


def case_model(case: dict):
    """(model, rng): the `stack_model` `case` describes (in mixed_float16
    where its "mixed" says so), every weight uniform in [-0.6, 0.6) so the
    biases are not trivial, and the rng that drew them (from the case's
    seed) for the inputs to come."""
    if case.get("mixed"):
        keras.config.set_dtype_policy("mixed_float16")
    try:
        model = stack_model(
            case["kind"], case["num_layers"], units=case["units"], input_size=case["input_size"],
            last_return_sequences=case["last_return_sequences"],
            last_return_state=case["last_return_state"],
            go_backwards_first=case["go_backwards_first"], initial_state=case["initial_state"],
            masked=case["masked"],
        )
    finally:
        keras.config.set_dtype_policy("float32")
    rng = np.random.default_rng(case["seed"])
    for v in model.weights:
        v.assign(rng.uniform(-0.6, 0.6, v.shape).astype(v.dtype))
    return model, rng


def masked_stack_with_head(kind: str, functional: bool):
    """(model, fast): a masked 3-layer `stack_model` with a Dense head, built
    as a functional or a Sequential model, and its optimization, which keeps
    the model's class and fuses the stack into one layer."""
    model = stack_model(kind, 3, functional=functional, head=True, masked=True)
    fast = rnnfuse.optimize(model)
    assert isinstance(fast, keras.Sequential) is (not functional)
    assert len(fused_layers(fast)) == 1
    return model, fast
