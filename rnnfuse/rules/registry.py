"""The rule registry: every fusion rule, by name, with its scope and doc.

A `Rule` is a stable `name` (what `Reason.rule` says), a `scope`, a
one-line `doc` and a `check` that returns a `Reason` (or its message) or
None and never raises; `@rule(...)` registers it in evaluation order,
`first_reason` runs a scope's rules, and docs/guide.md's rule table is
`markdown_table()`. Scopes: "layer" (a layer on its own; `applies`: part,
cell, stack, bidirectional, node, container), "link" (edge, views,
graph), "run", "backend" and "runtime" (call, raised, plan).

>>> import rnnfuse.rules
>>> RULES[("layer", "recurrent_dropout")].scope
'layer'
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rnnfuse.reasons import Reason

__all__ = ["RULES", "SCOPES", "Rule", "first_reason", "markdown_table", "rule", "rules_for"]

SCOPES = ("layer", "link", "run", "backend", "runtime")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One fusion rule."""

    # Stable name; the `rule` of every Reason this check returns.
    name: str
    # "layer", "link", "run", "backend" or "runtime".
    scope: str
    # One line: what the rule refuses and why.
    doc: str
    # Returns a Reason when the rule fails, None when it holds.
    check: Callable = dataclasses.field(repr=False, compare=False)
    # Within a scope, what the check looks at (see the module doc).
    applies: str = ""


# (scope, name) -> Rule, in evaluation order; filled by @rule at import only.
RULES: dict[tuple[str, str], Rule] = {}


def rule(name: str, scope: str, doc: str, applies: str = "") -> Callable:
    """Registers the decorated check as rule `name` of `scope`."""
    if scope not in SCOPES:
        raise ValueError(f"rule scope must be one of {SCOPES}; received {scope!r}")

    def register(check: Callable) -> Callable:
        key = (scope, name)
        if key in RULES:
            raise ValueError(f"rule {name!r} of scope {scope!r} is registered twice")
        RULES[key] = Rule(name, scope, doc, _named(name, check), applies)
        return check

    return register


def _named(name: str, check: Callable) -> Callable:
    """`check`, with a bare message it returns made a Reason of rule `name`."""

    def named(*args):
        said = check(*args)
        return Reason(name, said) if said is not None and not isinstance(said, Reason) else said

    return named


# (scope, applies, len(RULES)) -> rules_for's answer: a call's runtime
# check asks the same question on every call.
_SELECTED: dict[tuple, tuple[Rule, ...]] = {}


def rules_for(scope: str, applies: str | None = None) -> list[Rule]:
    """The rules of `scope` (and `applies`), in evaluation order."""
    key = (scope, applies, len(RULES))
    found = _SELECTED.get(key)
    if found is None:
        found = _SELECTED[key] = tuple(
            r for r in RULES.values()
            if r.scope == scope and (applies is None or r.applies == applies))
    return list(found)


def first_reason(scope: str, applies: str, *args) -> Reason | None:
    """The Reason of the first rule of `scope` and `applies` that `args` fail, or None."""
    key = (scope, applies, len(RULES))
    for r in _SELECTED[key] if key in _SELECTED else rules_for(scope, applies):
        reason = r.check(*args)
        if reason is not None:
            return reason
    return None


def markdown_table() -> str:
    """The rule table of docs/guide.md: number, name, scope, doc."""
    lines = ["| # | rule | scope | what it refuses |", "|---|------|-------|-----------------|"]
    for i, r in enumerate(RULES.values(), start=1):
        lines.append(f"| {i} | `{r.name}` | {r.scope} | {r.doc} |")
    return "\n".join(lines)
