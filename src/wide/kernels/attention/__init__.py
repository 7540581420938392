"""Routed attention: prefill and split-KV decode over the KV groups a token runs (``ops.py``: kernels, op
registration and the decode split rule ``decode_num_splits``), and the torch references (``reference.py``).
The fused decode layer's attention (``wide.kernels.fused_decode``) is the same math in its own launch
(docs/kernels.md, "Fused decode layer").
"""

from wide.kernels.attention.ops import decode_num_splits, routed_attention_decode, routed_attention_prefill
from wide.kernels.attention.reference import attention_decode_ref, attention_prefill_ref

__all__ = [
    "attention_decode_ref",
    "attention_prefill_ref",
    "decode_num_splits",
    "routed_attention_decode",
    "routed_attention_prefill",
]
