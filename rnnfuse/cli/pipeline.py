"""rnnfuse's own steps as the commands call them (analyze, choose the
plans, optimize; a bad argument becomes a one-line `CliError`), and what
every command says about the result (the compute dtype, why nothing runs
fused here).

>>> import keras
>>> compute_dtype(keras.Sequential([keras.Input((5, 2)), keras.layers.GRU(3)]))
'float32'
"""

from __future__ import annotations

import logging

from rnnfuse.cli.errors import CliError, _first_line

__all__ = ["analyze", "caveat", "choose", "compute_dtype", "nothing_fused_here", "optimize"]

logger = logging.getLogger("rnnfuse")


def analyze(model, min_layers: int | None):
    """`rnnfuse.analyze(model)`; a bad argument is a CliError."""
    import rnnfuse

    try:
        return rnnfuse.analyze(model, min_layers=min_layers)
    except (TypeError, ValueError) as err:
        raise CliError(_first_line(err, limit=600)) from err


def forced_plan(args):
    """The plan `--plan` forces on every group (None: optimize's choice)."""
    import rnnfuse

    return {"auto": None, "fused": rnnfuse.FUSED, "per-layer": rnnfuse.PER_LAYER}[
        getattr(args, "plan", "auto")
    ]


def choose(model, report, args, *, tune=None, training=True) -> list:
    """Each group's `TuneResult` (group, plan, how it was chosen), for
    `inspect`, which builds no model.

    The plan of each group (fused whole, split, per layer) comes from
    `--plan`: "auto" is `optimize`'s own choice (the static rule table, or
    timing on this device with `tune`), "fused" forces every group fused.
    """
    from rnnfuse.api import choose_plans

    try:
        return choose_plans(model, report.groups, tune=tune, training=training, plan=forced_plan(args))
    except (TypeError, ValueError) as err:
        raise CliError(_first_line(err, limit=600)) from err


def optimize(model, args, *, tune=None, training=True):
    """The `rnnfuse.OptimizeResult` of one `optimize` call (model, report,
    each group's `TuneResult`); the pipeline runs once. Its warnings reach
    the `rnnfuse` logger through `main` (`quiet.rnnfuse_warnings_logged`)."""
    import rnnfuse

    # The commands say themselves, per group, where nothing runs fused.
    said_here = _DropRecords("_say_if_nothing_runs_fused")
    logger.addFilter(said_here)
    try:
        return rnnfuse.optimize(
            model,
            min_layers=args.min_layers,
            tune=tune if tune is not None else False,
            training=training,
            plan=forced_plan(args),
            return_result=True,
        )
    except (TypeError, ValueError) as err:
        raise CliError(_first_line(err, limit=600)) from err
    finally:
        logger.removeFilter(said_here)


class _DropRecords(logging.Filter):
    """Drops the log records one function of the library emits."""

    def __init__(self, func_name: str):
        super().__init__()
        self.func_name = func_name

    def filter(self, record: logging.LogRecord) -> bool:
        return record.funcName != self.func_name


def fused_paths(model) -> dict:
    """Fused layer name -> what its last call ran (a `CallPath`, or None)."""
    from rnnfuse.fused import fused_layers

    return {layer.name: layer.last_path for layer in fused_layers(model)}


def nothing_fused_here(chosen) -> str | None:
    """Why no group runs fused here, or None: said before any work is timed."""
    from rnnfuse.placement import nothing_fused_reason

    return nothing_fused_reason([r.plan for r in chosen], [r.source for r in chosen])


def caveat(paths: dict, groups: int) -> str | None:
    """Why the two models should time alike here, if they should."""
    if not groups:
        return "nothing fuses in this model: both models run the same layers."
    if not paths:
        return "every group's plan keeps its layers: both models run the same layers."
    fallback = sorted({str(p.reason) for p in paths.values() if getattr(p, "reason", None) is not None})
    if fallback:
        return (
            f"the fused layers ran the original layers here ({'; '.join(fallback)}), "
            "so expect about 1.0x. On a CUDA GPU each group runs as one cuDNN call."
        )
    return None


def compute_dtype(model) -> str:
    """The narrowest compute dtype among the model's layers."""
    dtypes = {str(getattr(l, "compute_dtype", "float32")) for l in model._flatten_layers(include_self=False)}
    for narrow in ("float16", "bfloat16"):
        if narrow in dtypes:
            return narrow
    return "float32"
