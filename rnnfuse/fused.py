"""`FusedRNN`: one Keras layer that runs a stack of recurrent layers at once.

The layer holds the original layers (which own the variables). Where the
backend's fused kernel can run, the stack runs as one multi-layer call
whose weights are packed from the original variables on every call, so
gradients reach them; otherwise it calls the original layers in sequence.
A right-padded mask becomes sequence lengths; any other mask runs the
original layers. The layer's `rnnfuse.plan.Plan` says how the fused path
runs; all a call needs arrives as arguments and what it ran comes back in
`last_path`, so two models traced in two threads each run their own plan.
Under torch, training-mode input dropout draws other masks (same
distribution) than Keras' loop.

Example:
    >>> import keras, numpy as np
    >>> a, b = keras.layers.LSTM(8, return_sequences=True), keras.layers.LSTM(8)
    >>> x = np.random.rand(2, 5, 3).astype("float32")
    >>> y = b(a(x))
    >>> bool(np.allclose(FusedRNN([a, b])(x), y, atol=1e-6))
    True
"""

from __future__ import annotations

import contextlib
import weakref

import keras
from keras import ops, tree
from keras.src.backend.common import global_state
from keras.src.layers.layer import CallContext

from rnnfuse.backends import StackCall, StackSpec, get_backend
from rnnfuse.plan import FUSED, Plan
from rnnfuse.reasons import FUSED_PATH, CallPath, PathKind, Reason
from rnnfuse.recurrent import describe, input_merges, keras_has_cudnn_path
from rnnfuse.rules import layer_reason, not_implemented, runtime_reason, stack_link_reason
from rnnfuse.rules.runtime import mask_not_right_padded, plan_per_layer

__all__ = ["FusedRNN", "call_members", "default_name", "first_call_kwargs", "fused_layers"]


def default_name(layers) -> str:
    """A FusedRNN's name: "fused_" and its first and last layers' names, so
    it differs from every layer it holds."""
    first, last = layers[0].name, layers[-1].name
    return f"fused_{first}" if first == last else f"fused_{first}_to_{last}"

# `last_path` of a call whose plan keeps the original layers.
_KEPT_ORIGINAL = (PathKind.LAYERS, plan_per_layer(), None)
_NOT_RIGHT_PADDED = (PathKind.LAYERS, mask_not_right_padded(), None)


# FusedRNN -> its sublayers, for `_clear_losses`.
_LOSS_LAYERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@keras.saving.register_keras_serializable(package="rnnfuse")
class FusedRNN(keras.layers.Layer):
    """Runs stacked recurrent layers as one multi-layer cuDNN call.

    Args:
        layers: the recurrent layers of the run, bottom to top, each fusable
            (see `rnnfuse.analyze`) and feeding the next.
        dropout_layers: optional, one entry per gap: a `keras.layers.Dropout`
            absorbed as cuDNN's between-layer dropout, or None.
        plan: an `rnnfuse.Plan` (or its `to_dict()`); None is `rnnfuse.FUSED`.
            `set_plan` switches it later.
        **kwargs: Keras layer arguments; `name` defaults to
            `default_name(layers)`, `dtype` to the first layer's policy.

    Call arguments: sequences, initial_state, mask, training as the first
    layer takes them; `algorithm`, a runtime value for the plan's algorithm
    (the tuner's shared step); `mask_is_right_padded`, where the caller knows
    it. A call whose plan keeps the original layers is handed to their own
    calls; an eager torch call on a plain tensor skips Keras' `__call__`
    (`_calls_bare`). Returns what the last layer returns.

    Raises:
        TypeError: `layers` or `dropout_layers` hold the wrong types.
        ValueError: a layer that cannot be fused, or two that cannot be
            stacked, naming the rule.
    """

    def __init__(self, layers, dropout_layers=None, plan=None, **kwargs):
        plan = _plan_argument(plan, kwargs.pop("algorithm", None), kwargs.pop("pieces", "unset"))
        layers = _layer_list(layers)
        views = []
        activations = get_backend().activation_functions()
        for layer in layers:
            view = layer_reason(layer, require_built=False, activations=activations)
            if view is None:
                view = describe(layer, require_built=False, activations=activations)
            if isinstance(view, Reason):
                raise ValueError(
                    f"FusedRNN cannot fuse layer '{layer.name}' "
                    f"({type(layer).__name__}): {view}"
                )
            views.append(view)
        for upper, lower in zip(views, views[1:]):
            reason = stack_link_reason(upper, lower)
            if reason is not None:
                raise ValueError(f"FusedRNN cannot stack these layers: {reason}")
        dropout_layers = _dropout_list(dropout_layers, len(layers))
        rates = {None if d is None else float(d.rate) for d in dropout_layers}
        if len(rates) > 1:
            raise ValueError(
                "FusedRNN: cuDNN applies one dropout rate between every pair "
                "of layers; dropout_layers must be all None or all Dropout "
                f"layers of one rate; received rates {sorted(rates, key=str)}"
            )
        kwargs.setdefault("name", default_name(layers))
        kwargs.setdefault("dtype", layers[0].dtype_policy)
        super().__init__(**kwargs)
        self.fused_layers = layers
        # Keras tracks lists of layers; keep the absorbed ones apart from
        # their positions so the list holds no None.
        self.absorbed_dropout = [d for d in dropout_layers if d is not None]
        self._dropout_after = [i for i, d in enumerate(dropout_layers) if d is not None]
        self._views = tuple(views)
        self._stack = StackSpec(
            kind=views[0].kind,
            units=views[0].units,
            cells=tuple(level for v in views for level in v.levels),
            proj_size=views[0].proj_size,
            keras_loop=any(not keras_has_cudnn_path(v) and not v.proj_size for v in views),
            input_merges=input_merges(views),
        )
        self.supports_masking = True
        # The members in call order, for the original layers' direct call
        # (untracked: Keras tracks them through `fused_layers`).
        object.__setattr__(self, "_members", self.members())
        # A split plan's sub-stacks, built on first use; untracked and unsaved (they
        # share this layer's layers and variables).
        object.__setattr__(self, "_piece_cache", {})
        self._plan = FUSED.for_length(len(layers))
        self.set_plan(plan)
        # (input shape, training) -> Plan or None, asked first by each call (the
        # tuner's `per_shape.Planner`); untracked and unsaved. None: `plan`.
        object.__setattr__(self, "planner", None)
        # A runtime cuDNN algorithm (`Backend.algorithm_input`) that training
        # calls of a cuDNN plan pass to the op instead of the plan's own, so
        # one trace serves plans that differ only in it; untracked. None: the plan's.
        object.__setattr__(self, "algorithm_input", None)
        # `last_path` as (kind, reason or (rule, args), kernel): a trace builds no str subclass.
        object.__setattr__(self, "_path", None)
        if all(layer.built for layer in layers):
            self.built = True

    # -- Keras layer protocol -----------------------------------------------

    @property
    def stack(self) -> StackSpec:
        """The levels and cells this layer runs."""
        return self._stack

    @property
    def layers(self) -> list:
        """The original layers, as `members()` lists them (what Keras'
        `summary(expand_nested=True)` shows under this layer)."""
        return self.members()

    def members(self) -> list:
        """The run's layers in call order, absorbed Dropout layers in place (a
        method: Keras' saving walks properties)."""
        dropouts = dict(zip(self._dropout_after, self.absorbed_dropout))
        out = []
        for i, layer in enumerate(self.fused_layers):
            out.append(layer)
            if i in dropouts:
                out.append(dropouts[i])
        return out

    @property
    def plan(self) -> Plan:
        """How calls run the stack (`rnnfuse.plan.Plan`, its pieces spelled
        out for this layer's length: `(n,)` for the whole run)."""
        return self._plan

    def set_plan(self, plan: Plan | None) -> None:
        """Switches how later traces run the stack (None: `rnnfuse.FUSED`); the
        layers and variables are unchanged.

        Raises:
            TypeError: `plan` is not a Plan.
            ValueError: its pieces do not cover the layers, or split at an
                absorbed Dropout.
        """
        plan = FUSED if plan is None else plan
        if not isinstance(plan, Plan):
            raise TypeError(
                f"FusedRNN '{self.name}': set_plan takes an rnnfuse.Plan (or None); "
                f"received {type(plan).__name__} {plan!r}. Fix: e.g. "
                "set_plan(rnnfuse.Plan((2, 2))) or set_plan(rnnfuse.PER_LAYER)."
            )
        n = len(self.fused_layers)
        try:
            plan = plan.for_length(n)
        except ValueError as err:
            raise ValueError(f"FusedRNN '{self.name}' runs {n} layers: {err}") from None
        for start, stop in _piece_bounds(plan.pieces)[:-1]:
            if (stop - 1) in self._dropout_after:
                raise ValueError(
                    f"FusedRNN '{self.name}': plan {plan.name!r} splits at an "
                    "absorbed Dropout layer; split elsewhere"
                )
        self._plan = plan

    @property
    def last_path(self) -> CallPath | None:
        """The path the last call took, set by the branch that ran."""
        if self._path is None:
            return None
        kind, reason, kernel = self._path
        return CallPath(kind, reason[0](*reason[1]) if isinstance(reason, tuple) else reason, kernel)

    @property
    def uses_fused_kernel(self) -> bool:
        """Whether calls here run the fused kernel (a mask's values still decide per call)."""
        return self._fallback_reason(None) is None

    @property
    def supports_jit(self) -> bool:
        """False while a fused kernel XLA cannot compile may run; Keras reads it
        for `jit_compile="auto"` as it reads its own LSTM's."""
        return self._supports_jit and not self.fused_call_blocks_xla

    @property
    def fused_call_blocks_xla(self) -> bool:
        """Whether calls here may run a fused kernel XLA cannot compile
        (TensorFlow's CudnnRNNV3; not JAX's cuDNN custom call)."""
        if get_backend().capabilities.jit_compiles_fused_call:
            return False
        plans = [self._plan] + (self.planner.plans() if self.planner is not None else [])
        if all(p.per_layer for p in plans):
            return False  # every plan it may run keeps the original layers
        return self.uses_fused_kernel

    @supports_jit.setter
    def supports_jit(self, value: bool) -> None:
        self._supports_jit = bool(value)

    def build(self, sequences_shape, initial_state_shape=None):
        shape = sequences_shape
        for i, layer in enumerate(self.fused_layers):
            if not layer.built:
                if i == 0 and initial_state_shape is not None:
                    layer.build(shape, initial_state_shape)
                else:
                    layer.build(shape)
            shape = layer.compute_output_shape(shape)
        for d in self.absorbed_dropout:
            d.built = True
        self.built = True

    def compute_output_shape(self, sequences_shape, initial_state_shape=None):
        shape = sequences_shape
        for layer in self.fused_layers[:-1]:
            shape = layer.compute_output_shape(shape)
        return self.fused_layers[-1].compute_output_shape(shape)

    def compute_mask(self, sequences, mask=None):
        return self.fused_layers[-1].compute_mask(sequences, mask)

    def get_config(self):
        config = super().get_config()
        config["layers"] = [
            keras.saving.serialize_keras_object(l) for l in self.fused_layers
        ]
        dropout_layers = [None] * (len(self.fused_layers) - 1)
        for i, d in zip(self._dropout_after, self.absorbed_dropout):
            dropout_layers[i] = keras.saving.serialize_keras_object(d)
        config["dropout_layers"] = dropout_layers
        config["plan"] = self._plan.to_dict()
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        layers = [keras.saving.deserialize_keras_object(c) for c in config.pop("layers")]
        dropout_layers = [
            None if c is None else keras.saving.deserialize_keras_object(c)
            for c in config.pop("dropout_layers", None) or []
        ]
        return cls(layers, dropout_layers=dropout_layers or None, **config)

    # -- call ------------------------------------------------------------------

    def _clear_losses(self):
        # Keras' recursion, over the sublayers listed once and emptied only
        # where they hold losses (a microsecond a layer less each call).
        # (Kept off the layer: Keras' saving walks its attributes.)
        layers = _LOSS_LAYERS.get(self)
        if layers is None and self.built:
            layers = tuple(self._flatten_layers(include_self=False))
            if any(type(l)._clear_losses is not keras.Layer._clear_losses for l in layers):
                layers = ()
            _LOSS_LAYERS[self] = layers
        if not layers or keras.src.backend.in_stateless_scope():
            return super()._clear_losses()
        for layer in (self, *layers):
            if layer._losses:
                layer._losses.clear()
            if layer._loss_ids:
                layer._loss_ids.clear()

    def __call__(self, *args, **kwargs):
        # A kept-original call is theirs alone: it costs what the original layers cost.
        if self._keeps_original(args, kwargs):
            return self._original_call(*args, **kwargs)
        if self._calls_bare(args, kwargs):
            return self._bare_call(args[0], kwargs)
        return super().__call__(*args, **kwargs)

    def _calls_bare(self, args, kwargs) -> bool:
        """Whether Keras' `Layer.__call__` would do no more for this call than
        `_bare_call`: an eager call on one plain tensor of the compute dtype,
        with no mask, autocast, stateless scope or distribution
        (`Backend.may_skip_call`)."""
        if len(args) != 1 or (kwargs and kwargs.keys() != {"training"}) or not self.built:
            return False
        x = args[0]
        if getattr(x, "_keras_mask", None) is not None:
            return False
        if not get_backend().may_skip_call(self, x):
            return False
        if (self.input_spec is not None or self.activity_regularizer is not None
                or self._call_context_args != {"training"}):
            return False
        dtype = self.compute_dtype
        return (keras.backend.standardize_dtype(x.dtype) == dtype == self.variable_dtype
                and self.input_dtype == dtype
                and keras.src.backend.get_autocast_scope() is None
                and not keras.src.backend.in_stateless_scope()
                and global_state.get_global_attribute("distribution") is None)

    def _bare_call(self, sequences, kwargs):
        """What `Layer.__call__` does around `call` for a `_calls_bare` call:
        the call context (training resolved and passed on as Keras does),
        the entry layer's loss clearing, and the outputs' mask metadata."""
        if not self._called:
            self._called = True
        context = global_state.get_global_attribute("current_call_ctx")
        entry = context is None
        if entry:
            context = CallContext(entry_layer=self)
            global_state.set_global_attribute("current_call_ctx", context)
            self._clear_losses()
        try:
            training = kwargs["training"] if kwargs else getattr(context, "training", None)
            context.training = training
            outputs = self.call(sequences, training=training)
            self._set_mask_metadata(sequences, outputs, None)
        finally:
            if entry or context.entry_layer is self:
                global_state.set_global_attribute("current_call_ctx", None)
        return outputs

    def _keeps_original(self, args, kwargs) -> bool:
        """Whether this call's plan is known, untimed, to keep the original layers
        (a symbolic call keeps this layer's node; a tuner's call runs as asked;
        a shapes-only call runs them)."""
        if not args or not self.built or kwargs.get("algorithm") is not None:
            return False
        sequences = args[0]
        if isinstance(sequences, keras.KerasTensor):
            return False
        if get_backend().shapes_only(sequences):
            return True  # the original layers' shapes, at their cost (no kernel runs)
        if self.planner is None:
            return self._plan.per_layer
        training = kwargs.get("training")
        if training is None:
            # Keras' own resolution: the outer call's value, else inference.
            context = global_state.get_global_attribute("current_call_ctx")
            training = getattr(context, "training", None)
        return self.planner.keeps_original(tuple(sequences.shape), bool(training))

    def _original_call(self, sequences, initial_state=None, mask=None, training=None,
                       algorithm=None, mask_is_right_padded=False):
        """The original layers' own calls, with this call's arguments as the run's
        first layer received them."""
        object.__setattr__(self, "_path", _KEPT_ORIGINAL)
        mask = None if mask is None else tree.flatten(mask)[0]
        return self._call_layers(sequences, initial_state, mask, training)

    def call(self, sequences, initial_state=None, mask=None, training=None,
             algorithm=None, mask_is_right_padded=False):
        if mask is not None:
            mask = tree.flatten(mask)[0]
        plan = self._plan_for_call(sequences, training)
        if (algorithm is None and self.algorithm_input is not None and training is True
                and plan.kernel == "cudnn" and not plan.per_layer):
            algorithm = self.algorithm_input.tensor()
        outputs, path = self._run(
            plan, sequences, initial_state, mask, training, algorithm, mask_is_right_padded,
        )
        # Past Keras' attribute tracking (tens of microseconds a call).
        object.__setattr__(self, "_path", path)
        return outputs

    def _plan_for_call(self, sequences, training) -> Plan:
        """The plan of this call: the planner's for the call's shape and
        mode where there is one, else the layer's own."""
        if self.planner is None:
            return self._plan
        chosen = self.planner(tuple(sequences.shape), bool(training))
        return self._plan if chosen is None else chosen.for_length(len(self.fused_layers))

    def _run(self, plan, sequences, initial_state, mask, training, algorithm, right_padded):
        """(outputs, path) of one call under `plan` (`last_path`'s parts)."""
        if plan.per_layer:
            outputs = self._call_layers(sequences, initial_state, mask, training)
            return outputs, _KEPT_ORIGINAL
        if len(plan.pieces) > 1:
            return self._call_pieces(plan, sequences, initial_state, mask, training, algorithm,
                                     right_padded)
        reason = self._fallback_reason(mask)
        if reason is not None:
            outputs = self._call_layers(sequences, initial_state, mask, training)
            return outputs, (PathKind.LAYERS, reason, None)
        self._check_not_xla()
        if mask is None:
            return self._call_fused(plan, sequences, initial_state, None, training, algorithm)
        return self._call_masked(plan, sequences, initial_state, mask, training, algorithm,
                                 right_padded)

    def _call_masked(self, plan, sequences, initial_state, mask, training, algorithm, right_padded):
        """A masked call: right-padded, the fused call with sequence lengths; else
        the original layers in Keras' generic loop. Eagerly only the mask's branch
        runs; in a trace both are traced, unless Keras' own traced call asserts
        the mask (`_keras_asserts_traced_masks`), which this one then does too."""
        backend = get_backend()
        paths = []

        def fused():
            outputs, path = self._call_fused(plan, sequences, initial_state, mask, training,
                                             algorithm, add_losses=False)
            paths.append(path)
            return outputs

        def layers():
            if right_padded:
                return fused()
            paths.append(_NOT_RIGHT_PADDED)
            return self._call_layers(sequences, initial_state, mask, training, generic=True)

        supported = backend.mask_is_supported(mask)
        known = backend.concrete_bool(supported)
        if known is None and not right_padded and self._keras_asserts_traced_masks(backend):
            # Keras' traced cuDNN step asserts a right-padded mask; so does this one, and
            # the other branch (a masked step's cost, seconds of tracing) is not traced.
            backend.assert_mask_supported(supported)
            known = True
        # The last layer's activity loss is added once, after the branch: a
        # loss added inside a traced branch cannot leave it.
        with _activity_regularizer_off(self._views[-1].layer):
            if known is not None:
                outputs = fused() if known else layers()
            else:
                structure = self._output_structure()
                flat = ops.cond(
                    supported, lambda: tree.flatten(fused()), lambda: tree.flatten(layers())
                )
                outputs = tree.pack_sequence_as(structure, flat)
        self._add_activity_losses(outputs)
        # Traced: the graph holds the fused call for right-padded masks.
        return outputs, next((p for p in paths if p[0] is PathKind.FUSED), paths[0])

    def _keras_asserts_traced_masks(self, backend) -> bool:
        """Whether the original layers, traced here, accept only right-padded masks
        (every one an LSTM or GRU that Keras runs on cuDNN here)."""
        return backend.keras_runs_cudnn() and all(keras_has_cudnn_path(v) for v in self._views)

    def _fallback_reason(self, mask) -> Reason | None:
        """Why this call must run the original layers, or None (the
        runtime rules of `rnnfuse.rules`)."""
        return runtime_reason(get_backend(), self._stack, self.compute_dtype, self._views, mask)

    def _check_not_xla(self) -> None:
        """A clear error where XLA would fail on the fused kernel later."""
        if get_backend().in_xla_context():
            raise ValueError(
                f"FusedRNN '{self.name}' runs cuDNN's fused RNN kernel here, "
                "which XLA cannot compile, but it is being traced for XLA "
                "(jit_compile=True). Fix: compile the model with "
                "jit_compile='auto' or False (Keras then keeps this model "
                "out of XLA, as it does for its own cuDNN LSTM)."
            )

    def _call_layers(self, sequences, initial_state, mask, training, generic=False):
        """The original layers in sequence (exactly the original numbers)."""
        context = _keras_generic_loop(self.fused_layers) if generic else contextlib.nullcontext()
        # training=None is Keras' own default: the outer call's value.
        rest = {} if training is None else {"training": training}
        if mask is not None:
            rest["mask"] = mask
        first = dict(rest)
        if initial_state is not None:
            first["initial_state"] = initial_state
        with context:
            return call_members(self._members, sequences, first=first, rest=rest)

    def _call_pieces(self, plan, sequences, initial_state, mask, training, algorithm,
                     right_padded):
        """A split plan: one fused call per piece, absorbed Dropout between; the
        path is fused only if every piece ran fused."""
        dropouts = dict(zip(self._dropout_after, self.absorbed_dropout))
        x = sequences
        paths = []
        for start, stop in _piece_bounds(plan.pieces):
            piece = self._piece(plan, start, stop)
            kwargs = {"training": training, "algorithm": algorithm,
                      "mask_is_right_padded": right_padded}
            if mask is not None:
                kwargs["mask"] = mask
            if start == 0 and initial_state is not None:
                kwargs["initial_state"] = initial_state
            x = piece(x, **kwargs)
            paths.append(piece._path)
            if (stop - 1) in dropouts:
                x = dropouts[stop - 1](x, training=training)
        noted = [p for p in paths if p[2] is not None and p[2].note]
        return x, next((p for p in paths if p[0] is not PathKind.FUSED), (noted or paths)[0])

    def _piece(self, plan: Plan, start: int, stop: int) -> "FusedRNN":
        """The sub-stack layers[start:stop] as a FusedRNN running `plan`'s
        kernel and algorithm whole (cached, untracked)."""
        piece_plan = plan.with_pieces((stop - start,))
        key = (start, stop, piece_plan)
        if key not in self._piece_cache:
            gaps = [None] * (stop - start - 1)
            for i, d in zip(self._dropout_after, self.absorbed_dropout):
                if start <= i < stop - 1:
                    gaps[i - start] = d
            self._piece_cache[key] = FusedRNN(
                self.fused_layers[start:stop],
                dropout_layers=gaps or None,
                plan=piece_plan,
                name=f"{self.name}_piece{start}",
                dtype=self.dtype_policy,
            )
        return self._piece_cache[key]

    def _call_fused(self, plan, sequences, initial_state, mask, training, algorithm=None,
                    add_losses=True):
        """The whole stack as one backend call: (outputs, path); `add_losses`
        adds the last layer's activity-regularization loss."""
        backend = get_backend()
        x = self._input_dropout(sequences, training)
        initial_h, initial_c = self._initial_states(initial_state)
        rate, seed = self._between_dropout(training)
        note = None
        if (training and plan.inference_only
                and plan.kernel not in backend.capabilities.training_kernels):
            # A forward-only kernel this backend does not train on: cuDNN trains.
            note = f"a training call: the {plan.kernel} kernel runs inference only here"
            plan = plan.for_training()
        try:
            run = backend.run_stack(x, StackCall(
                self._stack,
                initial_h=initial_h,
                initial_c=initial_c,
                mask=mask,
                reverse=self._views[0].go_backwards,
                dropout=rate,
                seed=seed,
                algorithm=plan.cudnn_algorithm if algorithm is None else algorithm,
                kernel=plan.kernel,
                training=bool(training),
            ))
        except NotImplementedError as err:
            # As Keras' Bidirectional does for its fused LSTM: the backend
            # cannot run this call, so the original layers run it.
            path = (PathKind.LAYERS, (not_implemented, (backend.name, err)), None)
            return self._call_layers(sequences, initial_state, mask, training), path
        outputs = self._assemble(run.outputs, run.final_h, run.final_c, mask)
        if add_losses:
            self._add_activity_losses(outputs)
        return outputs, (PathKind.FUSED, None, run.kernel.with_note(note))

    def _add_activity_losses(self, outputs) -> None:
        """The loss Keras' `Layer.__call__` adds for the last layer's
        `activity_regularizer`: per output tensor, divided by the batch size, on
        that layer's own losses, so `model.losses` matches the original model."""
        layer = self._views[-1].layer
        regularizer = layer.activity_regularizer
        if regularizer is None:
            return
        for output in tree.flatten(outputs):
            if not ops.is_tensor(output):
                continue
            loss = regularizer(output)
            if len(output.shape) > 0:
                batch = ops.cast(ops.shape(output)[0], dtype=loss.dtype)
                loss = ops.divide_no_nan(loss, batch)
            layer.add_loss(loss)

    def _input_dropout(self, x, training):
        """The first layer's input dropout, as Keras' cuDNN path applies it."""
        view = self._views[0]
        if not view.dropout:
            return x
        cell = view.levels[0][0]
        # Keras draws the mask on every call (training or not), then uses it
        # only when training; draw the same way so seed streams stay aligned.
        dp_mask = cell.get_dropout_mask(x[:, 0, :])
        if training:
            x = x * ops.expand_dims(dp_mask, axis=1)
        cell.reset_dropout_mask()
        return x

    def _between_dropout(self, training):
        """(rate, seed) of cuDNN's between-level dropout for this call."""
        if not training or not self.absorbed_dropout:
            return 0.0, (0, 0)
        rate = float(self.absorbed_dropout[0].rate)
        seed = int(getattr(self.absorbed_dropout[0].seed_generator, "_initial_seed", 0) or 0)
        return rate, (seed % (2**31), (seed // (2**31)) % (2**31))

    def _initial_states(self, initial_state):
        """Per pseudo-layer (h, c) lists for the first layer's levels."""
        if initial_state is None:
            return None, None
        view = self._views[0]
        lstm = self._stack.kind == "lstm"
        if view.bidirectional:
            flat = tree.flatten(initial_state)
            half = len(flat) // 2
            per_cell = [flat[:half], flat[half:]]
        elif view.num_levels == 1:
            per_cell = [tree.flatten(initial_state)]
        else:
            per_cell = [tree.flatten(s) for s in initial_state]
        h = [s[0] for s in per_cell]
        c = [s[1] for s in per_cell] if lstm else None
        return h, c

    def _assemble(self, outputs, final_h, final_c, mask):
        """The last layer's return value from the fused call's results."""
        view = self._views[-1]
        dirs = view.num_directions
        n = self._stack.num_pseudo_layers
        # Only the states returned are indexed (each index an op a call).
        own = range(n - view.num_levels * dirs, n)
        if dirs == 1 and not view.return_state:
            own = own[-1:]
        hs = [final_h[i] for i in own]
        cs = [final_c[i] for i in own] if final_c is not None else None
        dtype = self.compute_dtype
        if dirs == 1:
            last = hs[-1]
            if not view.return_sequences:
                output = last
                if mask is not None and view.zero_output_for_mask and not (keras_has_cudnn_path(view) and get_backend().keras_runs_cudnn()):
                    # Keras' loop returns the last step's output, zero where it is masked.
                    keep = ops.expand_dims(ops.cast(mask[:, -1], "bool"), -1)
                    output = ops.where(keep, last, ops.zeros_like(last))
            elif mask is not None and not (
                view.zero_output_for_mask or (keras_has_cudnn_path(view) and get_backend().keras_runs_cudnn())
            ):
                # Keras' generic loop repeats the last output on padding.
                keep = ops.expand_dims(ops.cast(mask, "bool"), -1)
                output = ops.where(keep, outputs, ops.expand_dims(last, 1))
            else:
                output = outputs
            result = (ops.cast(output, dtype),)
            if view.return_state:
                flat = [s for i in range(len(hs)) for s in ((hs[i], cs[i]) if cs else (hs[i],))]
                flat = [ops.cast(s, dtype) for s in flat]
                result += tuple(tree.pack_sequence_as(list(view.layer.state_size), flat))
            return result if view.return_state else result[0]
        width = self._stack.output_size
        if view.return_sequences:
            y, y_rev = outputs[..., :width], outputs[..., width:]
        else:
            y, y_rev = hs[0], hs[1]
        y, y_rev = ops.cast(y, dtype), ops.cast(y_rev, dtype)
        output = _merge(view.merge_mode, y, y_rev)
        if not view.return_state:
            return output
        if cs is not None:
            states = (hs[0], cs[0], hs[1], cs[1])
        else:
            states = (hs[0], hs[1])
        states = tuple(ops.cast(s, dtype) for s in states)
        if view.merge_mode is None:
            return output + states
        return (output,) + states

    def _output_structure(self):
        """A nested structure shaped like this layer's return value."""
        view = self._views[-1]
        n_out = 2 if (view.bidirectional and view.merge_mode is None) else 1
        if not view.return_state:
            return (0, 0) if n_out == 2 else 0
        if view.bidirectional:
            n_states = 4 if self._stack.kind == "lstm" else 2
            return tuple([0] * (n_out + n_states))
        return (0,) + tuple(tree.map_structure(lambda _: 0, list(view.layer.state_size)))


def call_members(members, x, *, first: dict, rest: dict):
    """Runs a run's `members` (absorbed Dropout layers in place) one after the
    other on `x`, with `first` the first layer's keyword arguments and `rest`
    the later ones' (a Dropout gets `training`).

    >>> import keras, numpy as np
    >>> a, b = keras.layers.GRU(2, return_sequences=True), keras.layers.GRU(2)
    >>> tuple(call_members([a, b], np.zeros((1, 3, 4), "float32"), first={}, rest={}).shape)
    (1, 2)
    """
    for i, layer in enumerate(members):
        if i and type(layer) is keras.layers.Dropout:
            kwargs = {"training": rest["training"]} if "training" in rest else {}
        else:
            kwargs = first if i == 0 else rest
        x = layer(x, **kwargs)
    return x


def fused_layers(model) -> list:
    """The FusedRNN layers of `model`, nested models included.

    >>> import keras
    >>> fused_layers(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    []
    """
    return [l for l in model._flatten_layers(include_self=False) if isinstance(l, FusedRNN)]


def _plan_argument(plan, algorithm, pieces) -> Plan:
    """FusedRNN's `plan` argument as a Plan: a Plan, its dict, None, or the
    `algorithm`/`pieces` arguments of a layer saved before `plan` existed."""
    if plan is not None and (algorithm is not None or pieces != "unset"):
        raise ValueError(
            "FusedRNN: pass plan=, not algorithm= or pieces= beside it; received "
            f"plan={plan!r}, algorithm={algorithm!r}, pieces={pieces!r}"
        )
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if plan is not None:
        return plan
    if pieces == "unset" or pieces is None:
        return FUSED if algorithm is None else Plan(whole=True, algorithm=algorithm)
    if isinstance(pieces, (str, bytes)) or not hasattr(pieces, "__iter__"):
        raise ValueError(f"FusedRNN: pieces must be None, () or a tuple; received {pieces!r}")
    return Plan(tuple(pieces), algorithm)


def _layer_list(layers) -> list:
    """`layers` as a list of Keras layers, or a clear error."""
    example = "FusedRNN([keras.layers.LSTM(8, return_sequences=True), keras.layers.LSTM(8)])"
    if isinstance(layers, keras.layers.Layer):
        raise TypeError(
            f"FusedRNN(layers) expects a list of recurrent layers; received the "
            f"single layer '{layers.name}' ({type(layers).__name__}). Fix: "
            f"FusedRNN([{layers.name}]), e.g. {example}."
        )
    if layers is None or isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(
            "FusedRNN(layers) expects a list of Keras recurrent layer objects; "
            f"received {type(layers).__name__} {layers!r}. Fix: pass the layers "
            f"themselves, e.g. {example}."
        )
    layers = list(layers)
    if not layers:
        raise ValueError("FusedRNN needs at least one layer; received [].")
    for i, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"FusedRNN(layers): layers[{i}] is {type(layer).__name__} "
                f"{layer!r}, not a Keras layer. Fix: pass the recurrent layer "
                f"objects, e.g. {example}."
            )
    return layers


def _dropout_list(dropout_layers, num_layers: int) -> list:
    """One Dropout layer or None per gap between layers, or a clear error."""
    gaps = num_layers - 1
    if dropout_layers is None:
        return [None] * gaps
    if isinstance(dropout_layers, (str, bytes)) or not hasattr(dropout_layers, "__iter__"):
        raise TypeError(
            "FusedRNN(dropout_layers) expects a list with one entry per gap "
            f"between layers ({gaps}); received {type(dropout_layers).__name__} "
            f"{dropout_layers!r}."
        )
    dropout_layers = list(dropout_layers)
    if not dropout_layers:
        return [None] * gaps
    if len(dropout_layers) != gaps:
        raise ValueError(
            "dropout_layers needs one entry per gap between layers "
            f"({gaps}); received {len(dropout_layers)}"
        )
    for i, d in enumerate(dropout_layers):
        if d is not None and not isinstance(d, keras.layers.Dropout):
            fix = (
                f" Fix: pass the layer, e.g. keras.layers.Dropout({d!r}), in "
                "every gap (cuDNN applies one rate between every pair of levels)."
                if isinstance(d, (int, float)) and not isinstance(d, bool)
                else ""
            )
            raise TypeError(
                f"FusedRNN(dropout_layers): entry {i} is {type(d).__name__} {d!r}; "
                f"each entry must be a keras.layers.Dropout layer or None.{fix}"
            )
    return dropout_layers


def first_call_kwargs(args, kwargs) -> dict:
    """The keyword arguments to replay a recorded call of a run's first layer:
    `initial_state`, an explicit `mask`, and `training`."""
    out = {}
    initial_state = kwargs.get("initial_state")
    if initial_state is None and len(args) > 1:
        initial_state = args[1]
    if initial_state is not None:
        out["initial_state"] = initial_state
    for name in ("mask", "training"):
        if kwargs.get(name) is not None:
            out[name] = kwargs[name]
    return out


def _piece_bounds(pieces) -> list[tuple[int, int]]:
    """(start, stop) layer indices of each piece."""
    bounds, start = [], 0
    for size in pieces:
        bounds.append((start, start + size))
        start += size
    return bounds


def _merge(mode, y, y_rev):
    """Keras Bidirectional's merge of the two directions."""
    if mode == "concat":
        return ops.concatenate([y, y_rev], axis=-1)
    if mode == "sum":
        return y + y_rev
    if mode == "ave":
        return (y + y_rev) / 2
    if mode == "mul":
        return y * y_rev
    return (y, y_rev)


@contextlib.contextmanager
def _activity_regularizer_off(layer):
    """Clears `layer.activity_regularizer` while a masked call's branches are
    traced; `FusedRNN` adds the loss once, after the branch."""
    regularizer = layer.activity_regularizer
    if regularizer is None:
        yield
        return
    layer.activity_regularizer = None
    try:
        yield
    finally:
        layer.activity_regularizer = regularizer


@contextlib.contextmanager
def _keras_generic_loop(layers):
    """Sets use_cudnn=False on Keras' LSTM/GRU layers while the branch for
    masks cuDNN cannot take is traced (Keras' cuDNN path asserts right padding)."""
    touched = []
    for layer in layers:
        parts = (
            (layer.forward_layer, layer.backward_layer)
            if isinstance(layer, keras.layers.Bidirectional)
            else (layer,)
        )
        for part in parts:
            if getattr(part, "use_cudnn", None) in ("auto", True):
                touched.append((part, part.use_cudnn))
                part.use_cudnn = False
    try:
        yield
    finally:
        for part, value in touched:
            part.use_cudnn = value
