"""`JaxBackend`, `JaxTiming` and `JaxTooling`: the backend, tuner and tools'
contracts (rnnfuse.backends.base) for JAX.

Kernel methods delegate to this package's module functions
(`rnnfuse.backends.jax`) at call time; model steps for `rnnfuse bench` /
`check` (`JaxTooling`) are jitted `stateless_call`s, as Keras' JAX trainer
runs them.

Example:

    >>> JaxBackend().capabilities.absorbs_dropout
    True
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rnnfuse.backends import jax as kernels
from rnnfuse.backends.base import (
    Capabilities,
    KernelModuleBackend,
    NoProjectedLSTMPath,
    Timing,
    Tooling,
    cpu_description,
    loss_weights,
)

__all__ = ["JaxBackend", "JaxTiming", "JaxTooling"]


class JaxBackend(NoProjectedLSTMPath, KernelModuleBackend):
    """JAX: a stack as one call of rnnfuse's cuDNN core (XLA FFI; LSTM,
    LSTMP, GRU, SimpleRNN, float32/float16/bfloat16/float64), or an LSTM or GRU
    stack on rnnfuse's wavefront kernel (XLA FFI, float16 and bfloat16,
    Hopper). A ProjectedLSTM layer alone runs Keras' loop."""

    name = "jax"
    kernels = kernels
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            fused_kernel=True,
            # The core's cuDNN dropout, seeded by the Dropout layer's seed.
            absorbs_dropout=True,
            # The calls are XLA custom calls: jitted train steps keep working.
            jit_compiles_fused_call=True,
            tunes_one_call_per_layer=False,
            # cuDNN's algorithms where the core runs (it runs the plan's
            # algorithm in both passes).
            tuned_algorithms=kernels.tuned_algorithms(),
            # Nothing timed (a fit too short to tune, a shape not timed):
            # JAX's rules (tuning.table.JAX_RULES).
            plan_table="jax",
            projected_lstm_loop=None,
            # rnnfuse's wavefront kernel through XLA FFI: inference, and
            # training on its backward kernel (a jax.custom_vjp).
            inference_kernels=("wavefront",),
            training_kernels=("wavefront",),
            # `run_stack` asks cuDNN while traced and falls back there.
            algorithm_fixed_when_traced=True,
        )

    def kernel_reason(self, kernel, group, shape, training=False):
        return kernels.kernel_reason(kernel, group, shape, training=training)

    def group_reason(self, group):
        return kernels.group_reason(group)

    def keras_path_fails(self, group, dtype, masked=None):
        from rnnfuse.backends.jax import keras_paths

        return keras_paths.keras_path_fails(group, dtype, masked)

    def in_xla_context(self):
        return False

    def keras_runs_cudnn(self):
        return False

    def strategy_scope(self, strategy):
        return contextlib.nullcontext()

    def activation_functions(self):
        return {"tanh": [jnp.tanh], "sigmoid": [jax.nn.sigmoid], "relu": [jax.nn.relu]}


class JaxTiming(Timing):
    """What the tuner times plans with under JAX: jitted steps (`timed_step`)
    and one jitted gradient program per check (`gradients_of`)."""

    def device_environment(self):
        return kernels.device_environment()

    def timed_step(self, run, x, variables, training, jit=False):
        return kernels.timed_step(run, x, variables, training)

    def original_refusal(self, exc):
        # jaxlib's lowerings raise ValueError (the cuDNN RNN's "Unknown output
        # type float16"), XLA a JaxRuntimeError (a RuntimeError); a bug in the
        # step is another type and is raised.
        if not isinstance(exc, (ValueError, RuntimeError)):
            return None
        lines = str(exc).strip().splitlines() or [""]
        return f"{type(exc).__name__}: {lines[0].strip()[:300]}"

    def timing_context(self):
        # Keras' JAX layers run inside jit-traced steps, where nothing runs
        # to time; the static plan (Keras' layers) stands.
        return None

    def gradients(self, run, x, variables: Sequence[Any], training=False):
        return self.gradients_of([(run, x, training)], variables)[0]

    def float64_reference_scope(self):
        return _float64_scope()

    def gradients_of(self, calls, variables):
        # One trace and one XLA compile for reference, plan and twin, where
        # jax.grad alone compiles op by op.
        return kernels.gradients_of(calls, variables)


class JaxTooling(Tooling):
    """What `rnnfuse bench` / `check` and the examples use under JAX."""

    def describe_device(self):
        library = f"JAX {jax.__version__}"
        if jax.default_backend() != "gpu":
            return cpu_description(library), False
        device = jax.devices()[0]
        return f"GPU: {getattr(device, 'device_kind', str(device))}, {library}", True

    def timing_notes(self, on_gpu):
        return []

    def exact_float32(self):
        jax.config.update("jax_default_matmul_precision", "highest")

    def model_step(self, model, train):
        trainable = [v.value for v in model.trainable_variables]
        frozen = [v.value for v in model.non_trainable_variables]

        def loss(tv, inputs):
            y, _ = model.stateless_call(tv, frozen, inputs, training=train)
            return sum(jnp.mean(jnp.square(t.astype(jnp.float32))) for t in jax.tree.leaves(y))

        if train and trainable:
            grad = jax.value_and_grad(loss)

            def full(tv, inputs):
                value, grads = grad(tv, inputs)
                return value + sum(jnp.sum(g.astype(jnp.float32)) for g in jax.tree.leaves(grads))

            fn = jax.jit(full)
        else:
            fn = jax.jit(loss)
        return lambda inputs: float(fn(trainable, inputs))

    def outputs_and_grads(self, model, inputs, variables, seed):
        wanted = {id(v) for v in variables}
        trainable = list(model.trainable_variables)
        frozen = [v.value for v in model.non_trainable_variables]

        def loss(tv):
            y, _ = model.stateless_call(tv, frozen, inputs, training=False)
            flat = [t.astype(jnp.float32) for t in jax.tree.leaves(y)]
            weights = loss_weights([tuple(t.shape) for t in flat], seed)
            value = sum(jnp.mean(t * w) for t, w in zip(flat, weights))
            return value, flat

        grads, flat = jax.grad(loss, has_aux=True)([v.value for v in trainable])
        by_id = {id(v): g for v, g in zip(trainable, grads)}
        out = [
            np.asarray(by_id[id(v)], np.float32) if id(v) in by_id and id(v) in wanted
            else np.zeros(tuple(v.shape), np.float32)
            for v in variables
        ]
        return [np.asarray(t) for t in flat], out


@contextlib.contextmanager
def _float64_scope():
    """x64 on, and Keras' type promotion keeping float64 (it maps float64
    results to float32 on JAX: `tanh` of a float64 tensor is float32)."""
    from keras.src.backend.common import dtypes

    narrowed = dtypes.BIT64_TO_BIT32_DTYPE
    kept = narrowed.get("float64")
    narrowed["float64"] = "float64"
    try:
        with jax.enable_x64(True):
            yield
    finally:
        narrowed["float64"] = kept
