"""Tuning: choose, per fusion group, how to run it (fused, split, per-layer;
cuDNN algorithm), by a static rule table or by timing on the device.

Example:

    >>> from rnnfuse.tuning import Algorithm
    >>> Algorithm.parse("persistent_static+tc").algo
    1
"""

from rnnfuse.backends.algorithm import Algorithm

__all__ = ["Algorithm"]
