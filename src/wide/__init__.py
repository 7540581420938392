"""WIDE: token-level dynamic width pruning for LLM inference."""

from wide.config import WideConfig

__version__ = "0.1.0"
__all__ = ["WideConfig", "__version__"]
