"""The model classes `rnnfuse.optimize` returns: `OptimizedModel`
(Functional) and `OptimizedSequential`, the plain Keras classes with a few
methods changed and registered, so `keras.models.load_model` rebuilds a
fused file. `fit`/`evaluate`/`predict` choose plans on the first batch;
`get_layer` and `summary` also see the layers inside each FusedRNN;
`save`, `export` and weight files keep the original model's layout
(`rnnfuse.persistence`).

>>> import keras, rnnfuse
>>> m = keras.Sequential([keras.Input((5, 2)), keras.layers.LSTM(3)])
>>> type(rnnfuse.optimize(m)).__name__
'OptimizedSequential'
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import keras
from keras.src.models.functional import Functional
from keras.src.utils import io_utils

from rnnfuse.fused import FusedRNN, fused_layers
from rnnfuse.passes.rewrite import keep_dtype_policy
from rnnfuse.persistence import (
    copy_compile,
    export_model,
    in_original_order,
    is_fused_archive,
    portable_model,
    weights_model,
)
from rnnfuse.tuning import first_batch
from rnnfuse.tuning.budget import call_steps

__all__ = ["FUSED_FORMAT_NOTE", "OptimizedModel", "OptimizedSequential", "as_optimized"]

# The first entry of a fused-format model config (`save(path, fused=True)`).
_FORMAT_KEY = "rnnfuse"
# A Functional model's output names in that config (files saved before it
# have none: their FusedRNN layers carry the output layers' names).
_OUTPUT_NAMES_KEY = "rnnfuse_output_names"
FUSED_FORMAT_NOTE = (
    "this file is in rnnfuse's fused format (saved with save(path, "
    "fused=True)): it loads only where rnnfuse is installed and imported. "
    "Fix: pip install rnnfuse, then import rnnfuse before "
    "keras.models.load_model(path), or call rnnfuse.load_model(path); to get "
    "a file plain Keras loads, save the model again with save(path)"
)


class _OptimizedMixin:
    """The methods both optimized classes change (see the module doc); refuses
    `jit_compile=True` while a cuDNN kernel XLA cannot compile may run."""

    def _cudnn_layers(self) -> list[str]:
        """Names of the FusedRNN layers that would run the fused kernel here."""
        return [layer.name for layer in fused_layers(self) if layer.fused_call_blocks_xla]

    @property
    def jit_compile(self):
        return keras.Model.jit_compile.fget(self)

    @jit_compile.setter
    def jit_compile(self, value):
        if value is True:
            cudnn = self._cudnn_layers()
            if cudnn:
                raise ValueError(
                    f"jit_compile=True: model '{self.name}' runs its fused "
                    f"layers ({', '.join(repr(n) for n in cudnn)}) as cuDNN "
                    "kernels on this machine, and XLA cannot compile cuDNN ops "
                    "(nor Keras' own cuDNN LSTM/GRU). Fix: compile with "
                    "jit_compile='auto' (the default) or False."
                )
        keras.Model.jit_compile.fset(self, value)

    def compile(self, *args, **kwargs):
        # Kept for first-batch tuning (the original layers as Keras runs them) and `save`.
        jit = _argument(keras.Model.compile, args, kwargs, "jit_compile")
        object.__setattr__(self, "_rnnfuse_jit_compile", jit)
        state = getattr(self, "_rnnfuse_autotune", None)
        if state is not None:
            state.jit_auto = jit == "auto"
        return super().compile(*args, **kwargs)

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """`keras.Model.fit`, with plans first chosen on the first batch, as much
        timing as the fit's epochs x steps can pay for (`rnnfuse.tuning.budget`)."""
        given = (x, y, batch_size, *args)
        steps = call_steps(
            x, batch_size,
            epochs=_argument(keras.Model.fit, given, kwargs, "epochs"),
            steps=_argument(keras.Model.fit, given, kwargs, "steps_per_epoch"),
            initial_epoch=_argument(keras.Model.fit, given, kwargs, "initial_epoch"),
            validation_split=_argument(keras.Model.fit, given, kwargs, "validation_split"),
        )
        with first_batch.keras_call(self, x, batch_size, training=True, steps=steps):
            return super().fit(x, y, batch_size, *args, **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """`keras.Model.evaluate`, with plans first chosen on the first batch."""
        steps = call_steps(x, batch_size, steps=_argument(
            keras.Model.evaluate, (x, y, batch_size, *args), kwargs, "steps"))
        with first_batch.keras_call(self, x, batch_size, training=False, steps=steps):
            return super().evaluate(x, y, batch_size, *args, **kwargs)

    def predict(self, x, batch_size=None, *args, **kwargs):
        """`keras.Model.predict`, with plans first chosen on the first batch."""
        steps = call_steps(x, batch_size, steps=_argument(
            keras.Model.predict, (x, batch_size, *args), kwargs, "steps"))
        with first_batch.keras_call(self, x, batch_size, training=False, steps=steps):
            return super().predict(x, batch_size, *args, **kwargs)

    def train_on_batch(self, x, y=None, *args, **kwargs):
        """`keras.Model.train_on_batch`, planned as a `fit` of as many steps as
        this mode's batch calls so far (`first_batch.batch_call`)."""
        with first_batch.batch_call(self, x, training=True):
            return super().train_on_batch(x, y, *args, **kwargs)

    def test_on_batch(self, x, y=None, *args, **kwargs):
        """`keras.Model.test_on_batch`, planned as `train_on_batch` is."""
        with first_batch.batch_call(self, x, training=False):
            return super().test_on_batch(x, y, *args, **kwargs)

    def predict_on_batch(self, x):
        """`keras.Model.predict_on_batch`, planned as `train_on_batch` is."""
        with first_batch.batch_call(self, x, training=False):
            return super().predict_on_batch(x)

    # Each mode's step is made with the jit_compile its plans allow.
    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return super().make_train_function(force)
        with first_batch.mode_jit_compile(self, training=True):
            made = super().make_train_function(force)
        # Online tuning: a fit steps through its plans' race (`tuning.online`) until it commits.
        online = first_batch.online_train_function(self, self._train_function_now)
        if online is None:
            return made
        self.train_function = online
        return online

    def _train_function_now(self):
        """Keras' train function for the plans set now (the model's own stays in place)."""
        keep = self.train_function
        with first_batch.mode_jit_compile(self, training=True):
            super().make_train_function(force=True)
        made, self.train_function = self.train_function, keep
        return made

    def make_test_function(self, force=False):
        if self.test_function is not None and not force:
            return super().make_test_function(force)
        with first_batch.mode_jit_compile(self, training=False):
            return super().make_test_function(force)

    def make_predict_function(self, force=False):
        if self.predict_function is not None and not force:
            return super().make_predict_function(force)
        with first_batch.mode_jit_compile(self, training=False):
            return super().make_predict_function(force)

    def compile_from_config(self, config):
        # Compiled with jit_compile=True where no GPU was visible, loaded where one is: "auto".
        if (
            isinstance(config, dict)
            and config.get("jit_compile") is True
            and self._cudnn_layers()
        ):
            config = {**config, "jit_compile": "auto"}
        # Keras' own, which skips a model whose compile() is overridden (ours records jit_compile).
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if hasattr(self, "optimizer") and self.built:
            self.optimizer.build(self.trainable_variables)

    # The original model's variable order: optimizer slots and weight files number by position.

    @property
    def weights(self):
        return in_original_order(self, super().weights)

    @property
    def variables(self):
        return in_original_order(self, super().variables)

    def get_layer(self, name=None, index=None):
        """`keras.Model.get_layer`, which also finds the original layers a
        FusedRNN runs (the same objects as in the original model)."""
        try:
            return super().get_layer(name=name, index=index)
        except ValueError as err:
            if name is None or index is not None:
                raise
            inside = {}
            for layer in self.layers:
                if isinstance(layer, FusedRNN):
                    for member in layer.members():
                        if member.name == name:
                            return member
                        inside.setdefault(layer.name, []).append(member.name)
            if not inside:
                raise
            where = "; ".join(f"FusedRNN '{f}' runs {names}" for f, names in inside.items())
            raise ValueError(f"{err} ({where}.)") from None

    def summary(self, *args, **kwargs):
        """`keras.Model.summary`, then one line per FusedRNN: the layers it
        runs (`expand_nested=True` lists them as rows too)."""
        super().summary(*args, **kwargs)
        print_fn = _argument(keras.Model.summary, args, kwargs, "print_fn")
        fused = fused_layers(self)
        if not fused:
            return
        lines = [" Fused by rnnfuse (rnnfuse.restore(model) gives the original layers back):"]
        for layer in fused:
            kinds = "/".join(sorted({type(m).__name__ for m in layer.fused_layers}))
            names = " -> ".join(m.name for m in layer.members())
            lines.append(f"   {layer.name} (FusedRNN) runs {names} ({kinds})")
        for line in lines:
            (print_fn or io_utils.print_msg)(line)

    def save(self, filepath, overwrite=True, zipped=None, *, fused=False, **kwargs):
        """Saves the model as the original (unfused) model would, a file plain
        Keras loads: `rnnfuse.load_model` gives it optimized again.

        Args:
            filepath, overwrite, zipped, **kwargs: as for `keras.Model.save`.
            fused: write the optimized structure instead (loads with rnnfuse).
        """
        if fused:
            return super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)
        return portable_model(self).save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    def export(
        self, filepath, format="tf_saved_model", verbose=None, input_signature=None,
        *, fused=False, **kwargs,
    ):
        """Exports the model for inference as the original model would (its
        export serves without rnnfuse); arguments as for `keras.Model.export`.
        `fused=True` ("tf_saved_model" only, else ValueError) traces the
        optimized model as it runs here; a server then loads rnnfuse's op first
        (docs/deployment.md)."""
        if not fused:
            return export_model(self).export(
                filepath, format=format, verbose=verbose, input_signature=input_signature,
                **kwargs,
            )
        if format != "tf_saved_model":
            raise ValueError(
                f"export(fused=True) traces rnnfuse's own cuDNN op, which only a "
                f"TensorFlow SavedModel can hold; received format={format!r}. "
                "Fix: leave fused out, which exports the original layers (what "
                "the original model's export gives)."
            )
        return super().export(
            filepath, format=format, verbose=verbose, input_signature=input_signature, **kwargs
        )

    def get_config(self):
        # Read first in Keras' error where a save(fused=True) file loads without rnnfuse.
        config = {_FORMAT_KEY: FUSED_FORMAT_NOTE, **super().get_config()}
        if hasattr(self, "output_names"):
            # The original model's: a FusedRNN at an output has its own name.
            config[_OUTPUT_NAMES_KEY] = list(self.output_names)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        names = config.get(_OUTPUT_NAMES_KEY)
        config = {k: v for k, v in config.items() if k not in (_FORMAT_KEY, _OUTPUT_NAMES_KEY)}
        model = super().from_config(config, custom_objects=custom_objects)
        if names is not None:
            model.output_names = list(names)
        return model

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """Saves the weights (and optimizer state) as the original model would;
        the arguments of `keras.Model.save_weights`."""
        return weights_model(self).save_weights(filepath, overwrite=overwrite, **kwargs)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads weights saved by the original model or by this model, in the
        original layout unless the file is a fused `.keras` archive."""
        if is_fused_archive(filepath):
            return super().load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        return weights_model(self).load_weights(
            filepath, skip_mismatch=skip_mismatch, **kwargs
        )


@keras.saving.register_keras_serializable(package="rnnfuse")
class OptimizedModel(_OptimizedMixin, Functional):
    """A Functional model made by `rnnfuse.optimize` (see the module doc)."""


@keras.saving.register_keras_serializable(package="rnnfuse")
class OptimizedSequential(_OptimizedMixin, keras.Sequential):
    """A Sequential model made by `rnnfuse.optimize`; see `OptimizedModel`."""


def as_optimized(model: keras.Model, like: keras.Model | None = None) -> keras.Model:
    """`model` (a rewritten Sequential or Functional) as an Optimized* model,
    with `like`'s compile() arguments (the original model), made under
    `like`'s distribution strategy where none is active now."""
    if isinstance(model, (OptimizedModel, OptimizedSequential)):
        return model
    if not isinstance(model, keras.Sequential) and type(model) is not Functional:
        return model
    with _strategy_scope(like):
        if isinstance(model, keras.Sequential):
            layers = list(model.layers)
            first = model._layers[0] if model._layers else None
            if isinstance(first, keras.layers.InputLayer):
                # The same InputLayer: sub-models cut from this model's
                # layers see one input, as in the original.
                layers.insert(0, first.output)
            new = OptimizedSequential(layers, name=model.name, trainable=model.trainable)
        else:
            new = OptimizedModel(
                model.input, model.output, name=model.name, trainable=model.trainable
            )
            new.output_names = list(model.output_names)
        keep_dtype_policy(model, new)
        copy_compile(model if like is None else like, new)
    return new


_signature = functools.lru_cache(maxsize=None)(inspect.signature)


def _argument(function, args: tuple, kwargs: dict, name: str) -> Any:
    """The value of parameter `name` in a call `function(self, *args,
    **kwargs)` (its default where not given)."""
    signature = _signature(function)
    bound = signature.bind_partial(None, *args, **kwargs).arguments
    return bound.get(name, signature.parameters[name].default)


def _strategy_scope(like: Any):
    """The scope of `like`'s distribution strategy, if it has one and none is active."""
    from rnnfuse.backends import get_backend

    return get_backend().strategy_scope(getattr(like, "_distribute_strategy", None))
