"""Randomized properties over model topologies (TensorFlow, emulated cuDNN).

See tests/properties.py for the topologies and the properties. Bounded in
CI (HYPOTHESIS_PROFILE=ci: 12 derandomized examples), 3 by default (make test), 200
with HYPOTHESIS_PROFILE=thorough.
"""

from __future__ import annotations

from hypothesis import given

from properties import check_properties, topologies


@given(case=topologies())
def test_optimized_models_keep_every_property(case, emulated_cudnn):
    check_properties(case, tol=2e-5)
