"""Bidirectional layers as one-layer calls a direction (the wavefront
compositions of TensorFlow and JAX), the framework's ops passed in.

>>> import numpy as np
>>> x = np.arange(6.0).reshape(3, 1, 2)  # T=3, B=1, 2 features
>>> double = lambda src, flat, h, c: (2 * src, h + 1, None)
>>> y, hy, cy = compose(x, [None, None], np.zeros((2, 1, 2)), None, one_layer=double,
...                     reverse=lambda t: t[::-1], concat=np.concatenate)
>>> y.shape, hy[:, 0, 0].tolist(), cy
((3, 1, 4), [1.0, 1.0], None)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["compose"]


def compose(x, params: Sequence[Any], h0, c0, *, one_layer: Callable, reverse: Callable,
            concat: Callable):
    """(y [T, B, 2H], hy, cy or None) of x [T, B, I] through a buffer per
    direction of each layer (layer-major, forward first), h0/c0 [2L, B, H]:
    `one_layer(src, flat, h0_k, c0_k)` runs one, `reverse` within lengths."""
    if not params or len(params) % 2:
        raise ValueError("a bidirectional composition takes a buffer for each direction of "
                         f"each layer; received {len(params)}")
    inp, hys, cys = x, [], []
    for k, flat in enumerate(params):
        backward = k % 2 == 1
        src = reverse(inp) if backward else inp
        y, hy, cy = one_layer(src, flat, h0[k:k + 1], None if c0 is None else c0[k:k + 1])
        hys.append(hy)
        cys.append(cy)
        if backward:
            inp = concat([forward_y, reverse(y)], -1)
        else:
            forward_y = y
    return inp, concat(hys, 0), (None if cys[0] is None else concat(cys, 0))
