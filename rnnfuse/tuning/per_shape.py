"""Per-shape decisions: each plan is timed for the shape bucket it runs on.

A plan decided at one input shape does not carry to another (cuDNN's
persistent algorithms in particular), so an optimized model keeps one
decision per group, mode and bucket (`bucket_of`: batch and steps, each
rounded to the nearest power of two). The rule:

1. A bucket is timed on a real shape of it before a plan runs there: the
   first bucket of a mode times every candidate, a later one only the
   `contenders`; a cached decision for the bucket counts as timed.
2. A shape that cannot be timed (a trace that leaves the batch open, JAX
   or XLA, a failed timing) runs what its mode and bucket decided, else
   the static table's proven plan (JAX's traces: the layer's own), and a
   decided plan runs `untimed` on a bucket it was not timed in.
3. Within one `fit`/`evaluate`/`predict` nothing is timed after the first
   batch, so a plan never switches mid-epoch; elsewhere a FusedRNN asks its
   `Planner` when first called or traced with a concrete shape.
4. The original layers are timed on the path they run (XLA-compiled or
   not: `decision_key`).

Example (no GPU: a persistent plan runs as standard where not timed):
    >>> from rnnfuse.plan import Plan
    >>> bucket_of(48, 200), bucket_of(173, 108)
    ((64, 256), (128, 128))
    >>> untimed(Plan((4,), "persistent_static+tc")).name
    'fused'
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Callable, NamedTuple

import keras

from rnnfuse.backends import get_backend, get_timing
from rnnfuse.fused import FusedRNN
from rnnfuse.plan import PER_LAYER, Plan
from rnnfuse.report import FusionGroup
from rnnfuse.tuning import clock
from rnnfuse.tuning.budget import FIT_SHARE, TuningBudget
from rnnfuse.tuning.cache import PlanCache, cache_key
from rnnfuse.tuning.table import static_plan
from rnnfuse.tuning.tuner import (
    TuneResult,
    candidates_for,
    default_warmup,
    device_environment,
    tune_plans,
)

__all__ = [
    "AutoTune",
    "CONTENTION",
    "Member",
    "PendingRace",
    "Planner",
    "bucket_of",
    "contenders",
    "decide",
    "decision_key",
    "decision_record",
    "untimed",
]

logger = logging.getLogger("rnnfuse")

# Timed rounds of a first-batch tuning (`tune_plans`' default).
REPEATS = 5
# A candidate within this factor of the best at the nearest decided bucket
# is timed again at a new one.
CONTENTION = 1.5


class PendingRace(NamedTuple):
    """A member's online race before the fit's first step: its candidates
    (`plans`, {name: Plan}) and why the others do not race (`refused`)."""

    bucket: tuple
    shape: tuple
    plans: dict
    xla_baseline: bool
    refused: dict


@dataclasses.dataclass
class Member:
    """One FusedRNN of an optimized model, with what tuning needs of it."""

    # The layer and the FusionGroup `optimize` built it from.
    fused: FusedRNN
    group: FusionGroup
    # It reads a padding mask in its model (timed with one: a mask changes
    # which kernels Keras runs).
    masked: bool = False
    # Its input's time steps where the model fixes them (None: open).
    steps: int | None = None


@dataclasses.dataclass
class AutoTune:
    """The tuning state kept on an optimized model."""

    # Where decisions are kept (None: nowhere; every process times anew).
    cache: PlanCache | None
    # The model's FusedRNN layers, from `optimize` (`first_batch.attach`).
    members: list = dataclasses.field(default_factory=list)
    # Whether the user compiled with jit_compile="auto" (Keras' default).
    jit_auto: bool = True
    # (member index, training, bucket, xla_baseline) -> the TuneResult
    # decided for it (`decision_key`).
    decided: dict = dataclasses.field(default_factory=dict)
    # While a fit/evaluate/predict call runs: (member index, training) ->
    # (bucket, plan) of the call (None: not decided yet); else None.
    keras_call: dict | None = None
    # (training) -> {member index: (bucket, plan)} the mode's Keras step
    # functions were last traced with (`first_batch` retraces on a change).
    traced: dict = dataclasses.field(default_factory=dict)
    # Seconds spent timing plans so far.
    seconds: float = 0.0
    # One record per timed group, mode and bucket (`decision_record`).
    decisions: list = dataclasses.field(default_factory=list)
    # What the running fit/evaluate/predict call's timing may cost; None: no limit.
    budget: TuningBudget | None = None
    # The share of a call's time its timing may take; None: no limit.
    fit_share: float | None = FIT_SHARE
    # training -> the train_on_batch / test_on_batch / predict_on_batch calls
    # of that mode so far: a loop of them pays for timing as a fit of as
    # many steps would (`first_batch.batch_call`).
    batch_calls: dict = dataclasses.field(default_factory=dict)
    # training -> ((input shape, decisions made), keras_call) of the last
    # batch call planned (`first_batch.batch_call` reuses it).
    batch_memo: dict = dataclasses.field(default_factory=dict)
    # Race the candidates on a fit's own first steps instead of timing them
    # apart (`rnnfuse.tuning.online`); off by default.
    online: bool = False
    # While a fit prepares its online races: {member index: PendingRace};
    # the fit's OnlineFit while they run.
    online_pending: dict = dataclasses.field(default_factory=dict)
    online_fit: object = None
    # For tests: the online race's step timer ((name, run) -> (logs, s)).
    measure_step: Callable | None = None
    # For tests: tune_plans' measure / check_gradients / environment.
    measure: Callable | None = None
    check_gradients: Callable | None = None
    environment: dict | None = None

    def plans_of(self, index: int) -> list[Plan]:
        """Every plan decided for member `index` (any mode and bucket)."""
        return [r.plan for (i, *_), r in self.decided.items() if i == index]


def bucket_of(batch: int, steps: int) -> tuple[int, int]:
    """The (batch, steps) bucket: each rounded to the nearest power of two
    (in log scale; at least 1)."""
    return (_power_of_two(batch), _power_of_two(steps))


def _power_of_two(n: int) -> int:
    return 1 << max(0, round(math.log2(max(int(n), 1))))


def untimed(plan: Plan) -> Plan:
    """`plan` as it runs on a shape it was not timed for: a persistent
    algorithm, or a forward-only kernel whose speed depends on the shape,
    runs as cuDNN's standard algorithm (same pieces)."""
    if plan.inference_only:
        return plan.for_training()
    if plan.kernel == "cudnn" and plan.algorithm is not None:
        return Plan(plan.pieces, None, kernel=plan.kernel, whole=plan.whole)
    return plan


def contenders(result: TuneResult, group: FusionGroup, backend_name: str) -> list[Plan]:
    """What a new bucket times after `result` was decided at another: the
    original layers, the plan chosen there and its standard-algorithm twin,
    and every candidate within CONTENTION of the best there."""
    every = {p.name: p for p in candidates_for(backend_name)(group)}
    chosen = result.plan.for_length(len(group.layers))
    out = [PER_LAYER, chosen, untimed(chosen)]
    timings = {n: t for n, t in result.timings.items() if n in every}
    if timings:
        best = min(result.timings.values())
        out += [every[n] for n, t in sorted(timings.items(), key=lambda kv: kv[1]) if t <= CONTENTION * best]
    unique = {}
    for plan in out:
        # A forward-only kernel's plan is added by the tuner itself where the
        # kernel takes the new shape (`kernel_plans`); here its cuDNN twin.
        plan = plan.for_training() if plan.inference_only else plan
        unique.setdefault(plan.name, plan)
    return list(unique.values())


def decide(state: AutoTune, environment: dict, shapes: dict, training: bool, *,
           jit_baseline: bool = False, progress: bool = True, lookup_only: bool = False) -> dict:
    """member index -> the TuneResult for its shape in `shapes`, or None where
    timing failed (the module doc's rule 1)."""
    out, todo, narrowed = {}, {}, {}
    for i, shape in shapes.items():
        member = state.members[i]
        key = decision_key(i, training, shape, jit_baseline)
        if key in state.decided:
            out[i] = state.decided[key]
            continue
        hit = _cached_in_bucket(state.cache, environment, member, shape, training, jit_baseline)
        if hit is not None:
            state.decided[key] = out[i] = hit
            continue
        todo[i] = shape
        nearest = _nearest_decided(state, i, training, key[2])
        if nearest is not None:
            narrowed[id(member.group)] = (
                contenders(nearest[1], member.group, environment.get("backend", "tensorflow")),
                nearest[0],
            )
    if not todo or lookup_only:
        return out
    budget = state.budget
    backend_name = environment.get("backend", "tensorflow")
    if budget is not None and not budget.times_anything(default_warmup(backend_name), REPEATS):
        # Too short a call to earn its timing back: the static table's
        # proven plan, not kept as a decision (a longer call times it).
        why = budget.why_static(default_warmup(backend_name), REPEATS)
        for i, shape in todo.items():
            group = state.members[i].group
            out[i] = result = TuneResult(
                group, static_plan(group, group.dtype, training, proven_only=True, shape=shape), why)
            record = decision_record(result, shape, training, jit_baseline)
            if not _noted_static(state.decisions, record):
                state.decisions.append(record)
        return out
    groups = [state.members[i].group for i in todo]
    shape_of = {id(state.members[i].group): shape for i, shape in todo.items()}
    masked = {id(state.members[i].group): state.members[i].masked for i in todo}
    start = clock.now()
    try:
        results = tune_plans(
            groups,
            lambda g: shape_of[id(g)],
            training=training,
            cache=state.cache,
            measure=state.measure,
            check_gradients=state.check_gradients,
            environment=environment,
            progress=progress,
            jit_baseline=jit_baseline,
            masked_of=lambda g: masked[id(g)],
            candidates_of=lambda g: narrowed.get(id(g), (None,))[0],
            budget=budget,
            repeats=REPEATS,
        )
    except Exception as err:  # noqa: BLE001 - timing must never break the user's step
        logger.warning(
            "rnnfuse: timing the plans failed (%s: %s); the fused layers keep "
            "their plans (a persistent algorithm runs as standard where it was not timed)",
            type(err).__name__,
            err,
        )
        return {**out, **{i: None for i in todo}}
    seconds = clock.now() - start
    state.seconds += seconds
    for (i, shape), result in zip(todo.items(), results):
        if result.source == "measured" and id(result.group) in narrowed:
            near = narrowed[id(result.group)][1]
            result = dataclasses.replace(result, source=f"measured: the contenders of bucket {near}")
        state.decided[decision_key(i, training, shape, jit_baseline)] = out[i] = result
        _log(result, shape, training, seconds)
        state.decisions.append(decision_record(result, shape, training, jit_baseline))
    return out


def _noted_static(records: list, record: dict) -> bool:
    """Whether the last record of `record`'s group, mode and bucket is already
    a static one for the same plan (a loop of short calls notes it once)."""
    for earlier in reversed(records):
        if (earlier["layers"], earlier["mode"], earlier["bucket"]) == (
                record["layers"], record["mode"], record["bucket"]):
            return (earlier["source"].startswith("static: a call of")
                    and earlier["chosen"] == record["chosen"])
    return False


def decision_key(index: int, training: bool, shape: tuple, xla_baseline: bool) -> tuple:
    """The key of one decision in `AutoTune.decided`: member, mode, bucket,
    and whether the original layers were timed XLA-compiled.

    >>> decision_key(0, True, (48, 200, 8), True)
    (0, True, (64, 256), True)
    """
    return (index, bool(training), bucket_of(shape[0], shape[1]), bool(xla_baseline))


def _cached_in_bucket(cache, environment, member, shape, training,
                      xla_baseline=False) -> TuneResult | None:
    """A cached decision for `shape`, else for another shape of its bucket, as a TuneResult."""
    if cache is None:
        return None
    group = member.group
    key = cache_key(environment, group, shape, group.dtype, training, member.masked, xla_baseline)
    entry = cache.get(key)
    if entry is None:
        bucket = bucket_of(shape[0], shape[1])
        entry = next(
            (e for other, e in cache.entries()
             if key.other_shape(other) and len(other.shape) >= 2
             and bucket_of(other.shape[0], other.shape[1]) == bucket),
            None,
        )
    if entry is None:
        return None
    try:
        plan = Plan.from_dict(entry["plan"])
        plan.for_length(len(group.layers))
    except (KeyError, TypeError, ValueError):
        return None  # tune_plans sets a bad exact entry aside and times it
    return TuneResult(group, plan, "cache", dict(entry.get("timings", {})))


def _nearest_decided(state: AutoTune, index: int, training: bool, bucket) -> tuple | None:
    """(bucket, TuneResult) of the nearest decided bucket of this member and
    mode (distance |log batch ratio| + |log steps ratio|), or None."""
    best, best_distance = None, math.inf
    for (i, mode, other, _), result in state.decided.items():
        if i != index or mode != training or result is None:
            continue
        distance = abs(math.log(other[0] / bucket[0])) + abs(math.log(other[1] / bucket[1]))
        if distance < best_distance:
            best, best_distance = (other, result), distance
    return best


class Planner:
    """A FusedRNN's `planner`: the plan of each call, asked with the call's
    input shape and mode (the module doc's rule). Set by
    `rnnfuse.tuning.first_batch.attach`; not saved with the model."""

    def __init__(self, state: AutoTune, index: int):
        self.state, self.index = state, index

    def plans(self) -> list[Plan]:
        """Every plan this layer may run (its own and every decided one)."""
        return [self.state.members[self.index].fused.plan] + self.state.plans_of(self.index)

    def keeps_original(self, shape: tuple, training: bool) -> bool:
        """Whether the call's plan is already decided and keeps the original
        layers, looked up only (nothing timed or recorded), so such a call can
        skip its FusedRNN's own call; False wherever `__call__` may time.

        >>> from rnnfuse.plan import PER_LAYER
        >>> state = AutoTune(cache=None, members=[None])
        >>> state.decided[decision_key(0, True, (32, 100), False)] = TuneResult(None, PER_LAYER, "cache")
        >>> Planner(state, 0).keeps_original((30, 110, 8), True), Planner(state, 0).keeps_original((30, 110, 8), False)
        (True, False)
        """
        state, i = self.state, self.index
        call = state.keras_call
        if call is not None and (i, training) in call:
            entry = call[(i, training)]
            # Another bucket runs `untimed(plan)`: the original layers too.
            return entry is not None and entry[1].per_layer
        if len(shape) < 2 or shape[0] is None or shape[1] is None or _symbolic():
            return False
        result = state.decided.get(decision_key(i, training, shape, _xla_baseline()))
        return result is not None and result.plan.per_layer

    def __call__(self, shape: tuple, training: bool) -> Plan | None:
        state, i = self.state, self.index
        member = state.members[i]
        from keras.src import backend as keras_backend

        if keras_backend.in_symbolic_scope():
            return None  # shapes only (Keras building a model): the layer's own plan
        # A stateless trace (JAX's steps, a user's `stateless_call` under
        # jax.jit) cannot time, but runs what its mode and bucket decided.
        stateless = keras_backend.in_stateless_scope()
        batch = shape[0] if len(shape) > 0 else None
        steps = shape[1] if len(shape) > 1 else None
        bucket = None if batch is None or steps is None else bucket_of(batch, steps)
        call = state.keras_call
        if call is not None and (i, training) in call and call[(i, training)] is not None:
            # Inside fit/evaluate/predict: the call's plan (rule 3).
            decided_bucket, plan = call[(i, training)]
            return plan if bucket in (None, decided_bucket) else untimed(plan)
        if bucket is not None:
            xla = _xla_baseline()
            result = state.decided.get(decision_key(i, training, shape, xla))
            if result is None and not stateless:
                result = self._time_now(shape, training, xla)
            if result is not None:
                if call is not None and (i, training) in call:
                    call[(i, training)] = (bucket, result.plan)  # the call's first batch
                return result.plan
        if stateless:
            return None  # nothing decided for it: the layer's own plan
        # Not timed and no timing possible: the static table's proven rules (rule 2).
        return static_plan(member.group, member.group.dtype, training, proven_only=True,
                           shape=tuple(shape))

    def _time_now(self, shape: tuple, training: bool, xla: bool) -> TuneResult | None:
        """The plan timed for `shape` now, from inside the caller's call or
        trace, or None where nothing can be timed here."""
        state = self.state
        environment = state.environment if state.environment is not None else device_environment()
        if not _is_accelerator(environment):
            return None
        context = get_timing().timing_context()
        if context is None:
            return None
        member = state.members[self.index]
        features = shape[2] if len(shape) > 2 and shape[2] is not None else member.group.input_size
        full = (int(shape[0]), int(shape[1]), int(features or 1))
        with context, _apart_from_the_callers_call(member.group):
            return decide(state, environment, {self.index: full}, training, jit_baseline=xla,
                          progress=False).get(self.index)


def _xla_baseline() -> bool:
    """Whether a call outside fit/evaluate/predict runs its original layers
    XLA-compiled (traced under jit_compile=True): the baseline its decision
    is keyed by (rule 4). A user's XLA-compiled step thus reuses what a
    `fit` that Keras XLA-compiles decided; an eager call or a plain
    `tf.function` runs the original layers without XLA, a baseline of its
    own, so where `fit`'s was XLA-compiled that shape is decided apart."""
    return get_backend().in_xla_context()


def _is_accelerator(environment: dict | None) -> bool:
    """Whether `environment` names a device to time on (not a CPU)."""
    if environment is None:
        return False
    device = str(environment.get("device", "")).lower()
    return bool(device) and not device.startswith("cpu")


def _symbolic() -> bool:
    """Whether Keras is tracing shapes only (a functional model being built,
    `compute_output_spec`) or statelessly (JAX's traced steps)."""
    from keras.src import backend as keras_backend

    return keras_backend.in_symbolic_scope() or keras_backend.in_stateless_scope()


@contextlib.contextmanager
def _apart_from_the_callers_call(group: FusionGroup):
    """Runs the tuner's steps outside the Keras call that asked, clearing the
    losses they add, so the caller's `model.losses` holds only its own."""
    from keras.src.backend.common import global_state

    outer = global_state.get_global_attribute("current_call_ctx")
    global_state.set_global_attribute("current_call_ctx", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("current_call_ctx", outer)
        for view in group.views:
            view.layer._clear_losses()


def decision_record(result: TuneResult, shape: tuple, training: bool,
                    xla_baseline: bool = False) -> dict:
    """A JSON-ready record of one group's decision: layers, mode, input,
    bucket, dtype, xla_baseline, source, chosen, timings_ms, rejected, static."""
    group = result.group
    return dict(
        layers=list(group.layers),
        mode="training" if training else "inference",
        input=list(shape),
        bucket=list(bucket_of(shape[0], shape[1])),
        dtype=str(group.dtype),
        xla_baseline=bool(xla_baseline),
        source=result.source,
        chosen=result.plan.name,
        timings_ms={name: 1e3 * s for name, s in result.timings.items()},
        rejected=dict(result.rejected),
        static=static_plan(group, group.dtype, training, shape=shape).name,
    )


def _log(result: TuneResult, shape: tuple, training: bool, seconds: float) -> None:
    group = result.group
    timings = ", ".join(
        f"{name} {1e3 * s:.2f} ms" for name, s in sorted(result.timings.items(), key=lambda kv: kv[1])
    )
    logger.info(
        "rnnfuse: %s for %s %s (input %s): %s%s; chose %s (%.1f s)",
        "tuned" if result.source.startswith("measured") else f"plan from {result.source}",
        " -> ".join(group.layers),
        "training" if training else "inference",
        shape,
        timings or "no timings",
        f"; rejected {result.rejected}" if result.rejected else "",
        result.plan.name,
        seconds,
    )
