"""Pass 2: the fusion rules, as small checks that return a `Reason`.

Two kinds of rule:

- layer rules (`layer_reason`): can this recurrent layer take part in a
  fused run at all? (`describe` in `rnnfuse.recurrent` holds the rules about
  the layer's own arguments; this module adds the graph rules.)
- link rules (`link_reason`, `stack_link_reason`): can `upper` feed `lower`
  inside one fused call?

Every check returns None when the rule holds and a `Reason` when it does not;
none of them raises. `stack_link_reason` needs only the two layers, so the
`FusedRNN` layer uses it too; `link_reason` adds the rules that need the
model graph (consumers, model outputs, extra arguments).

Rule names (the `Reason.rule` of each failure) are listed in docs/guide.md.

Example:

    >>> import keras
    >>> from rnnfuse.recurrent import describe
    >>> a = keras.layers.LSTM(8, return_sequences=True, name="a")
    >>> b = keras.layers.LSTM(16, name="b")
    >>> _ = b(a(keras.ops.zeros((1, 4, 3))))
    >>> stack_link_reason(describe(a), describe(b)).rule
    'units'
"""

from __future__ import annotations

import networkx as nx

from rnnfuse.reasons import Reason
from rnnfuse.recurrent import RecurrentView

__all__ = ["layer_reason", "link_reason", "stack_link_reason"]


def layer_reason(graph: nx.DiGraph, key: str) -> Reason | None:
    """Graph rules for one recurrent layer node (its own arguments aside)."""
    data = graph.nodes[key]
    if data["calls"] > 1:
        return Reason(
            "shared_layer",
            f"the layer is called {data['calls']} times in the model (a "
            "shared layer); only layers called once are fused",
        )
    return None


def stack_link_reason(upper: RecurrentView, lower: RecurrentView) -> Reason | None:
    """Rules for `upper` feeding `lower` inside one cuDNN call.

    These rules need only the two layers. `upper` is the layer below in the
    stack (it runs first); `lower` reads its output sequence.
    """
    u, l = upper.layer.name, lower.layer.name
    if lower.kind != upper.kind:
        return Reason(
            "cell_kind",
            f"'{l}' is a {lower.kind} layer and '{u}' a {upper.kind} layer; "
            "one cuDNN call runs one kind of cell",
        )
    if lower.units != upper.units:
        return Reason(
            "units",
            f"'{l}' has {lower.units} units and '{u}' has {upper.units}; one "
            "cuDNN call needs the same width in every layer",
        )
    if lower.proj_size != upper.proj_size:
        return Reason(
            "proj_size",
            f"'{l}' has proj_size={lower.proj_size} and '{u}' "
            f"proj_size={upper.proj_size}",
        )
    if lower.bidirectional != upper.bidirectional:
        which = lambda v: "bidirectional" if v.bidirectional else "unidirectional"
        return Reason(
            "direction",
            f"'{l}' is {which(lower)} and '{u}' is {which(upper)}",
        )
    if not upper.return_sequences:
        return Reason(
            "return_sequences",
            f"'{u}' has return_sequences=False, so only its last output "
            f"reaches '{l}'; every layer but the last of a run must return "
            "sequences",
        )
    if upper.return_state:
        return Reason(
            "return_state",
            f"'{u}' has return_state=True; only the last layer of a run may "
            "return its states",
        )
    if upper.bidirectional and upper.merge_mode != "concat":
        return Reason(
            "merge_mode",
            f"'{u}' merges its directions with merge_mode="
            f"{upper.merge_mode!r}; cuDNN feeds the next layer the "
            "concatenation, so only the last layer may use another merge_mode",
        )
    if lower.go_backwards:
        return Reason(
            "go_backwards",
            f"'{l}' has go_backwards=True but is not the first layer of the "
            "run: Keras reverses the input of every go_backwards layer, so "
            "such a stack alternates direction, which one cuDNN call cannot do",
        )
    if lower.dropout:
        return Reason(
            "dropout",
            f"'{l}' has dropout={lower.dropout}: its one-mask-per-sequence "
            "input dropout can only be applied before the first layer of a run",
        )
    if lower.layer.dtype_policy.name != upper.layer.dtype_policy.name:
        return Reason(
            "dtype_policy",
            f"'{l}' runs under dtype policy {lower.layer.dtype_policy.name!r} "
            f"and '{u}' under {upper.layer.dtype_policy.name!r}",
        )
    return None


def link_reason(
    graph: nx.DiGraph,
    upper_key: str,
    lower_key: str,
    upper: RecurrentView,
    lower: RecurrentView,
    bridges: tuple[str, ...] = (),
) -> Reason | None:
    """All rules for the link `upper_key` -> (`bridges`) -> `lower_key`.

    Args:
        graph: the layer graph.
        upper_key, lower_key: node keys of the two recurrent layers.
        upper, lower: their views.
        bridges: keys of layers between them that the fused call absorbs
            (a `Dropout`), in order.
    """
    reason = stack_link_reason(upper, lower)
    if reason is not None:
        return reason
    chain = [upper_key, *bridges, lower_key]
    for src, dst in zip(chain, chain[1:]):
        reason = _single_consumer_reason(graph, src, dst)
        if reason is not None:
            return reason
    upper_masks = graph.nodes[upper_key].get("mask_sources", frozenset())
    lower_masks = graph.nodes[lower_key].get("mask_sources", frozenset())
    if lower_masks != upper_masks:
        if not upper_masks:
            return Reason(
                "mask",
                f"'{upper_key}' runs without a mask but '{lower_key}' receives "
                "one (Keras passes no mask to a layer called with an "
                "initial_state); one fused call cannot mask only some layers",
            )
        return Reason(
            "mask",
            f"'{lower_key}' receives a different mask from '{upper_key}'; "
            "inside a run every layer must see the mask the first one "
            "passes on",
        )
    extra = [
        (src, d["role"])
        for src, _, d in graph.in_edges(lower_key, data=True)
        if src != chain[-2] and not (d["role"] == "mask" and (src, d["index"]) in lower_masks)
    ]
    for src, role in extra:
        if role == "initial_state":
            return Reason(
                "initial_state",
                f"'{lower_key}' gets an initial_state; only the "
                "first layer of a run may",
            )
        return Reason(
            "extra_input",
            f"'{lower_key}' also reads '{src}' "
            f"(as {role!r}); inside a run a layer may read only the layer "
            "before it",
        )
    return None


def _single_consumer_reason(graph: nx.DiGraph, src: str, dst: str) -> Reason | None:
    consumers = list(graph.successors(src))
    outputs = [c for c in consumers if graph.nodes[c]["kind"] == "output"]
    if outputs:
        where = graph.nodes[outputs[0]]["scope"].rstrip("/")
        model = f"nested model '{where}'" if where else "the model"
        return Reason(
            "model_output",
            f"the output of '{src}' is an output of {model}; "
            "only the last layer of a run may be read from outside it",
        )
    others = [c for c in consumers if c != dst]
    if others:
        names = ", ".join(f"'{c}'" for c in others)
        return Reason(
            "other_consumer",
            f"the output of '{src}' also feeds {names}; inside "
            "a run each layer's output may feed only the next layer",
        )
    if graph.edges[src, dst]["role"] != "sequence":
        return Reason(
            "not_sequence_input",
            f"'{dst}' reads '{src}' as "
            f"{graph.edges[src, dst]['role']!r}, not as its input sequence",
        )
    if graph.edges[src, dst]["index"] != 0:
        return Reason(
            "reads_state",
            f"'{dst}' reads a state of '{src}', "
            "not its output sequence",
        )
    return None
