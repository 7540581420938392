"""Routed GEMMs where routing cannot skip weight reads: the plan's 'dense' paths (docs/kernels.md#path-policy).

With a few dozen to a few hundred tokens and per-token random decisions, every group has an active
token, so each weight tile must be read anyway: cuBLAS runs the GEMMs and the routing mask is
applied where it costs nothing extra.

* GEMM-MN: ``F.linear``; inactive entries are zeroed in place only when asked (``zero``).
* SwiGLU: two ``F.linear`` + one fused Triton epilogue ``silu(g) * u * mask`` (one pass; plain
  PyTorch needs two for ``silu(g) * u``), one program per (row, 1,024 columns), the group size a
  compile-time constant (a flat-index version divides 64-bit indices per element and ran slower than
  cuBLAS + PyTorch).
* GEMM-K: ``x`` with its inactive groups zeroed, then ``F.linear``; when the producer already wrote
  zeros there (``x_zeroed``: routed SwiGLU / routed attention outputs) it is a plain cuBLAS GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._triton_utils import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _silu_mul_mask_kernel(
        g_ptr, u_ptr, mask_ptr, h_ptr, N, NG, G: tl.constexpr, ZERO: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        """One program per (row, BLOCK_N columns): h = silu(g) * u, zeroed where the row's group is off."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = offs < N
        a = tl.load(g_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(u_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32)
        h = a * tl.sigmoid(a) * b
        if ZERO:  # G is a compile-time constant: the group index is a shift for power-of-two groups
            keep = tl.load(mask_ptr + row * NG + offs // G, mask=ok, other=0) != 0
            h = tl.where(keep, h, 0.0)
        tl.store(h_ptr + row * N + offs, h.to(h_ptr.dtype.element_ty), mask=ok)


def _zero_inactive_(y: torch.Tensor, mask: torch.Tensor, g: int) -> torch.Tensor:
    """In place: y [M, N] *= mask [M, N // g] expanded over each group's g columns."""
    m, n = y.shape
    y.view(m, n // g, g).mul_(mask[:, :, None].to(y.dtype))
    return y


def dense_gemm_mn(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, g: int, zero: bool) -> torch.Tensor:
    """x: [M, K], w: [N, K] -> [M, N]; inactive entries 0 when ``zero``, else the dense values."""
    y = F.linear(x, w)
    return _zero_inactive_(y, mask, g) if zero else y


def dense_swiglu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, mask: torch.Tensor, g: int, zero: bool
) -> torch.Tensor:
    """silu(x w_gate^T) * (x w_up^T) -> [M, N]; inactive entries 0 when ``zero``."""
    a, b = F.linear(x, w_gate), F.linear(x, w_up)  # [M, N] each
    if not use_triton(x):
        h = F.silu(a) * b
        return _zero_inactive_(h, mask, g) if zero else h
    m, n = a.shape
    h = torch.empty_like(a)
    block = 1024
    grid = (m, triton.cdiv(n, block))
    _silu_mul_mask_kernel[grid](a, b, mask.view(torch.uint8), h, n, n // g, G=g, ZERO=zero, BLOCK_N=block)
    return h


def masked_dense_gemm_k(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, g: int, x_zeroed: bool) -> torch.Tensor:
    """x: [M, K] with its inactive groups (mask [M, K // g] False) zeroed -> cuBLAS ``x @ w^T``."""
    if not x_zeroed:
        m, k = x.shape
        x = (x.view(m, k // g, g) * mask[:, :, None].to(x.dtype)).view(m, k)  # [M, K]
    return F.linear(x, w)
