"""Pass 3: find the maximal runs of fusable layers and explain the rest.

`plan_fusion(graph)`: every recurrent layer gets a view or a reason
(`rnnfuse.passes.candidates`); each candidate's output is followed to the
one layer that reads it (through an absorbable Dropout) and the link rules
checked; the passing links form disjoint paths, and each path with
`min_layers` levels is a `FusionGroup`. Every other recurrent layer gets
the reason of the rule that stopped it, and a failed link between two
grouped layers is a `breaks` entry.

>>> import keras
>>> from rnnfuse.passes.graph import build_layer_graph
>>> m = keras.Sequential([keras.Input((6, 2)), keras.layers.LSTM(4, return_sequences=True, name="a"),
...     keras.layers.LSTM(4, return_sequences=True, name="b"), keras.layers.LSTM(8, name="c")])
>>> report = plan_fusion(build_layer_graph(m), model_name=m.name)
>>> [g.layers for g in report.groups], report.breaks[("b", "c")].rule
([('a', 'b'), ('c',)], 'units')
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import networkx as nx

from rnnfuse import rules
from rnnfuse.backends import get_backend
from rnnfuse.passes.candidates import Candidates, find_candidates
from rnnfuse.passes.notes import model_notes
from rnnfuse.passes.result import PassOptions, PassResult
from rnnfuse.reasons import Reason
from rnnfuse.recurrent import RecurrentView
from rnnfuse.report import FusionGroup, FusionReport

__all__ = ["default_min_layers", "is_absorbable_dropout", "plan_fusion", "planning_pass"]


def is_absorbable_dropout(layer: Any) -> bool:
    """A plain `Dropout` (per element, per time step) between RNN layers."""
    return (
        type(layer) is keras.layers.Dropout
        and layer.noise_shape is None
        and 0.0 <= float(layer.rate) < 1.0
        # Its output stays inside the fused call, where no regularizer sees it.
        and layer.activity_regularizer is None
    )


# One level is worth a group: a layer in Keras' generic loop gains from one
# cuDNN call, an LSTM/GRU from rnnfuse's op, and the plan keeps the original
# where that is not faster. A lone ProjectedLSTM runs its own fast path.
MIN_LAYERS_ONE = 1
MIN_LAYERS_PROJECTED = 2


def default_min_layers(views: list[RecurrentView]) -> int:
    """The default least number of levels for a run of `views`: 2 for
    ProjectedLSTM, else 1 (a lone layer is a group).

    >>> import keras
    >>> from rnnfuse.recurrent import describe
    >>> layer = keras.layers.LSTM(4)
    >>> _ = layer(keras.ops.zeros((1, 3, 2)))
    >>> default_min_layers([describe(layer)])
    1
    """
    if any(v.proj_size for v in views):
        return MIN_LAYERS_PROJECTED
    return MIN_LAYERS_ONE


def planning_pass(model: keras.Model, so_far: PassResult, options: PassOptions) -> PassResult:
    """Pass 3: the report of `plan_fusion`, with notes on the whole model."""
    if so_far.graph is None:
        report = _subclassed_report(model, so_far.candidates)
    else:
        report = _plan(
            so_far.graph, so_far.candidates, model.name, options.min_layers, options.absorb_dropout
        )
        extra = model_notes(model, report)
        if extra:
            report = dataclasses.replace(report, notes=tuple(report.notes) + tuple(extra))
    return dataclasses.replace(so_far, report=report)


def plan_fusion(
    graph: nx.DiGraph,
    *,
    model_name: str,
    min_layers: int | None = None,
    absorb_dropout: bool = True,
) -> FusionReport:
    """A `FusionReport` of the fusable runs in `graph` (from
    `build_layer_graph`) and a reason for every other recurrent layer;
    `min_layers` (None: `default_min_layers`) and `absorb_dropout` as for
    `rnnfuse.analyze`."""
    candidates = find_candidates(graph, get_backend().activation_functions())
    return _plan(graph, candidates, model_name, min_layers, absorb_dropout)


def _plan(graph, candidates: Candidates, model_name, min_layers, absorb_dropout) -> FusionReport:
    """Steps 2 to 4 over the rules pass's `candidates`."""
    backend = get_backend()
    views, reasons = dict(candidates.views), dict(candidates.reasons)
    # A backend without seeded between-level dropout never absorbs Dropout.
    absorb_dropout = absorb_dropout and backend.capabilities.absorbs_dropout
    chain, link_reasons, bridges = _links(graph, views, candidates.recurrent, absorb_dropout)
    groups, in_group = [], set()
    runs = []
    for run in _runs(chain, views, graph):
        runs += _split_by_dropout(graph, run, bridges, link_reasons)
    least = {}
    for run in runs:
        levels = sum(views[k].num_levels for k in run)
        need = min_layers if min_layers is not None else default_min_layers([views[k] for k in run])
        least.update({k: need for k in run})
        too_short = rules.min_layers_reason(run, levels, need)
        if too_short is None:
            groups.append(_group(graph, run, views, bridges))
            in_group.update(run)
        elif len(run) > 1:
            for key in run:
                reasons[key] = too_short
    for key in views:
        if key not in in_group and key not in reasons:
            need = least.get(key)
            if need is None:
                need = min_layers if min_layers is not None else default_min_layers([views[key]])
            reasons[key] = rules.lone_reason(
                graph, key, views[key].num_levels, reasons, link_reasons, need
            )
    kept = []
    for group in groups:
        why = rules.backend_reason(backend, group)
        if why is None:
            kept.append(group)
            continue
        for key in group.layers:
            reasons[key] = why
    groups = kept
    # In graph order; layers inside a node (a wrapper, a custom layer, a
    # subclassed model) right after it.
    order = {k: i for i, k in enumerate(_graph_order(graph))}
    container = lambda k: k if k in order else k.rsplit("/", 1)[0]
    skipped = {
        k: reasons[k]
        for k in sorted(reasons, key=lambda k: (order.get(container(k), len(order)), k not in order))
    }
    notes = tuple(graph.graph.get("notes", ()))
    grouped = {k for g in groups for k in g.layers}
    breaks = {
        pair: reason
        for pair, reason in link_reasons.items()
        if pair[0] in grouped and pair[1] in grouped
    }
    return FusionReport(
        model_name=model_name,
        groups=tuple(groups),
        skipped=skipped,
        notes=notes,
        breaks=breaks,
    )


def _graph_order(graph: nx.DiGraph) -> list[str]:
    return list(nx.lexicographical_topological_sort(graph)) if nx.is_directed_acyclic_graph(graph) else list(graph)


def _links(graph: nx.DiGraph, views: dict, recurrent: frozenset, absorb_dropout: bool):
    """Step 2: the passing links (a chain DiGraph) and the failing ones."""
    chain = nx.DiGraph()
    chain.add_nodes_from(views)
    link_reasons: dict[tuple[str, str], Reason] = {}
    bridges: dict[tuple[str, str], tuple[str, ...]] = {}
    for key, view in views.items():
        target, via = _reader(graph, key, recurrent, absorb_dropout)
        if target is None or target not in views:
            continue
        reason = rules.link_reason(graph, key, target, view, views[target], via)
        if reason is None:
            chain.add_edge(key, target)
            bridges[(key, target)] = via
        else:
            link_reasons[(key, target)] = reason
    # A layer read by two passing links cannot happen (one sequence input),
    # but guard the path shape the later steps rely on.
    for node in list(chain):
        preds = list(chain.predecessors(node))
        for extra in preds[1:]:
            chain.remove_edge(extra, node)
    return chain, link_reasons, bridges


def _reader(graph: nx.DiGraph, key: str, recurrent: frozenset, absorb_dropout: bool):
    """(the recurrent layer that reads `key`'s output or None, the Dropout keys between)."""
    succ = list(graph.successors(key))
    if len(succ) != 1:
        # Several readers: report the link to a recurrent one, if any.
        rnn = [s for s in succ if s in recurrent]
        return (rnn[0], ()) if rnn else (None, ())
    (nxt,) = succ
    data = graph.nodes[nxt]
    if data["kind"] == "layer" and absorb_dropout and is_absorbable_dropout(data["layer"]):
        after = list(graph.successors(nxt))
        if len(after) == 1 and after[0] in recurrent:
            return after[0], (nxt,)
        return None, ()
    return (nxt, ()) if nxt in recurrent else (None, ())


def _runs(chain: nx.DiGraph, views: dict, graph: nx.DiGraph) -> list[list[str]]:
    """Step 3: the paths of the chain graph, bottom to top, in graph order."""
    order = {k: i for i, k in enumerate(_graph_order(graph))}
    runs = []
    for component in nx.weakly_connected_components(chain):
        runs.append(list(nx.topological_sort(chain.subgraph(component))))
    runs.sort(key=lambda run: order.get(run[0], 0))
    return runs


def _gap_rate(graph, bridges, upper, lower) -> float | None:
    via = bridges[(upper, lower)]
    return float(graph.nodes[via[0]]["layer"].rate) if via else None


def _split_by_dropout(graph, run, bridges, link_reasons) -> list[list[str]]:
    """Splits `run` at the first gap whose absorbed dropout differs from the
    gaps before it (cuDNN applies one rate between every pair of levels)."""
    pieces, current, rate = [], [run[0]], None
    for upper, lower in zip(run, run[1:]):
        gap = _gap_rate(graph, bridges, upper, lower)
        if len(current) == 1:
            rate = gap
        reason = rules.dropout_between(upper, lower, gap, rate)
        if reason is None:
            current.append(lower)
            continue
        link_reasons[(upper, lower)] = reason
        pieces.append(current)
        current, rate = [lower], None
    pieces.append(current)
    return pieces


def _group(graph, run, views, bridges) -> FusionGroup:
    first = views[run[0]]
    absorbed = tuple(
        b for upper, lower in zip(run, run[1:]) for b in bridges[(upper, lower)]
    )
    return FusionGroup(
        layers=tuple(run),
        cell=first.kind,
        units=first.units,
        num_layers=sum(views[k].num_levels for k in run),
        input_size=first.input_size,
        bidirectional=first.bidirectional,
        proj_size=first.proj_size,
        absorbed_dropout=absorbed,
        scope=graph.nodes[run[0]]["scope"],
        dtype=str(first.layer.compute_dtype),
        views=tuple(views[k] for k in run),
        gap_dropout=tuple(
            graph.nodes[bridges[(u, l)][0]]["layer"] if bridges[(u, l)] else None
            for u, l in zip(run, run[1:])
        ),
    )


def _subclassed_report(model: keras.Model, candidates: Candidates) -> FusionReport:
    note = (
        f"'{model.name}' is a subclassed model ({type(model).__name__}): rnnfuse "
        "cannot see inside its call(). Build it as a Functional or Sequential "
        "model to fuse its recurrent layers."
    )
    skipped = dict(candidates.reasons)
    return FusionReport(model_name=model.name, groups=(), skipped=skipped, notes=(note,))
