"""The `Plan` record: how one fusion group runs, from `optimize` to the kernel.

A plan says `pieces` (`(n,)` the whole run as one fused call, `(a, b,
...)` consecutive sub-runs, `()` the original layers), `kernel` (a key of
`KERNELS`) and `algorithm` (for "cudnn", an `Algorithm`: one of cuDNN's RNN
algorithms and a math type; None: the standard one). The static table or
the tuner chooses it, `FusedRNN` runs it, the plan cache stores it. A
backend that cannot run a plan raises NotImplementedError and the layer
runs the original layers.

Example:
    >>> Plan((2, 2), "persistent_static+tc").name
    'split 2+2 @persistent_static+tc'
    >>> Plan(()).name, FUSED.for_length(3).pieces
    ('per-layer', (3,))
    >>> Plan.from_dict(Plan((1, 2), "persistent_dynamic+tc").to_dict()).name
    'split 1+2 @persistent_dynamic+tc'
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "ALGORITHM_NAMES",
    "Algorithm",
    "FUSED",
    "INFERENCE_ONLY_KERNELS",
    "KERNELS",
    "MATH_TYPES",
    "PER_LAYER",
    "Plan",
]

# Plan kernels: "cudnn" (rnnfuse's op on TensorFlow where loaded, else
# CudnnRNNV3); "stock" (framework ops only, for exports without rnnfuse);
# "wavefront" (rnnfuse/backends/cuda's kernel).
KERNELS = {
    "cudnn": "the backend's cuDNN call",
    "stock": "the framework's own cuDNN op (no rnnfuse op in the graph)",
    "wavefront": "rnnfuse's wavefront kernel (cuDNN where it cannot run)",
}
# The kernels with no backward pass on some backend: a training call of a
# plan on one runs `Plan.for_training()` where the backend's
# `Capabilities.training_kernels` does not name it.
INFERENCE_ONLY_KERNELS = frozenset({"wavefront"})

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


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to run one fusion group (see the module doc).

    Raises:
        ValueError: a piece that is not a positive layer count, a kernel not
            in `KERNELS`, or an algorithm the kernel does not have.
    """

    # Sizes of the fused sub-runs, in layers, bottom to top; () = per-layer.
    pieces: tuple[int, ...] = ()
    # The kernel's variant for the fused pieces: for "cudnn", a cuDNN
    # algorithm name ("persistent_static+tc", ...; None: the standard one).
    algorithm: str | None = None
    # Which fused kernel runs the fused pieces (a key of `KERNELS`).
    kernel: str = "cudnn"
    # Whole-run marker: `pieces` is filled in for the group's length
    # (`for_length`).
    whole: bool = False

    def __post_init__(self):
        pieces = self.pieces
        if isinstance(pieces, (str, bytes)) or not all(
            isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in tuple(pieces)
        ):
            raise ValueError(
                "Plan pieces must be a tuple of positive layer counts (() for "
                f"the original layers); received {pieces!r}"
            )
        object.__setattr__(self, "pieces", tuple(int(p) for p in pieces))
        if self.kernel not in KERNELS:
            raise ValueError(
                f"Plan kernel must be one of {sorted(KERNELS)}; received {self.kernel!r}"
            )
        if self.algorithm is not None and self.kernel == "cudnn":
            object.__setattr__(self, "algorithm", Algorithm.parse(self.algorithm).name)
        if self.algorithm == "standard":
            object.__setattr__(self, "algorithm", None)
        if self.kernel != "cudnn" and self.algorithm is not None:
            what = (
                "runs cuDNN's standard algorithm only" if self.kernel == "stock"
                else "has no algorithm to choose"
            )
            raise ValueError(
                f"Plan: the {self.kernel!r} kernel {what}; received algorithm "
                f"{self.algorithm!r}. Fix: algorithm=None."
            )

    @property
    def per_layer(self) -> bool:
        """Whether this plan runs the original layers (no fused call)."""
        return not self.whole and not self.pieces

    @property
    def inference_only(self) -> bool:
        """Whether the plan's kernel runs forward passes only on some
        backend (`INFERENCE_ONLY_KERNELS`): a training call there runs
        `for_training()`."""
        return self.kernel in INFERENCE_ONLY_KERNELS and not self.per_layer

    def for_training(self) -> "Plan":
        """The plan a training call runs: this one, or for an inference-only
        kernel the same pieces on cuDNN's standard algorithm."""
        if not self.inference_only:
            return self
        return dataclasses.replace(self, kernel="cudnn", algorithm=None)

    @property
    def cudnn_algorithm(self) -> Algorithm | None:
        """The cuDNN algorithm of the fused pieces (None: standard, or a
        kernel other than cuDNN's)."""
        if self.kernel != "cudnn" or self.algorithm is None:
            return None
        return Algorithm.parse(self.algorithm)

    @property
    def name(self) -> str:
        if self.per_layer:
            return "per-layer"
        if self.whole or len(self.pieces) == 1:
            base = "fused"
        else:
            base = "split " + "+".join(str(p) for p in self.pieces)
        return (
            base
            + (f" @{self.algorithm}" if self.algorithm else "")
            + (f" on {self.kernel}" if self.kernel != "cudnn" else "")
        )

    def for_length(self, n: int) -> "Plan":
        """This plan with `pieces` spelled out for a group of `n` layers.

        Raises:
            ValueError: the pieces do not add up to `n`.
        """
        if self.whole:
            return dataclasses.replace(self, pieces=(n,), whole=False)
        if self.pieces and sum(self.pieces) != n:
            raise ValueError(
                f"plan {self.name!r} covers {sum(self.pieces)} layers; the group has {n}"
            )
        return self

    def with_pieces(self, pieces: tuple[int, ...]) -> "Plan":
        """The same kernel and algorithm on other `pieces`."""
        return dataclasses.replace(self, pieces=tuple(pieces), whole=False)

    def to_dict(self) -> dict:
        """JSON-ready (the plan cache's and `FusedRNN.get_config`'s form)."""
        d = {"pieces": list(self.pieces), "algorithm": self.algorithm}
        if self.whole:
            d["whole"] = True
        if self.kernel != "cudnn":
            d["kernel"] = self.kernel
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """The inverse of `to_dict` (an entry without `kernel` is a "cudnn" plan).

        Raises:
            KeyError, TypeError, ValueError: `d` is not a plan's dict.
        """
        return cls(
            tuple(int(p) for p in d["pieces"]),
            d.get("algorithm"),
            kernel=d.get("kernel", "cudnn"),
            whole=bool(d.get("whole", False)),
        )


FUSED = Plan(whole=True)
PER_LAYER = Plan(())
