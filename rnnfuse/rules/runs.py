"""Run and backend rules: which runs of linked layers become groups.

The planner (`rnnfuse.passes.planning`) finds the runs; these checks say
why a run, or a layer left alone, does not become a fusion group. Each is
registered with scope "run" (or "backend") and returns a `Reason` or None.

Example:
    >>> _min_layers(("a",), 1, 2).rule
    'min_layers'
"""

from __future__ import annotations

from typing import Any

from rnnfuse.reasons import Reason
from rnnfuse.rules.registry import rule

__all__ = ["backend_reason", "dropout_between", "lone_reason", "min_layers_reason"]


def _describe_gap(rate):
    return "no Dropout" if rate is None else f"Dropout({rate})"


@rule("dropout_between", "run", "the Dropout between two layers of a run differs from the gaps before it (cuDNN applies one rate)")
def dropout_between(upper: str, lower: str, gap, rate) -> Reason | None:
    """`gap`: the rate of the Dropout between `upper` and `lower` (None:
    none); `rate`: that of the run's gaps before it."""
    if gap == rate:
        return None
    return Reason(
        "dropout_between",
        f"between '{upper}' and '{lower}' there is {_describe_gap(gap)}, "
        f"but the run before it has {_describe_gap(rate)}; cuDNN applies "
        "one dropout rate between every pair of layers",
    )


@rule("min_layers", "run", "a run with fewer recurrent levels than min_layers")
def _min_layers(run, levels: int, min_layers: int) -> Reason | None:
    if levels >= min_layers:
        return None
    if len(run) == 1:
        return Reason("min_layers", f"min_layers={min_layers}")
    return Reason(
        "min_layers",
        f"its run ({' -> '.join(run)}) has {levels} recurrent "
        f"levels, fewer than min_layers={min_layers}",
    )


min_layers_reason = _min_layers


@rule("neighbour_unfusable", "run", "a layer that could fuse, alone too short, whose recurrent neighbour cannot fuse")
def _neighbour_unfusable(neighbour: str, reason: Reason) -> Reason:
    return Reason(
        "neighbour_unfusable",
        f"its neighbour '{neighbour}' cannot be fused ({reason.rule}): {reason}",
    )


@rule("not_stacked", "run", "a lone recurrent layer with no recurrent layer it could fuse with, shorter than min_layers")
def _not_stacked(feeds: str, levels: int, min_layers: int) -> Reason:
    return Reason(
        "not_stacked",
        "no recurrent layer it could be fused with directly before or "
        f"after it (its output feeds {feeds or 'nothing'}); a single layer "
        f"has {levels} recurrent level(s), fewer than min_layers={min_layers}",
    )


def lone_reason(graph, key, levels, reasons, link_reasons, min_layers) -> Reason:
    """Why an eligible layer ended up alone: a failed link (that link's
    rule), an unfusable neighbour, too few levels, or nothing to stack with."""
    for (upper, lower), reason in link_reasons.items():
        if key in (upper, lower):
            return reason.prefixed("not stacked with its neighbour: ")
    for neighbour in list(graph.successors(key)) + list(graph.predecessors(key)):
        if neighbour in reasons:
            return _neighbour_unfusable(neighbour, reasons[neighbour])
    if min_layers <= levels:
        # Eligible and long enough alone: reaching here means min_layers
        # allows it but the planner kept it out (should not happen).
        return Reason("min_layers", f"min_layers={min_layers}")
    feeds = ", ".join(
        "a model output"
        if graph.nodes[s]["kind"] == "output"
        else f"'{s}' ({type(graph.nodes[s]['layer']).__name__})"
        for s in graph.successors(key)
    )
    return _not_stacked(feeds, levels, min_layers)


@rule("backend", "backend", "the active Keras backend has no fused kernel, or never runs this kind of group (JAX: an LSTM whose first layer reads backwards)")
def backend_reason(backend: Any, group: Any) -> Reason | None:
    """Why `backend` (a `rnnfuse.backends.Backend`) never fuses `group`."""
    why = backend.group_reason(group)
    if why is None:
        return None
    if not backend.capabilities.fused_kernel:
        return Reason("backend", why)
    return Reason("backend", f"{why} (run {' -> '.join(group.layers)})")
