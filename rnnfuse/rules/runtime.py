"""Runtime rules: why one `FusedRNN` call runs the original layers (the
answer becomes its `last_path`); `not_implemented` is the backend raising
`NotImplementedError` from `run_stack`.

>>> from rnnfuse.backends.base import NoFusedKernel
>>> runtime_reason(NoFusedKernel("openvino"), None, "float32", (), None).rule
'no_fused_kernel'
"""

from __future__ import annotations

from typing import Any

from rnnfuse.reasons import Reason
from rnnfuse.rules.registry import first_reason, rule

__all__ = ["runtime_reason"]


def runtime_reason(backend: Any, stack: Any, dtype: str, views, mask) -> Reason | None:
    """The first runtime rule this call fails, or None (the fused call runs)."""
    return first_reason("runtime", "call", backend, stack, dtype, views, mask)


@rule("no_fused_kernel", "runtime", "rnnfuse has no fused kernel for the active Keras backend (OpenVINO, numpy)", "call")
def _no_fused_kernel(backend, stack, dtype, views, mask):
    if not backend.capabilities.fused_kernel:
        return Reason("no_fused_kernel", f"no fused kernel for the {backend.name} backend")
    return None


@rule("no_device", "runtime", "the fused kernel cannot run in this process (TensorFlow: no GPU visible)", "call")
def _no_device(backend, stack, dtype, views, mask):
    if not backend.is_available():
        return Reason("no_device", f"the fused kernel needs a CUDA GPU and {backend.name} sees none")
    return None


@rule("unsupported_config", "runtime", "a configuration the backend's kernel does not run (a dtype, projections on TensorFlow)", "call")
def _unsupported_config(backend, stack, dtype, views, mask):
    why = backend.unsupported_reason(stack, dtype)
    return None if why is None else Reason("unsupported_config", why)


@rule("go_backwards_mask", "runtime", "a go_backwards first layer under a mask", "call")
def _go_backwards_mask(backend, stack, dtype, views, mask):
    if mask is not None and views[0].go_backwards:
        return Reason("go_backwards_mask", "a go_backwards first layer under a mask")
    return None


@rule("not_implemented", "runtime", "the backend raised NotImplementedError for this call (JAX: the cuDNN core is not available or refused the call)", "raised")
def not_implemented(backend_name: str, err: BaseException) -> Reason:
    return Reason(
        "not_implemented", f"the {backend_name} backend cannot run this call: {err}"
    )


@rule("mask_not_right_padded", "runtime", "the call's mask is not right-padded (or holds an empty sequence): Keras' generic loop runs the original layers", "mask")
def mask_not_right_padded() -> Reason:
    return Reason(
        "mask_not_right_padded",
        "the mask is not right-padded (or holds an empty sequence), which cuDNN cannot take",
    )


@rule("plan_per_layer", "runtime", "the group's plan (tuned on the first batch, or the static table's) keeps the original layers", "plan")
def plan_per_layer() -> Reason:
    return Reason("plan_per_layer", "the plan keeps the original layers")
