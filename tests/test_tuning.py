"""The planner, the plan cache and the cuDNN algorithm record, on the CPU.

Timing and gradient checks are injected (a deterministic fake timer), so
these tests pin the decisions, the cache behaviour and the algorithm
record without a GPU.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import fused_layers, max_abs_diff, random_inputs, stack_model
from fake_clock import FakeTimer
from rnnfuse.backends import get_backend
from rnnfuse.passes import build_layer_graph, plan_fusion
from rnnfuse.plan import FUSED, PER_LAYER, Algorithm, Plan
from rnnfuse.tuning.cache import PlanCache
from rnnfuse.tuning.plans import candidate_plans, split_groups
from rnnfuse.tuning.tuner import tune_plans

ENV = {"device": "FakeGPU", "tensorflow": "2.21.0", "cudnn": "9", "backend": "tensorflow", "rnnfuse": "0.1.0"}


def _groups(model):
    return plan_fusion(build_layer_graph(model), model_name=model.name).groups


@pytest.fixture(autouse=True)
def _op_loaded(monkeypatch):
    """The fake-GPU tuner tests time the algorithms rnnfuse's op runs."""
    from rnnfuse.backends import tensorflow as tf_backend

    monkeypatch.setattr(tf_backend, "op_loaded", lambda: True)


def _tune(groups, timer, *, training=True, cache=None, errors=None, env=ENV):
    errors = errors or {}
    return tune_plans(
        groups,
        lambda g: (8, 20, g.input_size),
        training=training,
        cache=cache,
        measure=timer,
        check_gradients=lambda g, p, shape, dtype: errors.get(p.name, 1e-6),
        environment=env,
        progress=False,
    )


@pytest.fixture(autouse=True)
def _no_real_steps(monkeypatch):
    """The fake timer never runs steps; building them is all we skip."""
    from rnnfuse.tuning import tuner

    monkeypatch.setattr(tuner, "_steps", lambda group, plans, shape, dtype, training, jit_baseline=False, masked=False: {p.name: None for p in plans})


def test_candidates_cover_per_layer_whole_split_and_algorithms():
    (group,) = _groups(stack_model("lstm", 4))
    names = [p.name for p in candidate_plans(group)]
    assert names == [
        "per-layer",
        "fused",
        "fused @persistent_static+tc",
        "fused @persistent_dynamic+tc",
        "split 2+2",
        "split 2+2 @persistent_static+tc",
        "split 2+2 @persistent_dynamic+tc",
    ]
    (short,) = _groups(stack_model("gru", 2))
    assert [p.name for p in candidate_plans(short)] == [
        "per-layer",
        "fused",
        "fused @persistent_static+tc",
        "fused @persistent_dynamic+tc",
    ]


def test_tuner_picks_the_fastest_candidate():
    (group,) = _groups(stack_model("lstm", 4))
    timer = FakeTimer({"per-layer": 1.0, "fused": 0.9, "split 2+2 @persistent_static+tc": 0.5})
    (result,) = _tune([group], timer)
    assert result.plan.name == "split 2+2 @persistent_static+tc"
    assert result.source == "measured"
    assert result.timings["per-layer"] == 1.0


def test_halves_are_timed_only_on_algorithms_whose_whole_run_came_close(monkeypatch):
    """Stage two builds and times a split only where the whole run on the
    same algorithm was within PRUNE of stage one's best; the others are
    never traced, and say why."""
    from rnnfuse.tuning import tuner

    built = []
    monkeypatch.setattr(tuner, "_steps", lambda group, plans, *a, **k: built.extend(p.name for p in plans) or {p.name: None for p in plans})
    (group,) = _groups(stack_model("lstm", 4))
    timer = FakeTimer({
        "per-layer": 1.0, "fused": 0.9, "fused @persistent_static+tc": 3.0,
        "fused @persistent_dynamic+tc": 0.95, "split 2+2 @persistent_static+tc": 0.1,
    })
    (result,) = _tune([group], timer)
    assert "split 2+2 @persistent_static+tc" not in built
    assert "not timed" in result.rejected["split 2+2 @persistent_static+tc"]
    assert {"split 2+2", "split 2+2 @persistent_dynamic+tc"} <= set(built)
    # Stage two re-times the original layers and stage one's best beside the halves.
    assert timer.names[1] == sorted(["per-layer", "fused", "split 2+2", "split 2+2 @persistent_dynamic+tc"])
    assert len(built) == len(set(built)), "a plan timed in both stages is built once"
    assert result.plan.name == "fused"


def test_stage_two_does_not_rerun_original_layers_that_lost_by_far():
    (group,) = _groups(stack_model("lstm", 4))
    timer = FakeTimer({
        "per-layer": 10.0, "fused": 1.0, "fused @persistent_static+tc": 1.2,
        "fused @persistent_dynamic+tc": 5.0,
    })
    (result,) = _tune([group], timer)
    assert timer.calls == 2
    assert timer.names[1] == sorted(["fused", "split 2+2", "split 2+2 @persistent_static+tc"])
    assert result.timings["per-layer"] == 10.0  # its stage-one time stands


def test_a_group_with_one_algorithm_is_timed_in_one_stage():
    # Masked: the persistent algorithms are out, so stage one could rule out
    # only the default split, and re-timing would cost more than it saves.
    from rnnfuse.tuning import tuner

    (group,) = _groups(stack_model("lstm", 4))
    timer = FakeTimer({"per-layer": 1.0, "fused": 0.8})
    tuner.tune_plans(
        [group], lambda g: (8, 20, g.input_size), measure=timer,
        check_gradients=lambda *a: 1e-6, environment=dict(ENV), progress=False,
        masked_of=lambda g: True,
    )
    assert timer.names == [sorted(["per-layer", "fused", "split 2+2"])]


def test_never_slower_per_layer_wins_when_fusion_loses():
    (group,) = _groups(stack_model("lstm", 4))
    timer = FakeTimer({"per-layer": 0.5})  # every other candidate: 1.0
    (result,) = _tune([group], timer)
    assert result.plan == PER_LAYER


def test_non_default_algorithm_with_bad_gradients_is_rejected_for_training():
    (group,) = _groups(stack_model("lstm", 2))
    timer = FakeTimer({"per-layer": 1.0, "fused": 0.8, "fused @persistent_static+tc": 0.4})
    errors = {"fused": 1e-6, "fused @persistent_static+tc": 1e-3}
    (trained,) = _tune([group], timer, errors=errors)
    assert trained.plan.name == "fused"
    assert "gradient error" in trained.rejected["fused @persistent_static+tc"]
    (inferred,) = _tune([group], timer, errors=errors, training=False)
    assert inferred.plan.name == "fused @persistent_static+tc"


def test_float16_gradients_within_fp16_rounding_keep_the_persistent_algorithm():
    """In float16 every algorithm is ~1e-3 from float64; the persistent
    kernel's 7.6e-4 against the default's 3e-4 is rounding, not a
    worse algorithm: it is kept. 1e-2 is not."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        (group,) = _groups(stack_model("lstm", 2))
    finally:
        keras.config.set_dtype_policy("float32")
    timer = FakeTimer({"per-layer": 1.0, "fused": 0.8, "fused @persistent_static+tc": 0.4})
    (kept,) = _tune([group], timer, errors={"fused": 3e-4, "fused @persistent_static+tc": 7.6e-4})
    assert kept.plan.name == "fused @persistent_static+tc"
    assert "fused @persistent_static+tc" not in kept.rejected
    (worse,) = _tune([group], timer, errors={"fused": 3e-4, "fused @persistent_static+tc": 1e-2})
    assert worse.plan.name == "fused"


def test_persistent_algorithms_are_not_timed_above_their_dtypes_batch_bound():
    """float32 over a batch of 32 (PERSISTENT_MAX_BATCH): the persistent
    candidates are left out with the reason; at 32 they are timed."""
    (group,) = _groups(stack_model("lstm", 2))
    timer = FakeTimer({"per-layer": 1.0, "fused": 0.8, "fused @persistent_static+tc": 0.1})

    def tune(batch):
        return tune_plans([group], lambda g: (batch, 20, g.input_size), measure=timer,
                          check_gradients=lambda *a: 1e-6, environment=ENV, progress=False)[0]

    big = tune(33)
    assert big.plan.name == "fused"
    assert not any("persistent" in n for names in timer.names for n in names)
    assert "PERSISTENT_MAX_BATCH" in big.rejected["fused @persistent_dynamic+tc"]
    assert tune(32).plan.name == "fused @persistent_static+tc"


@pytest.mark.parametrize("units, dynamic_timed", [(256, True), (384, False)])
def test_persistent_dynamic_is_not_timed_from_its_float16_width(units, dynamic_timed):
    """float16 from 384 units (DYNAMIC_MIN_UNITS): persistent_dynamic is left
    out with the reason, the other algorithms still timed; at 256 it is."""
    from rnnfuse.tuning.tuner import plans_worth_timing

    keras.config.set_dtype_policy("mixed_float16")
    try:
        (group,) = _groups(stack_model("lstm", 4, units=units, steps=None))
    finally:
        keras.config.set_dtype_policy("float32")
    plans, rejected = plans_worth_timing(group, (16, 20, 5), "float16", False, True, "tensorflow",
                                         candidate_plans(group))
    names = {p.name for p in plans}
    assert {"fused", "fused @persistent_static+tc", "split 2+2 @persistent_static+tc"} <= names
    dynamic = {"fused @persistent_dynamic+tc", "split 2+2 @persistent_dynamic+tc"}
    assert (dynamic <= names) == dynamic_timed
    if not dynamic_timed:
        assert all("DYNAMIC_MIN_UNITS" in rejected[n] for n in dynamic)


def test_second_tune_reads_the_cache_without_timing(tmp_path):
    cache = PlanCache(tmp_path / "plans.json")
    (group,) = _groups(stack_model("gru", 3))
    timer = FakeTimer({"fused": 0.1})
    (first,) = _tune([group], timer, cache=cache)
    assert timer.calls == 1
    again = FakeTimer({"per-layer": 0.01})
    (second,) = _tune([group], again, cache=PlanCache(tmp_path / "plans.json"))
    assert again.calls == 0
    assert second.source == "cache" and second.plan == first.plan
    # Another device, dtype or mode is another key.
    (other,) = _tune([group], again, cache=cache, env={**ENV, "device": "OtherGPU"})
    assert again.calls == 1 and other.plan == PER_LAYER
    _tune([group], again, cache=cache, training=False)
    assert again.calls == 2


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 99, "entries": {}}), json.dumps([1, 2])])
def test_corrupt_or_stale_cache_is_ignored_with_a_warning(tmp_path, content):
    path = tmp_path / "plans.json"
    path.write_text(content)
    (group,) = _groups(stack_model("gru", 2))
    timer = FakeTimer({"fused": 0.1})
    with pytest.warns(RuntimeWarning, match="ignoring the plan cache"):
        (result,) = _tune([group], timer, cache=PlanCache(path))
    assert timer.calls == 1 and result.plan.name == "fused"
    assert json.loads(path.read_text())["format"] == 1  # rewritten


def _cached_with_plan(tmp_path, plan: dict):
    """(group, timer): a 2-layer GRU group tuned once into tmp_path's
    plans.json, whose entries then hold `plan`, and a fresh fake timer."""
    (group,) = _groups(stack_model("gru", 2))
    _tune([group], FakeTimer({"fused": 0.1}), cache=PlanCache(tmp_path / "plans.json"))
    data = json.loads((tmp_path / "plans.json").read_text())
    for entry in data["entries"].values():
        entry["plan"] = plan
    (tmp_path / "plans.json").write_text(json.dumps(data))
    return group, FakeTimer({"fused": 0.1})


def test_cache_entry_with_a_bad_plan_is_measured_again(tmp_path):
    group, timer = _cached_with_plan(tmp_path, {"pieces": ["x"]})
    with pytest.warns(RuntimeWarning, match="setting aside the cached plan"):
        _tune([group], timer, cache=PlanCache(tmp_path / "plans.json"))
    assert timer.calls == 1


def test_without_a_gpu_the_static_table_decides():
    (group,) = _groups(stack_model("rnn_tanh", 3))
    (result,) = tune_plans([group], lambda g: (2, 5, 5), progress=False)
    assert result.source.startswith("static")
    assert result.plan == FUSED


# -- plans applied by optimize ----------------------------------------------------


def test_split_plan_builds_two_fused_layers_and_stays_exact(emulated_cudnn):
    model = stack_model("lstm", 4, last_return_sequences=True)
    fast = rnnfuse.optimize(model, plan=Plan((2, 2)))
    fused = fused_layers(fast)
    assert [len(f.fused_layers) for f in fused] == [2, 2]
    x = random_inputs(model, 2, np.random.default_rng(0))
    assert max_abs_diff(fast(x), model(x)) <= 2e-5
    assert len(emulated_cudnn) == 2


def test_per_layer_plan_leaves_the_layers_alone():
    model = stack_model("gru", 3)
    fast = rnnfuse.optimize(model, plan=PER_LAYER)
    assert fused_layers(fast) == []
    assert [l.name for l in fast.layers[1:]] == ["gru_0", "gru_1", "gru_2"]


def test_plan_that_does_not_cover_the_group_is_an_error():
    with pytest.raises(ValueError, match="covers 3 layers; the group has 4"):
        rnnfuse.optimize(stack_model("gru", 4), plan=Plan((1, 2)))
    with pytest.raises(ValueError, match="plan must be an rnnfuse.Plan"):
        rnnfuse.optimize(stack_model("gru", 2), plan=lambda g: "fused")


def test_split_at_an_absorbed_dropout_is_refused():
    inp = keras.Input((5, 3))
    x = keras.layers.LSTM(4, return_sequences=True)(inp)
    x = keras.layers.Dropout(0.2, name="drop")(x)
    out = keras.layers.LSTM(4)(x)
    (group,) = _groups(keras.Model(inp, out))
    with pytest.raises(ValueError, match="absorbed Dropout 'drop'"):
        split_groups([group], [Plan((1, 1))])


def test_tune_with_a_sample_batch_on_cpu_uses_the_table(tmp_path):
    model = stack_model("lstm", 2, head=True)
    x = random_inputs(model, 4, np.random.default_rng(1))
    fast = rnnfuse.optimize(model, tune=x, cache=tmp_path / "c.json")
    assert len(fused_layers(fast)) == 1
    fast2 = rnnfuse.optimize(model, tune=rnnfuse.TuneShape(batch_size=4, steps=7), cache=False)
    assert len(fused_layers(fast2)) == 1
    with pytest.raises(ValueError, match=r'tune must be "auto", False or None .*received int'):
        rnnfuse.optimize(model, tune=3)


def test_fused_layer_keeps_its_algorithm_in_its_config():
    model = stack_model("gru", 2)
    (fused,) = fused_layers(rnnfuse.optimize(model, plan=Plan((2,), "persistent_static+tc")))
    assert fused.plan.algorithm == "persistent_static+tc"
    clone = rnnfuse.FusedRNN.from_config(fused.get_config())
    assert clone.plan == fused.plan
    with pytest.raises(ValueError, match="unknown cuDNN algorithm"):
        Plan((2,), "fastest")


# -- the algorithm record ------------------------------------------------------------


def test_algorithm_names_round_trip_for_every_algorithm_and_math_type():
    from rnnfuse.plan import ALGORITHM_NAMES, MATH_TYPES

    for algo, base in enumerate(ALGORITHM_NAMES):
        for math, suffix in MATH_TYPES.items():
            parsed = Algorithm.parse(base + suffix)
            assert (parsed.algo, parsed.math, parsed.name) == (algo, math, base + suffix)
    assert Algorithm(1, True) == Algorithm.parse("persistent_static+tc")
    with pytest.raises(ValueError, match="must be 0-3"):
        Algorithm(4)
    with pytest.raises(ValueError, match="unknown cuDNN algorithm"):
        Algorithm.parse("persistent_static+fast")


def test_no_process_wide_algorithm_state_is_left():
    """The algorithm is an input of the op call and the call's own argument:
    no environment variable, no module-level switch or record."""
    import rnnfuse.fused as fused_module
    from rnnfuse.backends import tensorflow as tf_backend

    for name in ("runtime_algorithm", "_RUNTIME_CODE", "_LAST", "last_kernel", "TUNED_ALGORITHMS"):
        assert not hasattr(tf_backend, name), name
    assert not hasattr(fused_module, "masks_known_right_padded")
    model = stack_model("gru", 2)
    rnnfuse.optimize(model, plan=Plan((2,), "persistent_static+tc"))(
        random_inputs(model, 1, np.random.default_rng(3))
    )
    assert not any(k.startswith("TF_DEBUG_CUDNN_RNN") for k in os.environ)


def test_without_the_op_an_algorithm_runs_as_standard_and_says_so(emulated_cudnn, monkeypatch):
    from rnnfuse.backends import tensorflow as tf_backend

    monkeypatch.setattr(tf_backend, "op_loaded", lambda: False)

    model = stack_model("gru", 2, last_return_sequences=True)
    fast = rnnfuse.optimize(model, plan=Plan((2,), "persistent_static+tc"))
    x = random_inputs(model, 2, np.random.default_rng(2))
    out = fast(x)
    last = fused_layers(fast)[0].last_path.kernel
    assert last.name == "CudnnRNNV3" and last.algorithm == "standard"
    assert "persistent_static+tc algorithm asked for runs as standard" in last.note
    assert max_abs_diff(out, model(x)) <= 2e-5
    assert get_backend().capabilities.tuned_algorithms == (None,)


def test_an_algorithm_cudnn_refuses_is_rejected_with_its_reason():
    """cuDNN refusing an algorithm for a shape reaches the tuner as an op
    error; the plan is rejected with the message, the others are timed."""
    (group,) = _groups(stack_model("gru", 2))

    def check(g, plan, shape, dtype):
        if plan.algorithm == "persistent_static+tc":
            raise tf.errors.UnimplementedError(None, None, "CUDNN_STATUS_NOT_SUPPORTED here")
        return 1e-6

    timer = FakeTimer({
        "per-layer": 1.0, "fused": 0.8, "fused @persistent_dynamic+tc": 0.5,
        "fused @persistent_static+tc": 0.3,
    })
    (result,) = tune_plans(
        [group], lambda g: (8, 20, g.input_size), measure=timer, check_gradients=check,
        environment=ENV, progress=False,
    )
    assert result.plan.name == "fused @persistent_dynamic+tc"
    assert "CUDNN_STATUS_NOT_SUPPORTED" in result.rejected["fused @persistent_static+tc"]


def test_gradients_are_checked_lazily_fastest_first():
    """One float64 check for the winner and one for its default-algorithm
    twin, not one per candidate; a slower candidate is never checked."""
    (group,) = _groups(stack_model("lstm", 4))
    checked = []

    def check(g, plan, shape, dtype):
        checked.append(plan.name)
        return 1e-3 if plan.name == "split 2+2 @persistent_static+tc" else 1e-6

    timer = FakeTimer({
        "per-layer": 1.0, "fused": 0.9, "split 2+2 @persistent_static+tc": 0.2,
        "fused @persistent_dynamic+tc": 0.4, "fused @persistent_static+tc": 0.6,
    })
    (result,) = tune_plans(
        [group], lambda g: (8, 20, g.input_size), measure=timer, check_gradients=check,
        environment=ENV, progress=False,
    )
    # The fastest fails its check, the next passes: four checks, not six.
    assert result.plan.name == "fused @persistent_dynamic+tc"
    assert "gradient error" in result.rejected["split 2+2 @persistent_static+tc"]
    assert sorted(checked) == sorted(
        ["split 2+2 @persistent_static+tc", "split 2+2", "fused @persistent_dynamic+tc", "fused"]
    )
    (inferred,) = tune_plans(
        [group], lambda g: (8, 20, g.input_size), measure=timer, check_gradients=check,
        environment=ENV, progress=False, training=False,
    )
    assert inferred.plan.name == "split 2+2 @persistent_static+tc"


def test_cached_plan_that_does_not_fit_the_group_is_set_aside_and_retuned(tmp_path):
    # 5 layers for a 2-layer group
    group, timer = _cached_with_plan(tmp_path, {"pieces": [5], "algorithm": None})
    with pytest.warns(RuntimeWarning, match="setting aside.*covers 5 layers; the group has 2"):
        (result,) = _tune([group], timer, cache=PlanCache(tmp_path / "plans.json"))
    assert timer.calls == 1 and result.source == "measured"
    data = json.loads((tmp_path / "plans.json").read_text())
    assert len(data["set_aside"]) == 1
    assert [e["plan"]["pieces"] for e in data["entries"].values()] == [[2]]


def test_a_masked_group_is_timed_without_the_persistent_algorithms():
    # cuDNN's persistent algorithms refuse padded sequence lengths
    # (CUDNN_STATUS_NOT_SUPPORTED), so they are no candidates.
    from rnnfuse.tuning import tuner

    (group,) = _groups(stack_model("lstm", 2))
    timer = FakeTimer({"per-layer": 1.0, "fused": 0.8, "fused @persistent_static+tc": 0.1})
    (result,) = tuner.tune_plans(
        [group], lambda g: (8, 20, g.input_size), measure=timer,
        check_gradients=lambda *a: 1e-6, environment=dict(ENV), progress=False,
        masked_of=lambda g: True,
    )
    assert result.plan.name == "fused"
    assert "padded sequence lengths" in result.rejected["fused @persistent_static+tc"]
    assert all("@" not in name for name in timer.names[-1])


class _OpError(Exception):
    """Stands in for TensorFlow's OpError (matched by class name)."""


_OpError.__name__ = "OpError"


def test_a_candidate_cudnn_refuses_while_timing_is_left_out_not_fatal():
    from rnnfuse.tuning import tuner
    from rnnfuse.plan import Plan

    plans = {"fused": Plan((2,)), "fused @persistent_static+tc": Plan((2,), "persistent_static+tc")}

    def refused():
        raise _OpError("CUDNN_STATUS_NOT_SUPPORTED")

    steps = {"fused": lambda: 1.0, "fused @persistent_static+tc": refused}
    kept, why = tuner._first_calls(steps, plans)
    assert list(kept) == ["fused"]
    assert "NOT_SUPPORTED" in why["fused @persistent_static+tc"]
    with pytest.raises(ValueError):  # anything else is a bug, not a refusal
        tuner._first_calls({"fused @persistent_static+tc": lambda: (_ for _ in ()).throw(ValueError("x"))}, plans)
    with pytest.raises(_OpError):  # the default algorithm failing is not a refusal either
        tuner._first_calls({"fused": refused}, plans)


def test_every_step_is_called_once_before_it_is_timed():
    from rnnfuse.tuning import tuner
    from rnnfuse.plan import Plan

    calls = []
    plans = {"per-layer": Plan(()), "fused": Plan((2,))}
    steps = {name: (lambda name=name: calls.append(name) or 1.0) for name in plans}
    kept, why = tuner._first_calls(steps, plans)
    assert calls == ["per-layer", "fused"] and list(kept) == list(plans) and not why


def test_the_default_timer_races_the_candidates(monkeypatch):
    """Without a `measure`, candidates are timed by interleaved_medians with
    pruning on, after each step's untimed first call: no warm-up call where
    that first call compiled and ran the step (TensorFlow), and a plan that
    cannot beat the original layers by the margin stops early."""
    from rnnfuse.tuning import tuner

    (group,) = _groups(stack_model("gru", 2))
    seen = {}

    def fake_medians(steps, **kwargs):
        seen.update(kwargs)
        return {name: {"median": 1.0 if name == "fused" else 2.0} for name in steps}

    monkeypatch.setattr(tuner, "interleaved_medians", fake_medians)
    monkeypatch.setattr(tuner, "_steps", lambda group, plans, *a, **k: {p.name: (lambda: 1.0) for p in plans})
    (result,) = tune_plans([group], lambda g: (8, 20, g.input_size), environment=ENV, progress=False)
    assert seen["prune"] == tuner.PRUNE > 1 and seen["warmup"] == 0
    assert seen["keep"] == ("per-layer",) and seen["beat"] == 1 - tuner.KEEP_ORIGINAL_MARGIN
    assert result.plan.name == "fused"


@pytest.mark.parametrize("fused_s, want", [(0.98, "per-layer"), (0.9, "fused")])
def test_the_original_layers_stay_unless_a_plan_clearly_beats_them(fused_s, want):
    """A plan 2% faster on the tuner's clock is within what `fit` disagrees
    by: the original layers stay; one 10% faster is taken."""
    (group,) = _groups(stack_model("gru", 2))
    timer = FakeTimer({"per-layer": 1.0, "fused": fused_s, "fused @persistent_static+tc": 2.0,
                       "fused @persistent_dynamic+tc": 2.0})
    (result,) = _tune([group], timer)
    assert result.plan.name == want
    assert result.timings["fused"] == fused_s  # the measurement is kept either way


def test_no_gradient_check_where_the_original_layers_stay_anyway():
    """A persistent plan fastest by under KEEP_ORIGINAL_MARGIN: the original
    layers stay whatever its gradients, so neither it nor its default twin
    is checked (a float64 reference and two gradient traces saved)."""
    (group,) = _groups(stack_model("lstm", 4))
    checked = []

    def check(g, plan, shape, dtype):
        checked.append(plan.name)
        return 1e-6

    timer = FakeTimer({"per-layer": 1.0, "fused @persistent_static+tc": 0.95, "fused": 0.97})
    (result,) = tune_plans(
        [group], lambda g: (8, 20, g.input_size), measure=timer, check_gradients=check,
        environment=ENV, progress=False,
    )
    assert result.plan == PER_LAYER and checked == []
    # Clearly faster: checked (and kept) as before.
    timer.medians["fused @persistent_static+tc"] = 0.5
    (result,) = tune_plans(
        [group], lambda g: (8, 20, g.input_size), measure=timer, check_gradients=check,
        environment=ENV, progress=False,
    )
    assert result.plan.name == "fused @persistent_static+tc"
    assert sorted(checked) == ["fused", "fused @persistent_static+tc"]


def test_skipping_the_gradient_check_never_changes_the_decision():
    """The decision with the check skipped where the original layers stay
    anyway equals the decision with every check run, over random timings
    and gradient errors; and fewer checks are run."""
    from rnnfuse.tuning import tuner

    rng = np.random.default_rng(0)
    algorithms = [None, "persistent_static+tc", "persistent_dynamic+tc"]
    plans = [PER_LAYER] + [Plan(p, a) for p in ((4,), (2, 2)) for a in algorithms]
    plans.append(Plan((4,), kernel="wavefront"))
    saved = 0
    for _ in range(400):
        timings = {p.name: float(rng.uniform(0.5, 1.3)) for p in plans}
        errors = {p.name: float(rng.choice([1e-6, 1e-3])) for p in plans}
        runs = []
        for cut in (True, False):
            checked = []

            def check(plan):
                checked.append(plan.name)
                return errors[plan.name]

            rejected = {}
            fastest = tuner._fastest_with_sound_gradients(
                plans, timings, rejected, True, check, "float32",
                keeps_original=(lambda p: tuner._keep_original_unless_clearly_slower(
                    plans, timings, p) is not p) if cut else None)
            runs.append((tuner._keep_original_unless_clearly_slower(plans, timings, fastest), checked))
        (with_cut, checked_cut), (without, checked_all) = runs
        assert with_cut == without, (timings, errors)
        assert set(checked_cut) <= set(checked_all)
        saved += len(checked_all) - len(checked_cut)
    assert saved > 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_plan_within_the_rounding_floor_needs_no_twin(dtype):
    """In half precision a plan whose gradient error is within the rounding
    floor passes whatever its default twin's error: the choice is the one
    every check gives, over random timings and errors, with fewer checks."""
    from rnnfuse.tuning import tuner

    rng = np.random.default_rng(1)
    algorithms = [None, "persistent_static+tc", "persistent_dynamic+tc"]
    plans = [PER_LAYER] + [Plan(p, a) for p in ((4,), (2, 2)) for a in algorithms]
    plans.append(Plan((4,), kernel="wavefront"))
    floor = tuner.rounding_floor(dtype)
    saved = 0
    for _ in range(300):
        timings = {p.name: float(rng.uniform(0.5, 1.3)) for p in plans}
        errors = {p.name: float(rng.choice([floor / 8, floor / 2, 2 * floor, 8 * floor])) for p in plans}
        checked = []

        def check(plan):
            checked.append(plan.name)
            return errors[plan.name]

        chosen = tuner._fastest_with_sound_gradients(plans, timings, {}, True, check, dtype)
        # Every plan's check and its twin's, as the rule reads.
        sound = [p for p in plans if not (p.algorithm or p.inference_only)
                 or errors[p.name] <= tuner.gradient_tolerance(errors[Plan(p.pieces).name], dtype)]
        assert chosen == min(sound, key=lambda p: timings[p.name])
        twins = {Plan(p.pieces).name for p in plans if p.algorithm or p.inference_only}
        saved += len(twins - set(checked))
    assert saved > 0
