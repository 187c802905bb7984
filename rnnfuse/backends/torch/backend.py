"""`TorchBackend`, `TorchTiming` and `TorchTooling`: the backend, tuner and
tools' contracts (rnnfuse.backends.base) for torch.

Kernel methods delegate to this package's module functions
(`rnnfuse.backends.torch`) at call time; the model steps and gradients for
`rnnfuse bench` / `check` (`TorchTooling`) are eager torch with autograd.

Example:

    >>> TorchBackend().capabilities.tunes_one_call_per_layer
    True
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import keras
import numpy as np
import torch
from keras.src.backend import in_symbolic_scope
from torch.nn.modules import module as _module

from rnnfuse.backends import torch as kernels
from rnnfuse.backends.base import (Capabilities, KernelModuleBackend, Timing, Tooling,
                                   cpu_description, loss_weights)

__all__ = ["TorchBackend", "TorchTiming", "TorchTooling"]


def _global_hooks() -> bool:
    """Whether a global module hook is registered (`torch.nn.modules.module`'s)."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)


class TorchBackend(KernelModuleBackend):
    """PyTorch: one `torch._VF` call per stack, on CUDA and on the CPU."""

    name = "torch"
    kernels = kernels

    @property
    def capabilities(self) -> Capabilities:
        return self.fused_capabilities(
            # Also one call per level: where PyTorch runs cuDNN's persistent
            # kernel for single-layer calls only (levels_per_call).
            tunes_one_call_per_layer=True,
            # Torch's own table: it fuses and keeps Keras' layers in half
            # precision differently from TensorFlow.
            plan_table="torch",
            projected_lstm_loop="torch",
            first_call_compiles=False,
            jit_compiles_fused_call=True,  # torch.compile traces rnnfuse's custom ops
        )

    def fused_call_kernel(self, plan):
        """What a fused "cudnn" call runs on here, for `inspect` (None on
        the CPU, where PyTorch's own kernels are the plan): rnnfuse's cuDNN
        core, or torch._VF with the reason the core cannot run."""
        if plan.kernel != "cudnn" or not torch.cuda.is_available():
            return None
        from rnnfuse.backends.torch import cudnn_core

        reason = cudnn_core.core_reason(torch.empty(0))  # float32: the dtype passes
        return "rnnfuse's cuDNN core" if reason is None else f"torch._VF ({reason})"

    def shapes_only(self, x):
        # Keras' compute_output_spec: meta tensors, else (where an op has no
        # meta kernel) real ones on the device, both in a symbolic scope.
        return isinstance(x, torch.Tensor) and (x.is_meta or in_symbolic_scope())

    def may_skip_call(self, layer, x):
        if type(x) is not torch.Tensor or torch._C._get_tracing_state():
            return False
        if (layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks
                or layer._backward_pre_hooks or _global_hooks()):
            return False
        return kernels.cudnn_core.runs_eagerly(x)

    def keras_runs_cudnn(self):
        # Keras 3.15's torch LSTM/GRU take cuDNN only without a mask.
        return False

    def projected_lstm_reason(self, cell):
        from rnnfuse.backends.torch import projected_lstm

        return projected_lstm.reason(cell)

    def run_projected_lstm(self, sequences, initial_state, mask, call):
        from rnnfuse.backends.torch import projected_lstm

        return projected_lstm.run(sequences, initial_state, mask, call)

    def resolve_projected_lstm_path(self, path):
        # One torch._VF.lstm call whatever the variant.
        return path

    def activation_functions(self):
        from rnnfuse.backends.torch.projected_lstm import ACTIVATIONS

        return {name: list(fns) for name, fns in ACTIVATIONS.items()}


class TorchTiming(Timing):
    """What the tuner times plans with under torch: eager steps (this
    package's `timed_step`) and autograd for the gradient check."""

    def device_environment(self):
        return kernels.device_environment()

    def timed_step(self, run, x, variables, training, jit=False):
        return kernels.timed_step(run, x, variables, training)

    def timing_context(self):
        # Eager: only gradients may be off (torch.no_grad()); a trace cannot time.
        return None if torch.compiler.is_compiling() else torch.enable_grad()

    def gradients(self, run, x, variables: Sequence[Any], training=False):
        params = [getattr(v, "value", v) for v in variables]
        y = run(x, training)
        loss = sum((t.double() ** 2).sum() for t in keras.tree.flatten(y))
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return [
            np.zeros(tuple(p.shape)) if g is None else g.detach().double().cpu().numpy()
            for p, g in zip(params, grads)
        ]


class TorchTooling(Tooling):
    """What `rnnfuse bench` / `check` and the examples use under torch."""

    def describe_device(self):
        library = f"PyTorch {torch.__version__}"
        if not torch.cuda.is_available():
            return cpu_description(library), False
        cudnn = torch.backends.cudnn.version()
        name = torch.cuda.get_device_name(0)
        return f"GPU: {name}, {library}" + (f", cuDNN {cudnn}" if cudnn else ""), True

    def timing_notes(self, on_gpu):
        if on_gpu or os.environ.get("OMP_WAIT_POLICY"):
            return []
        return [
            "on a CPU, PyTorch's OpenMP threads spin while they wait, so any other "
            "threads in the process (TensorFlow's, where Keras imported it) slow "
            "torch down, by up to 10-50x. Set OMP_WAIT_POLICY=PASSIVE in the "
            "environment for steady CPU timings"
        ]

    def exact_float32(self):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    def model_step(self, model, train):
        params = [v.value for v in model.trainable_variables]

        def run(inputs):
            x = _tensors(inputs)
            with torch.set_grad_enabled(train):
                flat = keras.tree.flatten(model(x, training=train))
                loss = sum(torch.mean(torch.square(t.float())) for t in flat)
                if train and params:
                    grads = torch.autograd.grad(loss, params, allow_unused=True)
                    loss = loss + sum(g.float().sum() for g in grads if g is not None)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return float(loss)

        return run

    def outputs_and_grads(self, model, inputs, variables, seed):
        flat = [t.float() for t in keras.tree.flatten(model(_tensors(inputs), training=False))]
        weights = loss_weights([tuple(t.shape) for t in flat], seed)
        loss = sum(torch.mean(t * torch.as_tensor(w, device=t.device)) for t, w in zip(flat, weights))
        params = [v.value for v in variables]
        grads = torch.autograd.grad(loss, params, allow_unused=True) if params else []
        grads = [
            np.zeros(tuple(v.shape), np.float32) if g is None else g.detach().float().cpu().numpy()
            for v, g in zip(variables, grads)
        ]
        return [t.detach().cpu().numpy() for t in flat], grads


def _tensors(inputs):
    return keras.tree.map_structure(keras.ops.convert_to_tensor, inputs)
