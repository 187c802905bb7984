"""What Keras' `Layer.__call__` does, and how a fused call keeps each part.

A fused call runs the inner layers' maths without their `__call__`, so
everything `Layer.__call__` does for a layer must be done by `FusedRNN`
(its own `__call__`, `call`, `build`, `compute_mask`) or be refused by a
rule. `AUDIT` lists every attribute of the layer and every function that
Keras' `Layer.__call__` uses, read from its source, with the answer. When a
Keras release adds something, the test fails and names it: audit it (does
a fused call now skip something that changes the answer?) and add it here.

The audit, item by item: masks out (compute_mask of the last
layer), `add_loss` in custom cells (refused: `cell_type`), activity
regularizers (the last layer's, added by `FusedRNN._add_activity_losses`;
elsewhere refused: `activity_regularizer`, `bidirectional_activity_regularizer`,
`cell_activity_regularizer`), metrics (Keras 3 layers add none in
`__call__`), the training flag (resolved by FusedRNN's own `__call__`,
passed to the kernel and to every layer it calls), autocast (one dtype
policy per run: `dtype_policy`; FusedRNN takes the first layer's).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import keras

_BOOKKEEPING = "bookkeeping of the call itself: FusedRNN's own __call__ does it"
_TRAINING = (
    "the training flag: FusedRNN's own __call__ resolves it; call() passes it to "
    "the kernel (between-level dropout) and to every layer it calls"
)
_AUTOCAST = (
    "input conversion and autocast: a run has one dtype policy (rule dtype_policy) "
    "and FusedRNN takes the first layer's, so its own __call__ converts the same"
)
_MASK = (
    "masks: FusedRNN supports masking, receives the mask and returns the last "
    "layer's compute_mask"
)
_ACTIVITY = (
    "activity regularization: FusedRNN._add_activity_losses adds the run's last "
    "layer's loss; the rules keep a regularized layer from anywhere else in a run"
)
_LAYOUT = (
    "a distribution's output relayout (sharding, never values): FusedRNN's own "
    "output gets its own path's layout"
)
_BUILD = "build: FusedRNN.build builds every inner layer that is not built"
_PLUMBING = "plumbing (argument specs, checks, errors, warnings)"

AUDIT = {
    # self.<attribute>
    "self.__class__": _PLUMBING,
    "self._allow_non_tensor_positional_args": _BOOKKEEPING,
    "self._assert_input_compatibility": (
        "the first layer's input spec: a wrong input rank is an error either way"
    ),
    "self._call_context_args": _TRAINING,
    "self._call_signature": _TRAINING,
    "self._called": _BOOKKEEPING,
    "self._check_super_called": _BOOKKEEPING,
    "self._convert_input_args": _AUTOCAST,
    "self._get_call_context": _TRAINING,
    "self._maybe_build": _BUILD,
    "self._maybe_reset_call_context": _TRAINING,
    "self._open_name_scope": "name scopes only (variables are named when built)",
    "self._resolve_and_populate_arg": _TRAINING,
    "self._set_mask_metadata": _MASK,
    "self.activity_regularizer": _ACTIVITY,
    "self.add_loss": _ACTIVITY,
    "self.autocast": _AUTOCAST,
    "self.built": _BUILD,
    "self.compute_dtype": _AUTOCAST,
    "self.dtype_policy": _AUTOCAST,
    "self.input_dtype": _AUTOCAST,
    "self.name": _PLUMBING,
    "self.supports_masking": _MASK,
    "self.variable_dtype": _AUTOCAST,
    # functions it calls
    "CallSpec": _TRAINING,
    "Node": _PLUMBING,
    "ValueError": _PLUMBING,
    "any": _PLUMBING,
    "any_symbolic_tensors": _PLUMBING,
    "backend.AutocastScope": _AUTOCAST,
    "backend.get_autocast_scope": _AUTOCAST,
    "backend.get_keras_mask": _MASK,
    "backend.is_float_dtype": _AUTOCAST,
    "backend.is_tensor": _ACTIVITY,
    "backend.set_keras_mask": _MASK,
    "backend.standardize_dtype": _AUTOCAST,
    "current_path": _LAYOUT,
    "distribution.get_tensor_layout": _LAYOUT,
    "distribution_lib.distribute_tensor": _LAYOUT,
    "distribution_lib.distribution": _LAYOUT,
    "is_backend_tensor_or_symbolic": _PLUMBING,
    "len": _PLUMBING,
    "list": _PLUMBING,
    "ops.cast": _ACTIVITY,
    "ops.divide_no_nan": _ACTIVITY,
    "ops.shape": _ACTIVITY,
    "super": _PLUMBING,
    "tree.flatten": _ACTIVITY,
    "tree.map_structure": _MASK,
    "type": _PLUMBING,
    "warnings.warn": _MASK,
}


def layer_call_uses() -> set[str]:
    """The `self.` attributes and the functions `keras.layers.Layer.__call__`
    uses, read from its source."""
    source = textwrap.dedent(inspect.getsource(keras.layers.Layer.__call__))
    uses = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            uses.add(f"self.{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                uses.add(func.id)
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id != "self":
                uses.add(f"{func.value.id}.{func.attr}")
    return uses


def test_every_part_of_keras_layer_call_is_audited():
    uses = layer_call_uses()
    new = sorted(uses - set(AUDIT))
    assert not new, (
        f"keras {keras.__version__}'s Layer.__call__ now uses {new}, which this "
        "audit has not looked at: check whether a fused call (FusedRNN, which runs "
        "the inner layers without their __call__) must do it too, then add it to AUDIT"
    )
    gone = sorted(set(AUDIT) - uses)
    assert not gone, f"Layer.__call__ no longer uses {gone}: remove them from AUDIT"


def test_the_audit_reads_the_source_it_claims_to():
    # The reader finds the activity-regularizer step the fused call reproduces.
    assert {"self.activity_regularizer", "self.add_loss", "ops.divide_no_nan"} <= layer_call_uses()
