"""GEMM-K: K-axis routed projection (O, down): y[m] = sum over active groups g of x[m, g] · w[:, g]^T.

The path is the route's plan (``route.plan.k``, decided by ``wide.kernels.route.plan``; docs/kernels.md#path-policy):

* ``small`` (decode-sized M): ``small_m.small_gemm_k`` reads the mask, skips the weight columns of the
  groups no token runs, fixed-order split-K reduction.
* ``dense``: ``dense_mid.masked_dense_gemm_k`` zeroes the inactive K groups of x, then cuBLAS; with
  ``x_zeroed`` (the producer, routed SwiGLU or routed attention, already wrote those zeros) it is a
  plain cuBLAS GEMM. With i.i.d. per-token masks every (m-tile, group) pair of rows in their natural
  order has active rows, so a token-tile schedule cannot skip anything there.
* ``ordered`` (few groups, large M): the rows in one order shared by all groups (``reorder.pattern_order``:
  sorted by the Gray rank of their group pattern), so a tile of consecutive rows shares its first groups'
  bits; each program (m-tile, n-tile) streams only the K tiles of the groups some of its rows run (zero A
  rows for the others), with TMA weight loads where available. Deterministic.
"""

from __future__ import annotations

import torch

from .._triton_utils import (
    HAS_TRITON,
    autotune_subset,
    check_dtype,
    largest_pow2_divisor,
    m_bucket,
    next_pow2,
    tma_supported,
    use_triton,
)
from ..route.contract import route_plan, validate_route
from ..route.reorder import RouteIndex, pattern_order, route_mask
from .dense_mid import masked_dense_gemm_k
from .reference import routed_gemm_k_ref
from .small_m import small_gemm_k

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .._triton_utils import grouped_tile

_STATE = {"tma": False}


def _cfg(bm, bn, bk, stages, warps, tma=False, group_m=8):
    kw = {"BLOCK_K": bk, "GROUP_M": group_m, "BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma}
    return triton.Config(kw, num_stages=stages, num_warps=warps)


def _prune_k(configs, named_args, **kwargs):
    g = named_args["G"]
    keep = [
        c for c in configs if g % c.kwargs["BLOCK_K"] == 0 and (_STATE["tma"] or not c.kwargs.get("USE_TMA", False))
    ]
    if not keep:
        c = configs[0]
        kw = dict(c.kwargs, BLOCK_K=largest_pow2_divisor(g, 64))
        keep = [triton.Config(kw, num_stages=3, num_warps=4)]
    return autotune_subset(keep)


_SMEM_BYTES = 200 * 1024  # pipelined A + B tiles must fit in shared memory (H100 / H200: 227 KiB)


def _prune_ordered(configs, named_args, **kwargs):
    """``_prune_k``; the configs whose stages fit in shared memory for this dtype (fp32 needs smaller
    tiles); then the TMA configs alone where TMA is available."""
    size = named_args["x_ptr"].element_size()

    def fits(c):
        kw = c.kwargs
        return c.num_stages * (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * size <= _SMEM_BYTES

    keep = [c for c in _prune_k(configs, named_args, **kwargs) if fits(c)]
    if not keep:
        bk = largest_pow2_divisor(named_args["G"], 32)
        keep = [_cfg(64, 128, bk, 3, 4, tma=False)]
    tma = [c for c in keep if c.kwargs.get("USE_TMA", False)]
    return tma or keep


if HAS_TRITON:

    @triton.jit(do_not_specialize=["M", "M_BUCKET"])
    def _gemm_k_ordered_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        mask_ptr,  # [M, N_G] uint8
        order_ptr,  # [M] int32: the shared row order (pattern_order)
        y_ptr,  # [M, N]
        M,
        N,
        K,
        G,
        NG,
        stride_xm,
        stride_wn,
        M_BUCKET,
        MASK_ROWS: tl.constexpr,
        PREC: tl.constexpr,
        NG_P2: tl.constexpr,
        PACKED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        pid = tl.program_id(0)
        pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

        offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # positions in the shared order
        in_m = offs_p < M
        rows = tl.load(order_ptr + offs_p, mask=in_m, other=0).to(tl.int64)  # [BLOCK_M] row ids
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_n = offs_n < N
        # the groups some row of this tile runs, in ascending order: slot[g] = rank among them
        gcol = tl.arange(0, NG_P2)
        tile_mask = tl.load(
            mask_ptr + rows[:, None] * NG + gcol[None, :], mask=in_m[:, None] & (gcol < NG)[None, :], other=0
        )  # [BLOCK_M, NG_P2]
        used = tl.max((tile_mask != 0).to(tl.int32), axis=0)  # [NG_P2]
        slot = tl.cumsum(used, axis=0) - used
        if PACKED:  # <= 16 groups: their ids as 4-bit fields of one scalar (no reduction in the loop)
            packed = tl.sum(tl.where(used != 0, gcol.to(tl.int64) << (4 * slot).to(tl.int64), 0), axis=0)
        steps = G // BLOCK_K  # K tiles per group
        offs_k = tl.arange(0, BLOCK_K)
        a_base = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
        if USE_TMA:
            wd = tl.make_tensor_descriptor(w_ptr, [N, K], [stride_wn, 1], [BLOCK_N, BLOCK_K])
        else:
            b_base = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in range(0, tl.sum(used, axis=0) * steps):  # only the used groups' K tiles
            s = j // steps
            if PACKED:
                g = ((packed >> (4 * s)) & 15).to(tl.int32)
            else:
                g = tl.sum(tl.where((slot == s) & (used != 0), gcol, 0), axis=0)
            k0 = g * G + (j - s * steps) * BLOCK_K
            if MASK_ROWS:  # x not pre-zeroed: rows that do not run g contribute nothing
                act = tl.load(mask_ptr + rows * NG + g, mask=in_m, other=0) != 0
                a = tl.load(a_base + k0, mask=act[:, None], other=0.0)
            else:
                a = tl.load(a_base + k0, mask=in_m[:, None], other=0.0)
            if USE_TMA:
                b = wd.load([n0, k0])
            else:
                b = tl.load(b_base + k0, mask=in_n[:, None], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
        y_ptrs = y_ptr + rows[:, None] * N + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])

    _KEY = ["M_BUCKET", "N", "K", "G"]
    # 128 x 256 tiles with TMA weight loads: where TMA works, the TMA configs are the only candidates
    # (the autotuner's warm-L2 timing would pick the pointer-load twin; docs/kernels.md#gemm-k-at-large-m)
    _ordered = triton.autotune(
        configs=[
            _cfg(128, 256, 64, 3, 8, tma=True),
            _cfg(128, 256, 64, 4, 8, tma=True),
            _cfg(128, 256, 128, 2, 8, tma=True),
            _cfg(128, 256, 64, 3, 8),
            _cfg(128, 128, 64, 4, 8),
        ],
        key=_KEY + ["MASK_ROWS"],
        prune_configs_by={"early_config_prune": _prune_ordered},
    )(_gemm_k_ordered_kernel)


def _launch_ordered(x, w, mask_u8, order, y, g: int, x_zeroed: bool, prec: str) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    ng = k // g
    args = (x, w, mask_u8, order, y, m, n, k, g, ng, x.stride(0), w.stride(0), m_bucket(m))
    ng_p2 = max(2, next_pow2(ng))
    flags = {"MASK_ROWS": not x_zeroed, "PREC": prec, "NG_P2": ng_p2, "PACKED": ng_p2 <= 16}
    if not x.is_cuda:  # interpreter: one fixed small config
        cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": largest_pow2_divisor(g, 32), "GROUP_M": 2, "USE_TMA": False}
        grid = (triton.cdiv(m, 16) * triton.cdiv(n, 32),)
        _gemm_k_ordered_kernel[grid](*args, **flags, **cfg)
        return y
    _STATE["tma"] = tma_supported(x.device.index or 0)  # installs the allocator too

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _ordered[grid](*args, **flags)
    return y


def _launch_k(x, w, mask, order, g: int, x_zeroed: bool) -> torch.Tensor:
    """The 'ordered' Triton GEMM-K. x: [M, K], w: [N, K] -> y: [M, N]."""
    m = x.shape[0]
    y = torch.empty(m, w.shape[0], device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    return _launch_ordered(x, w, mask.view(torch.uint8), order, y, g, x_zeroed, prec)


@torch.library.custom_op("wide::routed_gemm_k", mutates_args=())
def _gemm_k_op(
    x: torch.Tensor,
    w: torch.Tensor,
    idx: torch.Tensor,
    count: torch.Tensor,
    mask: torch.Tensor,
    order: torch.Tensor,
    group_size: int,
    path: str,
    x_zeroed: bool,
) -> torch.Tensor:
    if path == "dense":
        return masked_dense_gemm_k(x, w, mask, group_size, x_zeroed)
    if use_triton(x):
        if path == "small":
            return small_gemm_k(x, w, mask, group_size)
        return _launch_k(x, w, mask, order, group_size, x_zeroed)
    e = idx.new_empty((0, idx.shape[0]))
    return routed_gemm_k_ref(x, w, RouteIndex(idx, count, e, e, mask), group_size)


@_gemm_k_op.register_fake
def _(x, w, idx, count, mask, order, group_size, path, x_zeroed):
    return x.new_empty((x.shape[0], w.shape[0]))


def routed_gemm_k(
    x: torch.Tensor,
    w: torch.Tensor,
    route: RouteIndex,
    group_size: int,
    *,
    x_zeroed: bool = False,
) -> torch.Tensor:
    """K-axis routed projection. x: [M, K], w: [N, K] -> y: [M, N] (fp32 accumulation).

    The path is ``route.plan.k`` (``plan_route(mask, plan(...))``): 'small' | 'dense' | 'ordered' (rows
    in ``route.order``, computed by ``pattern_order`` when absent); every path is deterministic.
    ``x_zeroed=True`` promises x is already 0 on the inactive (row, group) pairs, which lets 'dense' skip
    its zeroing pass ('ordered' its per-row predicates); the result is the same either way for such an x.
    """
    check_dtype(x, w)
    validate_route(x, w.shape[0], w.shape[1], route, group_size, "k")
    m = x.shape[0]
    path = route_plan(route, m).k
    mask = route_mask(route)
    if mask.dtype != torch.bool or tuple(mask.shape) != (m, route.idx.shape[0]):
        raise ValueError(f"route.mask must be bool [M, N_G], got {mask.dtype} {tuple(mask.shape)}")
    order = route.idx.new_empty(0)
    if path == "ordered":
        order = route.order if route.order is not None else pattern_order(mask)
        if order.dtype != torch.int32 or tuple(order.shape) != (m,):
            raise ValueError(f"route.order must be int32 [M], got {order.dtype} {tuple(order.shape)}")
    return _gemm_k_op(
        x.contiguous(), w.contiguous(), route.idx, route.count, mask.contiguous(), order, group_size, path, x_zeroed
    )
