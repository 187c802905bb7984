"""Plans: how one fusion group runs, and the groups a plan turns into.

A `Plan` says how to run a group of `n` recurrent layers:

- `pieces=(n,)`: the whole run as one fused call;
- `pieces=(a, b, ...)`: consecutive sub-runs, each one fused call
  (a + b + ... = n);
- `pieces=()`: the original layers, one Keras call each;

and, for fused pieces, which cuDNN algorithm their forward kernel uses
(None: cuDNN's standard algorithm).

`candidate_plans(group)` lists what the tuner times; `split_groups` turns
groups and their plans into the groups the rewrite builds.

Example:

    >>> Plan((2, 2), "persistent_static+tc").name
    'split 2+2 @persistent_static+tc'
    >>> Plan(()).name
    'per-layer'
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from rnnfuse.report import FusionGroup
from rnnfuse.backends.algorithm import Algorithm

__all__ = ["Plan", "FUSED", "PER_LAYER", "candidate_plans", "split_groups"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to run one fusion group."""

    # Sizes of the fused sub-runs, in layers, bottom to top; () = per-layer.
    pieces: tuple[int, ...] = ()
    # cuDNN algorithm of the fused pieces ("persistent_static+tc", ...), or
    # None for TensorFlow's default.
    algorithm: str | None = None
    # Whole-run marker: `pieces` is filled in for the group's length.
    whole: bool = False

    def __post_init__(self):
        if self.algorithm is not None:
            object.__setattr__(self, "algorithm", Algorithm.parse(self.algorithm).name)
        if any(p < 1 for p in self.pieces):
            raise ValueError(f"Plan pieces must be positive; received {self.pieces}")

    @property
    def name(self) -> str:
        if self.whole:
            base = "fused"
        elif not self.pieces:
            return "per-layer"
        elif len(self.pieces) == 1:
            base = "fused"
        else:
            base = "split " + "+".join(str(p) for p in self.pieces)
        return base + (f" @{self.algorithm}" if self.algorithm else "")

    def for_length(self, n: int) -> "Plan":
        """This plan with `pieces` spelled out for a group of `n` layers."""
        if self.whole:
            return Plan((n,), self.algorithm)
        if self.pieces and sum(self.pieces) != n:
            raise ValueError(
                f"plan {self.name!r} covers {sum(self.pieces)} layers; the group has {n}"
            )
        return self

    def to_dict(self) -> dict:
        return {"pieces": list(self.pieces), "algorithm": self.algorithm}

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        return cls(tuple(int(p) for p in d["pieces"]), d.get("algorithm"))


FUSED = Plan(whole=True)
PER_LAYER = Plan(())

# The algorithms the tuner tries for fused pieces (None: the standard one).
# On TensorFlow they need rnnfuse's own op, which runs the algorithm in the
# backward pass too (the backend's TUNED_ALGORITHMS is (None,) without it).
CANDIDATE_ALGORITHMS: tuple[str | None, ...] = (
    None,
    "persistent_static+tc",
    "persistent_dynamic+tc",
)


def candidate_plans(
    group: FusionGroup,
    algorithms: Sequence[str | None] = CANDIDATE_ALGORITHMS,
    *,
    one_per_layer: bool = False,
) -> list[Plan]:
    """What the tuner times for `group`, the per-layer original first.

    The whole run; its two halves from 4 layers; with `one_per_layer`, one
    fused call per layer (from 2 layers); each with every algorithm. Runs
    with an absorbed Dropout are not split (the dropout lives in the fused
    call).
    """
    n = len(group.layers)
    shapes: list[tuple[int, ...]] = [(n,)]
    if n >= 4 and not group.absorbed_dropout:
        shapes.append((n // 2, n - n // 2))
    if one_per_layer and n >= 2 and not group.absorbed_dropout:
        shapes.append((1,) * n)
    plans = [PER_LAYER]
    for pieces in shapes:
        for algorithm in algorithms:
            plans.append(Plan(pieces, algorithm))
    return plans


def split_groups(
    groups: Iterable[FusionGroup], plans: Sequence[Plan]
) -> list[tuple[FusionGroup, str | None]]:
    """The (group, algorithm) pairs to fuse under `plans`.

    A per-layer plan drops its group (its layers stay as they are); a split
    plan gives one group per piece.
    """
    out = []
    for group, plan in zip(groups, plans):
        plan = plan.for_length(len(group.layers))
        keys = iter(group.absorbed_dropout)
        gap_keys = [None if d is None else next(keys) for d in group.gap_dropout]
        start = 0
        for size in plan.pieces:
            stop = start + size
            if stop < len(group.layers) and gap_keys[stop - 1] is not None:
                raise ValueError(
                    f"plan {plan.name!r} splits {' -> '.join(group.layers)} at "
                    f"the absorbed Dropout '{gap_keys[stop - 1]}'; split elsewhere"
                )
            views = group.views[start:stop]
            out.append(
                (
                    dataclasses.replace(
                        group,
                        layers=group.layers[start:stop],
                        num_layers=sum(v.num_levels for v in views),
                        input_size=views[0].input_size,
                        absorbed_dropout=tuple(
                            k for k in gap_keys[start : stop - 1] if k is not None
                        ),
                        views=views,
                        gap_dropout=group.gap_dropout[start : stop - 1],
                    ),
                    plan.algorithm,
                )
            )
            start = stop
    return out
