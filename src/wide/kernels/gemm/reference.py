"""Torch references for the routed GEMMs and the naive gather-scatter of the paper's appendix A."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..route.reorder import RouteIndex, route_mask


def expand_group_mask(mask: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[M, N_G] bool -> [M, N_G * group_size] 0/1 of ``dtype`` (channel-level mask)."""
    return mask.to(dtype).repeat_interleave(group_size, dim=1)


def routed_gemm_mn_ref(
    x: torch.Tensor, w: torch.Tensor, route: RouteIndex, group_size: int, *, zero_inactive: bool = True
) -> torch.Tensor:
    """y[m, n] = x[m]·w[n] if row m is active in group n // group_size, else 0.

    The reference always zeroes inactive entries (the kernel's ``zero_inactive=False`` leaves them
    undefined, so zeros are a valid result for it too)."""
    # x: [M, K], w: [N, K] -> [M, N]
    return F.linear(x, w) * expand_group_mask(route_mask(route), group_size, x.dtype)


def routed_swiglu_ref(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    route: RouteIndex,
    group_size: int,
    *,
    zero_inactive: bool = True,
) -> torch.Tensor:
    """h = silu(x w_gate^T) * (x w_up^T) on active (row, group), 0 elsewhere."""
    h = F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)  # [M, N]
    return h * expand_group_mask(route_mask(route), group_size, x.dtype)


def routed_gemm_k_ref(
    x: torch.Tensor, w: torch.Tensor, route: RouteIndex, group_size: int, *, deterministic: bool = False
) -> torch.Tensor:
    """y[m] = sum over groups g active for m of x[m, gG:(g+1)G] · w[:, gG:(g+1)G]^T."""
    # x: [M, K] masked on its K groups, w: [N, K] -> [M, N]
    return F.linear(x * expand_group_mask(route_mask(route), group_size, x.dtype), w)


# ----------------------------------------------------------------------------------------------
# Appendix A: naive, fully vectorised gather-scatter (token-specific weight copies). Benchmark only.
# ----------------------------------------------------------------------------------------------
def _active_groups(mask: torch.Tensor) -> torch.Tensor:
    """[M, N_G] bool with the same count R per row -> [M, R] group ids (appendix A assumes fixed R)."""
    r = int(mask[0].sum())
    return torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :r]


def gather_scatter_gemm_n(a: torch.Tensor, b: torch.Tensor, i_n: torch.Tensor, group_size: int) -> torch.Tensor:
    """N-axis naive gather-scatter. a: [M, K], b: [N, K], i_n: [M, R] group ids -> c: [M, N]."""
    m = a.shape[0]
    offset = torch.arange(group_size, device=a.device)  # [G]
    j_n = (i_n[..., None] * group_size + offset).reshape(m, -1)  # [M, N']
    b_sub = b[j_n, :]  # [M, N', K]
    c_sub = torch.einsum("mk,mnk->mn", a, b_sub)  # [M, N']
    c = torch.zeros(m, b.shape[0], device=a.device, dtype=a.dtype)
    c.scatter_(1, j_n, c_sub)
    return c


def gather_scatter_gemm_k(a: torch.Tensor, b: torch.Tensor, i_k: torch.Tensor, group_size: int) -> torch.Tensor:
    """K-axis naive gather-scatter. a: [M, K], b: [N, K], i_k: [M, R] group ids -> c: [M, N]."""
    m = a.shape[0]
    offset = torch.arange(group_size, device=a.device)  # [G]
    j_k = (i_k[..., None] * group_size + offset).reshape(m, -1)  # [M, K']
    a_sub = torch.gather(a, 1, j_k)  # [M, K']
    b_sub = b[:, j_k].permute(1, 0, 2)  # [M, N, K']
    return torch.einsum("mk,mnk->mn", a_sub, b_sub)


def fixed_count_mask(m: int, n_groups: int, active: int, device=None, generator=None) -> torch.Tensor:
    """Random [M, N_G] mask with exactly ``active`` groups per row (the appendix-A setting)."""
    scores = torch.rand(m, n_groups, device=device, generator=generator)
    keep = scores.argsort(dim=1)[:, :active]
    mask = torch.zeros(m, n_groups, dtype=torch.bool, device=device)
    mask.scatter_(1, keep, True)
    return mask


__all__ = [
    "routed_gemm_mn_ref",
    "routed_swiglu_ref",
    "routed_gemm_k_ref",
    "gather_scatter_gemm_n",
    "gather_scatter_gemm_k",
    "fixed_count_mask",
    "expand_group_mask",
    "_active_groups",
]
