"""The fusion rules, in one package with a registry (`RULES`), by scope:
`layer` (can a layer fuse at all), `links` (can it feed the next inside
one call), `runs` (which runs become groups), `runtime` (why one call
runs the original layers). A new rule is one decorated check in the
module of its scope, and the regenerated table in docs/guide.md.

>>> sorted({r.scope for r in RULES.values()})
['backend', 'layer', 'link', 'run', 'runtime']
"""

from rnnfuse.rules.registry import RULES, SCOPES, Rule, markdown_table, rules_for
from rnnfuse.rules.layer import layer_reason, recurrent_sublayers, subclassed_model, wrapped_layer
from rnnfuse.rules.links import link_reason, stack_link_reason
from rnnfuse.rules.runs import backend_reason, dropout_between, lone_reason, min_layers_reason
from rnnfuse.rules.runtime import not_implemented, runtime_reason

__all__ = [
    "RULES",
    "SCOPES",
    "Rule",
    "backend_reason",
    "dropout_between",
    "layer_reason",
    "link_reason",
    "lone_reason",
    "markdown_table",
    "min_layers_reason",
    "not_implemented",
    "recurrent_sublayers",
    "rules_for",
    "runtime_reason",
    "stack_link_reason",
    "subclassed_model",
    "wrapped_layer",
]
