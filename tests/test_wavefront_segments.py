"""Stacks larger than the chip as consecutive wavefront segments, on the CPU:
the segmentation choice (rnnfuse/backends/cuda/segments.py), the tuner's
candidate it becomes (`kernel_plans`, `kernel_segments`) and where the
two-stage timing puts it (`_time_in_stages`). The choice on the real
library's plan is in tests/test_wavefront_build.py; the wiring through the
bindings in tests/test_wavefront_wiring.py (TensorFlow) and
tests/torch_backend/test_torch_wavefront_wiring.py (torch); the real kernel
in tests/gpu/test_gpu_wavefront_segments.py.
"""

from __future__ import annotations

import itertools
import types

import pytest

from rnnfuse.backends.cuda.segments import fewest_balanced
from rnnfuse.plan import PER_LAYER, Plan
from rnnfuse.report import FusionGroup
from rnnfuse.tuning import tuner
from rnnfuse.tuning.plans import kernel_plans, kernel_segments


def _at_most(limit):
    """A refusal that takes sub-stacks of at most `limit` layers, and records
    what it was asked."""
    asked = []

    def refusal(start, stop):
        asked.append((start, stop))
        return None if stop - start <= limit else f"{stop - start} layers do not fit"

    refusal.asked = asked
    return refusal


def _brute_force(n, refusal):
    """Every composition of n, the fewest pieces first, then the smallest
    largest piece: (pieces count, largest) of the best, or None."""
    best = None
    for cuts in itertools.product([False, True], repeat=n - 1):
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 1
            else:
                size += 1
        sizes.append(size)
        bounds = list(itertools.accumulate([0] + sizes))
        if all(refusal(a, b) is None for a, b in zip(bounds, bounds[1:])):
            key = (len(sizes), max(sizes))
            best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("n, limit, want", [
    (8, 4, (4, 4)), (8, 5, (4, 4)), (7, 4, (4, 3)), (2, 1, (1, 1)), (4, 4, (4,)),
    (5, 2, (2, 2, 1)), (9, 4, (3, 3, 3)), (10, 4, (4, 3, 3)), (12, 6, (6, 6)),
])
def test_the_fewest_segments_and_the_largest_as_small_as_can_be(n, limit, want):
    assert fewest_balanced(n, _at_most(limit)) == want


def test_every_sub_stack_is_asked_once_at_most():
    refusal = _at_most(3)
    fewest_balanced(8, refusal)
    assert len(refusal.asked) == len(set(refusal.asked)) <= 8 * 9 // 2


@pytest.mark.parametrize("seed", range(40))
def test_the_choice_matches_a_brute_force_search_on_any_refusal(seed):
    """No assumption that a shorter sub-stack fits where a longer one does
    (a first layer reads another width; shared memory is per layer): any
    accepted set of sub-stacks, against every composition."""
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 9)
    accepted = {(a, b) for a in range(n) for b in range(a + 1, n + 1) if rng.random() < 0.45}

    def refusal(a, b):
        return None if (a, b) in accepted else f"{a}:{b} refused"

    got = fewest_balanced(n, refusal)
    best = _brute_force(n, refusal)
    if best is None:
        assert isinstance(got, str) and "refused" in got
    else:
        assert isinstance(got, tuple) and sum(got) == n
        assert (len(got), max(got)) == best
        bounds = list(itertools.accumulate((0,) + got))
        assert all(refusal(a, b) is None for a, b in zip(bounds, bounds[1:]))


def test_no_segmentation_answers_the_refusal_of_a_layer_that_fits_nowhere():
    assert fewest_balanced(3, lambda a, b: "float32, not float16") == "float32, not float16"
    # Layer 1 fits in no sub-stack: its own refusal is the answer.
    why = fewest_balanced(3, lambda a, b: None if b <= 1 or a >= 2 else f"layer {a}:{b}")
    assert why == "layer 1:2"


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_a_bad_layer_count_is_a_clear_error(n):
    with pytest.raises(ValueError, match="positive layer count; received"):
        fewest_balanced(n, lambda a, b: None)


def _group(n, *, units=16, input_size=5, dropout=()):
    views = tuple(types.SimpleNamespace(num_levels=1, input_size=input_size if i == 0 else units)
                  for i in range(n))
    gaps = tuple("drop" if i in dropout else None for i in range(n - 1))
    return FusionGroup(tuple(f"lstm_{i}" for i in range(n)), "lstm", units, n, input_size,
                       False, absorbed_dropout=tuple("drop" for _ in dropout), views=views,
                       gap_dropout=gaps)


def test_each_segment_is_asked_as_its_own_group_at_its_own_input_width():
    asked = []

    def reason_of(kernel, group, shape):
        asked.append((group.layers, group.num_layers, shape))
        return None if group.num_layers <= 2 else "does not fit"

    plans, rejected = kernel_plans(_group(4), (8, 7, 5), ["wavefront"], reason_of)
    assert [p.name for p in plans] == ["split 2+2 on wavefront"]
    assert rejected == {"fused on wavefront": "does not fit; timed as segments that each fit "
                                              "instead: split 2+2 on wavefront"}
    assert asked[0] == (("lstm_0", "lstm_1", "lstm_2", "lstm_3"), 4, (8, 7, 5))
    widths = {layers: shape for layers, _, shape in asked}
    assert widths[("lstm_0", "lstm_1")] == (8, 7, 5)
    assert widths[("lstm_2", "lstm_3")] == (8, 7, 16), "a segment above reads the layer below"


def test_no_segments_for_one_layer_an_absorbed_dropout_or_a_layer_too_big():
    big = lambda g, s: "does not fit"  # noqa: E731
    assert kernel_segments(_group(1), (8, 7, 5), big) == "one layer: nothing to segment"
    assert "absorbed Dropout" in kernel_segments(_group(4, dropout=(1,)), (8, 7, 5),
                                                 lambda g, s: None)
    plans, rejected = kernel_plans(_group(4), (8, 7, 5), ["wavefront"], lambda k, g, s: "big")
    assert plans == [] and rejected == {"fused on wavefront": "big"}
    # Where the whole run fits, it is the candidate (no segments asked for).
    plans, _ = kernel_plans(_group(4), (8, 7, 5), ["wavefront"], lambda k, g, s: None)
    assert plans == [Plan((4,), kernel="wavefront")]


class _Bar:
    def advance_rest(self, n):
        pass


def test_segments_are_timed_in_the_first_stage_beside_every_algorithm():
    """With two cuDNN algorithms the tuner times in two stages; a split on a
    kernel whose whole run is no candidate has no whole-run twin to wait
    for, so it is timed in stage one (else it would never be timed)."""
    algorithm = "persistent_static+tc"
    segments = Plan((2, 2), kernel="wavefront")
    plans = [PER_LAYER, Plan((4,)), Plan((4,), algorithm), Plan((2, 2)), Plan((2, 2), algorithm),
             segments]
    fake = {p.name: t for p, t in zip(plans, [2.0, 1.0, 1.1, 1.05, 1.2, 0.9])}
    stages = []

    def measured(ps):
        stages.append([p.name for p in ps])
        return {p.name: fake[p.name] for p in ps}, {}

    rejected = {}
    timings, timed = tuner._time_in_stages(plans, rejected, _Bar(), measured)
    assert "split 2+2 on wavefront" in stages[0]
    assert "split 2+2" not in stages[0] and "split 2+2" in stages[1]
    assert timings["split 2+2 on wavefront"] == 0.9 and segments in timed
