"""First-batch tuning (rnnfuse.tuning.first_batch) on the CPU.

The device is faked (an environment that names a GPU), the timer is a
deterministic fake, and the fused kernel is the emulated CudnnRNNV3, so
these tests pin the decisions, the cache, the plan switch and its numbers
without a GPU.
"""

from __future__ import annotations

import json
import logging

import keras
import numpy as np
import pytest

import rnnfuse
from builders import fused_layers, max_abs_diff, random_inputs, stack_model
import fake_clock
from rnnfuse.tuning import first_batch, tuner
from rnnfuse.tuning.cache import PlanCache

ENV = {"device": "FakeGPU", "tensorflow": "2.21.0", "cudnn": "9", "backend": "tensorflow", "rnnfuse": "0.1.0"}


class FakeTimer(fake_clock.FakeTimer):
    """Candidates without a median take 10 s: slower than any given."""

    default = 10.0


@pytest.fixture
def fake_gpu(monkeypatch):
    """A device to 'time' on; steps are never built (the timer is fake)."""
    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))
    built = []

    def steps(group, plans, shape, dtype, training, jit_baseline=False, masked=False):
        built.append({"shape": shape, "jit_baseline": jit_baseline, "masked": masked})
        return {p.name: None for p in plans}

    monkeypatch.setattr(tuner, "_steps", steps)
    return built


def _optimize(model, timer, cache):
    fast = rnnfuse.optimize(model, cache=cache)
    state = fast._rnnfuse_autotune
    state.measure = timer
    state.check_gradients = lambda g, p, shape, dtype: 1e-6
    state.fit_share = None  # tiny fits time everything (the budget: test_budget.py)
    return fast


def _data(model, n=16, seed=0):
    rng = np.random.default_rng(seed)
    x = random_inputs(model, n, rng)
    y = model.predict(x, verbose=0)
    return x, np.asarray(y)


def test_first_fit_times_the_candidates_on_the_real_batch_and_keeps_the_fastest(
    fake_gpu, emulated_cudnn, tmp_path
):
    model = stack_model("lstm", 4, units=6, steps=9, last_return_sequences=True)
    timer = FakeTimer({"per-layer": 3.0, "fused": 2.0, "split 2+2": 1.0})
    fast = _optimize(model, timer, PlanCache(tmp_path / "plans.json"))
    (layer,) = fused_layers(fast)
    x, y = _data(model, n=16)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=8, epochs=1, verbose=0)
    # One tuning (one algorithm without rnnfuse's op: one stage).
    assert timer.calls == 1
    assert timer.names == [sorted(["per-layer", "fused", "split 2+2"])]
    assert fake_gpu[0]["shape"] == (8, 9, 5), "timed on the first batch's shape"
    assert layer.plan == rnnfuse.Plan((2, 2))
    assert "fused" in layer.last_path
    (record,) = first_batch.decisions(fast)
    assert record["mode"] == "training" and record["input"] == [8, 9, 5]
    assert record["chosen"] == "split 2+2" and record["timings_ms"]["per-layer"] == 3000.0
    (group,) = rnnfuse.analyze(model).groups
    assert record["static"] == rnnfuse.tuning.table.static_plan(group, "float32", True).name
    json.dumps(record)  # JSON-ready, for bench/ and bug reports
    # The split plan computes what the original layers compute.
    assert max_abs_diff(fast.predict(x, verbose=0), model.predict(x, verbose=0)) <= 2e-5


def test_a_masked_input_is_timed_with_a_mask_and_cached_as_its_own_decision(
    fake_gpu, emulated_cudnn, tmp_path
):
    # Under torch a mask sends Keras' LSTM/GRU to their Python loop (over
    # 30x slower): timing the candidates unmasked misjudges them.
    cache = PlanCache(tmp_path / "plans.json")
    masked = stack_model("gru", 2, steps=6, masked=True)
    assert first_batch.receives_mask(fused_layers(rnnfuse.optimize(masked, cache=cache))[0])
    x, y = _data(masked, n=8)
    fast = _optimize(masked, FakeTimer({"per-layer": 2.0, "fused": 1.0}), cache)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=8, verbose=0)
    assert fake_gpu[-1]["masked"] is True
    plain = stack_model("gru", 2, steps=6)
    assert not first_batch.receives_mask(fused_layers(rnnfuse.optimize(plain, cache=cache))[0])
    xp, yp = _data(plain, n=8)
    timer = FakeTimer({"per-layer": 1.0, "fused": 2.0})
    fast2 = _optimize(plain, timer, cache)
    fast2.compile(optimizer="sgd", loss="mse")
    fast2.fit(xp, yp, batch_size=8, verbose=0)
    assert timer.calls == 1, "the masked decision must not stand in for an unmasked input"
    assert fake_gpu[-1]["masked"] is False
    keys = [k for k, _ in cache.entries()]
    assert sum(k.masked for k in keys) == 1 and len(keys) == 2


def test_the_padding_mask_for_timing_is_right_padded_and_reaches_the_layers(emulated_cudnn):
    model = stack_model("lstm", 2, units=4, steps=7, masked=True)
    (group,) = rnnfuse.analyze(model).groups
    mask = keras.ops.convert_to_numpy(tuner.padding_mask((5, 7)))
    assert mask[0].all() and not mask.all()
    assert all(list(row) == sorted(row, reverse=True) for row in mask)
    x = tuner._input_batch((5, 7, group.input_size), "float32")
    seen = []
    for plan in (rnnfuse.PER_LAYER, rnnfuse.FUSED):
        run = tuner._runner(group, plan)
        out = tuner._with_mask(run, tuner.padding_mask((5, 7)))(x, False)
        plain = run(x, False)
        seen.append(max_abs_diff(out, plain))
    assert all(d > 1e-4 for d in seen), "the mask changed neither plan's output"


@pytest.fixture
def traced(monkeypatch):
    """The names of the FusedRNN layers whose original layers were called
    (traced, in a tf.function), in order."""
    from rnnfuse.fused import FusedRNN

    names = []
    original = FusedRNN._call_layers

    def counting(self, *args, **kwargs):
        names.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FusedRNN, "_call_layers", counting)
    return names


def test_a_masked_fused_candidate_is_timed_with_its_branch_for_other_masks(emulated_cudnn, traced):
    """The tuner times the step the model runs: a masked fused call traces
    its branch for masks that are not right-padded (the original layers),
    which a masked `fit` step pays for too; left out of the timed step, a
    masked split plan 14% ahead on the tuner's clock ran 7% behind through
    `fit`."""
    import tensorflow as tf

    # 5 x 40: over the 128 elements up to which tf.function captures an
    # eager tensor as a constant (then the branch is folded away, in the
    # model's step as well).
    model = stack_model("lstm", 2, units=4, steps=40, masked=True)
    (group,) = rnnfuse.analyze(model).groups
    x = tuner._input_batch((5, 40, group.input_size), "float32")
    run = tuner._with_mask(tuner._runner(group, rnnfuse.FUSED), tuner.padding_mask((5, 40)))
    tf.function(lambda x: run(x, False))(x)
    assert len(traced) == 1, "the timed step left out the branch a masked model step traces"


def test_a_cached_decision_is_used_without_timing(fake_gpu, emulated_cudnn, tmp_path):
    cache = PlanCache(tmp_path / "plans.json")
    model = stack_model("gru", 2, steps=6)
    x, y = _data(model, n=8)
    first = FakeTimer({"per-layer": 1.0, "fused": 2.0})
    fast = _optimize(model, first, cache)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=8, verbose=0)
    assert first.calls == 1
    assert fused_layers(fast)[0].plan.per_layer
    again = FakeTimer({"per-layer": 1.0, "fused": 2.0})
    fast2 = _optimize(model, again, PlanCache(tmp_path / "plans.json"))
    fast2.compile(optimizer="sgd", loss="mse")
    fast2.fit(x, y, batch_size=8, verbose=0)
    assert again.calls == 0, "a cached shape must not be timed again"
    assert fused_layers(fast2)[0].plan.per_layer


def test_a_new_bucket_is_timed_on_its_contenders_and_a_shape_of_a_decided_bucket_is_not(
    fake_gpu, emulated_cudnn, tmp_path
):
    model = stack_model("lstm", 4, steps=None, input_size=3)
    timer = FakeTimer({"per-layer": 1.0, "fused": 1.4, "split 2+2": 4.0})
    fast = _optimize(model, timer, PlanCache(tmp_path / "plans.json"))
    fast.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    for batch, steps in ((8, 16), (8, 18), (32, 16)):
        x = rng.standard_normal((batch, steps, 3)).astype("float32")
        y = rng.standard_normal((batch, 6)).astype("float32")
        fast.fit(x, y, batch_size=batch, verbose=0)
    # (8, 18) is in (8, 16)'s bucket: not timed. (32, 16) is a new bucket:
    # timed, on what was in contention at (8, 16) (split 2+2 was 4x behind;
    # the original layers won, so no emulated kernel runs a relaxed trace).
    assert timer.names == [["fused", "per-layer", "split 2+2"], ["fused", "per-layer"]]
    assert [s["shape"][:2] for s in fake_gpu] == [(8, 16), (32, 16)]
    first, second = first_batch.decisions(fast)
    assert (first["bucket"], second["bucket"]) == ([8, 16], [32, 16])
    assert second["source"] == "measured: the contenders of bucket (8, 16)"
    assert fused_layers(fast)[0].plan.per_layer


def test_a_shape_already_decided_reads_no_cache_file_again(fake_gpu, emulated_cudnn, tmp_path, monkeypatch):
    model = stack_model("lstm", 2, input_size=3)
    timer = FakeTimer({"per-layer": 2.0, "fused": 1.0})
    cache = PlanCache(tmp_path / "plans.json")
    fast = _optimize(model, timer, cache)
    fast.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 7, 3)).astype("float32")
    y = rng.standard_normal((8, 6)).astype("float32")
    fast.fit(x, y, batch_size=8, verbose=0)
    reads = []
    monkeypatch.setattr(PlanCache, "get", lambda self, key: reads.append(key))
    monkeypatch.setattr(PlanCache, "entries", lambda self: reads.append("entries") or [])
    for _ in range(3):
        fast.fit(x, y, batch_size=8, verbose=0)
    assert reads == [] and timer.calls == 1
    assert fused_layers(fast)[0].plan.name == "fused"


def test_a_corrupt_cache_file_is_set_aside_and_tuning_goes_on(fake_gpu, emulated_cudnn, tmp_path):
    path = tmp_path / "plans.json"
    path.write_text("{not json")
    model = stack_model("gru", 2, steps=5)
    timer = FakeTimer({"per-layer": 2.0, "fused": 1.0})
    fast = _optimize(model, timer, PlanCache(path))
    fast.compile(optimizer="sgd", loss="mse")
    x, y = _data(model, n=4)
    with pytest.warns(RuntimeWarning, match="plan cache"):
        fast.fit(x, y, batch_size=4, verbose=0)
    assert timer.calls == 1
    assert fused_layers(fast)[0].plan.name == "fused"
    assert json.loads(path.read_text())["entries"], "the decision was written"


def test_timing_that_fails_runs_the_static_tables_proven_plan(fake_gpu, emulated_cudnn, tmp_path, caplog):
    model = stack_model("lstm", 2, steps=5)
    timer = FakeTimer({}, fail=True)
    fast = _optimize(model, timer, PlanCache(tmp_path / "plans.json"))
    (layer,) = fused_layers(fast)
    assert layer.plan.name == "fused"  # the static table's, before the first batch
    fast.compile(optimizer="sgd", loss="mse")
    x, y = _data(model, n=4)
    with caplog.at_level(logging.WARNING, logger="rnnfuse"):
        fast.fit(x, y, batch_size=4, verbose=0)
    # The table's float32 "units <= 256: fused" rule lost somewhere in its
    # measurements, so where nothing could be timed the layers stay.
    assert layer.plan.per_layer
    assert "timing the plans failed" in caplog.text
    assert max_abs_diff(fast.predict(x, verbose=0), model.predict(x, verbose=0)) <= 2e-5


def test_the_baseline_is_timed_with_xla_where_keras_would_compile_the_original(fake_gpu, tmp_path):
    # Keras compiles a SimpleRNN stack with XLA under jit_compile="auto";
    # an LSTM stack only where it cannot run cuDNN (here: no GPU).
    loops = stack_model("rnn_tanh", 2, steps=5)
    cudnn = stack_model("lstm", 2, steps=5)
    cudnn.layers[1].supports_jit = False  # as Keras sets it where cuDNN can run
    for model, want in ((loops, True), (cudnn, False)):
        fake_gpu.clear()
        fast = _optimize(model, FakeTimer({"fused": 0.5}), PlanCache(tmp_path / f"{model.name}.json"))
        x, _ = _data(model, n=4)
        first_batch.prepare(fast, x, 4, training=False)
        assert fake_gpu and fake_gpu[0]["jit_baseline"] is want, model.name


def test_switching_to_per_layer_runs_the_original_layers(fake_gpu, emulated_cudnn, tmp_path, caplog):
    model = stack_model("gru", 3, steps=6)
    timer = FakeTimer({"per-layer": 1.0, "fused": 5.0})
    fast = _optimize(model, timer, PlanCache(tmp_path / "plans.json"))
    x, _ = _data(model, n=4)
    with caplog.at_level(logging.INFO, logger="rnnfuse"):
        out = fast.predict(x, verbose=0)
    (layer,) = fused_layers(fast)
    assert layer.plan.per_layer
    assert layer.last_path.startswith("layers:")
    assert not layer.fused_call_blocks_xla
    assert "chose per-layer" in caplog.text and "inference" in caplog.text
    assert max_abs_diff(out, model.predict(x, verbose=0)) == 0.0


def test_tune_false_and_no_gpu_time_nothing(emulated_cudnn, tmp_path):
    model = stack_model("lstm", 2, steps=5)
    assert not hasattr(rnnfuse.optimize(model, tune=False), "_rnnfuse_autotune")
    # The emulated kernel is no device: "auto" falls back to the static table.
    assert not first_batch.can_time_here()
    assert not hasattr(rnnfuse.optimize(model), "_rnnfuse_autotune")


@pytest.mark.parametrize(
    "make, batch_size, want",
    [
        (lambda: np.zeros((10, 7, 3)), None, (10, 7, 3)),
        (lambda: np.zeros((100, 7, 3)), 16, (16, 7, 3)),
        (lambda: [np.zeros((5, 4, 2)), np.zeros((5, 1))], 8, (5, 4, 2)),
        (lambda: {"a": np.zeros((6, 3, 2))}, None, (6, 3, 2)),
    ],
)
def test_first_batch_shape_of_arrays(make, batch_size, want):
    assert first_batch.first_batch_shape(make(), batch_size) == want


def test_first_batch_shape_of_a_dataset_reads_one_element():
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices((np.zeros((10, 7, 3), "float32"), np.zeros((10, 1)))).batch(4)
    assert first_batch.first_batch_shape(ds, None) == (4, 7, 3)
    gen = (b for b in [np.zeros((2, 3, 4))])
    assert first_batch.first_batch_shape(gen, None) is None


def test_set_plan_checks_its_arguments():
    model = stack_model("lstm", 3, steps=5)
    (layer,) = fused_layers(rnnfuse.optimize(model, tune=False))
    with pytest.raises(ValueError, match="runs 3 layers: plan 'split 1\\+1' covers 2 layers"):
        layer.set_plan(rnnfuse.Plan((1, 1)))
    with pytest.raises(TypeError, match=r"set_plan takes an rnnfuse.Plan.*received tuple"):
        layer.set_plan((3,))
    layer.set_plan(rnnfuse.FUSED)
    assert layer.plan == rnnfuse.Plan((3,))
    restored = type(layer).from_config(layer.get_config())
    assert restored.plan == rnnfuse.Plan((3,))
    layer.set_plan(rnnfuse.Plan((1, 2), "persistent_static+tc"))
    assert type(layer).from_config(layer.get_config()).plan == layer.plan


def test_a_fused_layer_saved_before_plans_existed_loads_its_pieces_and_algorithm():
    model = stack_model("lstm", 3, steps=5)
    (layer,) = fused_layers(rnnfuse.optimize(model, tune=False))
    config = layer.get_config()
    del config["plan"]
    for old, want in (
        ({"pieces": None, "algorithm": None}, rnnfuse.Plan((3,))),
        ({"pieces": [], "algorithm": None}, rnnfuse.PER_LAYER),
        ({"pieces": [1, 2], "algorithm": "persistent_dynamic+tc"}, rnnfuse.Plan((1, 2), "persistent_dynamic+tc")),
    ):
        assert type(layer).from_config({**config, **old}).plan == want


def test_analyze_says_when_fusing_costs_the_model_xla(emulated_cudnn):
    # A SimpleRNN stack: Keras compiles it with XLA under jit_compile="auto";
    # the fused cuDNN kernel (here: emulated, so "available") cannot be.
    loops = stack_model("rnn_tanh", 2, steps=5)
    (note,) = [n for n in rnnfuse.analyze(loops).notes if "XLA" in n]
    assert "fusing costs" in note and "jit_compile='auto'" in note
    # An LSTM stack Keras itself runs on cuDNN has no XLA to lose.
    cudnn = stack_model("lstm", 2, steps=5)
    cudnn.layers[1].supports_jit = False
    assert not [n for n in rnnfuse.analyze(cudnn).notes if "XLA" in n]


def test_no_xla_note_where_no_fused_kernel_runs():
    loops = stack_model("rnn_tanh", 2, steps=5)
    assert not [n for n in rnnfuse.analyze(loops).notes if "XLA" in n]


@pytest.fixture
def gradient_calls(monkeypatch):
    """A 2-layer LSTM group, the (dtype, shape) of every input the backend's
    `gradients_of` sees, and how many `gradients_of` calls (programs) were made."""
    from rnnfuse.backends import get_timing

    model = stack_model("lstm", 2, units=4, steps=2)  # each step is traced: few
    (group,) = rnnfuse.analyze(model).groups
    timing = type(get_timing())
    calls, programs = [], []
    real = timing.gradients_of

    def recording(self, batch, variables):
        programs.append(len(batch))
        calls.extend((keras.backend.standardize_dtype(x.dtype), tuple(x.shape)) for _, x, _ in batch)
        return real(self, batch, variables)

    monkeypatch.setattr(timing, "gradients_of", recording)
    return group, calls, programs


def test_the_float64_reference_is_computed_once_for_all_candidates(emulated_cudnn, gradient_calls):
    from rnnfuse.plan import FUSED, Plan

    group, calls, programs = gradient_calls
    check = tuner.GradientCheck()
    shape = (3, 2, group.input_size)
    errors = [check(group, plan, shape, "float32") for plan in (FUSED, Plan((1, 1)))]
    dtypes = [dtype for dtype, _ in calls]
    assert dtypes.count("float64") == 1, calls
    assert len(calls) == 3
    assert all(0 <= e < 1e-4 for e in errors), errors


def test_a_plan_its_default_twin_and_the_reference_share_one_program(emulated_cudnn, gradient_calls):
    from rnnfuse.plan import Plan

    group, calls, programs = gradient_calls
    check = tuner.GradientCheck()
    shape = (3, 2, group.input_size)
    plan = Plan((2,), "persistent_static+tc")
    error = check(group, plan, shape, "float32")
    assert programs == [3], programs  # reference, plan, twin: one program
    assert [d for d, _ in calls] == ["float64", "float32", "float32"]
    # The twin's error is known: asking for it makes no new program, and it
    # is what the twin checked alone reads.
    twin = check(group, Plan((2,)), shape, "float32")
    assert programs == [3]
    alone = tuner.GradientCheck()(group, Plan((2,)), shape, "float32")
    assert twin == pytest.approx(alone, abs=1e-12) and error >= 0.0


def test_a_failing_shared_program_is_redone_one_call_at_a_time(emulated_cudnn, gradient_calls, monkeypatch):
    from rnnfuse.backends import get_timing
    from rnnfuse.plan import Plan

    group, calls, programs = gradient_calls
    timing = type(get_timing())
    recording = timing.gradients_of

    def fails_when_shared(self, batch, variables):
        if len(batch) > 1:
            raise RuntimeError("one of them failed")
        return recording(self, batch, variables)

    monkeypatch.setattr(timing, "gradients_of", fails_when_shared)
    check = tuner.GradientCheck()
    check(group, Plan((2,), "persistent_static+tc"), (3, 2, group.input_size), "float32")
    assert programs == [1, 1], programs  # the reference, then the plan alone


def test_the_gradient_check_runs_on_the_first_check_steps_of_a_long_batch(gradient_calls,
                                                                          monkeypatch):
    monkeypatch.setattr(tuner, "CHECK_STEPS", 3)  # each step is traced: few
    group, calls, programs = gradient_calls
    steps = tuner.CHECK_STEPS + 36
    tuner.GradientCheck()(group, rnnfuse.FUSED, (3, steps, group.input_size), "float32")
    assert calls and all(shape == (3, tuner.CHECK_STEPS, group.input_size) for _, shape in calls), calls


def test_mask_is_right_padded_leaves_the_per_layer_fallback_untraced(emulated_cudnn, traced):
    """With mask_is_right_padded (a caller that knows its masks), a masked fused
    call's other branch is the fused call again: the original layers are
    not traced; without it they are, and both give the same numbers."""
    import tensorflow as tf

    from rnnfuse.fused import FusedRNN

    a, b = keras.layers.LSTM(4, return_sequences=True), keras.layers.LSTM(4)
    fused = FusedRNN([a, b])
    x = np.random.default_rng(0).standard_normal((3, 6, 2)).astype("float32")
    mask = tuner.padding_mask((3, 6))
    step = lambda known: tf.function(lambda x, m: fused(x, mask=m, mask_is_right_padded=known))(x, mask)
    inside = step(True)
    assert traced == [] and fused.last_path.kind.name == "FUSED"
    outside = step(False)
    assert traced == [fused.name], "without it the fallback branch is traced"
    assert max_abs_diff(inside, outside) == 0.0


def test_a_half_precision_check_computes_the_twin_only_over_the_rounding_floor(
        emulated_cudnn, gradient_calls):
    from rnnfuse.plan import Plan

    group, calls, programs = gradient_calls
    shape = (3, 2, group.input_size)
    plan = Plan((2,), "persistent_static+tc")
    tuner.GradientCheck()(group, plan, shape, "float16")
    assert programs == [2], programs  # the reference and the plan: no twin
    assert [d for d, _ in calls] == ["float64", "float16"]
