"""GEMM-MN: N-axis routed projection (Q, gate, up) and the fused SwiGLU gate+up.

Grid: one program per (sorted m-tile, n-tile) with the n-tile inside one routing group (BLOCK_N
divides group_size). Rows are gathered through ``route.idx[g]`` (active rows first), so every
m-tile but one per group is fully active or fully inactive:
  * level 0: a program whose first sorted row is inactive does no GEMM work (it only writes the
    zero tile when ``zero_inactive``, else it exits);
  * level 1: in the boundary tile the loads of inactive A rows are predicated off.
Weight tiles are read once per admitted program (device-side TMA descriptors on Hopper when they
compile, pointer loads otherwise). At M <= 16 (decode) there is one m-tile per group, so a program
reads its weight slice only when some token of the batch uses the group.

``zero_inactive=False`` leaves the output of inactive (row, group) pairs unspecified (uninitialised
memory, or the dense value on the 'dense' path): use it only when a consumer ignores those entries.

This sorted kernel is the route plan's 'sorted' path (``route.plan.mn``, decided by ``wide.kernels.route.plan``;
docs/kernels.md#path-policy); 'small' runs ``small_m`` (decode-sized M: reads the mask, no reorder) and
'dense' runs ``dense_mid`` (cuBLAS + a masked epilogue).
"""

from __future__ import annotations

import torch

from .._triton_utils import (
    HAS_TRITON,
    autotune_subset,
    check_dtype,
    largest_pow2_divisor,
    m_bucket,
    tma_supported,
    use_triton,
)
from ..route.contract import route_plan, validate_route
from ..route.reorder import RouteIndex, route_mask
from .dense_mid import dense_gemm_mn, dense_swiglu
from .reference import routed_gemm_mn_ref, routed_swiglu_ref
from .small_m import small_gemm_mn

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .._triton_utils import grouped_tile

_STATE = {"tma": False}


def _cfg(bm, bn, bk, stages, warps, tma=False, group_m=8):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "USE_TMA": tma},
        num_stages=stages,
        num_warps=warps,
    )


if HAS_TRITON:
    # M <= 16: GEMV-like, weight-bandwidth bound -> many narrow programs, deep K tiles.
    _SMALL = [
        _cfg(16, 32, 128, 4, 4),
        _cfg(16, 32, 256, 3, 4),
        _cfg(16, 64, 128, 4, 4),
        _cfg(16, 16, 256, 4, 4),
    ]
    # 16 < M <= 256: still weight bound; one or few m-tiles per group.
    _MID = [
        _cfg(64, 32, 128, 4, 4),
        _cfg(64, 64, 64, 4, 4),
        _cfg(64, 64, 128, 3, 4),
        _cfg(64, 128, 64, 4, 4),
        _cfg(32, 64, 128, 4, 4),
    ]
    # M > 256: compute bound.
    _LARGE = [  # first: the WIDE_AUTOTUNE_MAX=1 pick (128x256 x 3 stages can exceed shared memory)
        _cfg(128, 128, 64, 4, 8),
        _cfg(128, 256, 64, 3, 8),
        _cfg(128, 64, 64, 4, 4),
        _cfg(128, 32, 64, 4, 4),
        _cfg(128, 256, 64, 3, 8, tma=True),
        _cfg(128, 128, 64, 4, 8, tma=True),
        _cfg(128, 32, 64, 4, 4, tma=True),
        # half-height m-tiles halve the idle rows of each group's last tile and fill the last wave
        # better (Q's shape)
        _cfg(64, 256, 64, 4, 8, tma=True),
    ]
    _SETS = ((16, _SMALL), (256, _MID), (1 << 30, _LARGE))
    _ALL = _SMALL + _MID + _LARGE


def prune_configs(configs, named_args, **kwargs):
    """Keep the configs of the M bucket whose BLOCK_N divides the group size (TMA only if usable)."""
    mb, g = named_args["M_BUCKET"], named_args["G"]
    ids = next({id(c) for c in s} for lim, s in _SETS if mb <= lim)
    keep = [
        c
        for c in configs
        if id(c) in ids and g % c.kwargs["BLOCK_N"] == 0 and (_STATE["tma"] or not c.kwargs["USE_TMA"])
    ]
    if not keep:  # odd group sizes (e.g. 48): one safe config
        bm = 16 if mb <= 16 else 64
        keep = [_cfg(bm, largest_pow2_divisor(g, 64), 64, 3, 4)]
    return autotune_subset(keep)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["M", "M_BUCKET"])
    def _gemm_mn_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        w2_ptr,  # [N, K] (up weight when SWIGLU, else unused)
        y_ptr,  # [M, N]
        idx_ptr,  # [N_G, M] int32
        count_ptr,  # [N_G] int32
        M,
        N,
        K,
        G,
        stride_xm,
        stride_wn,
        stride_ym,
        M_BUCKET,
        SWIGLU: tl.constexpr,
        ZERO: tl.constexpr,
        EVEN_K: tl.constexpr,
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        pid = tl.program_id(0)
        pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), N // BLOCK_N, GROUP_M)

        n0 = pid_n * BLOCK_N
        g = n0 // G
        cnt = tl.load(count_ptr + g)
        m0 = pid_m * BLOCK_M
        offs_p = m0 + tl.arange(0, BLOCK_M)  # sorted positions
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_m = offs_p < M
        rows = tl.load(idx_ptr + g * M + offs_p, mask=in_m, other=0).to(tl.int64)  # gathered row ids
        y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
        if m0 < cnt:
            act = offs_p < cnt  # level-1 predicate: only active rows are loaded
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if USE_TMA:
                wd = tl.make_tensor_descriptor(w_ptr, [N, K], [stride_wn, 1], [BLOCK_N, BLOCK_K])
                if SWIGLU:
                    wd2 = tl.make_tensor_descriptor(w2_ptr, [N, K], [stride_wn, 1], [BLOCK_N, BLOCK_K])
            else:
                b_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
                b2_ptrs = w2_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=act[:, None], other=0.0)
                else:
                    kk = (k0 + offs_k) < K
                    a = tl.load(a_ptrs, mask=act[:, None] & kk[None, :], other=0.0)
                if USE_TMA:
                    b = wd.load([n0, k0])
                elif EVEN_K:
                    b = tl.load(b_ptrs)
                else:
                    b = tl.load(b_ptrs, mask=kk[None, :], other=0.0)
                acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
                if SWIGLU:
                    if USE_TMA:
                        b2 = wd2.load([n0, k0])
                    elif EVEN_K:
                        b2 = tl.load(b2_ptrs)
                    else:
                        b2 = tl.load(b2_ptrs, mask=kk[None, :], other=0.0)
                    acc2 = tl.dot(a, tl.trans(b2), acc2, input_precision=PREC)
                a_ptrs += BLOCK_K
                if not USE_TMA:
                    b_ptrs += BLOCK_K
                    b2_ptrs += BLOCK_K
            if SWIGLU:
                acc = acc * tl.sigmoid(acc) * acc2
            if ZERO:
                out = tl.where(act[:, None], acc, 0.0)
                tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=in_m[:, None])
            else:
                tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=act[:, None])
        elif ZERO:
            zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=y_ptr.dtype.element_ty)
            tl.store(y_ptrs, zero, mask=in_m[:, None])

    _gemm_mn_tuned = triton.autotune(
        configs=_ALL,
        key=["M_BUCKET", "N", "K", "G", "SWIGLU", "ZERO"],
        prune_configs_by={"early_config_prune": prune_configs},
    )(_gemm_mn_kernel)


def _interp_config(m: int, g: int, k: int) -> dict:
    bn = largest_pow2_divisor(g, 32)
    return {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": 32, "GROUP_M": 2, "USE_TMA": False}


def _launch_mn(x, w, w2, route_idx, count, g: int, zero: bool, swiglu: bool) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    args = (x, w, w2, y, route_idx, count, m, n, k, g, x.stride(0), w.stride(0), y.stride(0), m_bucket(m))
    flags = {"SWIGLU": swiglu, "ZERO": zero, "PREC": prec}
    if x.is_cuda:
        _STATE["tma"] = tma_supported(x.device.index or 0)  # installs the allocator too

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * (n // meta["BLOCK_N"]),)

        even_k = k % 256 == 0
        _gemm_mn_tuned[grid](*args, EVEN_K=even_k, **flags)
    else:  # interpreter: one fixed small config
        cfg = _interp_config(m, g, k)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * (n // cfg["BLOCK_N"]),)
        _gemm_mn_kernel[grid](*args, EVEN_K=k % cfg["BLOCK_K"] == 0, **flags, **cfg)
    return y


def _route_of(idx: torch.Tensor, count: torch.Tensor, mask: torch.Tensor) -> RouteIndex:
    e = idx.new_empty((0, idx.shape[0]))
    return RouteIndex(idx, count, e, e, mask)


def _dispatch_mn(x, w, w2, idx, count, mask, g: int, zero: bool, path: str) -> torch.Tensor:
    """x: [M, K] -> [M, N] on a resolved path (SwiGLU when ``w2`` is given)."""
    if path == "dense":
        return dense_gemm_mn(x, w, mask, g, zero) if w2 is None else dense_swiglu(x, w, w2, mask, g, zero)
    if not use_triton(x):
        route = _route_of(idx, count, mask)
        return routed_gemm_mn_ref(x, w, route, g) if w2 is None else routed_swiglu_ref(x, w, w2, route, g)
    if path == "small":
        return small_gemm_mn(x, w, w2, mask, g, zero)
    return _launch_mn(x, w, w if w2 is None else w2, idx, count, g, zero, w2 is not None)


@torch.library.custom_op("wide::routed_gemm_mn", mutates_args=())
def _gemm_mn_op(
    x: torch.Tensor,
    w: torch.Tensor,
    idx: torch.Tensor,
    count: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    zero_inactive: bool,
    path: str,
) -> torch.Tensor:
    return _dispatch_mn(x, w, None, idx, count, mask, group_size, zero_inactive, path)


@_gemm_mn_op.register_fake
def _(x, w, idx, count, mask, group_size, zero_inactive, path):
    return x.new_empty((x.shape[0], w.shape[0]))


@torch.library.custom_op("wide::routed_swiglu", mutates_args=())
def _swiglu_op(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    idx: torch.Tensor,
    count: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    zero_inactive: bool,
    path: str,
) -> torch.Tensor:
    return _dispatch_mn(x, w_gate, w_up, idx, count, mask, group_size, zero_inactive, path)


@_swiglu_op.register_fake
def _(x, w_gate, w_up, idx, count, mask, group_size, zero_inactive, path):
    return x.new_empty((x.shape[0], w_gate.shape[0]))


def routed_gemm_mn(
    x: torch.Tensor,
    w: torch.Tensor,
    route: RouteIndex,
    group_size: int,
    *,
    zero_inactive: bool = True,
) -> torch.Tensor:
    """N-axis routed projection: ``y[m, n] = x[m]·w[n]`` if m is active in group ``n // group_size``.

    x: [M, K], w: [N, K] -> y: [M, N]. Inactive entries are 0 (``zero_inactive``) or unspecified.
    The path is ``route.plan.mn``: 'small' | 'dense' | 'sorted' (``wide.kernels.route.plan``).
    """
    check_dtype(x, w)
    validate_route(x, w.shape[0], w.shape[1], route, group_size, "n")
    path = route_plan(route, x.shape[0]).mn
    mask = route_mask(route).contiguous()
    return _gemm_mn_op(x.contiguous(), w.contiguous(), route.idx, route.count, mask, group_size, zero_inactive, path)


def routed_swiglu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    route: RouteIndex,
    group_size: int,
    *,
    zero_inactive: bool = True,
) -> torch.Tensor:
    """Fused routed gate+up: ``h = silu(x w_gate^T) * (x w_up^T)`` on active (row, group).

    x: [M, K], w_gate/w_up: [N, K] -> h: [M, N]; x is read once, h written once (small / sorted
    paths; the dense path runs two cuBLAS GEMMs and one fused epilogue). The path is ``route.plan.mn``.
    """
    check_dtype(x, w_gate, w_up)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} differ")
    validate_route(x, w_gate.shape[0], w_gate.shape[1], route, group_size, "n")
    path = route_plan(route, x.shape[0]).mn
    mask = route_mask(route).contiguous()
    return _swiglu_op(
        x.contiguous(),
        w_gate.contiguous(),
        w_up.contiguous(),
        route.idx,
        route.count,
        mask,
        group_size,
        zero_inactive,
        path,
    )
