"""The GPU tests' comparison of an optimized model with its original: the
worst relative difference of the outputs and of the gradients, each held to
its tolerance, and the float32 twin on Keras' generic loop compared with.

    >>> worst_within([([1.0], [2.0]), ([1.0], [2.0])], lambda a, b: abs(a - b),
    ...              out_tol=0, grad_tol=0)
    (0.0, 0.0)
    >>> rel([1.0, 1.0], [1.0, 0.0])
    1.0
"""

from __future__ import annotations

import keras
import numpy as np

import rnnfuse
from rnnfuse.plan import Plan


def rel(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def worst_within(results, rel, *, out_tol: float, grad_tol: float) -> tuple[float, float]:
    """`results`: [(outputs, gradients) of the original, of the optimized].
    Asserts as many outputs, and the worst `rel(optimized, original)` of the
    outputs within `out_tol` and of the gradients within `grad_tol`; returns
    both worsts."""
    (o0, g0), (o1, g1) = results
    assert len(o0) == len(o1)
    worst_out = max(rel(b, a) for a, b in zip(o0, o1))
    worst_grad = max(rel(b, a) for a, b in zip(g0, g1))
    assert worst_out <= out_tol, worst_out
    assert worst_grad <= grad_tol, worst_grad
    return float(worst_out), float(worst_grad)


def fused_and_generic_twin(build, policy: str):
    """(`build()` in `policy` optimized onto the wavefront plan, `build()`
    in float32 with every RNN layer on Keras' generic loop, holding the
    first's weights in variables of its own)."""
    keras.config.set_dtype_policy(policy)
    model = build()
    fast = rnnfuse.optimize(model, tune=False,
                            plan=lambda g: Plan((g.num_layers,), kernel="wavefront"))
    keras.config.set_dtype_policy("float32")
    twin = build()
    for layer in twin.layers:
        for rnn in (layer, getattr(layer, "forward_layer", None),
                    getattr(layer, "backward_layer", None)):
            if hasattr(rnn, "use_cudnn"):
                rnn.use_cudnn = False
    twin.set_weights(model.get_weights())
    return fast, twin
