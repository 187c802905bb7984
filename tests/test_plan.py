"""The Plan record (rnnfuse/plan.py): names, the kernel field, round trips."""

from __future__ import annotations

import pytest

from rnnfuse.plan import FUSED, PER_LAYER, Plan


def test_a_plan_names_its_pieces_algorithm_and_kernel():
    assert Plan((2, 2), "persistent_static+tc").name == "split 2+2 @persistent_static+tc"
    assert Plan((4,)).name == FUSED.name == "fused"
    assert PER_LAYER.name == "per-layer" and PER_LAYER.per_layer and not FUSED.per_layer
    assert Plan((4,), kernel="stock").name == "fused on stock"
    # "standard" is the default algorithm: one plan, one name.
    assert Plan((4,), "standard") == Plan((4,))


def test_for_length_spells_out_a_whole_run_and_keeps_its_kernel():
    whole = Plan(whole=True, kernel="stock")
    assert whole.for_length(3) == Plan((3,), kernel="stock")
    with pytest.raises(ValueError, match="covers 3 layers; the group has 4"):
        Plan((1, 2)).for_length(4)


@pytest.mark.parametrize(
    "plan",
    [PER_LAYER, FUSED, Plan((1, 3), "persistent_dynamic+tc"), Plan((2,), kernel="stock")],
)
def test_to_dict_round_trips(plan):
    assert Plan.from_dict(plan.to_dict()) == plan


def test_a_cache_entry_from_before_the_kernel_field_is_a_cudnn_plan():
    assert Plan.from_dict({"pieces": [2, 2], "algorithm": "persistent_static+tc"}).kernel == "cudnn"


def test_bad_plans_name_what_was_received():
    with pytest.raises(ValueError, match=r"positive layer counts.*\(0, 3\)"):
        Plan((0, 3))
    with pytest.raises(ValueError, match="kernel must be one of .'cudnn', 'stock', 'wavefront'.; received 'fast'"):
        Plan((2,), kernel="fast")
    with pytest.raises(ValueError, match="unknown cuDNN algorithm 'fastest'"):
        Plan((2,), "fastest")
    with pytest.raises(ValueError, match="'stock' kernel runs cuDNN's standard algorithm only"):
        Plan((2,), "persistent_static+tc", kernel="stock")
