"""The fusion rules, in one package with a registry.

Every rule is a `Rule` record in `RULES` (name, scope, one-line doc,
check); the modules register theirs in evaluation order:

- `layer`: can this layer be part of a fused call at all (its own
  arguments, its cells, its place in the graph)?
- `links`: can one layer feed the next inside one call?
- `runs`: which runs become groups; what the backend never fuses.
- `runtime`: why one `FusedRNN` call runs the original layers.

docs/guide.md's rule table is `markdown_table()`.

Adding a rule: one decorated check in the module of its scope (and the
regenerated table in docs/guide.md).

Example:

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
