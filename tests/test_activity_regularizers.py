"""Activity regularizers on fused runs, TensorFlow backend (the fused path
through the emulated CudnnRNNV3): `fast.losses` equals `model.losses`, and
evaluate and a fit epoch match the original (tests/activity_checks.py)."""

from __future__ import annotations

import pytest
from activity_checks import CASES, check_case, data, twins
from builders import fused_layers

import rnnfuse


@pytest.mark.parametrize("name", sorted(CASES))
def test_activity_losses_and_training_match_the_original(name, emulated_cudnn):
    check_case(name, emulated_cudnn)


def test_issue_repro_keeps_both_layers_apart_with_the_reason():
    model, _ = twins("issue_repro")
    first, second = model.layers[0].name, model.layers[1].name
    report = rnnfuse.analyze(model)
    assert [g.layers for g in report.groups] == [(first,), (second,)]
    assert report.breaks[(first, second)].rule == "activity_regularizer"
    report = rnnfuse.analyze(model, min_layers=2)
    assert report.groups == ()
    assert report.skipped[first].rule == "activity_regularizer"


def test_masked_activity_loss_is_added_once_outside_the_branch(emulated_cudnn):
    # Under a mask the fused layer chooses its path in a traced branch; the
    # loss must be added once, after it, in graph mode too (fit's trace).
    model, _ = twins("masked")
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x, _ = data(model, padded=True)
    import tensorflow as tf

    @tf.function
    def losses(inputs):
        fast(inputs, training=True)
        return fast.losses

    (fused,) = fused_layers(fast)
    activity = [l for l in losses(x)]
    weight_losses = len([w for w in model.trainable_weights if w.regularizer is not None])
    assert len(activity) == weight_losses + 1
    assert fused.fused_layers[-1].activity_regularizer is not None  # restored after the branch
