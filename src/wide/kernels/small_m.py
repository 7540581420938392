"""Decode-sized routed GEMMs (M <= SMALL_M): the kernels read the routing mask itself, no reorder.

At decode a routing decision covers a handful of tokens, so the cost is the weight bytes read. A
weight tile is read only when some token of the batch runs its group: at M = 1 and 50% active,
about half of the weight bytes. Masks are [M, N_G] bool (viewed as uint8).

* ``small_gemm_mn`` (Q, gate/up, fused SwiGLU): one program per BLOCK_N output columns (inside one
  group); a program whose group no token runs writes its zero tile (or nothing) and exits.
* ``small_gemm_k`` (O, down): programs own (n-tile, split of the K groups); the loop over the split's
  K tiles predicates the weight loads off for groups no token runs (no branch, so the loads stay
  software-pipelined), A rows inactive for the group load as 0. Splits write an fp32 workspace
  [S, M, N] summed in a fixed order by a second kernel (bit-identical repeats).
"""

from __future__ import annotations

import torch

from ._triton_utils import HAS_TRITON, largest_pow2_divisor, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

SMALL_BLOCK_M = 16  # tensor-core minimum: rows M..15 are padding


def _mn_cfg(bn, bk, stages, warps=4):
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_stages=stages, num_warps=warps)


def _prune_mn(configs, named_args, **kwargs):
    g = named_args["G"]
    keep = [c for c in configs if g % c.kwargs["BLOCK_N"] == 0]
    return keep or [_mn_cfg(largest_pow2_divisor(g, 64), 128, 3)]


def _prune_k(configs, named_args, **kwargs):
    g = named_args["G"]
    keep = [c for c in configs if g % c.kwargs["BLOCK_K"] == 0]
    return keep or [_mn_cfg(32, largest_pow2_divisor(g, 128), 3)]


if HAS_TRITON:

    @triton.jit
    def _small_mn_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        w2_ptr,  # [N, K] (up weight when SWIGLU)
        y_ptr,  # [M, N]
        mask_ptr,  # [M, N_G] uint8
        M,
        N,
        K,
        G,
        NG,
        stride_xm,
        stride_wn,
        stride_ym,
        SWIGLU: tl.constexpr,
        ZERO: tl.constexpr,
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        n0 = tl.program_id(0) * BLOCK_N
        g = n0 // G
        offs_m = tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        act = tl.load(mask_ptr + offs_m * NG + g, mask=in_m, other=0) != 0  # [BM]
        offs_n = n0 + tl.arange(0, BLOCK_N)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        if tl.max(act.to(tl.int32), axis=0) > 0:
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            b_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
            b2_ptrs = w2_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = (k0 + offs_k) < K
                a = tl.load(a_ptrs, mask=act[:, None] & kk[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=kk[None, :], other=0.0)
                acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
                if SWIGLU:
                    b2 = tl.load(b2_ptrs, mask=kk[None, :], other=0.0)
                    acc2 = tl.dot(a, tl.trans(b2), acc2, input_precision=PREC)
                a_ptrs += BLOCK_K
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
            tl.store(y_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=y_ptr.dtype.element_ty), mask=in_m[:, None])

    _small_mn_tuned = triton.autotune(
        configs=[
            _mn_cfg(16, 256, 4),
            _mn_cfg(16, 512, 3),
            _mn_cfg(32, 256, 4),
            _mn_cfg(32, 128, 5),
            _mn_cfg(64, 128, 4),
        ],
        key=["M", "N", "K", "G", "SWIGLU", "ZERO"],
        prune_configs_by={"early_config_prune": _prune_mn},
    )(_small_mn_kernel)

    @triton.jit
    def _small_k_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        out_ptr,  # [S, M, N] fp32 when SPLIT_OUT else y [M, N]
        mask_ptr,  # [M, N_G] uint8
        M,
        N,
        K,
        G,
        NG,
        GPS,  # groups per split
        stride_xm,
        stride_wn,
        SPLIT_OUT: tl.constexpr,
        PREC: tl.constexpr,
        GPS_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        s = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        g_lo = s * GPS
        n_groups = tl.minimum(GPS, NG - g_lo)
        # the split's mask block, read once: [BM, GPS_PAD]
        offs_j = tl.arange(0, GPS_PAD)
        mblock = tl.load(
            mask_ptr + offs_m[:, None] * NG + (g_lo + offs_j)[None, :],
            mask=in_m[:, None] & (offs_j < n_groups)[None, :],
            other=0,
        ).to(tl.int32)
        tiles_per_group = G // BLOCK_K
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_base = g_lo * G
        for t in range(0, n_groups * tiles_per_group):
            j = t // tiles_per_group
            row_act = tl.sum(tl.where(offs_j[None, :] == j, mblock, 0), axis=1) != 0  # [BM]
            n_lim = tl.where(tl.max(row_act.to(tl.int32), axis=0) != 0, N, 0)  # N, or 0: no token runs j
            k0 = k_base + t * BLOCK_K
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k0 + offs_k[None, :], mask=row_act[:, None], other=0.0)
            b = tl.load(
                w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k0 + offs_k[None, :],
                mask=(offs_n < n_lim)[:, None],
                other=0.0,
            )
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
        if SPLIT_OUT:
            o_ptrs = out_ptr + (s * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
            tl.store(o_ptrs, acc, mask=in_m[:, None] & in_n[None, :])
        else:
            o_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])

    _small_k_tuned = triton.autotune(
        configs=[
            _mn_cfg(32, 128, 3),
            _mn_cfg(32, 128, 5),
            _mn_cfg(64, 128, 4),
            _mn_cfg(32, 256, 3),
            _mn_cfg(64, 64, 5),
        ],
        key=["M", "N", "K", "G"],
        prune_configs_by={"early_config_prune": _prune_k},
    )(_small_k_kernel)

    @triton.jit
    def _sum_splits_kernel(ws_ptr, y_ptr, MN, S, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(0, S):  # fixed order: deterministic
            acc += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _prec(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def small_gemm_mn(
    x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor | None, mask: torch.Tensor, g: int, zero: bool
) -> torch.Tensor:
    """x: [M, K] (M <= 16), w/w2: [N, K], mask: [M, N_G] bool -> [M, N] (SwiGLU when ``w2`` is given)."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    swiglu = w2 is not None
    args = (x, w, w2 if swiglu else w, y, mask.view(torch.uint8), m, n, k, g, n // g)
    args += (x.stride(0), w.stride(0), y.stride(0))
    flags = {"SWIGLU": swiglu, "ZERO": zero, "PREC": _prec(x), "BLOCK_M": SMALL_BLOCK_M}
    if x.is_cuda:
        _small_mn_tuned[lambda meta: (n // meta["BLOCK_N"],)](*args, **flags)
    else:  # interpreter: one small config
        bn = largest_pow2_divisor(g, 32)
        _small_mn_kernel[(n // bn,)](*args, **flags, BLOCK_N=bn, BLOCK_K=32)
    return y


def split_count(m: int, k: int, ng: int) -> int:
    """K splits for ``small_gemm_k``: enough programs to keep HBM busy, while the fp32 workspace
    traffic (2·S·M·N·4 bytes) stays within ~3% of the weight bytes (N·K·2), i.e. 4·S·M <= 0.03·K."""
    s = 1
    while s * 2 <= min(ng, 16) and 4 * (s * 2) * m <= 0.03 * k:
        s *= 2
    return s


def small_gemm_k(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, g: int) -> torch.Tensor:
    """x: [M, K] (M <= 16), w: [N, K], mask: [M, K // g] bool -> y [M, N] = sum of the active groups."""
    m, k = x.shape
    n = w.shape[0]
    ng = k // g
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    s = split_count(m, k, ng)
    gps = triton.cdiv(ng, s)
    s = triton.cdiv(ng, gps)  # no empty split
    out = torch.empty(s, m, n, device=x.device, dtype=torch.float32) if s > 1 else y
    args = (x, w, out, mask.view(torch.uint8), m, n, k, g, ng, gps, x.stride(0), w.stride(0))
    flags = {"SPLIT_OUT": s > 1, "PREC": _prec(x), "GPS_PAD": next_pow2(gps), "BLOCK_M": SMALL_BLOCK_M}
    if x.is_cuda:

        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_N"]), s)

        _small_k_tuned[grid](*args, **flags)
    else:
        bk = largest_pow2_divisor(g, 32)
        _small_k_kernel[(triton.cdiv(n, 32), s)](*args, **flags, BLOCK_N=32, BLOCK_K=bk)
    if s > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, s, BLOCK=block)
    return y
