"""Re-export of `rnnfuse.backends.algorithm.Algorithm` (its old home).

The cuDNN algorithm is an attribute of rnnfuse's own TensorFlow op call
(see `rnnfuse.backends.algorithm`); there is no process-wide environment
to set any more.
"""

from rnnfuse.backends.algorithm import ALGORITHM_NAMES, MATH_TYPES, Algorithm

__all__ = ["Algorithm", "ALGORITHM_NAMES", "MATH_TYPES"]
