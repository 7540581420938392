"""The routed GEMMs: Q and gate/up as GEMM-MN (``gemm_mn.py``: output columns of inactive groups skipped),
O and down as GEMM-K (``gemm_k.py``: reduction columns of inactive groups skipped), their decode-sized kernels
(``small_m.py``), the cuBLAS + masked-epilogue middle (``dense_mid.py``) and the torch references
(``reference.py``). Which path runs is the route's plan (``wide.kernels.route``; docs/kernels.md#path-policy).
"""

from wide.kernels.gemm.gemm_k import routed_gemm_k
from wide.kernels.gemm.gemm_mn import routed_gemm_mn, routed_swiglu
from wide.kernels.gemm.reference import (
    gather_scatter_gemm_k,
    gather_scatter_gemm_n,
    routed_gemm_k_ref,
    routed_gemm_mn_ref,
    routed_swiglu_ref,
)

__all__ = [
    "gather_scatter_gemm_k",
    "gather_scatter_gemm_n",
    "routed_gemm_k",
    "routed_gemm_k_ref",
    "routed_gemm_mn",
    "routed_gemm_mn_ref",
    "routed_swiglu",
    "routed_swiglu_ref",
]
