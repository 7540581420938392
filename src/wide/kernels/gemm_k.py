"""GEMM-K: K-axis routed projection (O, down): y[m] = sum over active groups g of x[m, g] · w[:, g]^T.

``algo='auto'`` (``choose_algo``):

* M <= SMALL_M_K and G >= 64 (G 32: M = 1): ``small`` (``small_m.small_gemm_k``) — reads the mask,
  skips the weight columns of groups no token runs (M = 1, 50%: half the weight bytes), fixed-order split-K reduction.
* larger M: ``masked_dense`` (``dense_mid``) — zero the inactive K groups of x, then cuBLAS; with
  ``x_zeroed`` (the producer, routed SwiGLU or routed attention, already wrote those zeros) it is a
  plain cuBLAS GEMM. No routing saving: with i.i.d. per-token masks every (m-tile, group) pair of
  rows in their natural order has active rows.
* few groups (O: one per KV head) at large M, when the caller's ``sparsity_hint`` says enough is
  skipped (``ORDERED_WHEN``): ``ordered`` (deterministic) — the rows in one order shared by all groups
  (``reorder.pattern_order``: sorted by the Gray rank of their group pattern), so a tile of 128
  consecutive rows shares its first groups' bits; each program (m-tile, n-tile) streams only the K
  tiles of the groups some of its rows run (zero A rows for the others), with TMA weight loads.

Other opt-in Triton schedules (they lost to cuBLAS on the H200):

* ``stationary`` (deterministic): programs own a
  natural-order (m-tile, n-tile) of y and stream K; each K tile lies in one group, the A rows
  inactive for that group are predicated off and the weight tile is skipped when no row of the
  tile uses the group (``SKIP_W``, autotuned against dense-style loads at M <= 256). Small M splits
  K over extra programs into an fp32 workspace [S, M, N] reduced by a fixed-order sum.
* ``atomic``: one program per (group, sorted m-tile,
  n-tile) over the group's sorted rows (level-0 early exit), partial sums added with relaxed fp32
  atomics into a zeroed fp32 workspace, then cast. Costs p·M·N·N_G atomic adds (1 per 2·G MACs),
  so it only pays for large groups; the summation order is not fixed (not bit-reproducible).
"""

from __future__ import annotations

import torch

from ._triton_utils import (
    HAS_TRITON,
    SMALL_M,
    SMALL_M_K,
    autotune_subset,
    check_dtype,
    check_sparsity_hint,
    largest_pow2_divisor,
    m_bucket,
    mn_dense_thresholds,
    next_pow2,
    tma_supported,
    use_triton,
)
from .dense_mid import masked_dense_gemm_k
from .gemm_mn import validate_route
from .reference import routed_gemm_k_ref
from .reorder import RouteIndex, has_index, pattern_order, route_mask
from .small_m import small_gemm_k

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._triton_utils import grouped_tile

# The atomic schedule measured 0.55x of cuBLAS for O (G 512, M 4096, 50%) on the H200, so 'auto' never
# picks it for now; it stays available as algo='atomic'.
ATOMIC_MIN_GROUP = 1 << 30
ATOMIC_MIN_M = 257
# 'ordered' (a tile of rows in the shared pattern order skips the groups none of them runs): tiles of
# 128 rows share the first ~log2(M / 128) + 1 groups' bits, so it pays for few groups and large M
ORDERED_MAX_GROUPS = 16
# (min M, min expected sparsity) pairs where it beat cuBLAS on the H200, O at G 512 (incl. its row
# order; experiments/ordered-gemm-k-h200.json): M 8192 / 70% 1.42x, M 16384 / 50% 1.24x, 70% 1.72x;
# it lost at 0% (0.78-0.88x) and was within noise at M 4096 / 50% and M 16384 / 25%.
ORDERED_WHEN = ((16384, 0.4), (8192, 0.6))
_STATE = {"tma": False}


def _cfg(bm, bn, bk, stages, warps, tma=False, group_m=8, skip=None):
    kw = {"BLOCK_K": bk, "GROUP_M": group_m}
    if skip is not None:
        kw["SKIP_W"] = skip
    if bm:
        kw.update(BLOCK_M=bm, BLOCK_N=bn)
    if tma is not None:
        kw["USE_TMA"] = tma
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

    @triton.jit(do_not_specialize=["M", "M_BUCKET", "K_PER_SPLIT"])
    def _gemm_k_stationary_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        mask_ptr,  # [M, N_G] uint8
        out_ptr,  # [M, N] (out dtype) or [S, M, N] fp32 when SPLIT_OUT
        M,
        N,
        K,
        G,
        NG,
        stride_xm,
        stride_wn,
        K_PER_SPLIT,
        M_BUCKET,
        SPLIT_OUT: tl.constexpr,
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        SKIP_W: tl.constexpr,
    ):
        pid = tl.program_id(0)
        s = tl.program_id(1)
        pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        in_m = offs_m < M
        in_n = offs_n < N
        k_lo = s * K_PER_SPLIT
        k_hi = min(K, k_lo + K_PER_SPLIT)
        a_base = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        b_base = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            g = k0 // G  # BLOCK_K divides G: the tile lies in one group
            act = tl.load(mask_ptr + offs_m * NG + g, mask=in_m, other=0) != 0  # [BLOCK_M]
            if SKIP_W:  # weight tile read only if used (load depends on the mask load)
                used = tl.max(act.to(tl.int32), axis=0)
                b_ok = in_n & ((tl.zeros([BLOCK_N], dtype=tl.int32) + used) > 0)
                a = tl.load(a_base + k0, mask=act[:, None], other=0.0)
                b = tl.load(b_base + k0, mask=b_ok[:, None], other=0.0)
            else:  # dense-style pipelined loads, inactive A rows zeroed in registers
                a = tl.load(a_base + k0, mask=in_m[:, None], other=0.0)
                a = tl.where(act[:, None], a, 0.0)
                b = tl.load(b_base + k0, mask=in_n[:, None], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
        if SPLIT_OUT:
            o = out_ptr + s.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(o, acc, mask=in_m[:, None] & in_n[None, :])
        else:
            o = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])

    @triton.jit(do_not_specialize=["M", "M_BUCKET"])
    def _gemm_k_atomic_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        idx_ptr,  # [N_G, M] int32
        count_ptr,  # [N_G] int32
        ws_ptr,  # [M, N] fp32, zeroed
        M,
        N,
        K,
        G,
        stride_xm,
        stride_wn,
        M_BUCKET,
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        pid = tl.program_id(0)
        g = tl.program_id(1)
        pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        cnt = tl.load(count_ptr + g)
        m0 = pid_m * BLOCK_M
        if m0 < cnt:  # level 0: sorted tile holds active rows
            n0 = pid_n * BLOCK_N
            offs_p = m0 + tl.arange(0, BLOCK_M)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            act = offs_p < cnt
            in_n = offs_n < N
            rows = tl.load(idx_ptr + g * M + offs_p, mask=act, other=0).to(tl.int64)
            k_base = g * G
            a_ptrs = x_ptr + rows[:, None] * stride_xm + (k_base + offs_k)[None, :]
            if USE_TMA:
                wd = tl.make_tensor_descriptor(w_ptr, [N, K], [stride_wn, 1], [BLOCK_N, BLOCK_K])
            else:
                b_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_base + offs_k)[None, :]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kk in range(0, G, BLOCK_K):
                a = tl.load(a_ptrs, mask=act[:, None], other=0.0)
                if USE_TMA:
                    b = wd.load([n0, k_base + kk])
                else:
                    b = tl.load(b_ptrs, mask=in_n[:, None], other=0.0)
                    b_ptrs += BLOCK_K
                acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
                a_ptrs += BLOCK_K
            o = ws_ptr + rows[:, None] * N + offs_n[None, :]
            tl.atomic_add(o, acc, mask=act[:, None] & in_n[None, :], sem="relaxed")

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
    # split / small-M stationary: BLOCK_M, BLOCK_N fixed by the host (workspace shape depends on them)
    _stat_split = triton.autotune(
        configs=[
            _cfg(0, 0, bk, st, 4, tma=None, skip=sk) for sk in (True, False) for bk, st in ((32, 4), (128, 4), (256, 3))
        ],
        key=_KEY,
        prune_configs_by={"early_config_prune": _prune_k},
    )(_gemm_k_stationary_kernel)
    _stat_large = triton.autotune(
        configs=[
            _cfg(128, 128, 64, 4, 8, tma=None, skip=False),
            _cfg(128, 256, 64, 3, 8, tma=None, skip=False),
            _cfg(128, 128, 32, 4, 8, tma=None, skip=False),
            _cfg(128, 256, 32, 4, 8, tma=None, skip=False),
        ],
        key=_KEY,
        prune_configs_by={"early_config_prune": _prune_k},
    )(_gemm_k_stationary_kernel)
    _atomic = triton.autotune(
        configs=[
            _cfg(128, 128, 64, 4, 8),
            _cfg(128, 256, 64, 3, 8),
            _cfg(128, 128, 64, 4, 8, tma=True),
            _cfg(128, 256, 64, 3, 8, tma=True),
        ],
        key=_KEY,
        reset_to_zero=["ws_ptr"],
        prune_configs_by={"early_config_prune": _prune_k},
    )(_gemm_k_atomic_kernel)

    # H200 (experiments/ordered-gemm-k-h200.json): 128 x 256 tiles with TMA weight loads were the fastest
    # at every M and sparsity; do_bench's warm-L2 timing picked the pointer-load twin instead, so the
    # TMA configs are the only candidates where TMA works.
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


def sparsity_bucket(hint: float | None, group_size: int | None = None) -> float:
    """``hint`` reduced to what the schedule choices read of it: the largest threshold it reaches among
    ORDERED_WHEN's sparsities (``choose_algo``) and, given the group size, the GEMM-MN dense/sorted
    thresholds (``mn_dense_below`` at any M), else 0. Callers that specialise code on the hint, like the runtime's
    compiled layer step, then share one variant across layers that choose alike."""
    if hint is None:
        return 0.0
    thresholds = [s for _, s in ORDERED_WHEN] + (list(mn_dense_thresholds(group_size)) if group_size else [])
    return max((s for s in thresholds if hint >= s), default=0.0)


def choose_algo(
    m: int, group_size: int, deterministic: bool, n_groups: int | None = None, sparsity_hint: float | None = None
) -> str:
    """Host-side schedule choice from shapes and the expected sparsity, never from the mask: 'small'
    at M <= SMALL_M_K for groups of >= 64 columns; 'ordered' for few groups (<= ORDERED_MAX_GROUPS)
    where M and the skipped fraction the caller expects (``sparsity_hint``: the routers' sparsity,
    e.g. measured on calibration data) reach one of ORDERED_WHEN; else 'masked_dense'.

    Measured on the H200 (Triton 3.6) the other Triton large-M schedules lost to cuBLAS (stationary
    0.09-0.43x, atomic 0.55x at O / M 4096 / 50%); they stay available through ``algo``. 'ordered' runs
    the dense work at ~0.8x of cuBLAS (O, 0%), so without the hint it is not chosen.
    """
    # G 32 (32-column weight tiles): only at M = 1, where the active-group loop ran at 1.16x of cuBLAS
    # (decode-variants-down32-h200.json); with more tokens the union of their groups leaves little to skip
    if m <= SMALL_M_K and (group_size >= 64 or m == 1):
        return "small"
    few_groups = n_groups is not None and n_groups <= ORDERED_MAX_GROUPS
    if few_groups and any(m >= m_min and (sparsity_hint or 0.0) >= s_min for m_min, s_min in ORDERED_WHEN):
        return "ordered"
    if not deterministic and m >= ATOMIC_MIN_M and group_size >= ATOMIC_MIN_GROUP:
        return "atomic"
    return "masked_dense"


def _split_plan(m: int, n: int, k: int, g: int, n_sms: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, S) for the split stationary schedule at M <= 256."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn = 32 if m <= 16 else 64
    ctas = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    s = 1
    while s < 8 and ctas * s * 2 <= 2 * n_sms and k // (s * 2) >= 256:
        s *= 2
    return bm, bn, s


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


def _launch_k(x, w, idx, count, mask, order, g: int, algo: str, x_zeroed: bool) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    ng = k // g
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    mb = m_bucket(m)
    mask_u8 = mask.view(torch.uint8)
    if algo == "ordered":
        return _launch_ordered(x, w, mask_u8, order, y, g, x_zeroed, prec)
    if not x.is_cuda:  # interpreter: fixed small configs
        bk = largest_pow2_divisor(g, 32)
        if algo == "atomic":
            ws = torch.zeros(m, n, device=x.device, dtype=torch.float32)
            grid = (triton.cdiv(m, 16) * triton.cdiv(n, 32), ng)
            _gemm_k_atomic_kernel[grid](
                x, w, idx, count, ws, m, n, k, g, x.stride(0), w.stride(0), mb,
                PREC=prec, BLOCK_M=16, BLOCK_N=32, BLOCK_K=bk, GROUP_M=2, USE_TMA=False,
            )  # fmt: skip
            return ws.to(x.dtype)
        s = 2 if k // bk >= 2 else 1
        kps = triton.cdiv(k // bk, s) * bk
        ws = torch.empty(s, m, n, device=x.device, dtype=torch.float32)
        grid = (triton.cdiv(m, 16) * triton.cdiv(n, 32), s)
        _gemm_k_stationary_kernel[grid](
            x, w, mask_u8, ws, m, n, k, g, ng, x.stride(0), w.stride(0), kps, mb,
            SPLIT_OUT=True, PREC=prec, BLOCK_M=16, BLOCK_N=32, BLOCK_K=bk, GROUP_M=2, SKIP_W=m % 2 == 1,
        )  # fmt: skip
        return ws.sum(0).to(x.dtype)

    if algo == "atomic":
        _STATE["tma"] = tma_supported(x.device.index or 0)  # installs the allocator too
        ws = torch.zeros(m, n, device=x.device, dtype=torch.float32)

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), ng)

        _atomic[grid](x, w, idx, count, ws, m, n, k, g, x.stride(0), w.stride(0), mb, PREC=prec)
        return ws.to(x.dtype)
    if m <= 256:
        n_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        bm, bn, s = _split_plan(m, n, k, g, n_sms)
        kps = triton.cdiv(k, s * 256) * 256 if s > 1 else k
        out = torch.empty(s, m, n, device=x.device, dtype=torch.float32) if s > 1 else y
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), s)
        _stat_split[grid](
            x, w, mask_u8, out, m, n, k, g, ng, x.stride(0), w.stride(0), kps, mb,
            SPLIT_OUT=s > 1, PREC=prec, BLOCK_M=bm, BLOCK_N=bn,
        )  # fmt: skip
        return out.sum(0).to(x.dtype) if s > 1 else y

    def grid_l(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), 1)

    _stat_large[grid_l](x, w, mask_u8, y, m, n, k, g, ng, x.stride(0), w.stride(0), k, mb, SPLIT_OUT=False, PREC=prec)
    return y


@torch.library.custom_op("wide::routed_gemm_k", mutates_args=())
def _gemm_k_op(
    x: torch.Tensor,
    w: torch.Tensor,
    idx: torch.Tensor,
    count: torch.Tensor,
    mask: torch.Tensor,
    order: torch.Tensor,
    group_size: int,
    algo: str,
    x_zeroed: bool,
) -> torch.Tensor:
    if algo == "masked_dense":
        return masked_dense_gemm_k(x, w, mask, group_size, x_zeroed)
    if use_triton(x):
        if algo == "small":
            return small_gemm_k(x, w, mask, group_size)
        return _launch_k(x, w, idx, count, mask, order, group_size, algo, x_zeroed)
    e = idx.new_empty((0, idx.shape[0]))
    return routed_gemm_k_ref(x, w, RouteIndex(idx, count, e, e, mask), group_size)


@_gemm_k_op.register_fake
def _(x, w, idx, count, mask, order, group_size, algo, x_zeroed):
    return x.new_empty((x.shape[0], w.shape[0]))


ALGOS = ("auto", "small", "masked_dense", "ordered", "stationary", "atomic")


def routed_gemm_k(
    x: torch.Tensor,
    w: torch.Tensor,
    route: RouteIndex,
    group_size: int,
    *,
    deterministic: bool = False,
    algo: str = "auto",
    x_zeroed: bool = False,
    sparsity_hint: float | None = None,
) -> torch.Tensor:
    """K-axis routed projection. x: [M, K], w: [N, K] -> y: [M, N] (fp32 accumulation).

    ``algo``: 'auto' (``choose_algo``) | 'small' (M <= SMALL_M) | 'masked_dense' | 'ordered'
    (Triton, deterministic; rows in ``route.order``, computed by ``pattern_order`` when absent) |
    'stationary' (Triton, deterministic) | 'atomic' (Triton, fp32 atomics, not bit-reproducible).
    ``deterministic=True`` rejects 'atomic' and gives bit-identical repeats. ``x_zeroed=True``
    promises x is already 0 on the inactive (row, group) pairs, which lets 'masked_dense' skip its
    zeroing pass ('ordered' its per-row predicates); the result is the same either way for such an x.
    ``sparsity_hint``: the fraction of groups the caller expects skipped (the routers' measured or
    target sparsity); only 'auto' reads it.
    """
    check_dtype(x, w)
    validate_route(x, w.shape[0], w.shape[1], route, group_size, "k")
    if algo not in ALGOS:
        raise ValueError(f"unknown algo {algo!r}; choose from {ALGOS}")
    check_sparsity_hint(sparsity_hint)
    m = x.shape[0]
    if algo == "auto" or (deterministic and algo == "atomic"):
        algo = choose_algo(m, group_size, deterministic, w.shape[1] // group_size, sparsity_hint)
    if algo == "small" and m > SMALL_M:
        raise ValueError(f"algo 'small' serves M <= {SMALL_M}, got M={m}")
    if algo in ("stationary", "atomic") and not has_index(route):
        raise ValueError(f"algo {algo!r} needs the reorder index: pass reorder(mask), not plan_route(mask)")
    mask = route_mask(route)
    if mask.dtype != torch.bool or tuple(mask.shape) != (m, route.idx.shape[0]):
        raise ValueError(f"route.mask must be bool [M, N_G], got {mask.dtype} {tuple(mask.shape)}")
    order = route.idx.new_empty(0)
    if algo == "ordered":
        order = route.order if route.order is not None else pattern_order(mask)
        if order.dtype != torch.int32 or tuple(order.shape) != (m,):
            raise ValueError(f"route.order must be int32 [M], got {order.dtype} {tuple(order.shape)}")
    return _gemm_k_op(
        x.contiguous(), w.contiguous(), route.idx, route.count, mask.contiguous(), order, group_size, algo, x_zeroed
    )
