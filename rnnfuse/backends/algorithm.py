"""`Algorithm`: a cuDNN RNN algorithm and math type for one fused call.

cuDNN 9 has four RNN algorithms (`cudnnRNNAlgo_t`) and, for the math, the
`cudnnMathType_t` choices below. rnnfuse's own TensorFlow op
(`rnnfuse.backends.tensorflow.cudnn_op`) takes both as one int32 input of
the kernel call and uses the same algorithm in the forward and backward
pass, so nothing about the algorithm is process-wide state. Without that op (the
CudnnRNNV3 fallback) only the standard algorithm runs.

Names: the algorithm, optionally followed by a math suffix:
"standard", "persistent_static+tc" (tensor ops), "persistent_dynamic+tcc"
(tensor ops allowing fp32 -> fp16/bf16 conversion),
"persistent_static_small_h".

Example:

    >>> algo = Algorithm.parse("persistent_static+tc")
    >>> algo.algorithm_name, algo.math, algo.name
    ('persistent_static', 'tensor_op', 'persistent_static+tc')
    >>> Algorithm.parse("standard").is_standard
    True
"""

from __future__ import annotations

import dataclasses

__all__ = ["Algorithm", "ALGORITHM_NAMES", "MATH_TYPES"]

# cudnnRNNAlgo_t values 0..3, in order.
ALGORITHM_NAMES = (
    "standard",
    "persistent_static",
    "persistent_dynamic",
    "persistent_static_small_h",
)
# cudnnMathType_t choices and their name suffixes.
MATH_TYPES = {"default": "", "tensor_op": "+tc", "tensor_op_allow_conversion": "+tcc"}
_SUFFIXES = {v: k for k, v in MATH_TYPES.items()}


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A cuDNN RNN algorithm and math type."""

    # 0 standard, 1 persistent static, 2 persistent dynamic,
    # 3 persistent static small-h (cudnnRNNAlgo_t).
    algo: int = 0
    # "default", "tensor_op" or "tensor_op_allow_conversion"; True/False are
    # accepted for "tensor_op"/"default".
    math: str = "default"

    def __post_init__(self):
        if self.algo not in range(len(ALGORITHM_NAMES)):
            raise ValueError(
                f"Algorithm.algo must be 0-3 ({', '.join(ALGORITHM_NAMES)}); "
                f"received {self.algo!r}"
            )
        if isinstance(self.math, bool):
            object.__setattr__(self, "math", "tensor_op" if self.math else "default")
        if self.math not in MATH_TYPES:
            raise ValueError(
                f"Algorithm.math must be one of {sorted(MATH_TYPES)}; received {self.math!r}"
            )

    @property
    def algorithm_name(self) -> str:
        return ALGORITHM_NAMES[self.algo]

    @property
    def tensor_ops(self) -> bool:
        return self.math != "default"

    @property
    def is_standard(self) -> bool:
        return self.algo == 0

    @property
    def name(self) -> str:
        return self.algorithm_name + MATH_TYPES[self.math]

    @classmethod
    def parse(cls, text: str) -> "Algorithm":
        """'standard', 'persistent_static+tc', ... -> Algorithm."""
        text = str(text)
        base, plus, suffix = text.partition("+")
        suffix = plus + suffix
        if base not in ALGORITHM_NAMES or suffix not in _SUFFIXES:
            raise ValueError(
                f"unknown cuDNN algorithm {text!r}; expected one of "
                f"{list(ALGORITHM_NAMES)} with an optional '+tc' (tensor ops) "
                "or '+tcc' (tensor ops with conversion)"
            )
        return cls(ALGORITHM_NAMES.index(base), _SUFFIXES[suffix])
