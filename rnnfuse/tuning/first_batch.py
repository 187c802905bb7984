"""First-batch tuning: each group's plan chosen on the real batch shape.

`rnnfuse.optimize(model)` (``tune="auto"``, the default) returns a model
whose `fit`, `evaluate` and `predict` look at the first batch before any
step runs. Where the backend can time its fused kernel here (a GPU; see
`device_environment`), and no decision is cached for (device, backend,
group signature, batch shape, dtype policy, training), it times every
candidate plan of every `FusedRNN` on that shape (`tune_plans`: the
original layers always among them, jit-compiled when Keras would compile
the original model with XLA), keeps the fastest, caches it on disk, and
switches the fused layers (`FusedRNN.set_plan`) before Keras traces its
step function. One INFO line on the ``rnnfuse`` logger says what was
measured and chosen, and how long it took; tuning that takes more than a
few seconds shows a progress bar.

Later shapes never stall on timing. Each mode (training, inference) is
timed once per model, and a (mode, shape) already decided is remembered on
the model, so later calls of `fit` on it read no file. A shape seen later
(the last partial batch, another sequence length, another `fit`) takes the
cached decision for that exact shape if there is one, else the cached
decision of the nearest shape for the same group, dtype and mode (distance:
|log batch ratio| + |log steps ratio|), else keeps the plan it has (the
first-batch decision, or the static table's where nothing was timed).

Without a GPU (or with ``tune=False``) nothing is timed: the static table
decides, exactly as before.

Example (no GPU here: nothing is timed, nothing changes):

    >>> import keras, numpy as np, rnnfuse
    >>> m = keras.Sequential([keras.Input((10, 4)),
    ...     keras.layers.GRU(8, return_sequences=True), keras.layers.GRU(8)])
    >>> fast = rnnfuse.optimize(m)
    >>> prepare(fast, np.zeros((2, 10, 4), "float32"), None, training=False)
    []
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable

import keras

from rnnfuse.backends import get_backend
from rnnfuse.fused import FusedRNN, fused_layers
from rnnfuse.report import FusionGroup
from rnnfuse.tuning.cache import PlanCache, cache_key
from rnnfuse.plan import Plan
from rnnfuse.tuning.table import static_plan
from rnnfuse.tuning.tuner import TuneResult, device_environment, tune_plans

__all__ = [
    "AutoTune",
    "attach",
    "can_time_here",
    "decision_record",
    "decisions",
    "first_batch_shape",
    "prepare",
]

logger = logging.getLogger("rnnfuse")

# Tuning longer than this shows a progress bar (seconds, estimated).
PROGRESS_AFTER_S = 3.0


@dataclasses.dataclass
class AutoTune:
    """First-batch tuning state kept on an optimized model."""

    # Where decisions are kept (None: nowhere; every process times anew).
    cache: PlanCache | None
    # (FusedRNN, the FusionGroup it was built from) of the optimized model,
    # kept from `optimize` (`attach`), so nothing is described again.
    groups: list = dataclasses.field(default_factory=list)
    # Whether the user compiled with jit_compile="auto" (Keras' default).
    jit_auto: bool = True
    # (mode, input shape) -> the decisions taken for it, so a later fit or
    # predict on a shape already seen reads no cache file. A mode's first
    # shape is the one timed (`has_timed`).
    decided: dict = dataclasses.field(default_factory=dict)
    # Seconds spent timing plans so far.
    seconds: float = 0.0
    # One record per timed group (`decision_record`): what was measured,
    # what was chosen, and what the static table would have chosen.
    decisions: list = dataclasses.field(default_factory=list)
    # For tests: tune_plans' measure / check_gradients / environment.
    measure: Callable | None = None
    check_gradients: Callable | None = None
    environment: dict | None = None

    def has_timed(self, training: bool) -> bool:
        """Whether this mode (True: training) has been timed already."""
        return any(mode == training for mode, _shape in self.decided)


def can_time_here(environment: dict | None = None) -> bool:
    """Whether first-batch tuning has an accelerator to time on here.

    False without a fused kernel for this backend, under TensorFlow without
    a GPU, and on a CPU (the torch backend's fused call runs there, but
    nothing is timed on a CPU unless `tune=` asks for it).
    """
    environment = environment if environment is not None else device_environment()
    if environment is None:
        return False
    device = str(environment.get("device", "")).lower()
    return bool(device) and not device.startswith("cpu")


def attach(model: keras.Model, groups, state: AutoTune) -> keras.Model:
    """Marks `model` (an optimized model) for first-batch tuning, with the
    `FusionGroup`s its FusedRNN layers were built from (`optimize`'s): each
    FusedRNN is paired with the group whose first layer it runs first (a
    group whose fused layer failed to build has none)."""
    by_first = {id(g.views[0].layer): g for g in groups}
    state.groups = [
        (f, by_first[id(f.fused_layers[0])])
        for f in fused_layers(model)
        if id(f.fused_layers[0]) in by_first
    ]
    object.__setattr__(model, "_rnnfuse_autotune", state)
    return model


def first_batch_shape(x: Any, batch_size: int | None) -> tuple[int, ...] | None:
    """(batch, time, ...) of the first batch `fit`/`predict` will draw from `x`.

    Arrays and tensors: (min(batch_size or 32, len), *rest). A `tf.data`
    dataset, a Keras `PyDataset`, or another iterable of batches: the shape
    of its first element's first input (a dataset's static element spec
    where it is fully known, else one element is read). None where the shape
    cannot be known without consuming the user's data (a generator).
    """
    first = _first_input(x)
    shape = getattr(first, "shape", None)
    if shape is not None and not _is_batched_source(x):
        shape = tuple(shape)
        if len(shape) < 2:
            return None
        rows = int(shape[0])
        return (min(batch_size or 32, rows),) + tuple(int(d) for d in shape[1:])
    spec = getattr(x, "element_spec", None)
    if spec is not None:
        spec = keras.tree.flatten(spec)[0]
        dims = tuple(spec.shape)
        if dims and all(d is not None for d in dims):
            return tuple(int(d) for d in dims)
        try:
            element = next(iter(x.take(1)))
        except (StopIteration, TypeError, ValueError, AttributeError):
            return None
        return _shape_of_batch(element)
    if hasattr(x, "__getitem__") and hasattr(x, "__len__") and _is_batched_source(x):
        try:
            return _shape_of_batch(x[0])
        except (IndexError, KeyError, TypeError, ValueError):
            return None
    return None


def _is_batched_source(x: Any) -> bool:
    return hasattr(x, "element_spec") or type(x).__name__ == "PyDataset" or any(
        c.__name__ == "PyDataset" for c in type(x).__mro__
    )


def _first_input(x: Any) -> Any:
    if isinstance(x, dict):
        return next(iter(x.values()), None)
    if isinstance(x, (list, tuple)) and x and hasattr(x[0], "shape"):
        return x[0]
    return x


def _shape_of_batch(batch: Any) -> tuple[int, ...] | None:
    """Shape of the first input of one (x[, y[, w]]) batch."""
    if isinstance(batch, tuple) and batch:
        batch = batch[0]
    first = keras.tree.flatten(batch)[0] if keras.tree.is_nested(batch) else batch
    shape = getattr(first, "shape", None)
    if shape is None or len(shape) < 2 or any(d is None for d in shape):
        return None
    return tuple(int(d) for d in shape)


def _group_shape(fused: FusedRNN, group: FusionGroup, batch_shape: tuple) -> tuple:
    """(batch, steps, features) of a group's input for the model's first batch."""
    steps = None
    try:
        steps = fused.input.shape[1]
    except (AttributeError, ValueError, IndexError, TypeError):
        steps = None
    if steps is None:
        steps = batch_shape[1]
    return (int(batch_shape[0]), int(steps), int(group.input_size or 1))


def receives_mask(fused: FusedRNN) -> bool:
    """Whether `fused` is called with a padding mask in its model (the
    rewrite passes the mask as an argument; Keras' own propagation sets it
    on the input tensor)."""
    for node in getattr(fused, "_inbound_nodes", ()):
        arguments = getattr(node, "arguments", None)
        if arguments is not None and arguments.kwargs.get("mask") is not None:
            return True
        for tensor in keras.tree.flatten(getattr(node, "input_tensors", ())):
            if getattr(tensor, "_keras_mask", None) is not None:
                return True
    return False


def _keras_would_jit(model: keras.Model, state: AutoTune) -> bool:
    """Whether Keras would XLA-compile the original model (jit_compile="auto")."""
    if not state.jit_auto or not get_backend().capabilities.auto_jit_from_layers:
        return False
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, FusedRNN):
            members = [l for m in layer.members() for l in m._flatten_layers()]
            if not all(m.supports_jit for m in members):
                return False
        elif not isinstance(layer, keras.Model) and not layer.supports_jit:
            return False
    return True


def prepare(model: keras.Model, x: Any, batch_size: int | None, *, training: bool) -> list[TuneResult]:
    """Chooses each FusedRNN's plan for the first batch of `x` (see module doc).

    Returns the decisions that were timed or looked up (empty where nothing
    was: no GPU, no FusedRNN, a shape that cannot be known, already done).
    """
    state = getattr(model, "_rnnfuse_autotune", None)
    if state is None or not state.groups:
        return []
    layers = [f for f, _ in state.groups]
    environment = state.environment if state.environment is not None else device_environment()
    if environment is None:
        return []
    shape = first_batch_shape(x, batch_size)
    if shape is None:
        logger.info(
            "rnnfuse: the first batch's shape cannot be read without consuming "
            "the data; the fused layers keep their static plans"
        )
        return []
    results = state.decided.get((training, shape))
    if results is None:
        groups, shapes, masked = _groups_and_shapes(state.groups, shape)
        if state.has_timed(training):
            results = _nearest_decisions(state, environment, groups, shapes, training, masked)
        else:
            start = time.perf_counter()
            results = _timed_decisions(model, state, environment, groups, shapes, training, masked)
            seconds = time.perf_counter() - start
            state.seconds += seconds
            _log(results, shapes, training, seconds)
            state.decisions += [
                decision_record(r, shapes[id(r.group)], training) for r in results if r is not None
            ]
        state.decided[(training, shape)] = results
    changed = False
    for fused, result in zip(layers, results):
        if result is None:
            continue
        plan = result.plan.for_length(len(fused.fused_layers))
        if plan != fused.plan:
            fused.set_plan(plan)
            changed = True
    if changed:
        _retrace(model, state)
    return [r for r in results if r is not None]


def _groups_and_shapes(pairs: list, shape: tuple) -> tuple[list, dict, dict]:
    """Each FusedRNN's group record, its input shape and whether it is masked."""
    groups = [g for _, g in pairs]
    shapes = {id(g): _group_shape(f, g, shape) for f, g in pairs}
    masked = {id(g): receives_mask(f) for f, g in pairs}
    return groups, shapes, masked


def _timed_decisions(model, state, environment, groups, shapes, training, masked):
    try:
        return tune_plans(
            groups,
            lambda g: shapes[id(g)],
            training=training,
            cache=state.cache,
            measure=state.measure,
            check_gradients=state.check_gradients,
            environment=environment,
            progress=True,
            jit_baseline=_keras_would_jit(model, state),
            masked_of=lambda g: masked[id(g)],
        )
    except Exception as err:  # noqa: BLE001 - timing must never break the user's fit
        logger.warning(
            "rnnfuse: timing the plans on the first batch failed (%s: %s); "
            "the fused layers keep their static plans",
            type(err).__name__,
            err,
        )
        return [None] * len(groups)


def _nearest_decisions(state, environment, groups, shapes, training, masked):
    """Cached decisions for a later shape: exact, else the nearest shape."""
    if state.cache is None:
        return [None] * len(groups)
    out = []
    for group in groups:
        dtype = group.dtype
        shape = shapes[id(group)]
        is_masked = masked[id(group)]
        hit = state.cache.get(cache_key(environment, group, shape, dtype, training, is_masked))
        if hit is None:
            hit = _nearest(state.cache, environment, group, shape, dtype, training, is_masked)
        plan = _plan_of(hit, group)
        out.append(None if plan is None else TuneResult(group, plan, "cache"))
    return out


def _nearest(cache: PlanCache, environment, group, shape, dtype, training, masked=False) -> dict | None:
    """The cached entry of the nearest shape for the same group/dtype/mode
    (and the same masked or unmasked input)."""
    key = cache_key(environment, group, shape, dtype, training, masked)
    best, best_distance = None, math.inf
    for other, entry in cache.entries():
        if not key.other_shape(other) or len(other.shape) < 2:
            continue
        distance = abs(math.log(max(other.shape[0], 1) / max(shape[0], 1))) + abs(
            math.log(max(other.shape[1], 1) / max(shape[1], 1))
        )
        if distance < best_distance:
            best, best_distance = entry, distance
    return best


def _plan_of(hit: dict | None, group: FusionGroup) -> Plan | None:
    if not isinstance(hit, dict) or "plan" not in hit:
        return None
    try:
        plan = Plan.from_dict(hit["plan"])
        plan.for_length(len(group.layers))
    except (KeyError, TypeError, ValueError):
        return None
    return plan


def _retrace(model: keras.Model, state: AutoTune) -> None:
    """Drops Keras' traced step functions so the next step uses the new plans."""
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)
    if state.jit_auto and getattr(model, "compiled", False):
        # Keras resolved jit_compile="auto" at compile(); a plan that keeps
        # the original layers may give the model its XLA back.
        model.jit_compile = model._resolve_auto_jit_compile()


def decisions(model: keras.Model) -> list[dict]:
    """What first-batch tuning measured and chose for `model` so far: one
    `decision_record` per timed group and mode (empty before the first
    batch, without a GPU, or for a model `optimize` did not return).

    >>> import keras
    >>> decisions(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    []
    """
    state = getattr(model, "_rnnfuse_autotune", None)
    return list(state.decisions) if state is not None else []


def decision_record(result: TuneResult, shape: tuple, training: bool) -> dict:
    """A JSON-ready record of one group's decision.

    Keys: layers, mode, input (batch, steps, features), dtype, source,
    chosen (plan name), timings_ms (candidate -> median ms), rejected, and
    static (the plan the static table gives the group without timing).
    """
    group = result.group
    dtype = group.dtype
    return dict(
        layers=list(group.layers),
        mode="training" if training else "inference",
        input=list(shape),
        dtype=str(dtype),
        source=result.source,
        chosen=result.plan.name,
        timings_ms={name: 1e3 * s for name, s in result.timings.items()},
        rejected=dict(result.rejected),
        static=static_plan(group, dtype, training).name,
    )


def _log(results, shapes, training, seconds) -> None:
    for result in results:
        if result is None:
            continue
        group = result.group
        timings = ", ".join(
            f"{name} {1e3 * s:.2f} ms" for name, s in sorted(result.timings.items(), key=lambda kv: kv[1])
        )
        logger.info(
            "rnnfuse: %s for %s %s (input %s): %s%s; chose %s (%.1f s)",
            "tuned" if result.source == "measured" else f"plan from {result.source}",
            " -> ".join(group.layers),
            "training" if training else "inference",
            shapes[id(group)],
            timings or "no timings",
            f"; rejected {result.rejected}" if result.rejected else "",
            result.plan.name,
            seconds,
        )
