"""Where each fusion group's plan runs on this backend and device:
`placement(plan)` says whether its fused call runs here and how, and
`nothing_fused_reason` gives the line `optimize` logs when no group will.

>>> from rnnfuse.plan import PER_LAYER
>>> placement(PER_LAYER).fused
False
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = ["Placement", "backend_name", "nothing_fused_reason", "placement"]

# Why a backend's fused kernel cannot run in this process (is_available()
# is False), by backend name.
_UNAVAILABLE = {
    "tensorflow": "TensorFlow's fused kernel (rnnfuse's cuDNN op, or CudnnRNNV3) "
    "needs a CUDA GPU and none is visible",
    "jax": "JAX's fused kernel (rnnfuse's cuDNN core through XLA FFI) needs JAX on a GPU and "
    "JAX's default device is not one",
}


_ORIGINAL = "the original layers"


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one group runs here."""

    # Whether its fused call(s) will run (False: the original layers run).
    fused: bool
    # What runs: "one fused call", "2 fused calls" or "the original layers".
    how: str
    # Why the original layers run (None when fused).
    why: str | None = None

    def __str__(self) -> str:
        return self.how + (f" ({self.why})" if self.why else "")


def backend_name() -> str:
    """The active Keras backend, as rnnfuse's backend registry names it."""
    from rnnfuse.backends import get_backend

    return get_backend().name


def placement(plan, source: str = "static") -> Placement:
    """Whether a group with `plan` runs fused on this backend and device."""
    from rnnfuse.backends import get_backend

    if not plan.whole and not plan.pieces:
        kind = source.split(":")[0]
        why = {
            "static": "the static plan for this backend keeps them",
            "forced": "the plan was forced to per-layer",
        }.get(kind, "timing on this device found them fastest")
        if kind == "static" and get_backend().capabilities.plan_table in ("per_layer", "jax"):
            why = (
                f"on {get_backend().name} an untimed group keeps Keras' layers; on a GPU "
                "the first batch (tune='auto') or optimize(model, tune=batch) times "
                "the fused call against them"
            )
        return Placement(False, _ORIGINAL, why)
    backend = get_backend()
    name = backend.name
    if not backend.capabilities.fused_kernel:
        return Placement(False, _ORIGINAL, f"rnnfuse has no fused kernel for the {name} backend")
    if not backend.is_available():
        why = _UNAVAILABLE.get(name, f"the {name} fused kernel cannot run here")
        return Placement(False, _ORIGINAL, why)
    calls = "one fused call" if len(plan.pieces) <= 1 else f"{len(plan.pieces)} fused calls"
    # Which kernel the fused calls reach, where a backend has a choice (torch:
    # rnnfuse's cuDNN core, or torch._VF and why).
    describe = getattr(backend, "fused_call_kernel", None)
    kernel = describe(plan) if describe is not None else None
    return Placement(True, calls if kernel is None else f"{calls} on {kernel}")


def nothing_fused_reason(plans: Sequence, sources: Sequence[str] | None = None) -> str | None:
    """Why none of the groups with `plans` runs fused here, or None if one does."""
    if not plans:
        return None
    sources = list(sources or ["static"] * len(plans))
    found = [placement(p, s) for p, s in zip(plans, sources)]
    if any(p.fused for p in found):
        return None
    reasons = sorted({p.why for p in found if p.why})
    return "; ".join(reasons)
