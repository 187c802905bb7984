"""The backend contracts: `Backend` with its `Capabilities`, `Timing` and
`Tooling`, and their records `StackSpec`, `StackCall`, `StackRun` and
`ProjectedLSTMCall`.

Every backend (rnnfuse/backends/<name>/backend.py) implements the three
contracts, each for its own callers: `Backend` for the layers and the
planner, `Timing` for the tuner, `Tooling` for `rnnfuse bench` / `check`.
`NoFusedKernel`, `NoTiming` and `NoTooling` stand in for Keras backends
rnnfuse has no kernel for. This module imports no framework.

Example:

    >>> import keras
    >>> cells = ((keras.layers.LSTMCell(4),), (keras.layers.LSTMCell(4),))
    >>> spec = StackSpec(kind="lstm", units=4, cells=cells)
    >>> spec.num_levels, spec.num_directions, spec.num_pseudo_layers
    (2, 1, 2)

A level that reads a Bidirectional merged by "sum" or "ave" gets its input
kernel W [R, G*H] doubled: cuDNN feeds it [fwd, bwd] (2R wide), and

    (fwd + bwd) W == [fwd, bwd] [W; W]    and    (fwd + bwd)/2 W == [fwd, bwd] [W/2; W/2],

so the backends pack `input_scale(level) * W` twice, from the live
variable, and W's gradient is the sum of both halves'.

    >>> bi = ((keras.layers.LSTMCell(4), keras.layers.LSTMCell(4)),) * 2
    >>> spec = StackSpec("lstm", 4, bi, input_merges=(None, "ave"))
    >>> spec.input_scale(0), spec.input_scale(1)
    (None, 0.5)
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import platform
from typing import Any, NamedTuple, Sequence

from rnnfuse.reasons import KernelRun

__all__ = [
    "Backend",
    "Capabilities",
    "canonical_pieces",
    "GATES",
    "INPUT_SCALES",
    "KernelModuleBackend",
    "NoFusedKernel",
    "TUNED_ALGORITHMS",
    "NoProjectedLSTMPath",
    "NoTiming",
    "NoTooling",
    "PROJECTED_LSTM_PATHS",
    "ProjectedLSTMCall",
    "StackCall",
    "StackRun",
    "StackSpec",
    "Timing",
    "Tooling",
    "cpu_description",
    "loss_weights",
    "run_or_fall_back",
    "tanh_sigmoid",
]

# Gate matrices per cell kind (cuDNN's "pseudo-layer" has 2*G matrices).
# cuDNN's algorithms the tuner times where rnnfuse's own cuDNN call runs
# them in both passes (None: cuDNN's standard algorithm).
TUNED_ALGORITHMS = (None, "persistent_static+tc", "persistent_dynamic+tc")

GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
# Merge modes a fused level can read through its doubled input kernel, and its factor.
INPUT_SCALES = {"sum": 1.0, "ave": 0.5}


@dataclasses.dataclass(frozen=True)
class StackSpec:
    """A stack of recurrent levels that one fused call runs."""

    # cuDNN cell mode: "lstm", "gru", "rnn_tanh" or "rnn_relu".
    kind: str
    # Width of each cell's state.
    units: int
    # cells[i][d]: the Keras cell of level i, direction d (0 fwd, 1 bwd).
    cells: tuple[tuple[Any, ...], ...]
    # Recurrent projection width (0: none).
    proj_size: int = 0
    # Keras runs some original layer in its generic loop (SimpleRNN,
    # RNN(cell), no bias), whose float32 follows matmul precision, not cuDNN's.
    keras_loop: bool = False
    # input_merges[i]: "sum" or "ave" where level i reads level i-1's two
    # directions merged that way (see the module doc); None or no entry: as is.
    input_merges: tuple[str | None, ...] = ()

    @property
    def num_levels(self) -> int:
        return len(self.cells)

    def input_scale(self, level: int) -> float | None:
        """How level `level`'s input kernel W is packed: None, W as it is;
        s, the rows [s*W; s*W] (1.0 for a "sum" below, 0.5 for "ave")."""
        merge = self.input_merges[level] if level < len(self.input_merges) else None
        return INPUT_SCALES.get(merge)

    @property
    def num_directions(self) -> int:
        return len(self.cells[0])

    @property
    def num_pseudo_layers(self) -> int:
        """Levels times directions: the first dimension of cuDNN states."""
        return self.num_levels * self.num_directions

    @property
    def output_size(self) -> int:
        return self.proj_size or self.units


@dataclasses.dataclass(frozen=True)
class StackCall:
    """One fused call of a stack, as `Backend.run_stack` runs it.

    Change a field with `dataclasses.replace`:

    >>> import keras
    >>> spec = StackSpec("lstm", 4, ((keras.layers.LSTMCell(4),),))
    >>> call = StackCall(spec, dropout=0.25, seed=(7, 1))
    >>> call.kernel, call.training
    ('cudnn', False)
    >>> dataclasses.replace(call, kernel="wavefront").dropout
    0.25"""

    # The levels and cells to run.
    stack: StackSpec
    # Per pseudo-layer initial h [B, R] and c [B, H], level-major, fwd first;
    # None (or a missing entry): zeros.
    initial_h: Sequence[Any] | None = None
    initial_c: Sequence[Any] | None = None
    # Right-padded boolean mask [B, T] (the sequence lengths), or None.
    mask: Any = None
    # The first level reads each sequence reversed (outputs in processing order).
    reverse: bool = False
    # The between-level dropout rate and its seed pair.
    dropout: float = 0.0
    seed: tuple[int, int] = (0, 0)
    # For "cudnn" an `rnnfuse.plan.Algorithm` (None: standard), or the
    # runtime value `Timing.timed_steps` passes (one trace, every algorithm).
    algorithm: Any = None
    # One of `rnnfuse.plan.KERNELS`; one the backend lacks raises NotImplementedError.
    kernel: str = "cudnn"
    # Keras' training flag (a `Capabilities.training_kernels` kernel runs its backward).
    training: bool = False


class StackRun(NamedTuple):
    """What `Backend.run_stack` returns: the tensors and which kernel ran."""

    # [B, T, D*R] with zeros past each sequence's length.
    outputs: Any
    # [L*D, B, R] final h per pseudo-layer.
    final_h: Any
    # [L*D, B, H] final c (LSTM), else None.
    final_c: Any
    # The kernel and algorithm the call ran (decided when it is traced).
    kernel: KernelRun


def run_or_fall_back(run_kernel, run_cudnn, what: str,
                     errors: tuple = (NotImplementedError,)) -> StackRun:
    """`run_kernel()`, or where it raises one of `errors`, `run_cudnn()`
    with the reason in its `KernelRun`'s note.

    >>> def refuse():
    ...     raise NotImplementedError("8 layers of 512 do not fit on chip")
    >>> run = run_or_fall_back(refuse, lambda: StackRun(0, 0, None, KernelRun("cuDNN")), "the kernel")
    >>> run.kernel.note
    'the kernel cannot run this call (8 layers of 512 do not fit on chip); cuDNN runs it'"""
    try:
        return run_kernel()
    except errors as err:
        run = run_cudnn()
        return run._replace(
            kernel=run.kernel.with_note(f"{what} cannot run this call ({err}); cuDNN runs it")
        )


# ProjectedLSTM's fast-path variants ("off": Keras' generic loop).
PROJECTED_LSTM_PATHS = ("auto", "custom_xla", "custom", "while_xla", "while", "off")


@dataclasses.dataclass(frozen=True)
class ProjectedLSTMCall:
    """One `ProjectedLSTM` call, as `Backend.run_projected_lstm` runs it."""

    # The layer's `ProjectedLSTMCell`.
    cell: Any
    # Keras' training flag (input dropout).
    training: bool = False
    # The layer's go_backwards, zero_output_for_mask, return_sequences.
    go_backwards: bool = False
    zero_output_for_mask: bool = False
    return_sequences: bool = False
    # The fast-path variant asked for (a PROJECTED_LSTM_PATHS entry but "off").
    path: str = "auto"
    # Time steps per loop iteration, used where it divides the sequence length.
    unroll: int = 1

    def dropped_out(self, sequences):
        """`sequences` [B, T, F] times the input dropout mask `RNN.call`
        drew for this call (one per sequence), where training with dropout."""
        if self.training and 0.0 < self.cell.dropout < 1.0:
            return sequences * self.cell.get_dropout_mask(sequences[:, 0, :])[:, None, :]
        return sequences

    def inner_loop_result(self, outputs, h, c):
        """What `keras.layers.RNN.inner_loop` returns from batch-major
        `outputs` [B, T, P]: (last_output, outputs, or [B, 1, P] without
        return_sequences as the generic loop gives, [h, c])."""
        last_output = outputs[:, -1]
        if not self.return_sequences:
            outputs = last_output[:, None, :]
        return last_output, outputs, [h, c]


def tanh_sigmoid(cell, extra: dict | None = None) -> bool:
    """Whether `cell` uses exactly tanh and sigmoid activations, counting a
    backend's own from `extra` (its `activation_functions()`)."""
    from rnnfuse.recurrent import _activation_name

    return (
        _activation_name(cell.activation, extra or {}) == "tanh"
        and _activation_name(cell.recurrent_activation, extra or {}) == "sigmoid"
    )


# -- the backend contract --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as fields the planner and the layers read
    (every backend states every field; no probing with `getattr`)."""

    # False only for `NoFusedKernel`.
    fused_kernel: bool
    # The fused call takes seeded between-level dropout: Dropout layers fuse.
    absorbs_dropout: bool
    # jit_compile (XLA, torch.compile) compiles the fused call: `FusedRNN.supports_jit` stays True.
    jit_compiles_fused_call: bool
    # The tuner also times one fused call per layer.
    tunes_one_call_per_layer: bool
    # The cuDNN algorithms the tuner times (None: default).
    tuned_algorithms: tuple = (None,)
    # The static plan table without `tune=` (`rnnfuse.tuning.table.TABLES`).
    plan_table: str = "fused"
    # ProjectedLSTM's own fast loop ("tensorflow", "torch"), or None.
    projected_lstm_loop: str | None = None
    # Keras resolves jit_compile="auto" from its layers here, so the tuner
    # times the original layers XLA-compiled where Keras would.
    auto_jit_from_layers: bool = False
    # A timed step's first call compiles it; False (eager): that call already
    # says how slow a candidate is, so a clearly slower one gets no warm-up.
    first_call_compiles: bool = True
    # Kernels besides cuDNN the tuner also times for inference calls, where
    # `Backend.kernel_reason` accepts the group.
    inference_kernels: tuple = ()
    # Those of them this backend also trains on; a training call of a plan on
    # another forward-only kernel runs `Plan.for_training()` (cuDNN).
    training_kernels: tuple = ()
    # A traced call fixes its cuDNN algorithm (the standard one where cuDNN
    # refuses the plan's): the tuner drops such a candidate before compiling.
    algorithm_fixed_when_traced: bool = False


class Backend(abc.ABC):
    """The kernel interface every backend implements: what `FusedRNN`, the
    layers and the planner call. Kernel methods look the backend package's
    module functions up at call time, so a test that replaces one still
    takes effect."""

    # The Keras backend name ("tensorflow", "torch", "jax", ...).
    name: str

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """The fields the planner, tuner and layers read."""

    # -- planning -------------------------------------------------------------

    @abc.abstractmethod
    def group_reason(self, group: Any) -> str | None:
        """Why this backend never runs fusion `group` fused, or None."""

    def kernel_reason(self, kernel: str, group: Any, shape: tuple,
                      training: bool = False) -> str | None:
        """Why plan kernel `kernel` cannot run `group`'s inference calls (with
        `training`: forward and backward) at input `shape` (batch, steps,
        features) here, or None; asked before the tuner times it."""
        return f"the {self.name} backend has no {kernel!r} kernel"

    def keras_path_fails(self, group: Any, dtype: str, masked: bool | None = None) -> str | None:
        """Why Keras' own layers of `group` cannot run in `dtype` on this
        device (its original step fails to compile), or None; where they
        cannot, the planner fuses the group without timing it. `masked`:
        whether its input carries a mask (None: read from the graph).
        Default: None (they run)."""
        return None

    # -- the fused call ---------------------------------------------------------

    @abc.abstractmethod
    def is_available(self) -> bool:
        """The fused kernel can run in this process now (TF: a GPU)."""

    @abc.abstractmethod
    def unsupported_reason(self, stack: StackSpec, dtype: str) -> str | None:
        """A configuration the fused kernel cannot run, or None."""

    @abc.abstractmethod
    def mask_is_supported(self, mask: Any) -> Any:
        """Boolean tensor: the mask is right-padded with no empty sequence."""

    @abc.abstractmethod
    def run_stack(self, sequences, call: StackCall) -> StackRun:
        """`call` over `sequences` [B, T, F] as a `StackRun`; NotImplementedError
        where it cannot run this call (the original layers then run)."""

    def algorithm_input(self) -> Any | None:
        """A cuDNN algorithm read at run time, for `FusedRNN.algorithm_input`:
        an object with `set(algorithm, dtype)` (an `rnnfuse.plan.Algorithm` or
        None: standard) and `tensor()` (the value for `StackCall.algorithm`);
        None where a trace takes the algorithm as a constant. Default: None."""
        return None

    @abc.abstractmethod
    def concrete_bool(self, value: Any) -> bool | None:
        """A boolean scalar tensor's Python value where known now, or None
        while a graph is traced."""

    def in_xla_context(self) -> bool:
        """Whether the current trace is compiled by XLA where the fused call
        cannot be. Default: False."""
        return False

    def shapes_only(self, x: Any) -> bool:
        """Whether `x` carries shapes and no values that matter (Keras'
        symbolic build on torch runs the model on "meta" tensors, or on
        real ones where that fails). Default: False."""
        return False

    def may_skip_call(self, layer: Any, x: Any) -> bool:
        """Whether `layer`'s call on `x` may skip Keras' `Layer.__call__` here:
        an eager call (no trace, no transform, no hook) on a plain tensor.
        Default: False."""
        return False

    def keras_runs_cudnn(self) -> bool:
        """Whether Keras' own LSTM/GRU run cuDNN here (padded steps of a
        returned sequence are then zeros). Default: False."""
        return False

    def assert_mask_supported(self, supported: Any) -> None:
        """In a traced call, fail at run time where `supported` is False, with
        Keras' own cuDNN message. Called only where `keras_runs_cudnn()`."""
        raise NotImplementedError(f"{self.name}: Keras' own layers do not assert masks here")

    # -- ProjectedLSTM's own fast path ---------------------------------------------

    @abc.abstractmethod
    def projected_lstm_reason(self, cell: Any) -> str | None:
        """Why this backend's ProjectedLSTM fast path never runs `cell`, or None."""

    @abc.abstractmethod
    def run_projected_lstm(self, sequences, initial_state, mask, call: ProjectedLSTMCall):
        """((last_output, outputs, [h, c]), path name): what
        `keras.layers.RNN.inner_loop` returns; NotImplementedError (why) where
        it cannot run this call, and Keras' generic loop runs."""

    @abc.abstractmethod
    def resolve_projected_lstm_path(self, path: str) -> str:
        """The variant fast path `path` means here ("auto" -> "custom_xla" or
        "custom" on TensorFlow)."""

    # -- runtime environment ------------------------------------------------------

    def strategy_scope(self, strategy: Any) -> Any:
        """A context manager entering `strategy`'s scope where needed. Default: none."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def activation_functions(self) -> dict:
        """This framework's own tanh/sigmoid/relu: name -> list of functions."""


class Timing(abc.ABC):
    """What the tuner needs from a framework to time plans and check their
    gradients; `rnnfuse.backends.get_timing()` returns the active one's.

    >>> NoTiming("numpy").timing_context() is None
    True"""

    @abc.abstractmethod
    def device_environment(self) -> dict:
        """Device and library versions a tuned plan depends on (cache key)."""

    @abc.abstractmethod
    def timed_step(self, run, x, variables: Sequence[Any], training: bool, jit: bool = False):
        """A compiled step of `run(x, training)` (+ gradients): a callable giving
        a scalar tensor. `jit`: compile with XLA. It may carry `trace()`, which
        builds its program without running it, and then `compile()`, which
        compiles it on any thread, beside other steps' compiles."""

    def timed_steps(self, make_run, x, variables: Sequence[Any], training: bool,
                    algorithms: Sequence[Any], dtype: str) -> dict | None:
        """{algorithm name: step} for plans that differ only in cuDNN's algorithm,
        all on one compiled step of `make_run()` called as `run(x, training,
        algorithm=a)`; None, without calling `make_run`, where the backend cannot
        take the algorithm at run time. Default: None."""
        return None

    def original_refusal(self, exc: Exception) -> str | None:
        """Why the original layers' timed step cannot run here, where `exc`
        (raised by its first call) is the framework refusing to compile or
        run it, not a bug; None: `exc` is raised. Default: None."""
        return None

    @abc.abstractmethod
    def gradients(self, run, x, variables: Sequence[Any], training: bool = False) -> list:
        """d(sum of squared outputs of `run(x, training)`)/d(variables) as float64
        NumPy arrays."""

    def gradients_of(self, calls: Sequence[tuple], variables: Sequence[Any]) -> list[list]:
        """`gradients` of each (run, x, training) of `calls`, in order (a backend
        that compiles may take them in one program). Default: one each."""
        return [self.gradients(run, x, variables, training=training) for run, x, training in calls]

    def float64_reference_scope(self) -> Any:
        """A context manager under which the gradient check's float64 reference
        runs in a program of its own, on float64 layer copies; None (default):
        the fused call in float64, in the timed plans' program."""
        return None

    @abc.abstractmethod
    def timing_context(self) -> Any:
        """A context manager under which the tuner can build, run and time steps
        from inside a traced call, or None where it cannot (XLA, JAX)."""


class Tooling(abc.ABC):
    """What `rnnfuse bench` / `check` and the examples need from a framework;
    `rnnfuse.backends.get_tooling()` returns the active backend's."""

    @abc.abstractmethod
    def describe_device(self) -> tuple[str, bool]:
        """(one line naming the device and library, whether it is a GPU)."""

    @abc.abstractmethod
    def timing_notes(self, on_gpu: bool) -> list[str]:
        """Remarks on what may distort timings in this process."""

    @abc.abstractmethod
    def exact_float32(self) -> None:
        """Turn TF32 matmuls off (for numeric checks)."""

    @abc.abstractmethod
    def model_step(self, model, train: bool):
        """inputs -> float: one inference or training step of `model`, returning
        when the device is done."""

    @abc.abstractmethod
    def outputs_and_grads(self, model, inputs, variables, seed: int) -> tuple[list, list]:
        """(outputs, gradients) of sum(mean(output_i * w_i)) in inference mode,
        w_i = `loss_weights(shapes, seed)[i]`, as float32 NumPy arrays."""


class KernelModuleBackend(Backend):
    """A backend whose kernel calls are its package's module functions
    (`kernels`), looked up at call time so tests can replace them."""

    kernels: Any = None

    def fused_capabilities(self, **fields) -> Capabilities:
        """`Capabilities` of a fused cuDNN call with seeded dropout and the
        wavefront kernel for inference and training; `fields` add or replace."""
        return Capabilities(**{
            "fused_kernel": True,
            "absorbs_dropout": True,
            "jit_compiles_fused_call": False,
            "tuned_algorithms": self.kernels.tuned_algorithms(),
            "inference_kernels": ("wavefront",),
            "training_kernels": ("wavefront",),
            **fields,
        })

    def group_reason(self, group):
        return None

    def kernel_reason(self, kernel, group, shape, training=False):
        return self.kernels.kernel_reason(kernel, group, shape, training=training)

    def is_available(self):
        return self.kernels.is_available()

    def unsupported_reason(self, stack, dtype):
        return self.kernels.unsupported_reason(stack, dtype)

    def mask_is_supported(self, mask):
        return self.kernels.mask_is_supported(mask)

    def run_stack(self, sequences, call):
        return self.kernels.run_stack(sequences, call)

    def concrete_bool(self, value):
        return self.kernels.concrete_bool(value)


class NoProjectedLSTMPath:
    """The ProjectedLSTM part of the contract where there is no fast path
    (Keras' generic loop runs). Mixed in before the contract class."""

    def projected_lstm_reason(self, cell):
        return f"no fast path for the {self.name} backend"

    def run_projected_lstm(self, sequences, initial_state, mask, call):
        raise NotImplementedError(self.projected_lstm_reason(call.cell))

    def resolve_projected_lstm_path(self, path):
        return path


class NoFusedKernel(NoProjectedLSTMPath, Backend):
    """A Keras backend rnnfuse has no kernel for (OpenVINO, numpy): every
    group keeps its layers, with a reason; `NoTiming` is its `Timing`."""

    capabilities = Capabilities(
        fused_kernel=False,
        absorbs_dropout=False,
        jit_compiles_fused_call=False,
        tunes_one_call_per_layer=False,
        plan_table="per_layer",
    )

    def __init__(self, name: str):
        self.name = name

    def _none(self, what: str):
        raise NotImplementedError(f"rnnfuse has no {what} for the {self.name} backend")

    def group_reason(self, group):
        return (
            f"rnnfuse has no fused kernel for the {self.name} backend; the "
            "original layers run as they are"
        )

    def is_available(self):
        return False

    def unsupported_reason(self, stack, dtype):
        return f"no fused kernel for the {self.name} backend"

    def mask_is_supported(self, mask):
        return False

    def run_stack(self, sequences, call):
        self._none("fused kernel")

    def concrete_bool(self, value):
        return None

    def activation_functions(self):
        return {}


class NoTiming(Timing):
    """The tuner's contract for a Keras backend rnnfuse has no kernel for:
    nothing is timed (the tuner asks `Backend.capabilities` first)."""

    def __init__(self, name: str):
        self.name = name

    def _none(self, what: str):
        raise NotImplementedError(f"rnnfuse has no {what} for the {self.name} backend")

    def device_environment(self):
        return {}

    def timed_step(self, run, x, variables, training, jit=False):
        self._none("timing")

    def gradients(self, run, x, variables, training=False):
        self._none("gradients")

    def timing_context(self):
        return None


class NoTooling(Tooling):
    """The tools' contract for a Keras backend rnnfuse has no kernel for:
    every method raises NotImplementedError naming the backend."""

    def __init__(self, name: str):
        self.name = name

    def _none(self, what: str):
        raise NotImplementedError(f"rnnfuse has no {what} for the {self.name} backend")

    def describe_device(self):
        self._none("timing")

    def timing_notes(self, on_gpu):
        return []

    def exact_float32(self):
        return None

    def model_step(self, model, train):
        self._none("timing")

    def outputs_and_grads(self, model, inputs, variables, seed):
        self._none("gradients")


def loss_weights(shapes, seed: int) -> list:
    """One fixed random float32 array per output shape, so gradients of a
    weighted sum do not cancel (the same numbers on every backend)."""
    import numpy as np

    return [
        np.random.default_rng(seed + 1 + i).standard_normal(tuple(shape)).astype("float32")
        for i, shape in enumerate(shapes)
    ]


def cpu_description(library: str) -> str:
    """'CPU: <model name>, <n> cores, <library> (no GPU visible)'."""
    name = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown"
    return f"CPU: {name}, {os.cpu_count()} cores, {library} (no GPU visible)"


def canonical_pieces(stack: StackSpec, cell_params, dtype) -> list:
    """Every cell's weights, then every cell's biases, in cuDNN's canonical
    order: what a backend concatenates into the flat parameter buffer.
    `cell_params(kind, cell, dtype, input_scale)` gives one cell's
    (weights, biases)."""
    weights, biases = [], []
    for i, level in enumerate(stack.cells):
        for cell in level:
            w, b = cell_params(stack.kind, cell, dtype, stack.input_scale(i))
            weights += w
            biases += b
    return weights + biases
