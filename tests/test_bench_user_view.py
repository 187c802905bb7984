"""The user-view benchmark's own logic (bench/bench_user_view.py and
bench/report_user_view.py), on the CPU with tiny models: the numbers the
issues' targets are read from are only as good as this code."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import bench_user_view  # noqa: E402
import report_user_view  # noqa: E402

TINY = dict(kind="gru", layers=2, units=32, batch=4, steps=10, dtype="float32", masked=False)


def test_the_draw_is_fixed_by_its_seed():
    assert bench_user_view.draw_shapes(5, seed=3) == bench_user_view.draw_shapes(5, seed=3)
    assert bench_user_view.draw_shapes(5, seed=3) != bench_user_view.draw_shapes(5, seed=4)


def test_rounds_are_sized_from_the_step_not_from_a_whole_fit_call(monkeypatch):
    # A tiny model's step takes milliseconds, a whole `fit` call far more
    # (its set-up): sized from the call, every round was 3 steps.
    monkeypatch.setattr(bench_user_view, "ROUNDS_BUDGET_S", 0.5)  # CI's clock
    row = bench_user_view.measure(TINY, rounds=3, steps=20, predict_rounds=2)
    assert row["steps_per_round"] > 3, row["steps_per_round"]
    assert set(row["raw"]["fit"]) == {"original", "optimized"}
    # --rounds at least, more within the clock's budget, as many for each model.
    lengths = {len(v) for v in row["raw"]["fit"].values()}
    assert len(lengths) == 1 and 3 <= lengths.pop() <= bench_user_view.MAX_ROUNDS
    assert row["rounds"] == len(row["raw"]["fit"]["original"])
    # predict has its own round count (the target is read from fit)
    # (--predict-rounds at least, the same budget for more)
    lengths = {len(v) for v in row["raw"]["predict"].values()}
    assert len(lengths) == 1 and 2 <= lengths.pop() <= bench_user_view.MAX_ROUNDS
    assert row["predict_rounds"] == len(row["raw"]["predict"]["original"])
    # predict at 4x is sized the same way (it had 3 steps a round, two gaps)
    assert row["predict_4x_steps"] > 3 and row["predict_4x_rounds"] >= 2, row
    assert row["fit_speedup"] == pytest.approx(row["fit_ms"]["original"] / row["fit_ms"]["optimized"])


def test_only_times_the_given_cells_in_the_given_order(tmp_path, monkeypatch):
    timed, controls = [], []

    def fake_measure(shape, rounds, steps, predict_rounds=None, control=False):
        timed.append(shape)
        controls.append(control)
        return _row(shape, 1.0)

    monkeypatch.setattr(bench_user_view, "measure", fake_measure)
    out = tmp_path / "q.json"
    bench_user_view.main(["--only", "3,1", "--anchors", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    drawn = bench_user_view.draw_shapes(30)
    assert [r["cell"] for r in rows] == ["A1", 3, 1]
    assert timed == [dict(bench_user_view.ANCHORS[0]), drawn[2], drawn[0]]
    bench_user_view.main(["--only", "2", "--control", "--out", str(out)])
    assert controls == [False, False, False, True]
    assert json.loads(out.read_text())["meta"]["control"] is True


def _part(path, backend, rows):
    path.write_text(json.dumps(dict(meta=dict(backend=backend, seed=2026), results=rows)))
    return str(path)


def _row(shape, speedup, **extra):
    row = dict(shape=shape, fit_speedup=speedup, predict_speedup=1.0, tuning_s=1.0,
               fit_ms=dict(original=speedup, optimized=1.0), plans=[])
    return dict(row, **extra)


def test_report_merges_parts_by_cell_and_keeps_the_later_measurement(tmp_path):
    drawn = bench_user_view.draw_shapes(30)
    anchor = dict(bench_user_view.ANCHORS[0])
    first = _part(tmp_path / "a.json", "tensorflow",
                  [_row(anchor, 1.5), _row(drawn[1], 0.9), _row(drawn[0], 2.0)])
    later = _part(tmp_path / "b.json", "tensorflow", [_row(drawn[1], 1.1, cell=2)])
    rows = report_user_view.merge([first, later])["tensorflow"]["rows"]
    assert [r["cell"] for r in rows] == ["A1", 1, 2]
    assert rows[2]["fit_speedup"] == 1.1 and rows[2]["earlier"] == [0.9]
    text = report_user_view.markdown(report_user_view.merge([first, later]))
    assert "| 2 | " in text and "1.10x** (was 0.90x)" in text


def test_tuning_overhead_uses_the_median_drawn_model_and_its_training_tuning(tmp_path):
    drawn = bench_user_view.draw_shapes(30)
    rows = [_row(drawn[i], 1.0, cell=i + 1) for i in range(3)]
    for r, ms, tune in zip(rows, (10.0, 20.0, 30.0), (1.0, 2.0, 3.0)):
        r["fit_ms"] = dict(original=ms, optimized=ms)
        r["tuning_s"], r["fit_tuning_s"] = tune + 0.5, tune
    o = bench_user_view.tuning_overhead(rows)
    assert o["median_model"] == drawn[1]
    # 10 epochs of 100 steps of 20 ms = 20 s, against 2 s of training tuning.
    assert o["tuning_overhead_share"] == pytest.approx(2.0 / 22.0)
    assert o["median_model_training_only"]
    line = report_user_view.overhead_text(rows + [_row(dict(bench_user_view.ANCHORS[0]), 1.0, cell="A1")])
    assert line.startswith("Tuning overhead: 9.1% ")


def test_a_slow_lopsided_cell_gets_one_round_and_others_keep_theirs():
    # Keras' masked torch loop at 17 s a step against 0.2 s fused: one round.
    assert bench_user_view.rounds_for({"original": 17.0, "optimized": 0.2}, 3) == 1
    # Slow but close, or lopsided but fast: every round (the ratio is near 1x,
    # or the rounds are cheap).
    assert bench_user_view.rounds_for({"original": 2.5, "optimized": 2.4}, 3) == 3
    assert bench_user_view.rounds_for({"original": 1.5, "optimized": 0.01}, 5) == 5


def test_a_lopsided_cell_runs_a_short_custom_loop(monkeypatch):
    # 50 steps of a 17 s loop would take 14 minutes: such a cell's loop runs
    # LOPSIDED_LOOP_STEPS after its first step; the others keep LOOP_STEPS.
    import itertools

    sized = itertools.cycle([17.0, 0.2])  # original, optimized, in turn
    monkeypatch.setattr(bench_user_view, "_step_time", lambda run: next(sized))
    # Predict at 4x the batch (two more traces) is not what this is about.
    monkeypatch.setattr(bench_user_view, "PREDICT_4X_BYTES", 0)
    row = bench_user_view.measure(TINY, rounds=3, steps=4, predict_rounds=2)
    assert "predict_4x_skipped" in row
    assert row["rounds"] == 1 and row["loop_steps"] == bench_user_view.LOPSIDED_LOOP_STEPS
    assert {len(t) for t in row["raw"]["loop"].values()} == {1 + bench_user_view.LOPSIDED_LOOP_STEPS}


def test_report_marks_cells_where_both_models_ran_the_original_layers(tmp_path):
    drawn = bench_user_view.draw_shapes(30)
    kept = _row(drawn[0], 0.9, plans=[dict(layers=["a"], pieces=[], algorithm=None)],
                plans_predict=[dict(layers=["a"], pieces=[], algorithm=None)])
    fused = _row(drawn[1], 0.95, plans=[dict(layers=["b"], pieces=None, algorithm=None)],
                 plans_predict=[dict(layers=["b"], pieces=None, algorithm=None)])
    merged = report_user_view.merge([_part(tmp_path / "a.json", "tensorflow", [kept, fused])])
    text = report_user_view.markdown(merged)
    assert "| 1 | " in text and "0.90x †" in text
    assert "0.95x †" not in text
    assert "1 cells, fit 0.90x to 0.90x" in text and "1 of the 2 fit cells below 0.97x" in text


def test_resolution_shrinks_with_more_rounds_and_reads_the_raw_rounds():
    rows = []
    for i in range(6):  # rounds that wander by about 9% around each model's median
        wobble = [1.0, 1.1, 0.92, 1.05, 0.9]
        rows.append(dict(raw=dict(fit=dict(original=[w * (i + 1) for w in wobble],
                                           optimized=[w * (i + 2) for w in wobble[::-1]]))))
    res = report_user_view.resolution(rows, rounds=(3, 15), draws=2000)
    assert 0.05 < res["round_sd"] < 0.1 and res["deviations"] == 30  # paired rounds
    assert res[15]["below_0_97"] < res[3]["below_0_97"]
    lo, hi = res[15]["band_90"]
    assert lo < 1.0 < hi and hi - lo < res[3]["band_90"][1] - res[3]["band_90"][0]
    assert report_user_view.resolution([dict(raw=dict(fit=dict(a=[1.0, 2.0])))]) == {}


class _TimedStub:
    """A model stand-in whose predict costs `seconds` on `clock` (fake_clock)."""

    def __init__(self, seconds, clock):
        self.seconds, self.clock = seconds, clock

    def predict(self, x, batch_size, verbose):
        self.clock.advance(self.seconds)
        return x


def test_whole_calls_take_more_samples_only_while_calls_are_cheap(fake_clock):
    cheap = bench_user_view.whole_calls(
        [("a", _TimedStub(0, fake_clock)), ("b", _TimedStub(0, fake_clock))],
        "predict", [0.0], None, 1)
    assert len(cheap["a"]) == len(cheap["b"]) == bench_user_view.MAX_CALLS
    dear = bench_user_view.whole_calls(
        [("a", _TimedStub(0.02, fake_clock)), ("b", _TimedStub(0.02, fake_clock))],
        "predict", [0.0], None, 1, budget_s=0.05)
    # 5 calls at least, though the budget was spent after the second
    assert len(dear["a"]) == len(dear["b"]) == bench_user_view.CALLS


def test_where_keras_own_half_precision_step_fails_the_original_is_its_float32_twin(monkeypatch):
    import keras
    import numpy as np

    shape = dict(TINY, kind="lstm", dtype="mixed_float16", features=4)
    model = bench_user_view.build(shape)
    x, y = bench_user_view.data(shape, np.random.default_rng(0))
    assert bench_user_view.keras_step_error(shape, model, x, y) is None  # not JAX: not probed

    def fails(self, *args, **kwargs):
        raise ValueError("Unknown output type float16")

    monkeypatch.setattr(bench_user_view.keras.backend, "backend", lambda: "jax")
    monkeypatch.setattr(keras.Model, "train_on_batch", fails)
    assert bench_user_view.keras_step_error(shape, model, x, y) == (
        "ValueError: Unknown output type float16")
    assert bench_user_view.keras_step_error(dict(shape, dtype="float32"), model, x, y) is None
    twin = bench_user_view.float32_twin(shape, model)
    assert [layer.compute_dtype for layer in model.layers[1:3]] == ["float16", "float16"]
    assert [layer.compute_dtype for layer in twin.layers[1:3]] == ["float32", "float32"]
    for a, b in zip(twin.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_step_stamps_are_dispatched_as_a_default_fit_dispatches_its_callbacks():
    # A callback that is not async-safe makes Keras wait for every step on
    # the training thread, which a default fit does not do where the backend
    # allows otherwise: the step timer must not change what it times.
    import keras

    timer = bench_user_view.StepTimes()
    callbacks = keras.callbacks.CallbackList([timer], model=keras.Sequential([keras.Input((2,))]))
    assert callbacks._async_train == keras.src.backend.IS_THREAD_SAFE
    # Async stamps arrive in completion order: the gaps are read in time order.
    timer.stamps = [0.0, 10.0, 1.0, 11.0]
    assert timer.median_step() == 1.0
