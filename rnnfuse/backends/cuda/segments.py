"""Stacks larger than the chip: consecutive wavefront segments that each fit.

The wavefront kernel keeps every layer's weights in the register files of
one CTA an SM, so a stack whose weights do not fit (8 LSTM layers of 512
units, 2 of 1024 on a 132-SM Hopper GPU) is refused whole. Run as
consecutive segments, each one launch of the kernel over a sub-stack, it
still runs on the kernel: segment s + 1 reads segment s's output sequence
as its input (its first layer's input projection is one matmul before its
launch, as the stack's first layer's is), so the stack takes
T * S + L - S dependent steps for S segments, against L * T for cuDNN
run a layer at a time.

`fewest_balanced(n, refusal)` chooses the segmentation from a refusal
function of a sub-stack (layers[start:stop] -> why the kernel cannot run
it, or None): the fewest segments, and among those the most balanced (the
smallest largest segment; ties: the larger segments at the bottom). It
asks each sub-stack at most once (O(n^2) questions), makes no assumption
that a shorter sub-stack fits where a longer one does, and answers the
pieces, or the reason none exists (the refusal of the first layer alone,
the smallest sub-stack that has to fit).

`stack_segments(lib, ...)` is that choice on the library's own plan check
(`WavefrontLibrary.plan`, and for training the backward's plans), without
a GPU: what the tuner's candidate and the benchmark run. In the tuner the
refusal is the backend's `kernel_reason` of each sub-group
(`rnnfuse.tuning.plans.kernel_plans`), so the device, the dtype and the
bindings' own checks decide too.

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
        ValueError: `n` is not a positive layer count.
    """
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
    """`fewest_balanced` on the library's plan check for the device limits
    `sms`, `smem` (no GPU needed): each segment's forward plan
    (`lib.plan`; a segment above the first reads `units` inputs) and, with
    `training`, the backward's per-layer plan (`lib.backward_plan`, which
    every layer of every segment shares). `lib`: a loaded
    `library.WavefrontLibrary`.

    >>> from rnnfuse.backends.cuda import library  # doctest: +SKIP
    >>> stack_segments(library.load(), "lstm", 8, 512, 32, 1000, 512,
    ...                **library.H200)  # doctest: +SKIP
    (4, 4)
    """
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
