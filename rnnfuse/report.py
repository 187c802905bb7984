"""The records `analyze` and `optimize` return: `FusionGroup` (one run that
becomes one fused layer), `FusionReport` (the groups, and the `Reason`
for every recurrent layer left alone) and `OptimizeResult`.
`str(report)` is a plain-text table; `report.to_dict()` is JSON-ready.

>>> import keras, rnnfuse
>>> m = keras.Sequential([keras.Input((10, 4)),
...                       keras.layers.GRU(8, return_sequences=True), keras.layers.GRU(8)])
>>> [(g.cell, g.num_layers) for g in rnnfuse.analyze(m).groups]
[('gru', 2)]
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping

from rnnfuse.reasons import Reason

__all__ = ["FusionGroup", "FusionReport", "OptimizeResult", "RewriteFailure"]


@dataclasses.dataclass(frozen=True)
class FusionGroup:
    """One run of recurrent layers that runs as one multi-layer call."""

    # Qualified names of the original layers, bottom to top. Layers inside
    # nested models are prefixed with the sub-model's name ("enc/lstm").
    layers: tuple[str, ...]
    # cuDNN cell mode: "lstm", "gru", "rnn_tanh" or "rnn_relu".
    cell: str
    # Width of every layer's state.
    units: int
    # Recurrent levels of the fused call (a StackedRNNCells counts each cell).
    num_layers: int
    # Features of the run's input sequence.
    input_size: int | None
    # Whether every layer of the run is Bidirectional.
    bidirectional: bool
    # Recurrent projection width of a ProjectedLSTM run (0: none).
    proj_size: int = 0
    # Dropout layers between the run's layers, absorbed into the fused call.
    absorbed_dropout: tuple[str, ...] = ()
    # Qualified-name prefix of the (sub-)model holding the run ("" at top).
    scope: str = ""
    # The compute dtype the run's layers compute in (its first layer's
    # dtype policy: "float32", "float16" under mixed_float16, ...).
    dtype: str = "float32"
    # The RecurrentViews of the layers (internal; not compared or printed).
    views: tuple[Any, ...] = dataclasses.field(
        default=(), repr=False, compare=False
    )
    # Per gap between layers: the absorbed Dropout layer object or None.
    gap_dropout: tuple[Any, ...] = dataclasses.field(
        default=(), repr=False, compare=False
    )

    def to_dict(self) -> dict:
        hidden = ("views", "gap_dropout")
        d = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in hidden
        }
        d["layers"] = list(self.layers)
        d["absorbed_dropout"] = list(self.absorbed_dropout)
        return d


@dataclasses.dataclass(frozen=True)
class FusionReport:
    """What `analyze` found in a model."""

    # Name of the analyzed model.
    model_name: str
    # The runs that fuse, in graph order.
    groups: tuple[FusionGroup, ...]
    # Every recurrent layer not in a group -> why (a `Reason`, a str).
    skipped: Mapping[str, Reason]
    # Model-level remarks (a subclassed model, for example).
    notes: tuple[str, ...] = ()
    # (layer, the recurrent layer reading it) -> why two grouped layers are two calls.
    breaks: Mapping[tuple[str, str], Reason] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "skipped", types.MappingProxyType(dict(self.skipped)))
        object.__setattr__(self, "breaks", types.MappingProxyType(dict(self.breaks)))

    @property
    def absorbed(self) -> dict[str, str]:
        """Absorbed Dropout layer -> first layer of its group."""
        return {d: g.layers[0] for g in self.groups for d in g.absorbed_dropout}

    def to_dict(self) -> dict:
        """A JSON-ready dict of the report."""
        return {
            "model": self.model_name,
            "groups": [g.to_dict() for g in self.groups],
            "skipped": {
                name: {"rule": getattr(r, "rule", "unknown"), "reason": str(r)}
                for name, r in self.skipped.items()
            },
            "notes": list(self.notes),
            "breaks": [
                {"layers": [upper, lower], "rule": getattr(r, "rule", "unknown"), "reason": str(r)}
                for (upper, lower), r in self.breaks.items()
            ],
        }

    def tables(self, runs: list[str] | None = None, runs_title: str = "runs") -> tuple:
        """rich Tables of the fused groups and the layers left alone; `runs`: one
        extra cell per group, under `runs_title`."""
        from rnnfuse.report_text import report_tables

        return report_tables(self, runs, runs_title)

    def __str__(self) -> str:
        """Both tables and the notes as plain text (`rnnfuse.report_text`)."""
        from rnnfuse.report_text import report_text

        return report_text(self)


@dataclasses.dataclass(frozen=True)
class RewriteFailure:
    """A group whose fused layer could not be built; its layers stay."""

    # The group that stays unfused.
    group: FusionGroup
    # Why (the exception's type and message, as `FusedRNN` raised it).
    reason: str


@dataclasses.dataclass(frozen=True)
class OptimizeResult:
    """What `rnnfuse.optimize(model, return_result=True)` returns (like
    torch.fx's `PassResult`): the new model and how it was made."""

    # The optimized model (the input model itself when nothing could be
    # rewritten: a subclassed model).
    model: Any
    # What analysis found: the groups and every other layer's reason.
    report: FusionReport
    # One `rnnfuse.tuning.TuneResult` per group of `report`: the plan and
    # how it was chosen ("static", "forced", "measured", "cache").
    plans: tuple[Any, ...] = ()
    # Groups whose fused layer could not be built, and why.
    failed: tuple[RewriteFailure, ...] = ()

    @property
    def modified(self) -> bool:
        """Whether any FusedRNN layer was made."""
        return self.model is not None and any(
            type(l).__name__ == "FusedRNN" for l in self.model._flatten_layers(include_self=False)
        )
