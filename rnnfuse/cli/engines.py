"""Random inputs and the per-backend engines `bench` and `check` run.

Example:

    >>> _loss_weights([(2, 3)], seed=0)[0].shape
    (2, 3)
"""

from __future__ import annotations

import os
import platform
import sys

from rnnfuse.cli.errors import CliError, _first_line

__all__ = ["random_inputs"]


# -- random inputs -------------------------------------------------------------


def _elements(shape, batch: int, steps: int | None) -> int:
    """Elements of one example-shaped tensor: None -> batch (axis 0), steps (axis 1)."""
    n = 1
    for axis, dim in enumerate(shape):
        if dim is None:
            dim = batch if axis == 0 else (steps or 1)
        n *= int(dim)
    return n


def available_memory() -> int | None:
    """Bytes of memory available to this process now (None: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _check_memory(model, specs, batch: int, steps: int | None) -> None:
    """A clear error before allocating inputs and activations that cannot fit.

    The estimate is a floor: the inputs (drawn in float64), and every
    layer's output for the original and the optimized model with its
    gradient (4 copies in float32).
    """
    import keras

    needed = sum(8 * _elements(spec.shape, batch, steps) for spec in specs)
    for layer in model._flatten_layers(include_self=False):
        try:
            outputs = layer.output
        except (AttributeError, ValueError):
            continue
        for out in keras.tree.flatten(outputs):
            shape = getattr(out, "shape", None)
            if shape is not None and len(shape) >= 1:
                needed += 4 * 4 * _elements(shape, batch, steps)
    available = available_memory()
    if available is not None and needed > available:
        gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
        raise CliError(
            f"--batch {batch}"
            + (f" --steps {steps}" if steps is not None else "")
            + f" needs at least {gib(needed)} for the inputs and activations of "
            f"'{model.name}', and {gib(available)} is available. Fix: pass a "
            "smaller --batch or --steps"
        )



def random_inputs(model, *, batch: int, steps: int | None, rng, notes: list | None = None):
    """Random arrays for every input of `model`, as `model(...)` takes them.

    Args:
        model: a built Functional or Sequential keras.Model.
        batch: the batch size.
        steps: the time steps for inputs whose axis 1 is None.
        rng: a numpy Generator.
        notes: a list that receives one line per remark (may be None).

    Returns:
        (inputs as the model takes them, list of one-line descriptions).

    Raises:
        CliError: the model has no inputs to read, or an open dimension
            other than batch and time.
    """
    import keras

    try:
        specs = list(model.inputs)
    except (AttributeError, ValueError) as err:
        raise CliError(
            f"cannot tell the input shapes of '{model.name}' "
            f"({type(model).__name__}). Fix: build it as a Functional or "
            "Sequential model starting with keras.Input(shape)"
        ) from err
    vocab = _embedding_inputs(model, specs)
    _check_memory(model, specs, batch, steps)
    arrays, described = [], []
    for i, spec in enumerate(specs):
        name = getattr(spec, "name", f"input_{i}")
        shape = [batch]
        for axis, dim in enumerate(spec.shape[1:], start=1):
            if dim is not None:
                if axis == 1 and steps is not None and dim != steps and notes is not None:
                    notes.append(
                        f"input '{name}' has a fixed time dimension of {dim}; "
                        f"--steps {steps} does not apply to it"
                    )
                shape.append(int(dim))
            elif axis == 1:
                if steps is None:
                    raise CliError(
                        f"input '{name}' has no fixed time dimension (shape "
                        f"{tuple(spec.shape)}). Fix: pass --steps T"
                    )
                shape.append(steps)
            else:
                raise CliError(
                    f"input '{name}' has an open dimension at axis {axis} "
                    f"(shape {tuple(spec.shape)}), so rnnfuse cannot make random "
                    "inputs for it. Fix: give that dimension a size in "
                    "keras.Input(shape)"
                )
        dtype = str(spec.dtype)
        if "int" in dtype:
            high, mask_zero = vocab.get(i, (2, False))
            low = 1 if mask_zero and high > 1 else 0
            values = rng.integers(low, high, size=shape)
            text = f"{name}: {dtype} {shape}, token ids {low}..{high - 1}"
            if mask_zero and len(shape) >= 2:
                lengths = rng.integers(max(1, shape[1] // 2), shape[1] + 1, size=batch)
                for b, n in enumerate(lengths):
                    values[b, n:] = 0
                text += ", right-padded with 0"
            arrays.append(values.astype(dtype))
        elif dtype == "bool":
            arrays.append(rng.random(shape) < 0.5)
            text = f"{name}: bool {shape}"
        else:
            arrays.append(rng.standard_normal(shape).astype(dtype))
            text = f"{name}: {dtype} {shape}, standard normal"
        described.append(text)
    struct = getattr(model, "_inputs_struct", None)
    if struct is not None:
        packed = keras.tree.pack_sequence_as(struct, arrays)
    else:
        packed = arrays[0] if len(arrays) == 1 else arrays
    return packed, described


def _embedding_inputs(model, specs) -> dict[int, tuple[int, bool]]:
    """Input index -> (smallest input_dim, any mask_zero) of the Embeddings it feeds."""
    import keras

    from rnnfuse.passes.graph import build_layer_graph, is_graph_model

    if not is_graph_model(model):
        return {}
    graph = build_layer_graph(model)
    found = {}
    for i, spec in enumerate(specs):
        key = f"<input:{spec.name}>"
        if key not in graph:
            continue
        embeddings, seen, todo = [], {key}, [key]
        while todo:
            for nxt in graph.successors(todo.pop()):
                if nxt in seen:
                    continue
                seen.add(nxt)
                layer = graph.nodes[nxt].get("layer")
                if isinstance(layer, keras.layers.Embedding):
                    embeddings.append(layer)
                else:
                    todo.append(nxt)
        if embeddings:
            found[i] = (
                min(int(e.input_dim) for e in embeddings),
                any(bool(e.mask_zero) for e in embeddings),
            )
    return found


# -- backends: devices, timed steps, gradients -----------------------------------


def _engine(command: str):
    """The timing and gradient helpers of the active Keras backend."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        return _TensorFlowEngine()
    if backend == "torch":
        return _TorchEngine()
    raise CliError(
        f"rnnfuse {command} runs on the TensorFlow or torch Keras backend; this "
        f"process uses '{backend}'. Fix: set KERAS_BACKEND=tensorflow (or torch)"
    )


def _loss_weights(flat_shapes, seed: int) -> list:
    """One fixed random array per output, so gradients do not cancel."""
    import numpy as np

    return [
        np.random.default_rng(seed + 1 + i).standard_normal(shape).astype("float32")
        for i, shape in enumerate(flat_shapes)
    ]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _cpu_device(library: str) -> str:
    return f"CPU: {_cpu_name()}, {os.cpu_count()} cores, {library} (no GPU visible)"


class _TensorFlowEngine:
    """tf.function steps and GradientTape gradients."""

    def device(self) -> tuple[str, bool]:
        import tensorflow as tf

        library = f"TensorFlow {tf.__version__}"
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            return _cpu_device(library), False
        try:
            name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")
        except Exception:  # noqa: BLE001 - the name is cosmetic
            name = "GPU"
        cudnn = tf.sysconfig.get_build_info().get("cudnn_version")
        more = f" (+{len(gpus) - 1} more, unused)" if len(gpus) > 1 else ""
        return f"GPU: {name}{more}, {library}" + (f", cuDNN {cudnn}" if cudnn else ""), True

    def timing_notes(self, on_gpu: bool) -> list[str]:
        return []

    def exact_float32(self) -> None:
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(False)

    def step(self, model, train: bool):
        """A compiled inference or training step; returns a float when done."""
        import keras
        import tensorflow as tf

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

    def outputs_and_grads(self, model, inputs, variables, seed: int):
        """Outputs (inference mode) and d(loss)/d(variables), as numpy.

        Runs eagerly: one step does not pay back tracing a graph.
        """
        import keras
        import numpy as np
        import tensorflow as tf

        with tf.GradientTape() as tape:
            outputs = model(inputs, training=False)
            flat = [tf.cast(t, tf.float32) for t in keras.tree.flatten(outputs)]
            weights = _loss_weights([tuple(t.shape) for t in flat], seed)
            loss = tf.add_n([tf.reduce_mean(t * w) for t, w in zip(flat, weights)])
        grads = tape.gradient(loss, variables)
        grads = [
            np.zeros(v.shape, np.float32) if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32).numpy()
            for v, g in zip(variables, grads)
        ]
        return [t.numpy() for t in flat], grads


class _TorchEngine:
    """Eager torch steps and autograd gradients."""

    def device(self) -> tuple[str, bool]:
        import torch

        library = f"PyTorch {torch.__version__}"
        if not torch.cuda.is_available():
            return _cpu_device(library), False
        cudnn = torch.backends.cudnn.version()
        return f"GPU: {torch.cuda.get_device_name(0)}, {library}" + (f", cuDNN {cudnn}" if cudnn else ""), True

    def timing_notes(self, on_gpu: bool) -> list[str]:
        if on_gpu or "tensorflow" not in sys.modules or os.environ.get("OMP_WAIT_POLICY"):
            return []
        return [
            "TensorFlow is loaded in this process too (Keras imports it when it "
            "is installed); on a CPU its threads and PyTorch's spinning OpenMP "
            "threads can slow torch down 10-50x. Set OMP_WAIT_POLICY=PASSIVE "
            "in the environment for steady CPU timings"
        ]

    def exact_float32(self) -> None:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    @staticmethod
    def _tensors(inputs):
        import keras

        return keras.tree.map_structure(keras.ops.convert_to_tensor, inputs)

    def step(self, model, train: bool):
        import keras
        import torch

        params = [v.value for v in model.trainable_variables]

        def run(inputs):
            x = self._tensors(inputs)
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

    def outputs_and_grads(self, model, inputs, variables, seed: int):
        import keras
        import numpy as np
        import torch

        flat = [t.float() for t in keras.tree.flatten(model(self._tensors(inputs), training=False))]
        weights = _loss_weights([tuple(t.shape) for t in flat], seed)
        loss = sum(torch.mean(t * torch.as_tensor(w, device=t.device)) for t, w in zip(flat, weights))
        params = [v.value for v in variables]
        grads = torch.autograd.grad(loss, params, allow_unused=True) if params else []
        grads = [
            np.zeros(tuple(v.shape), np.float32) if g is None else g.detach().float().cpu().numpy()
            for v, g in zip(variables, grads)
        ]
        return [t.detach().cpu().numpy() for t in flat], grads


def _run_model(fn, *args, command: str):
    """Calls `fn(*args)`; a failure of the user's model becomes a CliError."""
    try:
        return fn(*args)
    except CliError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's model failed on our inputs
        raise CliError(
            f"{command}: running the model on random inputs failed: "
            f"{type(err).__name__}: {_first_line(err)}. Fix: check that the "
            "model runs on inputs of these shapes (--debug shows the traceback)"
        ) from err


def _caveat(paths: dict, groups: int) -> str | None:
    """Why the two models should time alike here, if they should."""
    if not groups:
        return "nothing fuses in this model: both models run the same layers."
    if not paths:
        return "every group's plan keeps its layers: both models run the same layers."
    fallback = sorted({p[len("layers: "):] for p in paths.values() if p and p.startswith("layers: ")})
    if fallback:
        return (
            f"the fused layers ran the original layers here ({'; '.join(fallback)}), "
            "so expect about 1.0x. On a CUDA GPU each group runs as one cuDNN call."
        )
    return None
