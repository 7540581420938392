"""Inference runtime: static KV cache, routed prefill / decode through the kernels, CUDA graphs.

Decode replays one graph per batch size; ``GraphedPrefill`` one per prompt shape.
"""

from wide.runtime.generate import GraphedDecode, GraphedPrefill, generate
from wide.runtime.model import StaticCache, WideRuntime

__all__ = ["GraphedDecode", "GraphedPrefill", "StaticCache", "WideRuntime", "generate"]
