"""Serving: a continuous-batching engine over ``WideRuntime`` (``wide.serve.engine``) and an OpenAI-compatible
HTTP server (``wide.serve.server``, needs the ``serve`` extra: ``pip install "wide[serve]"``)."""

from wide.serve.engine import Engine, EngineCounters, Histogram, Output, QueueFull, RequestError, Result, SamplingParams

__all__ = ["Engine", "EngineCounters", "Histogram", "Output", "QueueFull", "RequestError", "Result", "SamplingParams"]
