"""`TensorFlowBackend`, `TensorFlowTiming` and `TensorFlowTooling`: the
backend, tuner and tools' contracts (rnnfuse.backends.base) for TensorFlow.

Kernel methods delegate to this package's module functions
(`rnnfuse.backends.tensorflow`) at call time, so tests that replace
`cudnn_rnn` or `is_available` there still take effect; the model steps and
gradients for `rnnfuse bench` / `check` (`TensorFlowTooling`) are
`tf.function`s with `GradientTape`.

Example:

    >>> TensorFlowBackend().capabilities.plan_table
    'tensorflow'
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf

from rnnfuse.backends import tensorflow as kernels
from rnnfuse.backends.base import (Capabilities, KernelModuleBackend, Timing, Tooling,
                                   cpu_description, loss_weights)

__all__ = ["TensorFlowBackend", "TensorFlowTiming", "TensorFlowTooling"]


class TensorFlowBackend(KernelModuleBackend):
    """TensorFlow: one cuDNN call per stack (needs a GPU): rnnfuse's own op
    `RnnfuseCudnnRnn` where it is loaded, else `tf.raw_ops.CudnnRNNV3`."""

    name = "tensorflow"
    kernels = kernels

    @property
    def capabilities(self) -> Capabilities:
        return self.fused_capabilities(
            # The rule table measured with these kernels (docs/benchmarks.md).
            plan_table="tensorflow",
            projected_lstm_loop="tensorflow",
            auto_jit_from_layers=True,
            tunes_one_call_per_layer=False,
        )

    def algorithm_input(self):
        # Under a distribution strategy the variable would be mirrored on
        # each GPU: every candidate keeps a trace of its own there.
        if tf.distribute.has_strategy() or not kernels.op_loaded():
            return None
        from rnnfuse.backends.tensorflow.cudnn_op import AlgorithmInput

        return AlgorithmInput()

    def in_xla_context(self):
        return kernels.in_xla_context()

    def keras_runs_cudnn(self):
        return bool(tf.config.list_logical_devices("GPU"))

    def assert_mask_supported(self, supported):
        kernels.assert_mask_supported(supported)

    def projected_lstm_reason(self, cell):
        # Every cell runs: other activations take the autodiff loops.
        return None

    def run_projected_lstm(self, sequences, initial_state, mask, call):
        from rnnfuse.backends.tensorflow import projected_lstm

        return projected_lstm.run(sequences, initial_state, mask, call)

    def resolve_projected_lstm_path(self, path):
        from rnnfuse.backends.tensorflow import projected_lstm

        return projected_lstm.resolve_path(path)

    def strategy_scope(self, strategy):
        if strategy is None or tf.distribute.has_strategy():
            return contextlib.nullcontext()
        return strategy.scope()

    def activation_functions(self):
        return {
            "tanh": [tf.tanh, tf.math.tanh],
            "sigmoid": [tf.sigmoid, tf.math.sigmoid],
            "relu": [tf.nn.relu],
        }


class TensorFlowTiming(Timing):
    """What the tuner times plans with under TensorFlow: `tf.function` steps
    (this package's `timed_step` / `timed_steps`) and one graph for the
    gradient check."""

    def device_environment(self):
        return kernels.device_environment()

    def timed_step(self, run, x, variables, training, jit=False):
        return kernels.timed_step(run, x, variables, training, jit=jit)

    def timed_steps(self, make_run, x, variables, training, algorithms, dtype):
        return kernels.timed_steps(make_run, x, variables, training, algorithms, dtype)

    def timing_context(self):
        if kernels.in_xla_context():
            return None
        return tf.init_scope()

    def gradients(self, run, x, variables: Sequence[Any], training=False):
        return self.gradients_of([(run, x, training)], variables)[0]

    def gradients_of(self, calls, variables):
        # One graph for all of them (one trace, one graph set-up), of its
        # own (`kernels.graph_gradients`: no tape, so it also holds inside a
        # user's traced step, where tapes are stopped).
        variables, calls = list(variables), list(calls)

        @tf.function(autograph=False)  # as `kernels.timed_step` (its doc says why)
        def gradients(*xs):
            out = []
            for (run, _, training), x in zip(calls, xs):
                y = run(x, training)
                loss = tf.add_n(
                    [tf.reduce_sum(tf.cast(t, tf.float64) ** 2) for t in keras.tree.flatten(y)]
                )
                out.append([tf.cast(tf.convert_to_tensor(g), tf.float64)
                            for g in kernels.graph_gradients(loss, variables)])
            return out

        got = gradients(*[tf.convert_to_tensor(x) for _, x, _ in calls])
        return [[g.numpy() for g in grads] for grads in got]


class TensorFlowTooling(Tooling):
    """What `rnnfuse bench` / `check` and the examples use under TensorFlow."""

    def describe_device(self):
        library = f"TensorFlow {tf.__version__}"
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            return cpu_description(library), False
        try:
            name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")
        except Exception:  # noqa: BLE001 - the name is cosmetic
            name = "GPU"
        cudnn = tf.sysconfig.get_build_info().get("cudnn_version")
        more = f" (+{len(gpus) - 1} more, unused)" if len(gpus) > 1 else ""
        return f"GPU: {name}{more}, {library}" + (f", cuDNN {cudnn}" if cudnn else ""), True

    def timing_notes(self, on_gpu):
        return []

    def exact_float32(self):
        tf.config.experimental.enable_tensor_float_32_execution(False)

    def model_step(self, model, train):
        variables = list(model.trainable_variables)

        def loss_of(outputs):
            flat = [tf.cast(t, tf.float32) for t in keras.tree.flatten(outputs)]
            return tf.add_n([tf.reduce_mean(tf.square(t)) for t in flat])

        @tf.function
        def infer(inputs):
            return loss_of(model(inputs, training=False))

        @tf.function
        def train_step(inputs):
            with tf.GradientTape() as tape:
                loss = loss_of(model(inputs, training=True))
            grads = [g for g in tape.gradient(loss, variables) if g is not None]
            # Depend on every gradient so the step is timed to its end.
            return loss + tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads] or [0.0])

        fn = train_step if train and variables else infer
        return lambda inputs: float(fn(inputs).numpy())

    def outputs_and_grads(self, model, inputs, variables, seed):
        # Eager: one step does not pay back tracing a graph.
        with tf.GradientTape() as tape:
            outputs = model(inputs, training=False)
            flat = [tf.cast(t, tf.float32) for t in keras.tree.flatten(outputs)]
            weights = loss_weights([tuple(t.shape) for t in flat], seed)
            loss = tf.add_n([tf.reduce_mean(t * w) for t, w in zip(flat, weights)])
        grads = tape.gradient(loss, variables)
        grads = [
            np.zeros(v.shape, np.float32) if g is None
            else tf.cast(tf.convert_to_tensor(g), tf.float32).numpy()
            for v, g in zip(variables, grads)
        ]
        return [t.numpy() for t in flat], grads
