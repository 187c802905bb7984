"""The plans the tuner times for a group, and the groups a plan turns into.

`candidate_plans(group)` lists what the tuner times; `kernel_plans` adds
the whole run (or the fewest segments it takes, `kernel_segments`) on
each kernel besides cuDNN the backend runs for the mode; `split_groups`
turns groups and their plans into the groups the rewrite builds.

Example:
    >>> import types
    >>> group = types.SimpleNamespace(layers=("a", "b", "c", "d"), absorbed_dropout=())
    >>> [p.name for p in candidate_plans(group, [None, "persistent_static+tc"])]
    ['per-layer', 'fused', 'fused @persistent_static+tc', 'split 2+2', 'split 2+2 @persistent_static+tc']
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence

from rnnfuse.plan import PER_LAYER, Plan
from rnnfuse.report import FusionGroup

__all__ = ["CANDIDATE_ALGORITHMS", "DYNAMIC_MIN_UNITS", "PERSISTENT_MAX_BATCH", "candidate_plans",
           "dynamic_reason", "kernel_plans", "kernel_segments", "persistent_reason", "split_groups",
           "whole_run_twins"]

# The algorithms tried for fused pieces (None: standard); on TensorFlow only
# with rnnfuse's op, which runs them in the backward pass too.
CANDIDATE_ALGORITHMS: tuple[str | None, ...] = (
    None,
    "persistent_static+tc",
    "persistent_dynamic+tc",
)


# Above these batches cuDNN's persistent algorithms never came close, and
# their first calls cost most; bfloat16 has no bound.
PERSISTENT_MAX_BATCH = {"float32": 32, "float16": 128}


def persistent_reason(dtype: str, batch: int) -> str | None:
    """Why cuDNN's persistent algorithms are not timed at this batch
    (`PERSISTENT_MAX_BATCH`), or None.

    >>> persistent_reason("float32", 32) is None, persistent_reason("bfloat16", 512) is None
    (True, True)
    """
    bound = PERSISTENT_MAX_BATCH.get(str(dtype))
    if bound is None or int(batch) <= bound:
        return None
    return (f"not timed: at a batch over {bound} in {dtype}, persistent algorithms never "
            "came within 24% of the best in the measured matrix (PERSISTENT_MAX_BATCH)")


# From these widths in float16, persistent_dynamic ran 5-22x slower than the best
# plan in every measured case, and its first calls and timing cost seconds.
DYNAMIC_MIN_UNITS = {"float16": 384}


def dynamic_reason(dtype: str, units: int) -> str | None:
    """Why persistent_dynamic is not timed at this width, or None.

    >>> dynamic_reason("float16", 256) is None, dynamic_reason("bfloat16", 512) is None
    (True, True)
    """
    bound = DYNAMIC_MIN_UNITS.get(str(dtype))
    if bound is None or int(units) < bound:
        return None
    return (f"not timed: from {bound} units in {dtype}, persistent_dynamic ran 5-22x slower "
            "than the best plan in every measured case (DYNAMIC_MIN_UNITS)")


def candidate_plans(
    group: FusionGroup,
    algorithms: Sequence[str | None] = CANDIDATE_ALGORITHMS,
    *,
    one_per_layer: bool = False,
) -> list[Plan]:
    """What the tuner times for `group`, the original layers first: the whole
    run, its halves from 4 layers, with `one_per_layer` one fused call per
    layer, each with every algorithm; a run with an absorbed Dropout is not
    split."""
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


def whole_run_twins(plans: Sequence[Plan]) -> dict[str, str]:
    """{split's name: the whole run's on its kernel and algorithm}, among
    `plans`: the splits timed in a second stage, only where their twin came
    close. A split with no whole-run twin among them (wavefront segments
    where the kernel refuses the whole run) is not in it.

    >>> whole_run_twins([Plan((4,)), Plan((2, 2)), Plan((2, 2), "persistent_static")])
    {'split 2+2': 'fused'}
    """
    n = max((sum(p.pieces) for p in plans), default=0)
    wholes = {(p.kernel, p.algorithm): p.name for p in plans if p.pieces == (n,)}
    return {p.name: wholes[(p.kernel, p.algorithm)] for p in plans
            if len(p.pieces) > 1 and (p.kernel, p.algorithm) in wholes}


def kernel_plans(
    group: FusionGroup,
    shape: tuple,
    kernels: Sequence[str],
    reason_of: Callable[[str, FusionGroup, tuple], str | None],
) -> tuple[list[Plan], dict]:
    """(plans on `kernels` besides cuDNN that can run `group` at `shape`,
    {plan name: why not}); `reason_of` is the backend's `kernel_reason`.
    Where a kernel refuses the whole run, the fewest segments it takes each
    (`kernel_segments`) are a split plan on it.

    >>> import types
    >>> views = tuple(types.SimpleNamespace(num_levels=1, input_size=8) for _ in range(4))
    >>> group = FusionGroup(("a", "b", "c", "d"), "lstm", 8, 4, 8, False, views=views,
    ...                     gap_dropout=(None,) * 3)
    >>> two = lambda k, g, s: None if g.num_layers <= 2 else "too big"
    >>> [p.name for p in kernel_plans(group, (64, 10, 8), ["wavefront"], two)[0]]
    ['split 2+2 on wavefront']
    """
    plans, rejected = [], {}
    for kernel in kernels:
        plan = Plan((len(group.layers),), kernel=kernel)
        reason = reason_of(kernel, group, shape)
        if reason is None:
            plans.append(plan)
            continue
        pieces = kernel_segments(group, shape, lambda g, s: reason_of(kernel, g, s))
        if isinstance(pieces, tuple) and len(pieces) > 1:
            split = plan.with_pieces(pieces)
            plans.append(split)
            reason = f"{reason}; timed as segments that each fit instead: {split.name}"
        rejected[plan.name] = str(reason)
    return plans, rejected


def kernel_segments(
    group: FusionGroup,
    shape: tuple,
    reason_of: Callable[[FusionGroup, tuple], str | None],
) -> tuple[int, ...] | str:
    """The fewest balanced consecutive segments of `group` a kernel takes
    each, or why there are none (an absorbed Dropout, a single layer, a
    bidirectional run: the kernel runs those a layer a launch anyway).

    >>> import types
    >>> views = [types.SimpleNamespace(num_levels=1, input_size=n) for n in (5, 8, 8)]
    >>> group = FusionGroup(("a", "b", "c"), "lstm", 8, 3, 5, False, views=tuple(views),
    ...                     gap_dropout=(None, None))
    >>> kernel_segments(group, (4, 7, 5), lambda g, s: None if g.num_layers < 3 else "big")
    (2, 1)
    """
    from rnnfuse.backends.cuda.segments import fewest_balanced

    n = len(group.layers)
    if n < 2:
        return "one layer: nothing to segment"
    if group.absorbed_dropout:
        return "a run with an absorbed Dropout is not split"
    if group.bidirectional:
        return "a bidirectional run takes one launch a layer already"

    def refusal(start: int, stop: int) -> str | None:
        sizes = tuple(s for s in (start, stop - start, n - stop) if s)
        sub = split_groups([group], [Plan(sizes)])[1 if start else 0][0]
        width = shape[2] if start == 0 else sub.input_size
        return reason_of(sub, (shape[0], shape[1], width, *shape[3:]))

    return fewest_balanced(n, refusal)


def split_groups(
    groups: Iterable[FusionGroup], plans: Sequence[Plan]
) -> list[tuple[FusionGroup, Plan]]:
    """The (group, plan) pairs to fuse: a per-layer plan drops its group, a
    split plan gives one group per piece (same kernel and algorithm)."""
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
                    plan.with_pieces((size,)),
                )
            )
            start = stop
    return out

