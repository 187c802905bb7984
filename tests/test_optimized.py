"""Keras' model tools on an optimized model (rnnfuse/optimized.py).

- `get_layer` finds a layer that runs inside a FusedRNN by its own name, and
  its error for an unknown name says which layers each FusedRNN runs;
- `summary()` states the fused layers;
- `keras.utils.model_to_dot` (what `plot_model` draws): what Keras draws for
  an optimized model, and the original layers drawn from `rnnfuse.restore`;
- saving repeatedly calls the original layers once, not once per file;
- the optimized and restored models keep the original's dtype policy, so
  compile() gives a mixed_float16 model its LossScaleOptimizer as Keras does.
"""

from __future__ import annotations

import keras
import pytest
from builders import fused_layers, stack_model

import rnnfuse

L = keras.layers


def _model(functional: bool) -> keras.Model:
    layers = [L.LSTM(4, return_sequences=True, name="l1"), L.Dropout(0.1, name="drop"),
              L.LSTM(4, return_sequences=True, name="l2"), L.Dropout(0.1, name="drop2"),
              L.LSTM(4, name="l3"), L.Dense(2, name="head")]
    if not functional:
        return keras.Sequential([keras.Input((5, 3))] + layers)
    x = inp = keras.Input((5, 3))
    for layer in layers:
        x = layer(x)
    return keras.Model(inp, x)


@pytest.mark.parametrize("functional", [True, False], ids=["functional", "sequential"])
def test_get_layer_finds_the_layers_inside_a_fused_layer(functional):
    model = _model(functional)
    fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    assert fast.get_layer("l1") is model.get_layer("l1")
    assert fast.get_layer("drop") is model.get_layer("drop")  # absorbed Dropout
    assert fast.get_layer("l3") is model.get_layer("l3")
    assert fast.get_layer("fused_l1_to_l3") is fused
    assert fast.get_layer("head") is model.get_layer("head")
    with pytest.raises(ValueError, match=r"No such layer: nope.*FusedRNN 'fused_l1_to_l3' runs \['l1', 'drop', 'l2', 'drop2', 'l3'\]"):
        fast.get_layer("nope")
    # A sub-model cut by name builds as on the original (the layer's first
    # call is the original model's).
    sub = keras.Model(fast.inputs, fast.get_layer("l2").output)
    assert [l.name for l in sub.layers[1:]] == ["l1", "drop", "l2"]
    assert len(fused.fused_layers) == 3


def test_summary_states_the_fused_layers():
    fast = rnnfuse.optimize(_model(functional=True))
    lines = []
    fast.summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert "fused_l1_to_l3 (FusedRNN) runs l1 -> drop -> l2 -> drop2 -> l3 (LSTM)" in text
    assert "rnnfuse.restore(model)" in text
    plain = []
    _model(functional=True).summary(print_fn=plain.append)
    assert "FusedRNN" not in "\n".join(plain)


def _dot_nodes(model) -> tuple[list[str], set[str]]:
    """(drawn layer names, ids of edge ends that are no drawn node)."""
    from keras.src.utils.model_visualization import model_to_dot

    dot = model_to_dot(model, expand_nested=True)
    nodes = {n.get_name(): n for n in dot.get_nodes()}
    names = [label.split("<b>")[1].split("</b>")[0]
             for n in nodes.values() if (label := n.get_label() or "") and "<b>" in label]
    ends = {e for edge in dot.get_edges() for e in (edge.get_source(), edge.get_destination())}
    return names, {e for e in ends if e not in nodes}


def test_plot_model_draws_a_fused_layer_as_one_box_and_restore_draws_its_layers():
    """Keras' plot_model expands nested Functional/Sequential models only, so
    a FusedRNN is one box (docs/api.md says so). The original layers are
    drawn from `rnnfuse.restore(fast)`, with no stray node on a Functional
    model. (A Sequential model's expanded plot draws every call of its layers,
    also those of other models sharing them, as for any shared Keras layer.)"""
    pytest.importorskip("pydot")
    fast = rnnfuse.optimize(_model(functional=True))
    names, strays = _dot_nodes(fast)
    assert names[1:] == ["fused_l1_to_l3", "head"]
    assert not strays
    names, strays = _dot_nodes(rnnfuse.restore(fast))
    assert names[1:] == ["l1", "drop", "l2", "drop2", "l3", "head"]
    assert not strays


def test_saving_again_does_not_call_the_original_layers_again(tmp_path):
    model = stack_model("gru", 2, head=True)
    fast = rnnfuse.optimize(model)
    fast.compile(optimizer="adam", loss="mse")
    first = model.layers[1]
    fast.save(tmp_path / "a.keras")
    nodes = len(first._inbound_nodes)
    for name in ("b.keras", "c.keras"):
        fast.save(tmp_path / name)
    fast.save_weights(tmp_path / "w.weights.h5")
    fast.export(str(tmp_path / "saved"), verbose=False)
    assert len(first._inbound_nodes) == nodes


@pytest.mark.parametrize("functional", [True, False], ids=["functional", "sequential"])
def test_a_mixed_float16_model_keeps_its_policy_and_its_loss_scaling(functional):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = _model(functional)
        nested = keras.Sequential([keras.Input((5, 3)), L.GRU(4, return_sequences=True),
                                   L.GRU(4)])
        x = inp = keras.Input((5, 3))
        outer = keras.Model(inp, L.Dense(1)(nested(x)))
    finally:
        keras.config.set_dtype_policy("float32")  # optimized and compiled under float32
    for original in (model, outer):
        fast = rnnfuse.optimize(original)
        assert fused_layers(fast)
        for made in (fast, rnnfuse.restore(fast)):
            assert made.dtype_policy.name == "mixed_float16"
            made.compile(optimizer="adam", loss="mse")
            assert isinstance(made.optimizer, keras.optimizers.LossScaleOptimizer)
    assert rnnfuse.optimize(outer).layers[1].dtype_policy.name == "mixed_float16"
    plain = rnnfuse.optimize(_model(functional))
    assert plain.dtype_policy.name == "float32"
