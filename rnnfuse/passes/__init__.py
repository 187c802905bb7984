"""The graph passes: graph -> rules -> planning -> rewrite.

Example:

    >>> from rnnfuse.passes import build_layer_graph, plan_fusion, rewrite_model
"""

from rnnfuse.passes.graph import build_layer_graph
from rnnfuse.passes.planning import plan_fusion
from rnnfuse.passes.rewrite import FusionWarning, rewrite_model

__all__ = ["build_layer_graph", "plan_fusion", "rewrite_model", "FusionWarning"]
