"""The whole-fit benchmark's baseline (bench/bench_whole_fit.py): where
Keras' own model fails in the shape's policy, the original is timed in
float32, and the row says why."""

from __future__ import annotations

import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import bench_matrix  # noqa: E402
import bench_whole_fit  # noqa: E402


def test_an_original_that_fails_in_its_policy_is_timed_in_float32(monkeypatch):
    built, real = [], bench_matrix.build_keras

    def build(shape):
        model = real(shape)
        built.append(shape["dtype"])
        if shape["dtype"] != "float32":
            def fail(*args, **kwargs):
                raise ValueError("Unknown output type float16")
            model.fit = fail
        return model

    monkeypatch.setattr(bench_matrix, "build_keras", build)
    monkeypatch.setitem(bench_matrix.SHAPES, "half", dict(bench_matrix.SHAPES["lstm4x512"]))
    job = dict(shape_name="half", model="original", epochs=2, epoch_steps=1, quick=True, online=False)
    row = bench_whole_fit.measure(job)
    assert built == ["mixed_float16", "float32"]
    assert row["original_failed"] == "ValueError: Unknown output type float16"
    assert row["fit_s"] > 0 and len(row["epoch_end_s"]) == 2
