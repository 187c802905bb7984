"""The graph passes: graph -> rules -> planning -> rewrite (`run_pipeline`).

Example:
    >>> from rnnfuse.passes import PassOptions, run_pipeline
"""

from rnnfuse.passes.graph import build_layer_graph
from rnnfuse.passes.pipeline import PassOptions, PassResult, run_pipeline
from rnnfuse.passes.planning import plan_fusion
from rnnfuse.passes.rewrite import FusionWarning, rewrite_model

__all__ = [
    "FusionWarning",
    "PassOptions",
    "PassResult",
    "build_layer_graph",
    "plan_fusion",
    "rewrite_model",
    "run_pipeline",
]
