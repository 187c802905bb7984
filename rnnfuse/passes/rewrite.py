"""Pass 4: a new model in which each fusion group is one `FusedRNN` layer.

`rewrite_model(model, groups)` returns a plain Sequential or Functional
model with the same inputs, outputs and output names (every layer outside
a group the same object, each group's layers inside a `FusedRNN`), and
the groups whose fused layer could not be built. Sequential models get a
new layer list; Functional ones `keras.models.clone_model` with a
`call_function` that calls the fused layer at a run's first layer.

>>> import keras
>>> from rnnfuse.passes import run_pipeline, PassOptions
>>> m = keras.Sequential([keras.Input((6, 2)), keras.layers.GRU(4, return_sequences=True),
...     keras.layers.GRU(4), keras.layers.Dense(1)])
>>> new, failed = rewrite_model(m, run_pipeline(m, PassOptions()).report.groups)
>>> [type(l).__name__ for l in new.layers], failed
(['FusedRNN', 'Dense'], ())
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Any, Sequence

import keras
from keras.src.models.functional import Functional

from rnnfuse.fused import FusedRNN, first_call_kwargs
from rnnfuse.passes.graph import is_graph_model
from rnnfuse.passes.result import PassOptions, PassResult
from rnnfuse.plan import Plan
from rnnfuse.reasons import FusionWarning
from rnnfuse.report import FusionGroup, RewriteFailure

__all__ = ["FusionWarning", "keep_dtype_policy", "rewrite_model", "rewrite_pass"]


def rewrite_pass(model: keras.Model, so_far: PassResult, options: PassOptions) -> PassResult:
    """Pass 4: `rewrite_model` on the caller's plans; none asked, none made."""
    if so_far.graph is None or options.choose_plans is None:
        return so_far
    plans = tuple(options.choose_plans(so_far.report))
    new, failed = rewrite_model(model, [g for g, _ in plans], [p for _, p in plans])
    return dataclasses.replace(so_far, plans=plans, rewritten=new, failed=failed)


def rewrite_model(
    model: keras.Model,
    groups: Sequence[FusionGroup],
    plans: Sequence[Plan | None] | None = None,
) -> tuple[keras.Model, tuple[RewriteFailure, ...]]:
    """(a new model sharing every layer and variable with `model`, in which
    each of `groups` is one `FusedRNN`; a `RewriteFailure` per group that
    keeps its original layers, each also warned about).

    `plans`: optional `rnnfuse.Plan` per group (None: `rnnfuse.FUSED`; a
    per-layer plan keeps the original layers inside a switchable FusedRNN).
    """
    plans = list(plans or [None] * len(groups))
    if not groups and type(model) in (keras.Sequential, Functional):
        # Nothing to fuse: the original graph itself (the same nodes, no
        # layer called again), so the model costs what `model` costs.
        return model, ()
    by_scope: dict[str, list] = collections.defaultdict(list)
    for group, plan in zip(groups, plans):
        by_scope[group.scope].append((group, plan))
    rewriter = _Rewriter(by_scope)
    new = rewriter.rewrite(model, scope="", force_new=True)
    return new, tuple(rewriter.failures)


class _Rewriter:
    def __init__(self, by_scope: dict[str, list]):
        self.by_scope = by_scope
        self.done: dict[int, Any] = {}
        self.failures: list[RewriteFailure] = []

    def _has_groups_under(self, scope: str) -> bool:
        return any(s.startswith(scope) and groups for s, groups in self.by_scope.items())

    def rewrite(self, model: Any, scope: str, force_new: bool = False) -> Any:
        if id(model) in self.done:
            return self.done[id(model)]
        if not force_new and not self._has_groups_under(scope):
            return model
        fused = self._fused_layers(self.by_scope.get(scope, []))
        replacements = {}
        for layer in model.layers:
            if is_graph_model(layer):
                replacements[id(layer)] = self.rewrite(layer, f"{scope}{layer.name}/")
        if isinstance(model, keras.Sequential):
            new = _rewrite_sequential(model, fused, replacements)
        else:
            new = _rewrite_functional(model, fused, replacements)
        self.done[id(model)] = new = keep_dtype_policy(model, new)
        return new

    def _fused_layers(self, groups: list) -> list[tuple[FusionGroup, FusedRNN]]:
        built = []
        for group, plan in groups:
            layers = [v.layer for v in group.views]
            try:
                fused = FusedRNN(
                    layers,
                    dropout_layers=list(group.gap_dropout) or None,
                    plan=plan,
                )
            except Exception as err:  # noqa: BLE001 - one bad group must not sink the rest
                # Not silent: warned about, and recorded in the
                # OptimizeResult (`failed`) with the exception.
                self.failures.append(RewriteFailure(group, f"{type(err).__name__}: {err}"))
                warnings.warn(
                    f"rnnfuse: could not fuse {' -> '.join(group.layers)}; "
                    f"those layers stay as they are ({type(err).__name__}: {err})",
                    FusionWarning,
                    stacklevel=4,
                )
                continue
            built.append((group, fused))
        return built


def keep_dtype_policy(model, new):
    """`new` with `model`'s dtype policy: compile() gives mixed_float16 a LossScaleOptimizer.

    >>> m = keras.Sequential([keras.Input((2,))], name="m"); m.dtype_policy = "mixed_float16"
    >>> keep_dtype_policy(m, keras.Sequential([keras.Input((2,))])).dtype_policy.name
    'mixed_float16'
    """
    policy = model.dtype_policy
    if policy.name != new.dtype_policy.name and policy.quantization_mode is None:
        new.dtype_policy = policy
    return new


def _members(group: FusionGroup) -> list[Any]:
    """The run's layer objects and absorbed Dropout layers."""
    layers = [v.layer for v in group.views]
    return layers + [d for d in group.gap_dropout if d is not None]


def _rewrite_sequential(model, fused, replacements) -> keras.Sequential:
    first = {id(g.views[0].layer): f for g, f in fused}
    absorbed = {id(m) for g, _ in fused for m in _members(g)[1:]}
    layers = []
    for layer in model.layers:
        if id(layer) in first:
            layers.append(first[id(layer)])
        elif id(layer) not in absorbed:
            layers.append(replacements.get(id(layer), layer))
    input_layer = model._layers[0]
    if isinstance(input_layer, keras.layers.InputLayer):
        # The original InputLayer itself (see _rewrite_functional).
        layers.insert(0, input_layer.output)
    # Compile arguments are carried over where the result becomes an optimized model.
    return keras.Sequential(layers, name=model.name, trainable=model.trainable)


def _rewrite_functional(model, fused, replacements) -> keras.Model:
    roles: dict[int, tuple[str, int]] = {}
    for i, (group, _) in enumerate(fused):
        members = _members(group)
        layers = [v.layer for v in group.views]
        for m in members:
            roles[id(m)] = ("inner", i)
        roles[id(layers[-1])] = ("last", i)
        roles[id(layers[0])] = ("only", i) if len(layers) == 1 else ("first", i)
    results: dict[int, Any] = {}

    def call_function(layer, *args, **kwargs):
        role = roles.get(id(layer))
        if role is None:
            return layer(*args, **kwargs)
        what, i = role
        if what in ("first", "only"):
            out = _call_fused(fused[i][1], args, kwargs)
            if what == "only":
                return out
            results[i] = out
            return args[0]
        if what == "inner":
            return args[0]
        return results[i]

    # The original input tensors, so a sub-model cut from the rewritten model's
    # layers finds one input of each name.
    new = keras.models.clone_model(
        model,
        input_tensors=model.input,
        clone_function=lambda layer: replacements.get(id(layer), layer),
        call_function=call_function,
    )
    # A FusedRNN has a name of its own; the outputs keep the original names.
    new.output_names = list(model.output_names)
    # clone_model carried the compile() arguments over itself.
    return new


def _call_fused(fused: FusedRNN, args, kwargs):
    """Calls `fused` with the arguments the run's first layer received."""
    return fused(args[0], **first_call_kwargs(args, kwargs))
