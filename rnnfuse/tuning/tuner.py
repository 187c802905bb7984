"""Choose each group's plan by timing the candidates on this device.

`tune_plans(groups, shape_of, ...)`, per group: look the decision up in
the plan cache; else build one step (a forward, or forward + backward,
pass of the group alone on a random batch) per candidate plan
(`candidate_plans`), call each once untimed (a step cuDNN refuses is left
out with its message), time them interleaved with racing
(`interleaved_medians`) in two stages (`_time_in_stages`), keep the
fastest plan whose gradients pass the float64 check
(`gradient_tolerance`) unless the original layers come within
KEEP_ORIGINAL_MARGIN of it, and cache the decision. Under TensorFlow
without a GPU the static rule table decides. The timer and the gradient
check are parameters, so tests run this logic on a fake clock.

Example (no GPU: the static table answers):
    >>> import keras
    >>> from rnnfuse.passes import build_layer_graph, plan_fusion
    >>> m = keras.Sequential([keras.Input((10, 4)),
    ...     keras.layers.GRU(8, return_sequences=True), keras.layers.GRU(8)])
    >>> groups = plan_fusion(build_layer_graph(m), model_name=m.name).groups
    >>> [r.source for r in tune_plans(groups, lambda g: (2, 10, 4), progress=False)]
    ['static: no GPU to time on']
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import os
from typing import Callable, Sequence

import keras
import numpy as np

from rnnfuse.backends import get_backend, get_timing
from rnnfuse.report import FusionGroup
from rnnfuse.tuning.budget import TuningBudget
from rnnfuse.tuning.cache import PlanCache, cache_key
from rnnfuse.tuning.clock import Clock, current_clock
from rnnfuse.plan import PER_LAYER, Plan
from rnnfuse.tuning.plans import (candidate_plans, dynamic_reason, kernel_plans, persistent_reason,
                                  split_groups, whole_run_twins)
from rnnfuse.tuning.table import static_plan
from rnnfuse.tuning.timing import interleaved_medians

__all__ = ["TuneResult", "candidates_for", "default_warmup", "device_environment",
           "plans_worth_timing", "tune_plans"]

# A non-default algorithm's gradients may be this many times further from float64 than the default's.
GRADIENT_SLACK = 2.0
# ... or this many units of the dtype's rounding: in float16 every algorithm
# is ~1e-3 from float64, so the factor alone would reject on noise.
ROUNDING_UNITS = 4.0
_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
# A candidate this many times slower than the best stops being timed.
PRUNE = 1.5
# From the third round, one whose fastest call is this many times the best
# median cannot win; the original layers, the baseline, are never raced.
RACE = 1.2

# An eager first call (torch) over PRUNE**2 x the fastest and this many
# seconds is the step's time: a second call of Keras' masked loop only loses.
FIRST_CALL_PRUNE_S = 1.0
# The original layers' full-length first call is skipped where first calls
# on PROBE_STEPS and twice as many extrapolate to a clearly slow one.
PROBE_STEPS = 16
PROBE_MIN_STEPS = 8 * PROBE_STEPS
# The original layers stay unless a plan beats them by this share: smaller
# wins on the tuner's clock did not hold through `fit`.
KEEP_ORIGINAL_MARGIN = 0.10
# At most this many steps compile at once (`_first_calls`; XLA frees the GIL).
COMPILE_THREADS = min(8, os.cpu_count() or 1)


def gradient_tolerance(default_error: float, dtype: str) -> float:
    """The largest gradient error (vs float64) a non-default algorithm may
    have: GRADIENT_SLACK x the default algorithm's, or ROUNDING_UNITS units
    of `dtype`'s rounding, whichever is larger.

        >>> gradient_tolerance(1e-5, "float32") == 2e-5 + 1e-7
        True
    """
    return max(GRADIENT_SLACK * default_error + 1e-7, rounding_floor(dtype))


def sound_gradients(error: float, twin_error: Callable[[], float], dtype: str) -> bool:
    """Whether gradient `error` passes against the twin's, asked for only above
    `rounding_floor`: `sound_gradients(1e-3, lambda: 1 / 0, "float16")` is True."""
    return error <= rounding_floor(dtype) or error <= gradient_tolerance(twin_error(), dtype)


def rounding_floor(dtype: str) -> float:
    """ROUNDING_UNITS units of `dtype`'s rounding (0 for float32).

        >>> rounding_floor("float16"), rounding_floor("float32")
        (0.00390625, 0.0)
    """
    return ROUNDING_UNITS * _EPS.get(str(dtype), 0.0)


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """The plan chosen for one group and how it was chosen."""

    group: FusionGroup
    plan: Plan
    # "cache", "measured", or "static: <why>".
    source: str
    # Candidate name -> median seconds per step (empty unless measured).
    timings: dict = dataclasses.field(default_factory=dict)
    # Candidates dropped before timing, name -> why.
    rejected: dict = dataclasses.field(default_factory=dict)


def device_environment() -> dict | None:
    """Device and library versions, or None when nothing can be timed (no
    fused kernel for this backend, or TensorFlow without a GPU)."""
    backend = get_backend()
    if not backend.capabilities.fused_kernel or not backend.is_available():
        return None
    from rnnfuse._version import __version__

    env = {"backend": backend.name, "rnnfuse": __version__}
    env.update(get_timing().device_environment())
    return env


def _input_batch(shape: tuple, dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    return keras.ops.convert_to_tensor(rng.standard_normal(shape).astype("float32"), dtype=dtype)


def padding_mask(shape: tuple, seed: int = 0):
    """A right-padded boolean mask (batch, steps): lengths between half the
    steps and all of them, the first row full.

    >>> m = keras.ops.convert_to_numpy(padding_mask((3, 8)))
    >>> m.shape, bool(m[0].all())
    ((3, 8), True)
    """
    rng = np.random.default_rng(seed)
    batch, steps = int(shape[0]), int(shape[1])
    lengths = rng.integers(max(1, steps // 2), steps + 1, size=batch)
    lengths[0] = steps
    return keras.ops.convert_to_tensor(np.arange(steps)[None, :] < lengths[:, None])


def _with_mask(run: Callable, mask) -> Callable:
    """`run` with the padding mask passed to every call (None: `run` itself)."""
    if mask is None:
        return run
    return lambda x, training, **kwargs: run(x, training, mask=mask, **kwargs)


def _runner(group: FusionGroup, plan: Plan, dtype: str | None = None) -> Callable:
    """`run(x, training, mask=None, algorithm=None)` running `group` under
    `plan`. A masked fused call traces what the model's own step traces (its
    fallback branch or Keras' mask assertion), since that is part of what a
    masked step costs; `algorithm` is `Timing.timed_steps`' runtime value."""
    from rnnfuse.fused import FusedRNN, call_members

    if plan.for_length(len(group.layers)).per_layer:
        members = []
        for i, view in enumerate(group.views):
            members.append(view.layer)
            if i < len(group.gap_dropout) and group.gap_dropout[i] is not None:
                members.append(group.gap_dropout[i])

        def per_layer(x, training, mask=None, algorithm=None):
            kwargs = {"training": training}
            if mask is not None:
                kwargs["mask"] = mask
            return call_members(members, x, first=kwargs, rest=kwargs)

        return per_layer
    pieces = [
        FusedRNN(
            [v.layer for v in g.views],
            dropout_layers=list(g.gap_dropout) or None,
            plan=piece_plan,
            **({"dtype": dtype} if dtype else {}),
        )
        for g, piece_plan in split_groups([group], [plan])
    ]

    # An eager call says which algorithm ran, and so does a JAX trace; a
    # TensorFlow trace decides it when its program is built.
    caps = get_backend().capabilities
    known = not caps.first_call_compiles or caps.algorithm_fixed_when_traced

    def fused(x, training, mask=None, algorithm=None):
        kwargs = {"algorithm": algorithm}
        if mask is not None:
            kwargs["mask"] = mask
        for piece in pieces:
            x = piece(x, training=training, **kwargs)
            ran = piece.last_path.kernel
            if piece.plan.inference_only and (ran is None or ran.note):
                # Timing it would time cuDNN under the kernel's name. (A
                # builtin type: a traced step re-raises only those as they are.)
                raise NotImplementedError(
                    f"not timed: the {piece.plan.kernel} kernel did not run "
                    f"({ran.note if ran is not None else piece.last_path})")
            asked = piece.plan.algorithm
            if (known and asked and ran is not None and ran.algorithm not in ("", "runtime")
                    and ran.algorithm != asked):
                # cuDNN refused the candidate's algorithm (the core ran standard).
                raise NotImplementedError(
                    f"not timed: {ran.algorithm} ran for {asked} ({ran.note})")
        return x

    return fused


def _step(group: FusionGroup, run: Callable, x, training: bool, jit: bool = False):
    """A forward (+ backward) step on this backend; `jit` compiles it with XLA
    (the per-layer baseline under Keras' jit_compile="auto")."""
    variables = _group_variables(group)
    if jit:
        return get_timing().timed_step(run, x, variables, training, jit=True)
    return get_timing().timed_step(run, x, variables, training)


def _group_variables(group: FusionGroup) -> list:
    """The trainable variables of a group's layers, in layer order."""
    return [w for v in group.views for w in v.layer.trainable_weights]


def _float64_reference(group: FusionGroup, x, timing) -> list:
    """The reference gradients on float64 copies of the layers, fused (JAX:
    the cuDNN core) or, where that fails, on the copies' own calls."""
    x64 = keras.ops.cast(x, "float64")
    copies, variables = _float64_copies(group, x64)
    try:
        (grads,) = timing.gradients_of([(_fused_on(copies, group), x64, False)], variables)
    except Exception as fused:  # noqa: BLE001 - no fused float64 here: the layers compute it
        try:
            (grads,) = timing.gradients_of([(_on_layers(copies), x64, False)], variables)
        except Exception as exc:
            raise RuntimeError(f"{_first_line(exc)}; fused in float64: {_first_line(fused)}") from exc
    return grads


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def _fused_on(copies: list, group: FusionGroup) -> Callable:
    """`run(x, training)`: `copies` as one fused call in float64, or raising."""
    from rnnfuse.fused import FusedRNN

    piece = FusedRNN(copies, dropout_layers=list(group.gap_dropout) or None,
                     plan=Plan((len(copies),)), dtype="float64")

    def run(x, training, mask=None, algorithm=None):
        y = piece(x, training=training)
        if piece.last_path.kernel is None:
            raise NotImplementedError(f"no fused float64 call here ({piece.last_path})")
        return y

    return run


def _on_layers(copies: list) -> Callable:
    """`run(x, training)`: the copies' own calls, checked to stay float64."""
    from rnnfuse.fused import call_members

    for layer in (inner for c in copies for inner in c._flatten_layers()):
        if hasattr(layer, "use_cudnn"):
            # jaxlib's float64 cuDNN LSTM backward fails XLA's verifier.
            layer.use_cudnn = False

    def run(x, training, mask=None, algorithm=None):
        y = call_members(copies, x, first={"training": training}, rest={"training": training})
        narrowed = {str(t.dtype) for t in keras.tree.flatten(y)} - {"float64"}
        if narrowed:
            raise TypeError(f"the float64 copies computed {sorted(narrowed)}")
        return y

    return run


def _float64_copies(group: FusionGroup, x) -> tuple[list, list]:
    """(copies, variables): `group`'s layers as built float64 copies holding
    their weights now, and their trainable variables in `_group_variables`' order."""
    from rnnfuse.fused import call_members

    copies = [type(v.layer).from_config(_float64_config(v.layer.get_config())) for v in group.views]
    call_members(copies, keras.KerasTensor(tuple(x.shape), "float64"), first={}, rest={})  # builds them
    twin = {}
    for copy, view in zip(copies, group.views):
        copy.set_weights([np.asarray(w, np.float64) for w in view.layer.get_weights()])
        # Paired by position: a copy's trainable flags come from its config.
        twin.update({id(w): c for w, c in zip(view.layer.weights, copy.weights)})
    return copies, [twin[id(w)] for w in _group_variables(group)]


def _float64_config(config):
    """A layer config with every (nested) dtype policy float64.

    >>> _float64_config({"dtype": "mixed_float16", "layer": {"config": {"dtype": "float32"}}})
    {'dtype': 'float64', 'layer': {'config': {'dtype': 'float64'}}}
    """
    if isinstance(config, dict):
        # Zeros, not the initializers: the copies take the layers' weights.
        return {k: "float64" if k == "dtype" else "zeros" if k.endswith("_initializer")
                else _float64_config(v) for k, v in config.items()}
    if isinstance(config, list):
        return [_float64_config(v) for v in config]
    return config


def gradient_error(got: list, reference: list) -> float:
    """Max difference of `got` from `reference` (float64 arrays, in order),
    relative to the reference's largest magnitude.

    >>> import numpy as np
    >>> round(gradient_error([np.array([1.0, 2.1])], [np.array([1.0, 2.0])]), 3)
    0.05
    """
    scale = max(float(np.max(np.abs(r))) for r in reference) or 1.0
    return max(float(np.max(np.abs(g - r))) for g, r in zip(got, reference)) / scale


def _gradient_call(group: FusionGroup, plan: Plan, x) -> tuple:
    """(run, x, training) for `plan`'s gradient check: an inference call (no
    dropout), except on a kernel besides cuDNN, whose own backward only a
    training call reaches."""
    return _runner(group, plan), x, plan.inference_only


def tune_plans(
    groups: Sequence[FusionGroup],
    shape_of: Callable[[FusionGroup], tuple],
    *,
    training: bool = True,
    cache: PlanCache | None = None,
    measure: Callable | None = None,
    check_gradients: Callable | None = None,
    environment: dict | None = None,
    progress: bool = True,
    warmup: int | None = None,
    repeats: int = 5,
    jit_baseline: bool = False,
    masked_of: Callable[[FusionGroup], bool] | None = None,
    candidates_of: Callable[[FusionGroup], Sequence[Plan] | None] | None = None,
    budget: TuningBudget | None = None,
) -> list[TuneResult]:
    """The plan for each group, measured on this device (see module doc).

    `shape_of`: group -> (batch, steps, features); `training`: time forward +
    backward; `cache`: where decisions are kept; `measure`, `warmup`,
    `repeats`: the timer (default `interleaved_medians`); `check_gradients`:
    (group, plan, shape, dtype) -> error against float64; `environment`:
    device and versions (None without a GPU: the static table decides);
    `jit_baseline`: time the original layers XLA-compiled, as Keras runs
    them; `masked_of`: group -> whether its input is masked; `candidates_of`:
    group -> the plans to time; `budget`: what the call can pay for (a cut
    decision is not cached).
    """
    environment = environment if environment is not None else device_environment()
    if environment is None:
        return [TuneResult(g, static_plan(g, g.dtype, training), "static: no GPU to time on")
                for g in groups]
    backend_name = environment.get("backend", "tensorflow")
    results, jobs = _look_up(groups, shape_of, cache, environment, training, masked_of, jit_baseline)
    if not jobs:
        return results
    every = candidates_for(backend_name)

    def candidates(group):
        chosen = candidates_of(group) if candidates_of is not None else None
        return list(chosen) if chosen is not None else every(group)

    warmup = default_warmup(backend_name) if warmup is None else warmup
    measure = measure or (lambda steps, on_step=None: interleaved_medians(
        steps, warmup=warmup, repeats=repeats, on_step=on_step, prune=PRUNE, race=RACE,
        keep=(PER_LAYER.name,), beat=1 - KEEP_ORIGINAL_MARGIN))
    check_gradients = check_gradients or GradientCheck()
    with _progress(progress, sum(len(candidates(job.group)) for job in jobs)) as bar:
        for job in jobs:
            plans, rejected = _plans_to_time(job, candidates(job.group), backend_name, training, bar)
            results[job.index] = result = _tune_group(
                job, plans, rejected, backend_name, jit_baseline, measure, check_gradients,
                budget, bar)
            if cache is not None and result.source == "measured":
                cache.put(job.key, {
                    "plan": result.plan.to_dict(), "timings": result.timings,
                    "rejected": result.rejected,
                    "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                })
    return results


@dataclasses.dataclass(frozen=True)
class _Job:
    """One group to time: where its result goes and what it is timed on."""

    index: int
    group: FusionGroup
    shape: tuple
    dtype: str
    key: object
    masked: bool
    training: bool


def _look_up(groups, shape_of, cache, environment, training, masked_of, jit_baseline):
    """(results with the cache's hits filled in and None elsewhere, the
    groups left to time); a cached plan that no longer fits is set aside."""
    results: list = []
    jobs = []
    for group in groups:
        dtype = group.dtype
        shape = tuple(int(d) for d in shape_of(group))
        masked = bool(masked_of(group)) if masked_of is not None else False
        key = cache_key(environment, group, shape, dtype, training, masked, jit_baseline)
        hit = cache.get(key) if cache is not None else None
        if hit is not None:
            plan, problem = _cached_plan(hit, group)
            if plan is not None:
                results.append(TuneResult(group, plan, "cache", dict(hit.get("timings", {}))))
                continue
            cache.set_aside(key, problem)
        jobs.append(_Job(len(results), group, shape, dtype, key, masked, training))
        results.append(None)
    return results, jobs


def _plans_to_time(job: _Job, plans: list, backend_name: str, training: bool, bar):
    """`plans_worth_timing` for a job, the refused ones counted as done."""
    kept, rejected = plans_worth_timing(job.group, job.shape, job.dtype, job.masked, training,
                                        backend_name, plans)
    bar.advance_rest(sum(1 for p in plans if p.name in rejected))
    return kept, rejected


def plans_worth_timing(group: FusionGroup, shape: tuple, dtype: str, masked: bool,
                       training: bool, backend_name: str, plans: list) -> tuple[list, dict]:
    """(the candidates worth timing, {name: why not} for the others): no
    persistent algorithm for a masked group (cuDNN refuses padded lengths)
    or above PERSISTENT_MAX_BATCH, no persistent_dynamic from
    DYNAMIC_MIN_UNITS, and the other kernels' plans (the wavefront kernel)
    where the backend runs them for this shape."""
    rejected = {}
    backend = get_backend(backend_name)
    no_persistent = ("cuDNN's persistent algorithms do not take padded sequence lengths"
                     if masked else persistent_reason(dtype, shape[0]))
    if no_persistent is not None:
        rejected.update({p.name: no_persistent for p in plans if p.algorithm})
    no_dynamic = dynamic_reason(dtype, group.units)
    if no_dynamic is not None:
        rejected.update({p.name: no_dynamic for p in plans
                         if p.algorithm and p.algorithm.startswith("persistent_dynamic")
                         and p.name not in rejected})
    # Keras' own layers whose step fails to compile here: nothing to time.
    fails = backend.keras_path_fails(group, dtype, masked=masked)
    if fails is not None:
        rejected.update({p.name: f"not timed: {fails}" for p in plans if not p.pieces})
    plans = [p for p in plans if p.name not in rejected]
    caps = backend.capabilities
    more, why = kernel_plans(
        group, shape, caps.training_kernels if training else caps.inference_kernels,
        lambda k, g, s: backend.kernel_reason(k, g, s, training=training))
    plans += [p for p in more if p.name not in {q.name for q in plans}]
    rejected.update(why)
    return plans, rejected


def _tune_group(job: _Job, plans, rejected, backend_name, jit_baseline, measure, check_gradients,
                budget, bar) -> TuneResult:
    """Times `plans` for one group and keeps the fastest sound one."""
    group, shape, dtype, training = job.group, job.shape, job.dtype, job.training
    eager_first_calls = not get_backend(backend_name).capabilities.first_call_compiles
    spend = budget.start() if budget is not None else None
    timings, plans = _time_in_stages(
        plans, rejected, bar,
        _Measured(group, shape, dtype, training, jit_baseline, job.masked, measure, bar,
                  eager_first_calls=eager_first_calls),
        spend=spend, lead=leading_candidates(group, dtype, training, shape, plans),
    )
    if not timings:
        # Every candidate refused or failed: the static plan, not kept.
        return TuneResult(group, static_plan(group, dtype, training, shape[0]),
                          "static: no candidate ran here", {}, rejected)
    best = _keep_original_unless_clearly_slower(plans, timings, _fastest_with_sound_gradients(
        plans, timings, rejected, training,
        lambda p: check_gradients(group, p, shape, dtype), dtype,
        keeps_original=lambda p: _keep_original_unless_clearly_slower(plans, timings, p) is not p,
    ))
    # A decision the budget cut short is not kept (a longer call times it all).
    cut = spend is not None and spend.cut
    return TuneResult(group, best, "measured: within the call's budget" if cut else "measured",
                      timings, rejected)


def _cached_plan(entry: dict, group: FusionGroup) -> tuple[Plan | None, str]:
    """(the cached plan, "") if it fits `group`, else (None, what is wrong)."""
    try:
        plan = Plan.from_dict(entry["plan"])
        split_groups([group], [plan])  # pieces add up, no split at a Dropout
    except (KeyError, TypeError, ValueError) as err:
        return None, f"{type(err).__name__}: {err}"
    return plan, ""


def candidates_for(backend_name: str) -> Callable[[FusionGroup], list[Plan]]:
    """group -> the plans to time on this backend: whole and halves, with
    each cuDNN algorithm (TensorFlow) or with one fused call per layer (torch)."""
    capabilities = get_backend(backend_name).capabilities
    algorithms = capabilities.tuned_algorithms
    per_layer = capabilities.tunes_one_call_per_layer
    return lambda group: candidate_plans(group, algorithms, one_per_layer=per_layer)


def _takes_on_step(fn) -> bool:
    import inspect

    try:
        return "on_step" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class _Measured:
    """`plans` -> ({name: median seconds}, {name: why refused}) for one group.

    Each step is built and called once, untimed, when first asked for, and
    reused by a later stage. With `eager_first_calls` (torch) a clearly slow
    first call is the step's time, and the original layers' full-length first
    call may be extrapolated instead; they are called last, and the process's
    very first call (one-time set-up) never judges a step.
    """

    def __init__(self, group, shape, dtype, training, jit_baseline, masked, measure, bar,
                 eager_first_calls=False):
        self.args = (group, shape, dtype, training, jit_baseline, masked)
        self.measure, self.bar, self.steps = measure, bar, {}
        self.eager_first_calls, self.first_s = eager_first_calls, {}
        self.estimated: dict[str, float] = {}

    def __call__(self, plans):
        group, shape, dtype, training, jit_baseline, masked = self.args
        new = [p for p in plans if p.name not in self.steps and p.name not in self.estimated]
        built = _steps(group, new, shape, dtype, training, jit_baseline, masked)
        by_name = {p.name: p for p in new}
        # The original layers' first call comes last (the class doc says why).
        original = next((p for p in new if not p.pieces), None)
        original_step = built.pop(original.name) if original is not None else None
        if original is not None and not self.eager_first_calls:
            # Nothing to extrapolate: last in the same (pipelined) first calls.
            built[original.name], original = original_step, None
        built, refused = _first_calls(built, by_name, self.first_s)
        if original is not None:
            why = self._extrapolated_first_call(original)
            if why is not None:
                refused[original.name] = why
            else:
                more, more_refused = _first_calls({original.name: original_step}, by_name,
                                                  self.first_s)
                built.update(more)
                refused.update(more_refused)
        self.steps.update(built)
        steps = {p.name: self.steps[p.name] for p in plans if p.name in self.steps}
        timings = {p.name: self.estimated[p.name] for p in plans if p.name in self.estimated}
        if self.eager_first_calls:
            judged = self._judged_first_calls(steps)
            for name in clearly_slow_first_calls(judged):
                timings[name] = self.first_s[name]
                del steps[name]
        measure, bar = self.measure, self.bar
        stats = measure(steps, on_step=bar.advance_one) if _takes_on_step(measure) else measure(steps)
        timings.update({name: float(s["median"]) for name, s in stats.items()})
        return timings, refused

    def _judged_first_calls(self, names) -> dict:
        """The first-call seconds of `names` that may judge a step (all but
        the process's very first call)."""
        judged = {n: self.first_s[n] for n in names if n in self.first_s}
        judged.pop(next(iter(self.first_s), None), None)
        return judged

    def _extrapolated_first_call(self, plan) -> str | None:
        """Why the original layers' full-length first call is skipped (its
        extrapolated seconds go to `self.estimated`), or None to run it."""
        group, shape, dtype, training, jit_baseline, masked = self.args
        judged = self._judged_first_calls(self.first_s)
        length = int(shape[1])
        if not judged or length < PROBE_MIN_STEPS:
            return None
        seconds: dict = {}
        for steps in (PROBE_STEPS, 2 * PROBE_STEPS):
            short = (shape[0], steps, *shape[2:])
            step = _steps(group, [plan], short, dtype, training, jit_baseline, masked)[plan.name]
            _first_calls({steps: step}, {}, seconds)
        a, b = seconds[PROBE_STEPS], seconds[2 * PROBE_STEPS]
        estimate = a + max(b - a, 0.0) * (length - PROBE_STEPS) / PROBE_STEPS
        if plan.name not in clearly_slow_first_calls({**judged, plan.name: estimate}):
            return None
        self.estimated[plan.name] = estimate
        return (f"not run at {length} steps: its first calls on {PROBE_STEPS} and "
                f"{2 * PROBE_STEPS} steps ({a:.3f} s, {b:.3f} s) extrapolate to {estimate:.2f} s, "
                f"over {PRUNE**2:g}x the fastest first call ({min(judged.values()):.3f} s)")


def clearly_slow_first_calls(first_s: dict) -> set:
    """The steps whose eager first call took over FIRST_CALL_PRUNE_S and
    over PRUNE**2 x the fastest first call.

    >>> sorted(clearly_slow_first_calls({"per-layer": 17.2, "fused": 0.3, "split 3+3": 0.35}))
    ['per-layer']
    """
    if len(first_s) < 2:
        return set()
    fastest = min(first_s.values())
    return {n for n, t in first_s.items() if t > FIRST_CALL_PRUNE_S and t > PRUNE**2 * fastest}


def default_warmup(backend_name: str) -> int:
    """Untimed calls after a step's first: none where the first call
    compiles (TensorFlow), one where it ran eagerly (torch)."""
    return 0 if get_backend(backend_name).capabilities.first_call_compiles else 1


def leading_candidates(group, dtype, training, shape, plans) -> tuple[str, ...]:
    """The names a budgeted timing starts with: the original layers and the
    static table's plan for this shape (the whole run where the table keeps
    the original layers), among `plans`."""
    names = {p.name for p in plans}
    try:
        static = static_plan(group, dtype, training, shape=shape).for_length(len(group.layers))
    except Exception:  # noqa: BLE001 - a group the table cannot read: the whole run leads
        static = PER_LAYER
    if static.per_layer or static.name not in names:
        static = Plan((len(group.layers),))
    return tuple(n for n in (PER_LAYER.name, static.name) if n in names)


def _time_in_stages(plans, rejected, bar, measured, spend=None, lead=()):
    """Times `plans` in two stages; returns ({name: seconds}, the plans timed).

    Stage one: the original layers and the whole run on every algorithm.
    Stage two: the splits, only on the algorithms whose whole run came within
    PRUNE of the best (a trace costs about a second, and such a split never
    won), beside stage one's best again so the deciding plans share one
    interleaved session. With `spend` (a `budget.Spend`), `lead` is timed
    first and each stage runs only where the budget allows; what is left out
    goes to `rejected` (tests/test_tuning_stages.py).
    """
    first, rest = _stages(plans)
    leading = [p for p in plans if p.name in lead] if spend is not None else []
    if 0 < len(leading) < len(plans):
        first = leading + [p for p in first if p not in leading]
        rest = [p for p in rest if p not in leading]
        timings, refused = measured(leading)
        rejected.update(refused)
        spend.timed += len(leading)
        if not spend.allows(len(first), _step_basis(timings)):
            _left_out([p for p in plans if p not in leading], rejected, spend,
                      _step_basis(timings))
            bar.advance_rest(len(plans))
            return timings, [p for p in leading if p.name in timings]
    timings, refused = measured(first)
    rejected.update(refused)
    if spend is not None:
        spend.timed += len(first)
    timed = [p for p in first if p.name in timings]
    bar.advance_rest(len(first))
    if not rest or not timings:
        return timings, timed
    again, second = _second_stage(rest, timed, timings, rejected)
    if second:
        if spend is not None and not spend.allows(len(again + second), _step_basis(timings)):
            _left_out(second, rejected, spend, _step_basis(timings))
            bar.advance_rest(len(rest))
            return timings, timed
        more, refused = measured(again + second)
        rejected.update(refused)
        timings.update(more)
        timed += [p for p in second if p.name in more]
    bar.advance_rest(len(rest))
    return timings, timed


def _step_basis(timings: dict) -> float | None:
    """The step time a budget is a share of: the original layers', or where
    they were not timed (they cannot run here) the fastest step timed."""
    if PER_LAYER.name in timings:
        return timings[PER_LAYER.name]
    return min(timings.values()) if timings else None


def _stages(plans) -> tuple[list, list]:
    """(stage one, stage two) of `_time_in_stages`; all in stage one where the
    fused plans have one algorithm (a masked group, torch)."""
    if len({p.algorithm for p in plans if p.pieces}) <= 1:
        return plans, []
    twins = whole_run_twins(plans)
    return [p for p in plans if p.name not in twins], [p for p in plans if p.name in twins]


def _second_stage(rest, timed, timings, rejected) -> tuple[list, list]:
    """(stage one's plans to time again, stage two's plans); the splits left
    out go to `rejected`."""
    best = min(timings.values())
    twins = whole_run_twins([*timed, *rest])
    second = []
    for p in rest:
        twin = twins.get(p.name)
        if twin not in timings:
            rejected[p.name] = "not timed: the whole run on its algorithm was not timed"
        elif timings[twin] > PRUNE * best:
            rejected[p.name] = (
                f"not timed: {twin} was over {PRUNE}x slower than the best of stage one"
            )
        else:
            second.append(p)
    again = [p for p in timed
             if timings[p.name] == best or (not p.pieces and timings[p.name] <= PRUNE * best)]
    return again, second


def _left_out(plans, rejected, spend, original_step_s) -> None:
    """Records `plans` as left out by the call's budget (`spend.cut`)."""
    why = spend.why_not(original_step_s)
    for p in plans:
        rejected.setdefault(p.name, why)
    spend.cut = True


def _steps(group, plans, shape, dtype, training, jit_baseline=False, masked=False) -> dict:
    """name -> step for each of `plans`; fused plans that differ only in
    their algorithm share one step where the backend can (`_shared_steps`)."""
    x = _input_batch(shape, dtype)
    mask = padding_mask(shape) if masked else None
    shared = {} if masked else _shared_steps(group, plans, x, dtype, training)
    return {
        p.name: shared[p.name] if p.name in shared else _step(
            group, _with_mask(_runner(group, p), mask), x, training,
            jit=jit_baseline and not p.pieces,
        )
        for p in plans
    }


def _shared_steps(group, plans, x, dtype, training) -> dict:
    """name -> step for the fused plans that share their pieces with another
    algorithm: one `Timing.timed_steps` (one trace, one graph set-up) per
    piece set. {} where the backend builds a step per plan."""
    by_pieces: dict = {}
    for p in plans:
        if p.pieces and p.kernel == "cudnn":
            by_pieces.setdefault(p.pieces, []).append(p)
    out = {}
    timing = get_timing()
    for pieces, same in by_pieces.items():
        if len(same) < 2:
            continue
        steps = timing.timed_steps(
            lambda pieces=pieces: _runner(group, Plan(pieces)), x, _group_variables(group),
            training, [p.algorithm for p in same], str(dtype),
        )
        if steps is None:
            return {}
        out.update({p.name: steps[p.algorithm] for p in same})
    return out


def _keep_original_unless_clearly_slower(plans, timings, best):
    """`best`, or the original layers where `best` wins by less than KEEP_ORIGINAL_MARGIN."""
    original = next((p for p in plans if p == PER_LAYER), None)
    if original is None or best is original or original.name not in timings or best.name not in timings:
        return best
    if timings[best.name] > (1 - KEEP_ORIGINAL_MARGIN) * timings[original.name]:
        return original
    return best


def _fastest_with_sound_gradients(plans, timings, rejected, training, check, dtype,
                                  keeps_original=None):
    """The fastest plan whose gradients may be trusted for training.

    A plan on a non-default algorithm or another kernel must have
    `sound_gradients`. Checks run lazily, fastest first; failures go to
    `rejected`. Where `keeps_original(plan)` says the original layers would
    stay anyway, they are returned without the check."""
    errors: dict = {}
    original = next((p for p in plans if p == PER_LAYER), None)

    def error_of(plan):
        if plan.name not in errors:
            try:
                errors[plan.name] = check(plan)
            except ReferenceFailed as exc:
                errors[plan.name] = None
                rejected[plan.name] = f"not checked: {exc}"
            except Exception as exc:  # cuDNN refusing an algorithm: an op error
                reason = _refusal(plan, exc)
                if reason is None:
                    raise
                errors[plan.name] = None
                rejected[plan.name] = reason
        return errors[plan.name]

    for plan in sorted(plans, key=lambda p: timings[p.name]):
        if not (training and (plan.algorithm or plan.inference_only)):
            return plan
        if original is not None and keeps_original is not None and keeps_original(plan):
            return original
        # The default-algorithm twin: checked even where `_time_in_stages` left it untimed.
        base = Plan(plan.pieces)
        error = error_of(plan)
        if error is None:
            continue
        if sound_gradients(error, lambda: error_of(base), dtype):
            return plan
        rejected[plan.name] = (
            f"gradient error {error:.2e} vs {errors[base.name]:.2e} with the default algorithm"
        )
    return min((p for p in plans if not p.algorithm), key=lambda p: timings[p.name])


def _first_calls(steps: dict, plans: dict, seconds: dict | None = None) -> tuple[dict, dict]:
    """Calls each step once, untimed (trace, compile, cuDNN's plan).

    Returns (kept steps, {name: refusal}): a step a kernel refuses is left out
    instead of ending all timing; `seconds` receives each call's seconds. A
    step with `trace()` is traced here and its first call runs on a worker
    thread while the next step traces, after its `compile()` (if any) on a
    pool of threads beside the others' (a refused trace is not compiled);
    first calls run one at a time, so the device holds one step at a time.
    """
    outcomes: dict = {}
    clock = current_clock()  # the worker thread does not see this context
    compiling = sum(1 for s in steps.values() if callable(getattr(s, "compile", None)))
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="rnnfuse-first-call"
    ) as worker, concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, min(compiling, COMPILE_THREADS)),
        thread_name_prefix="rnnfuse-compile"
    ) as compiler:
        for name, step in steps.items():
            if not callable(step):
                continue
            trace = getattr(step, "trace", None)
            if trace is None:
                concurrent.futures.wait(list(outcomes.values()))
                outcomes[name] = _done(_call_once, step, clock)
                continue
            traced = _done(trace)
            if traced.exception():
                outcomes[name] = traced
                continue
            compile_ = getattr(step, "compile", None)
            compiled = compiler.submit(compile_) if callable(compile_) else _done(lambda: None)
            outcomes[name] = worker.submit(_call_once_compiled, compiled, step, clock)
        kept, refused = {}, {}
        for name, step in steps.items():
            if name in outcomes:
                try:
                    took = outcomes[name].result()
                except Exception as exc:  # noqa: BLE001 - only op errors are refusals
                    reason = _refusal(plans.get(name), exc)
                    if reason is None:
                        raise
                    refused[name] = reason
                    continue
                if seconds is not None:
                    seconds[name] = took
            kept[name] = step
    return kept, refused


def _call_once_compiled(compiled: concurrent.futures.Future, step, clock: Clock) -> float:
    """`_call_once` after the step's compile (`compiled`), failing as it did."""
    compiled.result()
    return _call_once(step, clock)


def _call_once(step, clock: Clock) -> float:
    """Calls `step` and waits for its result; the seconds it took on `clock`."""
    start = clock()
    keras.ops.convert_to_numpy(step())
    return clock() - start


def _done(fn, *args) -> concurrent.futures.Future:
    """A future already holding `fn(*args)`'s result or exception."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:  # noqa: BLE001 - handed to the caller with the result
        future.set_exception(exc)
    return future


def _refusal(plan: Plan | None, exc: Exception) -> str | None:
    """Why the kernel refused `plan`, when `exc` is a kernel's op error (or
    NotImplementedError) on a non-default algorithm or another kernel, or,
    for the original layers, the framework refusing their step
    (`Timing.original_refusal`); None for anything else (a real error, to
    raise)."""
    if plan is None:
        return None
    if not plan.pieces:
        # The original layers: the framework may refuse to compile them here.
        why = get_timing().original_refusal(exc)
        return None if why is None else f"the original layers cannot run here: {why}"
    last_line = (str(exc).strip().splitlines() or [""])[-1].strip()[:300]
    if (plan.inference_only or plan.algorithm) and isinstance(exc, NotImplementedError):
        return last_line.removeprefix("NotImplementedError: ")
    if not (plan.algorithm or plan.inference_only) or not _is_op_error(exc):
        return None
    who = f"the {plan.kernel} kernel" if plan.inference_only else "cuDNN"
    return f"{who} refused it: {last_line}"


def _is_op_error(exc: Exception) -> bool:
    """A backend kernel's runtime error (TensorFlow's OpError), by name so
    tuning needs no TensorFlow import."""
    return any(c.__name__ == "OpError" for c in type(exc).__mro__)


# The gradient check's steps: the length favours neither algorithm, and a
# float64 reference of a long batch was most of a tuning's cost.
CHECK_STEPS = 64


class ReferenceFailed(RuntimeError):
    """The gradient check's float64 reference could not be computed: the
    plans it would check are not chosen for training."""


class GradientCheck:
    """`check_gradients` for `tune_plans`: a plan's gradient error against the
    whole run in float64 on the batch's first CHECK_STEPS steps, computed once
    per (group, shape, dtype), with the plan's and its twin's where it can."""

    def __init__(self):
        self._references: dict = {}
        self._errors: dict = {}

    def __call__(self, group, plan, shape, dtype) -> float:
        shape = (shape[0], min(int(shape[1]), CHECK_STEPS), *shape[2:])
        key = (tuple(group.layers), tuple(shape), str(dtype))
        if (key, plan.name) in self._errors:
            return self._errors[(key, plan.name)]
        x = _input_batch(shape, dtype, seed=1)
        variables = _group_variables(group)
        timing = get_timing()
        scope = timing.float64_reference_scope() if key not in self._references else None
        if scope is not None:
            try:
                with scope:
                    self._references[key] = _float64_reference(group, x, timing)
            except Exception as exc:  # noqa: BLE001 - the plan is then not checked
                self._references[key] = ReferenceFailed(
                    f"the float64 reference failed ({_first_line(exc)})")
        if isinstance(self._references.get(key), ReferenceFailed):
            raise self._references[key]
        # The twin `sound_gradients` compares with (half precision: asked for later).
        twin = (Plan(plan.pieces) if (plan.algorithm or plan.inference_only)
                and not rounding_floor(dtype) else None)
        plans = [plan] + ([twin] if twin is not None and (key, twin.name) not in self._errors else [])
        calls = [_gradient_call(group, p, x) for p in plans]
        if key not in self._references:
            reference = _runner(group, Plan((len(group.layers),)), dtype="float64")
            calls.insert(0, (reference, keras.ops.cast(x, "float64"), False))
        try:
            grads = timing.gradients_of(calls, variables)
        except Exception:  # noqa: BLE001 - re-raised below by the call that fails alone
            grads = None
        if grads is None:
            grads = [timing.gradients_of([c], variables)[0] for c in calls[: len(calls) - len(plans) + 1]]
            plans = plans[:1]
        if key not in self._references:
            self._references[key] = grads.pop(0)
        for p, got in zip(plans, grads):
            self._errors[(key, p.name)] = gradient_error(got, self._references[key])
        return self._errors[(key, plan.name)]


class _progress:
    """A rich progress bar over candidate steps (or nothing)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.done = enabled, total, 0
        self._bar = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task("rnnfuse: timing plans", total=self.total)
        return self

    def advance_one(self, _name=None):
        if self._bar is not None:
            self._bar.advance(self._task, 0.2)

    def advance_rest(self, n):
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False
