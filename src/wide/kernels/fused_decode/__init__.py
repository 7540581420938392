"""The fused decode layer: one decode step's decoder layer in four kernels (+ the two router launches).

``kernels.py``: the Triton kernels and their device helpers; ``rules.py``: the launch rules (grid, splits,
stages) and ``launch_overrides``; ``reference.py``: the torch references the kernels are tested against;
``ops.py``: the ``wide::`` op registration and the checked public wrappers. docs/kernels.md, "Fused decode layer".
"""

from wide.kernels.fused_decode.ops import (
    attention_decode_merged,
    ffn_residual_norm,
    fused_rms_norm,
    o_proj_residual_norm,
    qkv_rope_cache,
)
from wide.kernels.fused_decode.reference import (
    ffn_residual_norm_ref,
    o_proj_residual_norm_ref,
    qkv_rope_cache_ref,
    rms_norm_ref,
    rotate_half,
)
from wide.kernels.fused_decode.rules import (
    COMPACT_STAGES,
    LONG_CONTEXT,
    LONG_WAVES,
    MAX_BATCH,
    NARROW_DOWN_SPAN,
    LaunchOverrides,
    attn_num_splits,
    attn_programs,
    attn_split_cap,
    down_step,
    ffn_chunk,
    k_splits,
    launch_overrides,
    long_context,
    qkv_row_slices,
    router_overlap,
)

__all__ = [
    "COMPACT_STAGES",
    "LONG_CONTEXT",
    "LONG_WAVES",
    "MAX_BATCH",
    "NARROW_DOWN_SPAN",
    "LaunchOverrides",
    "attention_decode_merged",
    "attn_num_splits",
    "attn_programs",
    "attn_split_cap",
    "down_step",
    "ffn_chunk",
    "ffn_residual_norm",
    "ffn_residual_norm_ref",
    "fused_rms_norm",
    "k_splits",
    "launch_overrides",
    "long_context",
    "o_proj_residual_norm",
    "o_proj_residual_norm_ref",
    "qkv_rope_cache",
    "qkv_rope_cache_ref",
    "qkv_row_slices",
    "rms_norm_ref",
    "rotate_half",
    "router_overlap",
]
