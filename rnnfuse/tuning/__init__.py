"""Tuning: choose each fusion group's `rnnfuse.plan.Plan`, from the static
rule table (`table`) or by timing on the device (`tuner`, `timing`), per
shape bucket (`per_shape`), on a model's first batch (`first_batch`),
kept on disk (`cache`).

>>> from rnnfuse.tuning.table import Regime, plan_for_regime
>>> plan_for_regime(Regime("lstm", 512, 4, False, False, "float16", True)).name
'fused @persistent_static+tc'
"""
