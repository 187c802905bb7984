"""Link rules: can `upper` feed `lower` inside one fused call?

"views" rules need only the two layers' `RecurrentView`s
(`stack_link_reason`), so `FusedRNN` checks them too; "edge" and "graph"
rules need the model graph (the edge's role, other consumers, model
outputs, masks, extra inputs). `link_reason` runs the edge rules, the
views rules, then the graph rules; the first failing one's `Reason` wins.

>>> import keras
>>> from rnnfuse.recurrent import describe
>>> a, b = keras.layers.LSTM(8, return_sequences=True), keras.layers.LSTM(16)
>>> _ = b(a(keras.ops.zeros((1, 4, 3))))
>>> stack_link_reason(describe(a), describe(b)).rule
'units'
"""

from __future__ import annotations

import networkx as nx

from rnnfuse.reasons import Reason
from rnnfuse.recurrent import STACKABLE_MERGES, RecurrentView
from rnnfuse.rules.registry import first_reason, rule

__all__ = ["link_reason", "stack_link_reason"]


def stack_link_reason(upper: RecurrentView, lower: RecurrentView) -> Reason | None:
    """The "views" link rules for `upper` (the layer below, which runs first)
    feeding `lower` in one call."""
    return first_reason("link", "views", upper, lower)


def link_reason(
    graph: nx.DiGraph,
    upper_key: str,
    lower_key: str,
    upper: RecurrentView,
    lower: RecurrentView,
    bridges: tuple[str, ...] = (),
) -> Reason | None:
    """All link rules for `upper_key` -> (`bridges`: absorbed Dropout keys)
    -> `lower_key` in `graph`, with the two layers' views."""
    edge = (graph, upper_key, lower_key, bridges)
    return (first_reason("link", "edge", *edge) or stack_link_reason(upper, lower)
            or first_reason("link", "graph", *edge))


def _hops(upper_key, lower_key, bridges):
    chain = [upper_key, *bridges, lower_key]
    return list(zip(chain, chain[1:]))


# -- edge roles: does `lower` read `upper`'s output sequence? ------------------------


@rule("not_sequence_input", "link", "the next layer reads this layer's output as another argument (initial_state, mask), not as its input sequence", "edge")
def _not_sequence_input(graph, upper_key, lower_key, bridges):
    for src, dst in _hops(upper_key, lower_key, bridges):
        role = graph.edges[src, dst]["role"]
        if role != "sequence":
            return f"'{dst}' reads '{src}' as {role!r}, not as its input sequence"
    return None


@rule("reads_state", "link", "the next layer reads a state of this layer, not its output sequence", "edge")
def _reads_state(graph, upper_key, lower_key, bridges):
    for src, dst in _hops(upper_key, lower_key, bridges):
        if graph.edges[src, dst]["index"] != 0:
            return f"'{dst}' reads a state of '{src}', not its output sequence"
    return None


# -- the two layers ----------------------------------------------------------------------


def _views_rule(name: str, doc: str, fails, says: str) -> None:
    """Registers the "views" rule `name`: where `fails(upper, lower)`, the
    Reason is `says` formatted with the two views as `upper` and `lower`."""
    rule(name, "link", doc, "views")(
        lambda upper, lower: says.format(upper=upper, lower=lower) if fails(upper, lower) else None)


_views_rule("cell_kind", "the two layers have different cell kinds", lambda u, l: l.kind != u.kind,
            "'{lower.layer.name}' is a {lower.kind} layer and '{upper.layer.name}' a {upper.kind} layer; one cuDNN call runs one kind of cell")
_views_rule("units", "the two layers have different widths", lambda u, l: l.units != u.units,
            "'{lower.layer.name}' has {lower.units} units and '{upper.layer.name}' has {upper.units}; one cuDNN call needs the same width in every layer")
_views_rule("proj_size", "the two layers have different projection widths", lambda u, l: l.proj_size != u.proj_size,
            "'{lower.layer.name}' has proj_size={lower.proj_size} and '{upper.layer.name}' proj_size={upper.proj_size}")


@rule("direction", "link", "one layer is bidirectional and the other is not", "views")
def _direction(upper, lower):
    if lower.bidirectional != upper.bidirectional:
        which = lambda v: "bidirectional" if v.bidirectional else "unidirectional"
        return f"'{lower.layer.name}' is {which(lower)} and '{upper.layer.name}' is {which(upper)}"
    return None


_views_rule("return_sequences", "a layer below the top of a run returns only its last output", lambda u, l: not u.return_sequences,
            "'{upper.layer.name}' has return_sequences=False, so only its last output reaches '{lower.layer.name}'; every layer but the last of a run must return sequences")
_views_rule("return_state", "a layer below the top of a run returns its states", lambda u, l: u.return_state,
            "'{upper.layer.name}' has return_state=True; only the last layer of a run may return its states")
_views_rule("merge_mode", "a Bidirectional below the top of a run merges its directions by 'mul' or returns them apart (merge_mode=None); only concat, sum and ave can be packed",
            lambda u, l: u.bidirectional and u.merge_mode not in STACKABLE_MERGES,
            "'{upper.layer.name}' merges its directions with merge_mode={upper.merge_mode!r}; cuDNN feeds the next layer the concatenation "
            "of the two, which its input kernel can turn into their sum or average but not into this, so below the last layer of a run "
            "only merge_mode 'concat', 'sum' or 'ave' can be packed")
_views_rule("activity_regularizer", "a layer below the top of a run has an activity_regularizer, which needs its output sequence (one fused call returns only the top layer's)",
            lambda u, l: u.layer.activity_regularizer is not None,
            "'{upper.layer.name}' has an activity_regularizer, which Keras applies to its output sequence; inside a fused call with "
            "'{lower.layer.name}' that sequence never leaves the kernel, so only the last layer of a run may have one")
_views_rule("go_backwards", "a go_backwards layer that is not the first of its run", lambda u, l: l.go_backwards,
            "'{lower.layer.name}' has go_backwards=True but is not the first layer of the run: Keras reverses the input of every "
            "go_backwards layer, so such a stack alternates direction, which one cuDNN call cannot do")
_views_rule("dropout", "input dropout on a layer that is not the first of its run", lambda u, l: l.dropout,
            "'{lower.layer.name}' has dropout={lower.dropout}: its one-mask-per-sequence input dropout can only be applied before the first layer of a run")
_views_rule("dtype_policy", "the two layers run under different dtype policies",
            lambda u, l: l.layer.dtype_policy.name != u.layer.dtype_policy.name,
            "'{lower.layer.name}' runs under dtype policy {lower.layer.dtype_policy.name!r} and '{upper.layer.name}' under {upper.layer.dtype_policy.name!r}")


# -- the rest of the graph -------------------------------------------------------------------


@rule("model_output", "link", "an intermediate layer's output is also a model output", "graph")
def _model_output(graph, upper_key, lower_key, bridges):
    for src, _ in _hops(upper_key, lower_key, bridges):
        outputs = [c for c in graph.successors(src) if graph.nodes[c]["kind"] == "output"]
        if outputs:
            where = graph.nodes[outputs[0]]["scope"].rstrip("/")
            model = f"nested model '{where}'" if where else "the model"
            return (f"the output of '{src}' is an output of {model}; only the last layer of a run may "
                    "be read from outside it")
    return None


@rule("other_consumer", "link", "an intermediate layer's output also feeds another layer", "graph")
def _other_consumer(graph, upper_key, lower_key, bridges):
    for src, dst in _hops(upper_key, lower_key, bridges):
        others = [c for c in graph.successors(src) if c != dst]
        if others:
            names = ", ".join(f"'{c}'" for c in others)
            return f"the output of '{src}' also feeds {names}; inside a run each layer's output may feed only the next layer"
    return None


@rule("mask", "link", "the two layers see different masks", "graph")
def _mask(graph, upper_key, lower_key, bridges):
    upper_masks = graph.nodes[upper_key].get("mask_sources", frozenset())
    lower_masks = graph.nodes[lower_key].get("mask_sources", frozenset())
    if lower_masks == upper_masks:
        return None
    if not upper_masks:
        return (f"'{upper_key}' runs without a mask but '{lower_key}' receives one (Keras passes no "
                "mask to a layer called with an initial_state); one fused call cannot mask only some "
                "layers")
    return (f"'{lower_key}' receives a different mask from '{upper_key}'; inside a run every layer "
            "must see the mask the first one passes on")


def _extra_inputs(graph, upper_key, lower_key, bridges):
    previous = ([upper_key, *bridges])[-1]
    lower_masks = graph.nodes[lower_key].get("mask_sources", frozenset())
    return [
        (src, d["role"])
        for src, _, d in graph.in_edges(lower_key, data=True)
        if src != previous and not (d["role"] == "mask" and (src, d["index"]) in lower_masks)
    ]


@rule("initial_state", "link", "a layer that is not the first of its run gets an initial_state", "graph")
def _initial_state(graph, upper_key, lower_key, bridges):
    for src, role in _extra_inputs(graph, upper_key, lower_key, bridges)[:1]:
        if role == "initial_state":
            return f"'{lower_key}' gets an initial_state; only the first layer of a run may"
    return None


@rule("extra_input", "link", "a layer inside a run also reads another tensor (constants, a second input)", "graph")
def _extra_input(graph, upper_key, lower_key, bridges):
    for src, role in _extra_inputs(graph, upper_key, lower_key, bridges)[:1]:
        return f"'{lower_key}' also reads '{src}' (as {role!r}); inside a run a layer may read only the layer before it"
    return None
