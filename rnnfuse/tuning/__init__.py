"""Tuning: choose, per fusion group, how to run it (fused, split, per-layer;
cuDNN algorithm), by a static rule table or by timing on the device.

The choice is a `rnnfuse.plan.Plan`. `table` gives the static choice,
`tuner` the measured one, `per_shape` keeps one per shape bucket (and times
a custom loop's shapes), `first_batch` makes them on a model's
fit/evaluate/predict calls, `cache` keeps measured choices on disk,
`timing` times candidates.

Example:

    >>> from rnnfuse.tuning.table import Regime, plan_for_regime
    >>> plan_for_regime(Regime("lstm", 512, 4, False, False, "float16", True)).name
    'fused @persistent_static+tc'
"""
