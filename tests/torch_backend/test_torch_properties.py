"""Randomized properties over model topologies under torch (real CPU kernels).

See tests/properties.py for the topologies and the properties. Bounded in
CI (HYPOTHESIS_PROFILE=ci), thorough with HYPOTHESIS_PROFILE=thorough.
"""

from __future__ import annotations

from hypothesis import given

from properties import check_properties, topologies


@given(case=topologies())
def test_optimized_models_keep_every_property_under_torch(case, torch_calls):
    check_properties(case, tol=2e-5)
