"""The records the passes share: what the caller asks, and what they found.

Every pass has one signature, `pass_(model, so_far, options) -> PassResult`
(torch.fx's `PassResult` is the model): it reads the input `model` (never
changed) and what the passes before it found, and returns a new record.

Example:
    >>> PassResult().modified, PassOptions().min_layers
    (False, None)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from rnnfuse.plan import Plan
from rnnfuse.report import FusionGroup, FusionReport, RewriteFailure

__all__ = ["PassOptions", "PassResult"]


@dataclasses.dataclass(frozen=True)
class PassOptions:
    """What the caller asks of the passes (see `rnnfuse.analyze`)."""

    # The least number of recurrent levels worth fusing (None: per kind).
    min_layers: int | None = None
    # Whether a Dropout between two recurrent layers joins their run.
    absorb_dropout: bool = True
    # report -> the (group, plan) pairs to fuse; None: stop before rewrite.
    # The caller's choice (the tuner, in rnnfuse.api), so no pass needs it.
    choose_plans: Callable[[FusionReport], Sequence[tuple[FusionGroup, Plan | None]]] | None = None


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What the passes found so far; each pass fills its own fields."""

    # The layer graph (graph pass); None for a model rnnfuse cannot see into.
    graph: Any = None
    # A view or a reason per recurrent layer (rules pass): `Candidates`.
    candidates: Any = None
    # The groups, every other layer's reason, and notes (planning pass).
    report: FusionReport | None = None
    # The (group, plan) pairs the rewrite fused (rewrite pass).
    plans: tuple[tuple[FusionGroup, Plan | None], ...] = ()
    # The new plain Keras model (rewrite pass); None before it runs.
    rewritten: Any = None
    # Groups whose fused layer could not be built, and why.
    failed: tuple[RewriteFailure, ...] = ()

    @property
    def modified(self) -> bool:
        """Whether the rewrite made a new model."""
        return self.rewritten is not None
