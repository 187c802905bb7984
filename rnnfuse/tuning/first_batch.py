"""First-batch tuning: each group's plan chosen on the real batch shape.

With ``tune="auto"`` (the default), an optimized model's `fit`,
`evaluate` and `predict` look at the first batch before any step runs
(`keras_call`): on a GPU each `FusedRNN`'s plan is decided for that
batch's bucket (`rnnfuse.tuning.per_shape`) within what the call can pay
for (`rnnfuse.tuning.budget`), and the layers switch before Keras traces
its step; an INFO line says what was chosen. Without a GPU the static
table decides.

>>> import keras, numpy as np, rnnfuse
>>> fast = rnnfuse.optimize(keras.Sequential([keras.Input((10, 4)), keras.layers.GRU(8)]))
>>> prepare(fast, np.zeros((2, 10, 4), "float32"), None, training=False)
[]
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
from typing import Any

import keras

from rnnfuse.backends import get_backend
from rnnfuse.fused import FusedRNN, fused_layers
from rnnfuse.plan import PER_LAYER, Plan
from rnnfuse.tuning.budget import TuningBudget
from rnnfuse.tuning.cache import cache_key
from rnnfuse.tuning.online import OnlineFit
from rnnfuse.tuning.per_shape import (
    REPEATS,
    AutoTune,
    Member,
    PendingRace,
    Planner,
    bucket_of,
    decide,
    decision_key,
    decision_record,
    untimed,
)
from rnnfuse.tuning.table import static_plan
from rnnfuse.tuning.tuner import (
    GradientCheck,
    TuneResult,
    candidates_for,
    default_warmup,
    device_environment,
    plans_worth_timing,
    sound_gradients,
)

__all__ = [
    "attach",
    "batch_call",
    "can_time_here",
    "decisions",
    "first_batch_shape",
    "keras_call",
    "mode_jit_compile",
    "online_train_function",
    "prepare",
]

logger = logging.getLogger("rnnfuse")


def can_time_here(environment: dict | None = None) -> bool:
    """Whether first-batch tuning has an accelerator to time on here (not on
    a CPU, though torch's fused call runs there)."""
    environment = environment if environment is not None else device_environment()
    if environment is None:
        return False
    device = str(environment.get("device", "")).lower()
    return bool(device) and not device.startswith("cpu")


def attach(model: keras.Model, groups, state: AutoTune) -> keras.Model:
    """Marks an optimized `model` for first-batch tuning: each FusedRNN gets
    the `per_shape.Planner` of the group it runs."""
    by_first = {id(g.views[0].layer): g for g in groups}
    state.members = [
        Member(f, by_first[id(f.fused_layers[0])], masked=receives_mask(f), steps=_static_steps(f))
        for f in fused_layers(model)
        if id(f.fused_layers[0]) in by_first
    ]
    for i, member in enumerate(state.members):
        object.__setattr__(member.fused, "planner", Planner(state, i))
    object.__setattr__(model, "_rnnfuse_autotune", state)
    return model


@contextlib.contextmanager
def keras_call(model: keras.Model, x: Any, batch_size: int | None, *, training: bool,
               steps: int | None = None, online: bool = True):
    """Around one `fit`, `evaluate` or `predict`: the plans decided for the
    call's first batch, held for the whole call, with timing held to what
    `steps` can pay for (a call inside another spends the outer budget);
    `online`: a training call may race its candidates on its own steps."""
    state = getattr(model, "_rnnfuse_autotune", None)
    if state is None or not state.members:
        yield
        return
    outer, outer_budget = state.keras_call, state.budget
    state.batch_memo.clear()  # this call may trace other plans
    if outer_budget is None and steps is not None and state.fit_share is not None:
        state.budget = TuningBudget(steps=int(steps), share=state.fit_share)
    try:
        chosen = _prepare(model, state, x, batch_size, training, online=online)
        state.keras_call = {**(outer or {}), **chosen}
        yield
    finally:
        if state.online_fit is not None and outer is None:
            state.online_fit.finish()  # a fit that ended before its race did
            state.online_fit = None
            release_algorithm_inputs(state)
        state.online_pending = {} if outer is None else state.online_pending
        state.keras_call, state.budget = outer, outer_budget


@contextlib.contextmanager
def batch_call(model: keras.Model, x: Any, *, training: bool):
    """Around one `train_on_batch`, `test_on_batch` or `predict_on_batch`:
    a call of as many steps as the mode's batch calls so far. So the first
    calls of a loop run the plan a `fit` that short runs (the static table's
    proven plan, where nothing is decided); once the loop is as long as a
    call that can pay for timing, its next step is planned as any call of
    unknown length (`per_shape.Planner`: timed in full where undecided).

    >>> import keras, numpy as np, rnnfuse
    >>> fast = rnnfuse.optimize(keras.Sequential([
    ...     keras.Input((10, 4)), keras.layers.GRU(8, return_sequences=True), keras.layers.GRU(8)]))
    >>> with batch_call(fast, np.zeros((2, 10, 4), "float32"), training=False):
    ...     pass  # no GPU here: nothing to plan, the call runs as Keras' own
    """
    state = getattr(model, "_rnnfuse_autotune", None)
    if state is None or not state.members or state.keras_call is not None or state.fit_share is None:
        yield
        return
    calls = state.batch_calls[training] = state.batch_calls.get(training, 0) + 1
    enough = _paying_calls(get_backend().name, state.fit_share)
    if calls >= enough:
        if calls == enough:
            _retrace(model, state, training)  # the traces holding the short calls' plans
            state.traced.pop(training, None)
        yield
        return
    shape = getattr(_first_input(x), "shape", None)
    rows = int(shape[0]) if shape is not None and len(shape) and shape[0] is not None else None
    # A loop's next batch of the shape planned last, with nothing decided
    # since: the same plans, without planning again (microseconds a call).
    memo_key = (None if shape is None else tuple(shape), len(state.decided))
    memo = state.batch_memo.get(training)
    if memo is not None and memo[0] == memo_key:
        state.keras_call = memo[1]
        try:
            yield
        finally:
            state.keras_call = None
        return
    with keras_call(model, x, rows, training=training, steps=calls, online=False):
        state.batch_memo[training] = (memo_key, dict(state.keras_call))
        yield


@functools.lru_cache(maxsize=None)  # memo: asked on every batch call
def _paying_calls(backend_name: str, share: float) -> int:
    """The fewest steps a call needs to pay for timing (`TuningBudget.min_steps`)."""
    return TuningBudget(steps=0, share=share).min_steps(default_warmup(backend_name), REPEATS)


def prepare(model: keras.Model, x: Any, batch_size: int | None, *, training: bool) -> list[TuneResult]:
    """Chooses each FusedRNN's plan for the first batch of `x`; returns the
    decisions timed or looked up (empty where there were none)."""
    state = getattr(model, "_rnnfuse_autotune", None)
    if state is None or not state.members:
        return []
    chosen = _prepare(model, state, x, batch_size, training)
    jit = _keras_would_jit(model, state)
    found = (
        state.decided.get((i, mode, entry[0], jit))
        for (i, mode), entry in chosen.items() if entry is not None
    )
    return [r for r in found if r is not None]


def _prepare(model, state: AutoTune, x, batch_size, training, online: bool = True) -> dict:
    """The decisions for the first batch of `x`, applied: (member, training)
    -> (bucket, plan), or None where the first batch cannot be known."""
    undecided = {(i, training): None for i in range(len(state.members))}
    environment = state.environment if state.environment is not None else device_environment()
    if environment is None:
        return undecided
    shape = first_batch_shape(x, batch_size)
    if shape is None:
        logger.info(
            "rnnfuse: the first batch's shape cannot be read without consuming "
            "the data; the fused layers decide when their step is traced"
        )
        if state.traced.pop(training, None) is not None:
            # The mode's step was traced for decided plans (perhaps with
            # XLA, `mode_jit_compile`): traced again, for plans decided then.
            _retrace(model, state, training)
        return undecided
    shapes = {i: _member_shape(m, shape) for i, m in enumerate(state.members)}
    jit = _keras_would_jit(model, state)
    online = online and not _torch_compiled_step(model)
    results = _online_races(state, environment, shapes, training, jit) if online else None
    if results is None:
        results = decide(state, environment, shapes, training, jit_baseline=jit)
    chosen, changed = {}, False
    for i, member in enumerate(state.members):
        bucket = bucket_of(shapes[i][0], shapes[i][1])
        result = results.get(i)
        plan = (result.plan if result else static_plan(
            member.group, member.group.dtype, training, proven_only=True, shape=shapes[i])
        ).for_length(len(member.fused.fused_layers))
        chosen[(i, training)] = (bucket, plan)
        if plan != member.fused.plan:
            member.fused.set_plan(plan)
            changed = True
    traced = state.traced.get(training)
    now = {i: entry for (i, _), entry in chosen.items()}
    if changed or traced is None or _traces_differ(traced, now):
        _retrace(model, state, training)
    state.traced[training] = now
    return chosen


def _online_races(state: AutoTune, environment: dict, shapes: dict, training: bool,
                  jit: bool) -> dict | None:
    """With online tuning on, for a training call: the decided results, the
    other members set to race on the fit's own steps; None where the call is
    timed apart (online off, inference, JAX, nothing to race, too short)."""
    backend = environment.get("backend", "tensorflow")
    if not (state.online and training and backend in ("tensorflow", "torch")):
        return None
    results = decide(state, environment, shapes, training, jit_baseline=jit, lookup_only=True)
    every = candidates_for(backend)
    pending = {}
    for i, shape in shapes.items():
        if i in results:
            continue
        member = state.members[i]
        # As the offline tuner's: its kernels' plans (the wavefront) included.
        plans, refused = plans_worth_timing(member.group, shape, member.group.dtype,
                                            member.masked, True, backend, every(member.group))
        pending[i] = PendingRace(bucket_of(shape[0], shape[1]), shape,
                                 {p.name: p for p in plans}, jit, refused)
    if not pending:
        return None
    race_steps = sum(len(race.plans) for race in pending.values()) * (
        1 + default_warmup(backend) + REPEATS)
    budget = state.budget
    if budget is not None and (budget.steps < race_steps
                               or not budget.times_anything(default_warmup(backend), REPEATS)):
        return None  # the budgeted offline timing (or the static table) decides
    state.online_pending = pending
    for i in pending:
        group = state.members[i].group
        results[i] = TuneResult(group, PER_LAYER, "online: racing on the fit's own steps")
    return results


def online_train_function(model: keras.Model, make) -> Any:
    """The fit's step function while online races are pending (an
    `online.OnlineFit` over `make`); None where none is."""
    state = getattr(model, "_rnnfuse_autotune", None)
    if state is None or not state.online_pending or state.online_fit is not None:
        return None
    environment = state.environment if state.environment is not None else device_environment()
    pending, state.online_pending = state.online_pending, {}
    races = [(i, race.bucket, race.shape, race.plans) for i, race in pending.items()]
    check_gradients = state.check_gradients or GradientCheck()
    inputs = _algorithm_inputs(model, state, races)

    def trace_key(index, plan):
        if index not in inputs:
            return plan.name
        return _shared_trace(plan.for_length(len(state.members[index].fused.fused_layers)))

    def apply(index, bucket, plan):
        member = state.members[index]
        plan = plan.for_length(len(member.fused.fused_layers))
        member.fused.set_plan(plan)
        if index in inputs:
            object.__setattr__(member.fused, "algorithm_input", inputs[index])
            inputs[index].set(plan.cudnn_algorithm, member.fused.compute_dtype)
        if state.keras_call is not None:
            state.keras_call[(index, True)] = (bucket, plan)
        state.traced.setdefault(True, {})[index] = (bucket, plan)

    def check(index, plan):
        if not (plan.algorithm or plan.inference_only):
            return True
        member = state.members[index]
        shape, dtype = pending[index].shape, member.group.dtype
        error = check_gradients(member.group, plan, shape, dtype)
        return sound_gradients(
            error, lambda: check_gradients(member.group, Plan(plan.pieces), shape, dtype), dtype)

    def record(index, shape, result, cost):
        state.seconds += cost["overhead_s"] + cost["check_s"]  # as timing's seconds count
        member = state.members[index]
        # Committed: the steps traced from now take the plan's algorithm as a
        # constant (those traced in the race keep reading the winner's value).
        object.__setattr__(member.fused, "algorithm_input", None)
        # The record says why a plan did not race, as the offline tuner's does.
        result = dataclasses.replace(result, group=member.group,
                                     rejected={**pending[index].refused, **result.rejected})
        jit = pending[index].xla_baseline
        state.decided[decision_key(index, True, shape, jit)] = result
        state.decisions.append({**decision_record(result, shape, True, jit), "race": _rounded(cost)})
        # As the offline tuner's: a decision the budget cut short is not cached.
        if state.cache is not None and environment is not None and not cost["cut"]:
            key = cache_key(environment, member.group, shape, member.group.dtype, True,
                            member.masked, jit)
            state.cache.put(key, {"plan": result.plan.to_dict(), "timings": result.timings,
                                  "rejected": result.rejected,
                                  "when": datetime.datetime.now(datetime.timezone.utc).isoformat()})

    def install(function):
        model.train_function = function

    state.online_fit = OnlineFit(
        races, make=make, apply=apply, record=record, check=check, install=install,
        measure_step=state.measure_step, trace_key=trace_key,
        budget=state.budget,
        warmup=default_warmup(environment.get("backend", "tensorflow")), repeats=REPEATS)
    return state.online_fit


def _rounded(cost: dict) -> dict:
    """The online race's cost for its record, in milliseconds where seconds.

    >>> _rounded({"steps": 9, "check_s": 0.01234, "first_s": {"fused": 0.5}})
    {'steps': 9, 'check_ms': 12.3, 'first_ms': {'fused': 500.0}}
    """
    out = {}
    for name, value in cost.items():
        if name.endswith("_s"):
            name = name[:-2] + "_ms"
            value = ({k: round(1e3 * v, 1) for k, v in value.items()} if isinstance(value, dict)
                     else round(1e3 * value, 1))
        out[name] = value
    return out


def _shared_trace(plan: Plan):
    """What a training step traced for `plan` depends on where its cuDNN
    algorithm is a runtime input: the plan, but the algorithm."""
    if plan.kernel != "cudnn" or plan.per_layer:
        return plan.name
    return dataclasses.replace(plan, algorithm=None)


def _algorithm_inputs(model: keras.Model, state: AutoTune, races) -> dict:
    """{member index: `Backend.algorithm_input()`} for the races whose
    candidates include plans that differ only in cuDNN's algorithm, where the
    backend takes it at run time: those plans then share one traced step."""
    if getattr(model, "_distribute_strategy", None) is not None:
        return {}
    inputs = {}
    for index, _, _, plans in races:
        n = len(state.members[index].fused.fused_layers)
        keys = [_shared_trace(p.for_length(n)) for p in plans.values()]
        if len(set(keys)) < len(keys):
            holder = get_backend().algorithm_input()
            if holder is None:
                return {}
            inputs[index] = holder
    return inputs


def release_algorithm_inputs(state: AutoTune) -> None:
    """Detaches every member's runtime algorithm (a race over or cut short):
    later traces take their plans' algorithms as constants."""
    for member in state.members:
        object.__setattr__(member.fused, "algorithm_input", None)


def _traces_differ(before: dict, now: dict) -> bool:
    """Whether a step traced for `before` would run another plan than `now`
    asks (a persistent plan in another bucket runs `untimed`)."""
    for i, (bucket, plan) in now.items():
        old_bucket, old_plan = before.get(i, (None, None))
        if old_plan != plan or (old_bucket != bucket and untimed(plan) != plan):
            return True
    return False


def first_batch_shape(x: Any, batch_size: int | None) -> tuple[int, ...] | None:
    """(batch, time, ...) of the first batch `fit`/`predict` will draw from
    `x`; None where it cannot be known without consuming the data."""
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


def _static_steps(fused: FusedRNN) -> int | None:
    """The time steps of `fused`'s input in its model, where static."""
    try:
        steps = fused.input.shape[1]
    except (AttributeError, ValueError, IndexError, TypeError):
        return None
    return None if steps is None else int(steps)


def _member_shape(member: Member, batch_shape: tuple) -> tuple:
    """(batch, steps, features) of a member's input for the model's first batch."""
    steps = member.steps if member.steps is not None else batch_shape[1]
    return (int(batch_shape[0]), int(steps), int(member.group.input_size or 1))


def receives_mask(fused: FusedRNN) -> bool:
    """Whether `fused` is called with a padding mask in its model."""
    from rnnfuse.recurrent import called_with_mask

    return called_with_mask(fused)


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


def _torch_compiled_step(model: keras.Model) -> bool:
    """Whether Keras torch.compiles the steps: not raced (a recompile a plan; dynamo's limit)."""
    return get_backend().name == "torch" and getattr(model, "_jit_compile", None) is True


@contextlib.contextmanager
def mode_jit_compile(model: keras.Model, *, training: bool):
    """Around Keras making one mode's step function: `jit_compile` as Keras'
    "auto" resolves it for the plans that mode runs. Keras has one setting
    for all modes and a fused cuDNN plan turns it off; where a mode runs only
    original layers, it is XLA-compiled as the original model would be.

    >>> import keras, rnnfuse
    >>> fast = rnnfuse.optimize(keras.Sequential([keras.Input((4, 2)), keras.layers.SimpleRNN(3)]))
    >>> with mode_jit_compile(fast, training=False):
    ...     pass  # no GPU here: Keras' own value, untouched
    """
    jit = _mode_jit(model, training)
    if jit is None:
        yield
        return
    saved = model._jit_compile
    model._jit_compile = jit
    try:
        yield
    finally:
        model._jit_compile = saved


def _mode_jit(model: keras.Model, training: bool) -> bool | None:
    """True where the mode's step may be XLA-compiled though the model's
    other mode runs a fused kernel XLA cannot compile; None: Keras' value."""
    state = getattr(model, "_rnnfuse_autotune", None)
    if state is None or not getattr(model, "compiled", False):
        return None
    blocking = [f for f in fused_layers(model) if f.fused_call_blocks_xla]
    if not blocking or getattr(model, "_distribute_strategy", None) is not None:
        return None
    if not _keras_would_jit(model, state):
        return None
    runs = {id(m.fused): i for i, m in enumerate(state.members)}
    call = state.keras_call or {}
    for fused in blocking:
        index = runs.get(id(fused))
        if index is not None and (index, training) in call:
            entry = call[(index, training)]
            if entry is None:
                return None  # decided when the step is traced: it may fuse
        else:
            entry = state.traced.get(training, {}).get(index)
        plan = entry[1] if entry is not None else fused.plan
        if not plan.per_layer:
            return None
    return True


def _retrace(model: keras.Model, state: AutoTune, training: bool) -> None:
    """Drops Keras' traced step functions of one mode so the next step runs the new plans."""
    names = ("train_function",) if training else ("test_function", "predict_function")
    for name in names:
        if getattr(model, name, None) is not None:
            setattr(model, name, None)
    if state.jit_auto and getattr(model, "compiled", False):
        # Keras resolved jit_compile="auto" at compile(); plans that keep
        # the original layers may give the model its XLA back.
        model.jit_compile = model._resolve_auto_jit_compile()


def decisions(model: keras.Model) -> list[dict]:
    """What first-batch tuning measured and chose for `model` so far, one
    `per_shape.decision_record` per group, mode and bucket.

    >>> import keras
    >>> decisions(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    []
    """
    state = getattr(model, "_rnnfuse_autotune", None)
    return list(state.decisions) if state is not None else []
