"""Stacks larger than the chip: consecutive wavefront segments that each fit.

A stack whose weights do not fit on chip is refused whole; run as
consecutive segments, each one launch over a sub-stack reading the one
below's output sequence, it takes T * S + L - S dependent steps for S
segments, against L * T for cuDNN a layer at a time.

`fewest_balanced(n, refusal)` chooses the segmentation from a refusal of
sub-stacks (layers[start:stop] -> why not, or None): the fewest segments,
then the smallest largest one (ties: larger at the bottom), asking each
sub-stack at most once. `stack_segments` applies it to the library's plan
check; the tuner to the backend's `kernel_reason`.

Example (the refusal of a plan that holds at most 4 layers):

    >>> fewest_balanced(8, lambda a, b: None if b - a <= 4 else "too big")
    (4, 4)
    >>> fewest_balanced(7, lambda a, b: None if b - a <= 4 else "too big")
    (4, 3)
    >>> fewest_balanced(5, lambda a, b: None if b - a <= 2 else "too big")
    (2, 2, 1)
    >>> fewest_balanced(3, lambda a, b: "float32")
    'float32'
"""

from __future__ import annotations

import functools
from typing import Callable

__all__ = ["fewest_balanced", "stack_segments"]


def fewest_balanced(n: int, refusal: Callable[[int, int], str | None]) -> tuple[int, ...] | str:
    """The segment sizes (bottom to top, adding up to `n`) of the fewest
    consecutive sub-stacks that `refusal(start, stop)` all accept, the
    largest of them as small as possible; or the reason no segmentation
    exists (`refusal(0, 1)`, else the first refused single layer's).

    Raises:
        ValueError: `n` is not a positive layer count."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"fewest_balanced: n must be a positive layer count; received {n!r}")
    ask = functools.lru_cache(maxsize=None)(refusal)
    # best[i]: (segments, largest, sizes) of layers[i:], lexicographically
    # least in (segments, largest); None where layers[i:] cannot be cut.
    # The suffix's best is enough: (k + 1, max(s, m)) grows with (k, m).
    best: list[tuple[int, int, tuple[int, ...]] | None] = [None] * (n + 1)
    best[n] = (0, 0, ())
    for i in range(n - 1, -1, -1):
        for size in range(n - i, 0, -1):  # larger first: ties keep the bottom segment larger
            rest = best[i + size]
            if rest is None or ask(i, i + size) is not None:
                continue
            option = (rest[0] + 1, max(size, rest[1]), (size,) + rest[2])
            if best[i] is None or option[:2] < best[i][:2]:
                best[i] = option
    if best[0] is not None:
        return best[0][2]
    for i in range(n):
        reason = ask(i, i + 1)
        if reason is not None:
            return reason
    # Unreachable: where every layer fits alone, one segment a layer fits.
    return "no segmentation of the stack fits the kernel"


def stack_segments(lib, kind: str, num_layers: int, units: int, batch: int, steps: int,
                   input_size: int, *, sms: int, smem: int,
                   training: bool = False) -> tuple[int, ...] | str:
    """`fewest_balanced` on the library's plan check for device limits `sms`,
    `smem` (no GPU needed): each segment's forward plan and, with `training`,
    the backward's per-layer plan.

    >>> from rnnfuse.backends.cuda import library  # doctest: +SKIP
    >>> stack_segments(library.load(), "lstm", 8, 512, 32, 1000, 512,
    ...                **library.H200)  # doctest: +SKIP
    (4, 4)"""
    def refusal(start: int, stop: int) -> str | None:
        width = input_size if start == 0 else units
        plan = lib.plan(kind, stop - start, units, batch, steps, width, sms=sms, smem=smem)
        if isinstance(plan, str):
            return plan
        if training:
            back = lib.backward_plan(units, batch, steps, sms=sms, smem=smem)
            if isinstance(back, str):
                return back
        return None

    return fewest_balanced(int(num_layers), refusal)
