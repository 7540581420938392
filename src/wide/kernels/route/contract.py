"""The route contract: what every routed operator checks of the route it is handed before it launches
(``validate_route``: shapes, dtypes, devices) and where it takes its path from (``route_plan``: the plan the route
carries, checked against it). The operators decide nothing themselves (docs/kernels.md#path-policy).
"""

from __future__ import annotations

import torch

from .plan import SMALL_M, Plan
from .reorder import RouteIndex, has_index


def validate_route(x: torch.Tensor, n_out: int, n_in: int, route: RouteIndex, group_size: int, axis: str) -> None:
    """Shape / dtype / route checks shared by the routed GEMMs (raise ValueError)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    if group_size <= 0 or group_size % 16 != 0:
        raise ValueError(f"group_size must be a positive multiple of 16, got {group_size}")
    routed = n_out if axis == "n" else n_in
    if routed % group_size != 0:
        raise ValueError(f"{'N' if axis == 'n' else 'K'}={routed} is not divisible by group_size={group_size}")
    if x.shape[1] != n_in:
        raise ValueError(f"x has K={x.shape[1]} but the weight expects K={n_in}")
    ng = routed // group_size
    if not has_index(route):  # index-less route of plan_route (small / dense paths): the mask alone
        if route.mask is None or tuple(route.mask.shape) != (x.shape[0], ng) or route.mask.dtype != torch.bool:
            raise ValueError(f"route without index needs route.mask bool [{x.shape[0]}, {ng}]")
        if route.mask.device != x.device:
            raise ValueError(f"route on {route.mask.device} but x on {x.device}")
        return
    if tuple(route.idx.shape) != (ng, x.shape[0]) or tuple(route.count.shape) != (ng,):
        raise ValueError(
            f"route does not match: idx {tuple(route.idx.shape)} / count {tuple(route.count.shape)}, "
            f"expected ({ng}, {x.shape[0]}) / ({ng},)"
        )
    if route.idx.dtype != torch.int32 or route.count.dtype != torch.int32:
        raise ValueError("route.idx and route.count must be int32")
    if route.idx.device != x.device:
        raise ValueError(f"route on {route.idx.device} but x on {x.device}")


def route_plan(route: RouteIndex, m: int) -> Plan:
    """The plan a route carries (``plan_route(mask, plan(...))``), checked against the route: a route
    without a plan, a sorted GEMM-MN without the reorder index, a small path past SMALL_M tokens are
    ValueErrors (M: the operator's token count). The operators take their path from it and decide nothing
    themselves."""
    p = route.plan
    if p is None:
        raise ValueError("route has no plan: build it with plan_route(mask, plan(m, group_size, n_groups, sparsity))")
    if p.mn == "sorted" and not has_index(route):
        raise ValueError(f"{p}: the sorted GEMM-MN needs the reorder index; build the route with plan_route")
    if "small" in (p.mn, p.k) and m > SMALL_M:
        raise ValueError(f"{p}: the small paths serve M <= {SMALL_M}, got M={m}")
    return p
