"""The public entry points: `analyze(model)` and `optimize(model)`, which
check their arguments at the boundary (the argument, what was received,
the fix); nothing deeper raises on bad input.

>>> import keras, numpy as np, rnnfuse
>>> inp = keras.Input((12, 8))
>>> x = keras.layers.LSTM(16)(keras.layers.LSTM(16, return_sequences=True)(inp))
>>> model = keras.Model(inp, keras.layers.Dense(2)(x))
>>> fast = rnnfuse.optimize(model)
>>> [type(l).__name__ for l in fast.layers[1:]]
['FusedRNN', 'Dense']
>>> x = np.random.rand(3, 12, 8).astype("float32")
>>> bool(np.allclose(fast(x), model(x), atol=1e-6))
True
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import Any, Callable

import keras

from rnnfuse.optimized import as_optimized
from rnnfuse.passes.pipeline import PassOptions, run_pipeline
from rnnfuse.reasons import FusionWarning
from rnnfuse.report import FusionGroup, FusionReport, OptimizeResult
from rnnfuse.tuning import first_batch
from rnnfuse.tuning.per_shape import AutoTune
from rnnfuse.tuning.cache import PlanCache, default_cache
from rnnfuse.plan import Plan
from rnnfuse.tuning.plans import split_groups
from rnnfuse.tuning.table import static_plan, static_source
from rnnfuse.tuning.tuner import TuneResult, tune_plans

__all__ = ["TuneShape", "analyze", "choose_plans", "optimize"]

# `optimize(tune=AUTO)`: plans chosen on the first batch (the default).
AUTO = "auto"

logger = logging.getLogger("rnnfuse")


def analyze(
    model: keras.Model, *, min_layers: int | None = None, absorb_dropout: bool = True
) -> FusionReport:
    """Finds the runs of `model`'s recurrent layers that fuse, and why not.

    Args:
        model: a built Keras 3 Sequential or Functional model.
        min_layers: the least number of recurrent levels worth fusing; None:
            1 (a lone layer is a group), 2 for ProjectedLSTM.
        absorb_dropout: treat a `Dropout` between two recurrent layers as
            cuDNN's between-layer dropout instead of a break in the run.

    Returns a `FusionReport`: `.groups`, `.skipped` (layer -> reason) and
    `.breaks` (grouped neighbours that are separate calls -> reason). Raises
    TypeError for a non-Keras model, ValueError for an unbuilt one or a bad
    `min_layers`.

    >>> import keras
    >>> m = keras.Sequential([keras.Input((5, 3)), keras.layers.GRU(4)])
    >>> [g.layers for g in analyze(m).groups]
    [('gru',)]
    """
    _check_model(model, "analyze")
    _check_min_layers(min_layers, "analyze")
    return run_pipeline(model, PassOptions(min_layers, absorb_dropout)).report


def optimize(
    model: keras.Model,
    *,
    min_layers: int | None = None,
    absorb_dropout: bool = True,
    tune: Any = "auto",
    training: bool = True,
    plan: Plan | Callable[[FusionGroup], Plan] | None = None,
    cache: Any = None,
    online: bool = False,
    return_result: bool = False,
) -> keras.Model | OptimizeResult:
    """A new model in which each fusable run is one `FusedRNN` layer.

    It has the same inputs, outputs and output names and shares every layer
    and variable with `model` (training one trains the other); `model` is
    not changed. A subclassed model comes back as it is, with a warning.

    Args:
        model: a built Keras 3 Sequential or Functional model.
        min_layers, absorb_dropout: see `analyze`.
        tune: "auto" (the default): the static rule table now, then on a GPU
            the plans timed on the first batch of `fit`/`evaluate`/`predict`;
            False or None: the static table only; a sample batch or
            `rnnfuse.TuneShape(batch_size, steps)`: time the candidates now.
        training: tune for training steps or for inference.
        plan: one `rnnfuse.Plan` for every group (or group -> Plan); overrides
            `tune`.
        cache: the plan cache: None (the default file), False, a path, or a
            `PlanCache`.
        online: with `tune="auto"`, a `fit` races the candidates on its own
            first steps (TensorFlow, torch) instead of timing them apart.
        return_result: return an `rnnfuse.OptimizeResult` (model, report,
            plans, failed rewrites) instead of the model.

    Raises:
        TypeError: `model` is not a Keras 3 model.
        ValueError: `model` is not built, or a bad `min_layers`, `tune` or `plan`.

    Example:
        >>> import keras
        >>> m = keras.Sequential([keras.Input((5, 3)), keras.layers.GRU(4, return_sequences=True),
        ...                       keras.layers.GRU(4)])
        >>> [type(l).__name__ for l in optimize(m, tune=False).layers]
        ['FusedRNN']
    """
    _check_model(model, "optimize")
    _check_min_layers(min_layers, "optimize")
    _check_tune(tune)
    if not isinstance(online, bool):
        raise ValueError(f"optimize: online must be True or False; received {online!r}")
    if not (cache is None or cache is False or cache is True or isinstance(cache, PlanCache)):
        _plan_cache(cache)  # a bad cache argument fails before any work
    at_first_batch = (
        isinstance(tune, str) and tune == AUTO and plan is None and first_batch.can_time_here()
    )
    tuned: list[TuneResult] = []  # the tuner's choice, kept for OptimizeResult.plans
    choose = _plan_chooser(model, tuned, at_first_batch, tune=tune, training=training, plan=plan,
                           cache=cache)
    done = run_pipeline(model, PassOptions(min_layers, absorb_dropout, choose))
    if done.rewritten is None:
        warnings.warn(
            f"rnnfuse.optimize: '{model.name}' is a subclassed model "
            f"({type(model).__name__}); rnnfuse cannot see inside its call(), "
            "so it is returned unchanged. Build it as a Functional or "
            "Sequential model to fuse its recurrent layers.",
            FusionWarning,
            stacklevel=2,
        )
        new = model
    else:
        # Weight files in the original layout, registered classes (optimized.py).
        new = as_optimized(done.rewritten, like=model)
        if at_first_batch:
            first_batch.attach(new, done.report.groups,
                               AutoTune(cache=_plan_cache(cache), online=online))
    if return_result:
        return OptimizeResult(model=new, report=done.report, plans=tuple(tuned), failed=done.failed)
    return new


def _plan_chooser(model, tuned: list, at_first_batch: bool, **choice) -> Callable:
    """The pipeline's `choose` step (the passes get plans, not the tuner);
    what it chose is appended to `tuned`."""

    def choose(report: FusionReport):
        if at_first_batch:
            tuned.extend(_first_batch_plans(report.groups, choice["training"]))
            return [(r.group, r.plan) for r in tuned]
        tuned.extend(choose_plans(model, report.groups, **choice))
        _say_if_nothing_runs_fused(model, tuned)
        return split_groups(report.groups, [r.plan for r in tuned])

    return choose


def _first_batch_plans(groups, training) -> list[TuneResult]:
    """One switchable FusedRNN per group, on its static plan for now; the
    first batch chooses (`rnnfuse.tuning.first_batch`)."""
    return [
        TuneResult(g, static_plan(g, g.dtype, training),
                   static_source(g, g.dtype, "static: until the first batch"))
        for g in groups
    ]


def _say_if_nothing_runs_fused(model, plans: list[TuneResult]) -> None:
    """One warning on the `rnnfuse` logger when no group will run fused here."""
    from rnnfuse.placement import backend_name, nothing_fused_reason

    why = nothing_fused_reason([r.plan for r in plans], [r.source for r in plans])
    if why is not None:
        logger.warning(
            "optimize('%s'): none of its %d fusion group(s) will run fused "
            "on the %s backend here, so the optimized model runs the original "
            "layers at their speed: %s.",
            model.name,
            len(plans),
            backend_name(),
            why,
        )


@dataclasses.dataclass(frozen=True)
class TuneShape:
    """Input shape to tune for, when no sample batch is at hand; a bad
    `batch_size` or `steps` raises ValueError.

    >>> TuneShape(32, 100).steps
    100
    """

    batch_size: int
    # Time steps (used where the model's input shape leaves time open).
    steps: int

    def __post_init__(self):
        for name in ("batch_size", "steps"):
            value = getattr(self, name)
            object.__setattr__(self, name, _positive_int(value, name))


def _positive_int(value: Any, name: str) -> int:
    """`value` as an int if it is a positive integer (NumPy ints too)."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            f"rnnfuse.TuneShape: {name} must be a positive integer; received "
            f"{value!r} ({type(value).__name__}). Fix: e.g. "
            "rnnfuse.TuneShape(batch_size=32, steps=100), the batch size and "
            "number of time steps you train or serve with."
        )
    return int(value)


def choose_plans(model, groups, *, tune=None, training=True, plan=None, cache=None) -> list[TuneResult]:
    """A `TuneResult` per group: forced, static, or measured (see optimize)."""
    if plan is not None:
        pick = plan if callable(plan) and not isinstance(plan, Plan) else (lambda g: plan)
        chosen = []
        for group in groups:
            p = pick(group)
            if not isinstance(p, Plan):
                raise ValueError(
                    "rnnfuse.optimize: plan must be an rnnfuse.Plan or a callable "
                    f"returning one; received {type(p).__name__}"
                )
            chosen.append(TuneResult(group, p, "forced"))
        return chosen
    if tune is None or tune is False or (isinstance(tune, str) and tune == AUTO):
        return [
            TuneResult(g, static_plan(g, g.dtype, training), static_source(g, g.dtype))
            for g in groups
        ]
    batch, steps = _tune_shape(model, tune)
    plan_cache = _plan_cache(cache)

    def shape_of(group):
        first = group.views[0].layer
        try:
            t = first.input.shape[1]
        except (AttributeError, ValueError, IndexError, TypeError):
            t = None
        return (batch, t if t is not None else steps, group.input_size)

    return tune_plans(groups, shape_of, training=training, cache=plan_cache)


def _tune_shape(model, tune) -> tuple[int, int]:
    if isinstance(tune, TuneShape):
        return int(tune.batch_size), int(tune.steps)
    if isinstance(tune, (tuple, list)) and len(tune) == 2 and all(
        isinstance(v, (int, float, str)) for v in tune
    ):
        raise ValueError(
            "rnnfuse.optimize: tune must be a sample batch or "
            f"rnnfuse.TuneShape(batch_size, steps); received the {type(tune).__name__} "
            f"{tune!r}. Fix: tune=rnnfuse.TuneShape{tuple(tune)!r}."
        )
    first = keras.tree.flatten(tune)[0] if keras.tree.is_nested(tune) else tune
    shape = getattr(first, "shape", None)
    if shape is None or len(shape) < 2:
        raise ValueError(
            f"rnnfuse.optimize: tune must be {_TUNE_VALUES}; received {type(tune).__name__}"
            + (f" of shape {tuple(shape)}" if shape is not None else "")
        )
    batch, steps = shape[0], shape[1]
    if batch is None or steps is None or int(batch) < 1 or int(steps) < 1:
        raise ValueError(
            "rnnfuse.optimize: tune's sample batch must have at least one "
            f"sequence and one time step; received shape {tuple(shape)}. Fix: "
            "pass a real batch, or rnnfuse.TuneShape(batch_size, steps)."
        )
    return int(batch), int(steps)


def _plan_cache(cache) -> PlanCache | None:
    if cache is False:
        return None
    if cache is None or cache is True:
        return default_cache()
    if isinstance(cache, PlanCache):
        return cache
    if not isinstance(cache, (str, os.PathLike)):
        raise TypeError(
            "rnnfuse.optimize: cache must be None (the default file), False (no "
            "cache), a file path or an rnnfuse.tuning.cache.PlanCache; received "
            f"{type(cache).__name__} {cache!r}. Fix: e.g. cache='plans.json' or "
            "cache=False."
        )
    try:
        return PlanCache(cache)
    except ValueError as err:
        raise ValueError(f"rnnfuse.optimize: cache={os.fspath(cache)!r}: {err}") from None


def _check_model(model: Any, fn: str) -> None:
    if not isinstance(model, keras.Model):
        kind = f"{type(model).__module__}.{type(model).__qualname__}"
        hint = "pass a keras.Model (Keras 3)"
        if isinstance(model, keras.layers.Layer):
            hint = "wrap the layer in a model, e.g. keras.Sequential([keras.Input(shape), layer])"
        elif type(model).__module__.startswith(("tf_keras", "keras.engine", "tensorflow.python.keras")):
            hint = (
                "this is a tf.keras (Keras 2) model; rnnfuse works on Keras 3 "
                "models (`import keras`, keras>=3.10)"
            )
        elif isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            hint = "load it first: keras.models.load_model(path)"
        raise TypeError(
            f"rnnfuse.{fn}(model) expects a keras.Model; received {kind}. Fix: {hint}."
        )
    if not model.built:
        raise ValueError(
            f"rnnfuse.{fn}(model): model '{model.name}' is not built, so its "
            "layers have no weights or shapes yet. Fix: start it with "
            "keras.Input(shape), call model.build(input_shape), or call it "
            "once on a batch."
        )


def _check_min_layers(min_layers: Any, fn: str) -> None:
    if min_layers is None:
        return
    if isinstance(min_layers, bool) or not isinstance(min_layers, int) or min_layers < 1:
        raise ValueError(
            f"rnnfuse.{fn}: min_layers must be a positive integer (or None for "
            f"the per-kind default); received {min_layers!r}."
        )


_TUNE_VALUES = (
    '"auto", False or None (the static rule table), a sample batch shaped like '
    "the model's input (batch, time, ...), or rnnfuse.TuneShape(batch_size, steps)"
)


def _check_tune(tune: Any) -> None:
    """A string or bool that is not one of `tune`'s values fails here,
    naming them (a batch or TuneShape is checked where it is used)."""
    if isinstance(tune, str) and tune != AUTO or tune is True:
        raise ValueError(
            f"rnnfuse.optimize: tune must be {_TUNE_VALUES}; received {tune!r}. "
            'Fix: tune="auto" to time on the first batch where a GPU is visible.'
        )

