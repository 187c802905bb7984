"""Printing, equivalence and timing helpers shared by the examples.

Each example builds its model, then calls `report`, `check` and `timing`:

    fast = report(model)                       # prints analyze(), returns optimize()
    ok = check(model, fast, inputs)            # outputs match? prints PASS/FAIL
    timing(model, fast, inputs, loss_fn=...)   # medians and ratio on this machine

Every example takes `--quick`: time inference only, with fewer repeats (the
tests use it; tracing a training step is the slow part on a CPU).

Everything here uses rnnfuse's public API, the backend object
(`rnnfuse.backends.get_tooling()`) and the tuner's timing loop.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ["KERAS_BACKEND"] == "torch":
    # Keras imports TensorFlow too when it is installed; on a CPU its threads
    # and PyTorch's spinning OpenMP threads then slow torch down 10-50x.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

import rnnfuse  # noqa: E402
from rnnfuse.backends import get_tooling  # noqa: E402
from rnnfuse.tuning.timing import interleaved_medians  # noqa: E402

console = Console(highlight=False)


def report(model: keras.Model) -> keras.Model:
    """Prints what rnnfuse fuses in `model` and returns the optimized model."""
    result = rnnfuse.analyze(model)
    console.rule(f"[bold]rnnfuse.analyze('{escape(model.name)}')")
    fused, alone = result.tables()
    console.print(fused)
    if result.skipped:
        console.print(alone)
    return rnnfuse.optimize(model)


def device() -> tuple[str, bool]:
    """(where the Keras backend runs, whether that is a GPU)."""
    if keras.backend.backend() == "torch":
        import torch

        if torch.cuda.is_available():
            return f"GPU ({torch.cuda.get_device_name(0)}, torch)", True
        return f"CPU ({os.cpu_count()} cores, no GPU visible, torch)", False
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")
        return f"GPU ({name})", True
    return f"CPU ({os.cpu_count()} cores, no GPU visible)", False


def fused_paths(fast: keras.Model) -> dict[str, str]:
    """Each FusedRNN layer -> the path its last call took."""
    return {
        layer.name: layer.last_path
        for layer in fast._flatten_layers(include_self=False)
        if isinstance(layer, rnnfuse.FusedRNN)
    }


def check(model: keras.Model, fast: keras.Model, inputs, tolerance: float = 1e-4) -> bool:
    """Prints the max abs difference of the two models' outputs; True if within."""
    expected = keras.tree.flatten(model(inputs, training=False))
    actual = keras.tree.flatten(fast(inputs, training=False))
    as64 = lambda t: keras.ops.convert_to_numpy(t).astype(np.float64)
    diff = max(float(np.max(np.abs(as64(a) - as64(b)))) for a, b in zip(expected, actual))
    console.rule("[bold]equivalence")
    for name, path in fused_paths(fast).items():
        console.print(escape(f"{name}: {path}"))
    ok = len(expected) == len(actual) and diff <= tolerance
    verdict = "[green]PASS" if ok else "[red]FAIL"
    console.print(f"max abs diff of outputs, original vs optimized: {diff:.3g} (tolerance {tolerance:g}) {verdict}")
    return ok


def timing(model: keras.Model, fast: keras.Model, inputs, *, loss_fn=None, repeats: int = 7) -> dict:
    """Times inference (and a training step when `loss_fn` is given).

    `loss_fn(outputs) -> scalar` defines the training step: forward,
    loss and gradients of every trainable variable (no optimizer update).
    Returns {"inference": ratio, "train": ratio} (original / optimized).
    """
    where, _ = device()
    console.rule(f"[bold]timing on {escape(where)}")
    table = Table()
    for col in ("step", "original ms", "optimized ms", "speedup"):
        table.add_column(col, justify="left" if col == "step" else "right")
    ratios = {}
    steps = {"inference": None}
    if quick():
        repeats = 3
    elif loss_fn is not None:
        steps["train"] = loss_fn
    for name, loss in steps.items():
        a, b = _median_ms(_step(model, loss), _step(fast, loss), inputs, repeats)
        ratios[name] = a / b
        table.add_row(name, f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}x")
    console.print(table)
    fallback = {p for p in fused_paths(fast).values() if p and p.kind is rnnfuse.PathKind.LAYERS}
    if fallback:
        why = "; ".join(sorted(str(p.reason) for p in fallback))
        console.print(
            escape(f"FusedRNN ran the original layers here ({why}), so about 1.0x is ")
            + "expected. On a CUDA GPU each group runs as one cuDNN call."
        )
    return ratios


def quick() -> bool:
    """Whether the example was run with --quick."""
    return "--quick" in sys.argv[1:]


def _step(model: keras.Model, loss_fn):
    """One inference step (`loss_fn` None) or training step (forward, loss,
    gradients of every trainable variable) of this backend, returning when
    the device is done: `rnnfuse bench`'s step. The training loss is the
    backend's (mean squared outputs); `loss_fn` only asks for training."""
    return get_tooling().model_step(model, train=loss_fn is not None)


def _median_ms(fn_a, fn_b, inputs, repeats: int) -> tuple[float, float]:
    """Median milliseconds of each function: the tuner's and `rnnfuse
    bench`'s timing loop (warm-up, then interleaved rounds)."""
    stats = interleaved_medians(
        {"a": lambda: fn_a(inputs), "b": lambda: fn_b(inputs)}, warmup=1, repeats=repeats
    )
    return 1000 * stats["a"]["median"], 1000 * stats["b"]["median"]
