"""Inference runtime: static KV cache, routed prefill / decode through the kernels, CUDA-graph decode."""

from wide.runtime.generate import GraphedDecode, generate
from wide.runtime.model import StaticCache, WideRuntime

__all__ = ["GraphedDecode", "StaticCache", "WideRuntime", "generate"]
