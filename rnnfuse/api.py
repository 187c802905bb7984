"""The public entry points: `analyze(model)` and `optimize(model)`.

Both check their arguments at the boundary and raise clear errors (the
argument, what was received, the fix); nothing deeper raises on bad input.

Example:

    >>> import keras, numpy as np, rnnfuse
    >>> inp = keras.Input((12, 8))
    >>> x = keras.layers.LSTM(16, return_sequences=True)(inp)
    >>> x = keras.layers.LSTM(16)(x)
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
import warnings
from typing import Any, Callable

import keras

from rnnfuse.passes.graph import build_layer_graph, is_graph_model
from rnnfuse.passes.planning import plan_fusion
from rnnfuse.passes.rewrite import FusionWarning, rewrite_model
from rnnfuse.reasons import Reason
from rnnfuse.recurrent import is_recurrent
from rnnfuse.report import FusionGroup, FusionReport
from rnnfuse.tuning.cache import PlanCache
from rnnfuse.tuning.plans import Plan, split_groups
from rnnfuse.tuning.table import static_plan
from rnnfuse.tuning.tuner import TuneResult, tune_plans

__all__ = ["TuneShape", "analyze", "choose_plans", "optimize"]

logger = logging.getLogger("rnnfuse")


def analyze(
    model: keras.Model, *, min_layers: int = 2, absorb_dropout: bool = True
) -> FusionReport:
    """Finds the runs of `model`'s recurrent layers that fuse, and why not.

    Args:
        model: a built Keras 3 Sequential or Functional model (nested
            sub-models are looked into).
        min_layers: the least number of recurrent levels worth fusing.
        absorb_dropout: treat a `Dropout` layer between two recurrent layers
            as cuDNN's between-layer dropout instead of a break in the run.

    Returns:
        A `FusionReport`: `.groups` (one `FusionGroup` per run) and
        `.skipped` (every other recurrent layer -> the reason).

    Raises:
        TypeError: `model` is not a Keras 3 model.
        ValueError: `model` is not built, or `min_layers` is not a positive
            integer.
    """
    _check_model(model, "analyze")
    _check_min_layers(min_layers, "analyze")
    if not is_graph_model(model):
        return _subclassed_report(model)
    graph = build_layer_graph(model)
    return plan_fusion(
        graph,
        model_name=model.name,
        min_layers=min_layers,
        absorb_dropout=absorb_dropout,
    )


def optimize(
    model: keras.Model,
    *,
    min_layers: int = 2,
    absorb_dropout: bool = True,
    tune: Any = None,
    training: bool = True,
    plan: Plan | Callable[[FusionGroup], Plan] | None = None,
    cache: Any = None,
) -> keras.Model:
    """A new model in which each fusable run is one `FusedRNN` layer.

    The new model has the same inputs, outputs and output names; every layer
    outside a run is the same object, and the runs' layers live inside the
    fused layers, so all variables are shared: training the new model
    trains `model`. `model` itself is not changed.

    Args:
        model: a built Keras 3 Sequential or Functional model.
        min_layers: the least number of recurrent levels worth fusing.
        absorb_dropout: see `analyze`.
        tune: how each group's plan (fused whole, split, per-layer; cuDNN
            algorithm) is chosen. None: the static rule table
            (`rnnfuse.tuning.table`). A sample batch (what the model takes)
            or `rnnfuse.TuneShape(batch_size, steps)`: time the candidates
            on this device and keep the fastest per group; decisions are
            cached on disk, so a second call costs nothing.
        training: tune for training steps (forward + backward) or inference.
        plan: force one `rnnfuse.Plan` for every group (or a callable
            group -> Plan); overrides `tune`. `rnnfuse.FUSED` fuses every
            run whole with TensorFlow's default algorithm.
        cache: the plan cache for `tune`: None (the default file, see
            `rnnfuse.tuning.cache`), False (none), a path, or a `PlanCache`.

    Returns:
        The optimized `keras.Model` (for a subclassed model: `model` itself,
        with a warning, since its call() cannot be rewritten).

    Raises:
        TypeError: `model` is not a Keras 3 model.
        ValueError: `model` is not built, or `min_layers`, `tune` or `plan`
            is not valid.
    """
    _check_model(model, "optimize")
    _check_min_layers(min_layers, "optimize")
    if not is_graph_model(model):
        warnings.warn(
            f"rnnfuse.optimize: '{model.name}' is a subclassed model "
            f"({type(model).__name__}); rnnfuse cannot see inside its call(), "
            "so it is returned unchanged. Build it as a Functional or "
            "Sequential model to fuse its recurrent layers.",
            FusionWarning,
            stacklevel=2,
        )
        return model
    graph = build_layer_graph(model)
    report = plan_fusion(
        graph,
        model_name=model.name,
        min_layers=min_layers,
        absorb_dropout=absorb_dropout,
    )
    plans = choose_plans(
        model, report.groups, tune=tune, training=training, plan=plan, cache=cache
    )
    _say_if_nothing_runs_fused(model, plans)
    pairs = split_groups(report.groups, [r.plan for r in plans])
    return rewrite_model(model, [g for g, _ in pairs], [a for _, a in pairs])


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
    """Input shape to tune for, when no sample batch is at hand."""

    batch_size: int
    # Time steps (used where the model's input shape leaves time open).
    steps: int


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
    if tune is None or tune is False:
        return [
            TuneResult(g, static_plan(g, g.views[0].layer.compute_dtype, training), "static")
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
    first = keras.tree.flatten(tune)[0] if keras.tree.is_nested(tune) else tune
    shape = getattr(first, "shape", None)
    if shape is None or len(shape) < 2:
        raise ValueError(
            "rnnfuse.optimize: tune must be a sample batch shaped like the "
            "model's input (batch, time, ...) or rnnfuse.TuneShape(batch_size, "
            f"steps); received {type(tune).__name__}"
            + (f" of shape {tuple(shape)}" if shape is not None else "")
        )
    return int(shape[0]), int(shape[1])


def _plan_cache(cache) -> PlanCache | None:
    if cache is False:
        return None
    if cache is None or cache is True:
        return PlanCache()
    if isinstance(cache, PlanCache):
        return cache
    return PlanCache(cache)


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
    if isinstance(min_layers, bool) or not isinstance(min_layers, int) or min_layers < 1:
        raise ValueError(
            f"rnnfuse.{fn}: min_layers must be a positive integer; received "
            f"{min_layers!r}."
        )


def _subclassed_report(model: keras.Model) -> FusionReport:
    skipped = {}
    for layer in model._flatten_layers(include_self=False):
        if is_recurrent(layer):
            skipped[layer.name] = Reason(
                "subclassed_model",
                f"it is inside the subclassed model '{model.name}', whose "
                "call() rnnfuse cannot see into",
            )
    note = (
        f"'{model.name}' is a subclassed model ({type(model).__name__}): rnnfuse "
        "cannot see inside its call(). Build it as a Functional or Sequential "
        "model to fuse its recurrent layers."
    )
    return FusionReport(
        model_name=model.name, groups=(), skipped=skipped, notes=(note,)
    )
