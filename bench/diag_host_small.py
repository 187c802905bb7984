"""rnnfuse's own host time in a training step of a fused layer, the kernel
calls faked: what its Python, binding and packing cost around the kernels.

For each small float32 shape of bench/bench_matrix.py (`--shapes`), the
Keras model is optimized with `plan=rnnfuse.FUSED` and its FusedRNN layer
runs forward and backward (a sum of its output as the loss) on inputs of
the shape's size, with the kernel calls replaced by fakes that return
zeros of the right shapes (so any machine runs the GPU path's host code):

- torch (eager): the cuDNN core's `core_forward`/`core_backward` are the
  fakes; `own_us` = a step's CPU time (the calling thread's, one intra-op
  thread: robust to other work on a shared machine) minus the time inside
  the fakes and minus the floor (the same loss and gradient on a leaf
  tensor of the output's shape). `keras_layer_us` is what Keras'
  `Layer.__call__` costs around a one-multiply layer (the original model
  pays it once per layer); `rnnfuse_us` = `own_us` minus it, rnnfuse's
  own share. `ops` counts the aten ops a step runs (torch.profiler), each
  a kernel launch's host cost on a GPU; `profile` lists cProfile's top
  functions by their own time.
- tensorflow and jax (traced: `tf.function`, `jax.jit`): what runs a step
  is the trace, not the Python. The fake kernel's inputs are kept alive
  (an optimization barrier), so nothing rnnfuse computes is pruned.
  `own_us` = the traced step's CPU time (the process's: the runtime's
  threads run the ops) minus a traced step of the fake kernel alone on
  inputs made beforehand; `ops` counts the graph's ops
  (TensorFlow: ops of the step's function graphs, the kernel-only step's
  subtracted) or the jaxpr's equations.

On the CPU, copies run on the CPU, where a GPU runs them as device work.
`--size host` (the default) keeps each shape's kind and layers (the same
code path and op count) at batch 2, 2 time steps, 4 units and features:
copies then cost next to nothing, and what is left is the per-call host
work a GPU step pays too. `--size tiny` keeps the units (the weights'
copies run on the CPU: an upper bound), `--size full` everything. The op
counts are the device-independent part (each op one launch on a GPU).
One process per backend (KERAS_BACKEND); one JSON.

    KERAS_BACKEND=torch python bench/diag_host_small.py --out /tmp/host_torch.json
    KERAS_BACKEND=jax python bench/diag_host_small.py --steps 50 --out /tmp/host_jax.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

SMALL = "gru3x64,rnn3x256,lstm8x128,lstm2x40"
# What --size changes in a shape: "host" keeps its kind and layers (so the
# same code path and op count) with copies too small to matter.
SIZES = {"host": dict(batch=2, steps=2, units=4, features=4), "tiny": dict(batch=2, steps=2),
         "full": {}}


def _median_us(step, steps: int, rounds: int, clock=time.perf_counter) -> float:
    """Median over `rounds` of the mean microseconds of `steps` calls, on `clock`."""
    step()
    per = []
    for _ in range(rounds):
        start = clock()
        for _ in range(steps):
            step()
        per.append((clock() - start) / steps)
    return 1e6 * statistics.median(per)


def _cprofile(step, steps: int, top: int = 14) -> list:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, fn), (_, calls, own, cum, _) in stats.stats.items():
        short = f"{os.path.basename(path)}:{line}({fn})"
        rows.append(dict(fn=short, own_us=1e6 * own / steps, cum_us=1e6 * cum / steps,
                         calls=calls / steps))
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def _fused_layer(shape: dict):
    import bench_matrix
    import rnnfuse
    from rnnfuse.fused import fused_layers

    model = rnnfuse.optimize(bench_matrix.build_keras(shape), plan=rnnfuse.FUSED, cache=False)
    layers = fused_layers(model)
    if len(layers) != 1:
        raise RuntimeError(f"expected one FusedRNN layer, got {len(layers)}")
    return layers[0]


def _inputs(shape: dict):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.standard_normal((shape["batch"], shape["steps"], shape["features"])).astype("float32")


# -- torch -----------------------------------------------------------------------


class _TorchFakes:
    """The cuDNN core's forward and backward as zero-filled results of the
    right shapes, the seconds inside them counted on `clock`."""

    def __init__(self, clock=time.thread_time):
        self.seconds, self.clock = 0.0, clock

    def forward(self, ints, dropout, seed, training, x, hx, cx, params, lengths, dev_lengths):
        start = self.clock()
        out = (ints[3] or ints[2]) * ints[5]
        y = x.new_zeros((x.shape[0], x.shape[1], out))
        cy = cx.new_zeros(cx.shape) if ints[0] == 0 else x.new_empty((0,))
        result = y, hx.new_zeros(hx.shape), cy, x.new_empty((16,), dtype=__import__("torch").uint8)
        self.seconds += self.clock() - start
        return result

    def backward(self, ints, dropout, seed, x, hx, cx, params, *rest):
        start = self.clock()
        dcx = cx.new_zeros(cx.shape) if ints[0] == 0 else x.new_empty((0,))
        result = x.new_zeros(x.shape), hx.new_zeros(hx.shape), dcx, params.new_zeros(params.shape)
        self.seconds += self.clock() - start
        return result


def _plain_layer():
    """A Keras layer whose call is one multiply."""
    import keras

    class PlainLayer(keras.layers.Layer):
        def call(self, x, weight):
            return x * weight

    return PlainLayer()


def measure_torch(shape: dict, steps: int, rounds: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    # Every op on the calling thread, whose CPU time is measured (robust to
    # other work on a shared machine).
    torch.set_num_threads(1)
    from rnnfuse.backends import torch as torch_backend
    from rnnfuse.backends.torch import cudnn_core

    fakes = _TorchFakes()
    saved = (cudnn_core.core_forward, cudnn_core.core_backward, cudnn_core.core_reason,
             torch_backend.core_applies)
    cudnn_core.core_forward, cudnn_core.core_backward = fakes.forward, fakes.backward
    cudnn_core.core_reason = lambda x: None
    torch_backend.core_applies = lambda x: True
    try:
        layer = _fused_layer(shape)
        params = [v.value for v in layer.trainable_variables]
        # Where the variables are (a GPU, if any: its launches are then measured).
        device = params[0].device
        x = torch.from_numpy(_inputs(shape)).to(device)

        # Gradients returned, not accumulated into .grad: accumulation is
        # the optimizer's business, the same for the original layers.
        def step():
            torch.autograd.grad(layer(x, training=True).sum(), params)

        out_shape = tuple(layer(x, training=True).shape)
        leaf = torch.zeros(out_shape, device=device, requires_grad=True)

        def floor():
            torch.autograd.grad(leaf.sum(), [leaf])

        # Keras' own price of one layer call (a layer whose call is one
        # multiply), which the original model pays once per layer.
        plain = _plain_layer()
        weight = torch.ones((), device=device, requires_grad=True)

        def keras_call():
            torch.autograd.grad(plain(x, weight).sum(), [weight])

        path = layer.last_path
        step()
        clock = time.thread_time
        floor_us = _median_us(floor, steps, rounds, clock)
        keras_us = _median_us(keras_call, steps, rounds, clock)
        fakes.seconds = 0.0
        calls = steps * (rounds + 1)
        wall_us = _median_us(step, steps, rounds, clock)
        kernel_us = 1e6 * fakes.seconds / calls
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        ops = {}
        for e in prof.key_averages():
            if e.key.startswith("aten::") or e.key.startswith("rnnfuse::"):
                ops[e.key] = e.count / steps
        fakes.seconds = 0.0
        own_us = wall_us - kernel_us - floor_us
        return dict(wall_us=wall_us, kernel_us=kernel_us, floor_us=floor_us, own_us=own_us,
                    keras_layer_us=keras_us, rnnfuse_us=own_us - keras_us, path=str(path),
                    ops=sum(ops.values()),
                    top_ops=sorted(ops.items(), key=lambda kv: -kv[1])[:12],
                    profile=_cprofile(step, steps))
    finally:
        (cudnn_core.core_forward, cudnn_core.core_backward, cudnn_core.core_reason,
         torch_backend.core_applies) = saved


# -- tensorflow ------------------------------------------------------------------


def _tf_fake_op():
    import tensorflow as tf

    def fake(module, **kw):
        x, h, c, params = kw["input"], kw["input_h"], kw["input_c"], kw["params"]

        @tf.custom_gradient
        def kernel(x, h, c, params):
            # Every input read (one element), so no packing op is pruned.
            live = sum(tf.reshape(t, [-1])[:1] for t in (x, h, params)) * 0.0
            out = int(params.shape[0] and 0) or (kw["proj_size"] or kw["num_units"])
            dirs = 2 if kw["direction"] == "bidirectional" else 1
            y = tf.zeros(tf.stack([tf.shape(x)[0], tf.shape(x)[1], out * dirs])) + live
            hy = tf.zeros_like(h) + live

            def grad(dy, dhy, dcy):
                return tf.zeros_like(x), tf.zeros_like(h), tf.zeros_like(c), tf.zeros_like(params)

            return (y, hy, tf.zeros_like(c)), grad

        y, hy, cy = kernel(x, h, c, params)
        return y, hy, cy, tf.zeros([0], tf.uint8)

    return fake


def measure_tensorflow(shape: dict, steps: int, rounds: int) -> dict:
    import tensorflow as tf

    from rnnfuse.backends import tensorflow as tf_backend
    from rnnfuse.backends.tensorflow import cudnn_op

    class _Module:
        pass

    fake = _tf_fake_op()
    saved = (cudnn_op.call_op, tf_backend.is_available, tf_backend.op_loaded, tf_backend._op_for)
    cudnn_op.call_op = fake
    tf_backend.is_available = lambda: True
    tf_backend.op_loaded = lambda: True
    tf_backend._op_for = lambda dtype, dropout: (_Module(), None)
    try:
        layer = _fused_layer(shape)
        x = tf.constant(_inputs(shape))
        variables = layer.trainable_variables

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(x, training=True))
            return tape.gradient(loss, variables)

        stack = layer.stack
        lstm = stack.kind == "lstm"
        n = stack.num_pseudo_layers
        t, b = shape["steps"], shape["batch"]
        x_tm = tf.zeros([t, b, shape["features"]])
        h0 = tf.zeros([n, b, stack.output_size])
        c0 = tf.zeros([n, b, stack.units]) if lstm else tf.zeros([0])
        size = int(tf_backend.pack_params(stack, "float32").shape[0])
        params = tf.Variable(tf.zeros([size]))

        @tf.function
        def kernel_only(x_tm):
            with tf.GradientTape() as tape:
                y, hy, _, _ = fake(None, input=x_tm, input_h=h0, input_c=c0, params=params,
                                   proj_size=stack.proj_size, num_units=stack.units,
                                   direction="unidirectional")
                loss = tf.reduce_sum(hy[-1])
            return tape.gradient(loss, [params])

        run = lambda: step(x)  # noqa: E731
        base = lambda: kernel_only(x_tm)  # noqa: E731
        run(), base()
        path = str(layer.last_path)
        wall_us = _median_us(run, steps, rounds, time.process_time)
        kernel_us = _median_us(base, steps, rounds, time.process_time)
        ops = _tf_ops(step.get_concrete_function(x))
        base_ops = _tf_ops(kernel_only.get_concrete_function(x_tm))
        return dict(wall_us=wall_us, kernel_us=kernel_us, own_us=wall_us - kernel_us,
                    path=path, ops=ops - base_ops, ops_step=ops, ops_kernel_only=base_ops)
    finally:
        (cudnn_op.call_op, tf_backend.is_available, tf_backend.op_loaded,
         tf_backend._op_for) = saved


def _tf_ops(concrete) -> int:
    """Ops of a concrete function's graph and the function graphs it calls."""
    graph = concrete.graph.as_graph_def()
    return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)


# -- jax -------------------------------------------------------------------------


def _jax_fake_ffi(target, results, *operands, input_output_aliases=None, **attributes):
    import jax
    import jax.numpy as jnp

    kept = jax.lax.optimization_barrier(operands)
    live = sum(jnp.ravel(o)[:1].astype(jnp.float32).sum() for o in kept if o.size) * 0.0
    return [jnp.zeros(r.shape, r.dtype) + live.astype(r.dtype) for r in results]


def measure_jax(shape: dict, steps: int, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp

    from rnnfuse.backends import jax as jax_backend
    from rnnfuse.backends.jax import cudnn_core

    saved = (cudnn_core.ffi_call, cudnn_core.reserve_bytes, cudnn_core.workspace_bytes,
             cudnn_core.register, jax_backend.is_available)
    cudnn_core.ffi_call = _jax_fake_ffi
    cudnn_core.reserve_bytes = lambda *a: 16
    cudnn_core.workspace_bytes = lambda *a: 16
    cudnn_core.register = lambda: None
    jax_backend.is_available = lambda: True
    try:
        layer = _fused_layer(shape)
        x = jnp.asarray(_inputs(shape))
        trainable = [v.value for v in layer.trainable_variables]
        others = [v.value for v in layer.non_trainable_variables]

        def loss(trainable, x):
            y, _ = layer.stateless_call(trainable, others, x, training=True)
            return jnp.sum(y)

        step = jax.jit(jax.grad(loss))
        run = lambda: jax.block_until_ready(step(trainable, x))  # noqa: E731

        size = sum(int(jnp.size(v)) for v in trainable)
        params = jnp.zeros([size])
        x_tm = jnp.swapaxes(x, 0, 1)

        def kernel_loss(params, x_tm):
            out = _jax_fake_ffi("", [jax.ShapeDtypeStruct(x_tm.shape[:2] + (layer.stack.output_size,),
                                                          jnp.float32)], x_tm, params)
            return jnp.sum(out[0][-1])

        kernel = jax.jit(jax.grad(kernel_loss))
        base = lambda: jax.block_until_ready(kernel(params, x_tm))  # noqa: E731
        run(), base()
        wall_us = _median_us(run, steps, rounds, time.process_time)
        kernel_us = _median_us(base, steps, rounds, time.process_time)
        eqns = len(jax.make_jaxpr(jax.grad(loss))(trainable, x).eqns)
        base_eqns = len(jax.make_jaxpr(jax.grad(kernel_loss))(params, x_tm).eqns)
        return dict(wall_us=wall_us, kernel_us=kernel_us, own_us=wall_us - kernel_us,
                    path=str(layer.last_path), ops=eqns - base_eqns, ops_step=eqns)
    finally:
        (cudnn_core.ffi_call, cudnn_core.reserve_bytes, cudnn_core.workspace_bytes,
         cudnn_core.register, jax_backend.is_available) = saved


MEASURE = dict(torch=measure_torch, tensorflow=measure_tensorflow, jax=measure_jax)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file")
    parser.add_argument("--shapes", default=SMALL, help="comma-separated names of bench_matrix.SHAPES")
    parser.add_argument("--steps", type=int, default=20, help="steps a round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the median is kept)")
    parser.add_argument("--size", choices=SIZES, default="host",
                        help="host: batch 2, 2 time steps, 4 units and features; tiny: batch 2, "
                             "2 time steps; full: the shape's own")
    args = parser.parse_args(argv)

    import keras

    import bench_matrix
    import rnnfuse

    backend = keras.backend.backend()
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in bench_matrix.SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {', '.join(bench_matrix.SHAPES)}")
    meta = dict(backend=backend, keras=keras.__version__, rnnfuse=rnnfuse.__version__,
                python=platform.python_version(), cpu=platform.processor() or platform.machine(),
                cores=os.cpu_count(), steps=args.steps, rounds=args.rounds, size=args.size)
    results = []
    for name in names:
        try:
            shape = bench_matrix.SHAPES[name]
            shape = dict(shape, **SIZES[args.size])
            row = dict(shape_name=name, **MEASURE[backend](shape, args.steps, args.rounds))
        except Exception as err:  # noqa: BLE001 - record and go on
            row = dict(shape_name=name, error=f"{type(err).__name__}: {err}"[:500])
        results.append(row)
        print(name, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                     if k not in ("profile", "top_ops")}, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(meta=meta, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
