"""Routed kernels (Triton) with torch references.

Per routing decision: ``plan(m, group_size, n_groups, sparsity)`` decides the path of each operator
(``wide.kernels.route.plan``, the one policy), ``plan_route(mask, plan)`` builds the route that carries it (the
``reorder`` index only when the GEMM-MN takes the sorted path), and the operators of the decision share
that route and read its plan:
  attention: routed_gemm_mn (Q) -> routed_attention_prefill / _decode -> routed_gemm_k (O)
  FFN:       routed_swiglu (gate+up, fused) -> routed_gemm_k (down)
The decisions themselves: router_margin / router_decisions (/ _pair: two routers on one input, one launch),
the one decision rule (docs/routing.md).
Decode (B <= 16) can run a whole decoder layer through the fused kernels of `fused_decode`
(`WideRuntime(fused_decode=True)`).
Every op is a `torch.library` custom op in the `wide::` namespace (torch.compile / CUDA-graph safe, no
host syncs); on CPU tensors the torch reference runs unless TRITON_INTERPRET=1.
"""

from wide.kernels.attention import (
    attention_decode_ref,
    attention_prefill_ref,
    decode_num_splits,
    routed_attention_decode,
    routed_attention_prefill,
)
from wide.kernels.fused_decode import (
    attention_decode_merged,
    ffn_residual_norm,
    fused_rms_norm,
    o_proj_residual_norm,
    qkv_rope_cache,
)
from wide.kernels.gemm import (
    gather_scatter_gemm_k,
    gather_scatter_gemm_n,
    routed_gemm_k,
    routed_gemm_k_ref,
    routed_gemm_mn,
    routed_gemm_mn_ref,
    routed_swiglu,
    routed_swiglu_ref,
)
from wide.kernels.route import (
    K_PATHS,
    MN_PATHS,
    Plan,
    RouteIndex,
    has_index,
    mn_dense_below,
    mn_dense_thresholds,
    pattern_order,
    plan,
    plan_route,
    reorder,
    reorder_reference,
    route_mask,
    sparsity_bucket,
)
from wide.kernels.router import (
    router_decisions,
    router_decisions_pair,
    router_decisions_ref,
    router_margin,
    router_margin_ref,
)


def clear_autotune_cache() -> None:
    """Forget the configs the routed GEMMs' autotuners chose: the next call of each shape tunes again.

    Autotuning happens on the first call of a shape, with that call's masks; how many tiles are active
    changes the best tile shape, so re-tune after routers start producing masks of another density (the
    kernel benchmark tunes each sparsity level afresh, as a model deployed at that level would be)."""
    from wide.kernels.gemm import gemm_k, gemm_mn, small_m

    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # no triton: nothing was tuned
        return
    for mod in (gemm_mn, gemm_k, small_m):
        for obj in vars(mod).values():
            if isinstance(obj, Autotuner):
                obj.cache.clear()


__all__ = [
    "K_PATHS",
    "MN_PATHS",
    "Plan",
    "RouteIndex",
    "clear_autotune_cache",
    "attention_decode_merged",
    "attention_decode_ref",
    "attention_prefill_ref",
    "decode_num_splits",
    "ffn_residual_norm",
    "fused_rms_norm",
    "gather_scatter_gemm_k",
    "gather_scatter_gemm_n",
    "has_index",
    "mn_dense_below",
    "mn_dense_thresholds",
    "o_proj_residual_norm",
    "pattern_order",
    "plan",
    "plan_route",
    "qkv_rope_cache",
    "reorder",
    "reorder_reference",
    "route_mask",
    "router_decisions",
    "router_decisions_pair",
    "router_decisions_ref",
    "router_margin",
    "router_margin_ref",
    "routed_attention_decode",
    "routed_attention_prefill",
    "routed_gemm_k",
    "routed_gemm_k_ref",
    "routed_gemm_mn",
    "routed_gemm_mn_ref",
    "routed_swiglu",
    "routed_swiglu_ref",
    "sparsity_bucket",
]
