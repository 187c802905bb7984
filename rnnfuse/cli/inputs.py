"""Random inputs for `bench` and `check`, and running the user's model
through the backend's own tooling (`rnnfuse.backends.get_tooling()`).

>>> import keras, numpy as np
>>> m = keras.Sequential([keras.Input((4, 2)), keras.layers.LSTM(3)])
>>> random_inputs(m, batch=2, steps=None, rng=np.random.default_rng(0))[0].shape
(2, 4, 2)
"""

from __future__ import annotations

import os

from rnnfuse.cli.errors import CliError, _first_line

__all__ = ["backend_for", "random_inputs", "run_model"]


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


def random_inputs(
    model,
    *,
    batch: int,
    steps: int | None,
    rng,
    notes: list | None = None,
    default_steps: int | None = None,
):
    """Random arrays for every input of `model`, as `model(...)` takes them:
    (inputs, one-line descriptions).

    `steps` (`--steps`) fills an open time axis (a note in `notes` where an
    input's own time dimension wins), else `default_steps`; floats are
    standard normal, an Embedding's inputs token ids below its input_dim
    (right-padded with 0 under mask_zero). Raises CliError for a model without
    readable inputs or an open dimension besides batch and time.
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
    asked, steps = steps, steps if steps is not None else default_steps
    _check_memory(model, specs, batch, steps)
    arrays, described = [], []
    for i, spec in enumerate(specs):
        name = getattr(spec, "name", f"input_{i}")
        shape = _input_shape(spec, name, batch, steps, asked, notes)
        values, text = _random_array(rng, str(spec.dtype), shape, vocab.get(i, (2, False)))
        arrays.append(values)
        described.append(f"{name}: {text}")
    struct = getattr(model, "_inputs_struct", None)
    if struct is not None:
        packed = keras.tree.pack_sequence_as(struct, arrays)
    else:
        packed = arrays[0] if len(arrays) == 1 else arrays
    return packed, described


def _input_shape(spec, name: str, batch: int, steps: int | None, asked: int | None,
                 notes: list | None) -> list:
    """The shape of one random input: `batch`, then `spec`'s dimensions, an
    open time axis taking `steps`."""
    shape = [batch]
    for axis, dim in enumerate(spec.shape[1:], start=1):
        if dim is not None:
            if axis == 1 and asked is not None and dim != asked and notes is not None:
                notes.append(
                    f"input '{name}' has a fixed time dimension of {dim}; "
                    f"--steps {asked} does not apply to it"
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
    return shape


def _random_array(rng, dtype: str, shape: list, vocab: tuple[int, bool]):
    """(values, description) of one input: token ids below the vocabulary
    size `vocab[0]` (right-padded with 0 where `vocab[1]`, mask_zero),
    random booleans, or standard normal floats."""
    if "int" in dtype:
        high, mask_zero = vocab
        low = 1 if mask_zero and high > 1 else 0
        values = rng.integers(low, high, size=shape)
        text = f"{dtype} {shape}, token ids {low}..{high - 1}"
        if mask_zero and len(shape) >= 2:
            lengths = rng.integers(max(1, shape[1] // 2), shape[1] + 1, size=shape[0])
            for b, n in enumerate(lengths):
                values[b, n:] = 0
            text += ", right-padded with 0"
        return values.astype(dtype), text
    if dtype == "bool":
        return rng.random(shape) < 0.5, f"bool {shape}"
    return rng.standard_normal(shape).astype(dtype), f"{dtype} {shape}, standard normal"


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


# -- running the user's model ----------------------------------------------------


def backend_for(command: str):
    """The active Keras backend's `rnnfuse.backends.Tooling` (its device
    description, model steps and gradients); a CliError where rnnfuse has
    no kernel for it."""
    from rnnfuse.backends import get_backend, get_tooling

    backend = get_backend()
    if not backend.capabilities.fused_kernel:
        raise CliError(
            f"rnnfuse {command} runs on the TensorFlow, torch or JAX Keras backend; "
            f"this process uses '{backend.name}'. Fix: set KERAS_BACKEND=tensorflow "
            "(or torch, or jax)"
        )
    return get_tooling()


def run_model(fn, *args, command: str):
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
