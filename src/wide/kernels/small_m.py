"""Decode-sized routed GEMMs (M <= SMALL_M): the kernels read the routing mask itself, no reorder.

At decode a routing decision covers a handful of tokens, so the cost is the weight bytes read. A
weight tile is read only when some token of the batch runs its group: at M = 1 and 50% active,
about half of the weight bytes. Masks are [M, N_G] bool (viewed as uint8).

Both kernels split K over S programs per output tile (S from ``split_count``: enough programs to keep
HBM busy when N is small, while the fp32 workspace [S, M, N] stays a few % of the weight bytes) and a
second kernel sums the splits in a fixed order (bit-identical repeats) and finishes the epilogue.

* ``small_gemm_mn`` (Q, gate/up, fused SwiGLU): programs own (BLOCK_N columns inside one group,
  K split); a program whose group no token runs reads nothing (the finishing pass writes its zeros).
* ``small_gemm_k`` (O, down): programs own (n-tile, K split) and stream its K tiles; a K tile may span
  several groups, the weight columns of groups no token runs are predicated off (no branch, so the
  loads stay software-pipelined) and A entries of inactive (row, group) pairs load as 0.
"""

from __future__ import annotations

import torch

from ._triton_utils import HAS_TRITON, largest_pow2_divisor

if HAS_TRITON:
    import triton
    import triton.language as tl

SMALL_BLOCK_M = 16  # tensor-core minimum: rows M..15 are padding


def _cfg(bn, bk, stages, warps=4):
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_stages=stages, num_warps=warps)


def _prune_mn(configs, named_args, **kwargs):
    g = named_args["G"]  # an n-tile lies inside one group
    keep = [c for c in configs if g % c.kwargs["BLOCK_N"] == 0]
    return keep or [_cfg(largest_pow2_divisor(g, 64), 128, 3)]


if HAS_TRITON:

    @triton.jit
    def _small_mn_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        w2_ptr,  # [N, K] (up weight when SWIGLU)
        out_ptr,  # [S, M, N] fp32 (ws), or y [M, N] when not SPLIT_OUT
        out2_ptr,  # [S, M, N] fp32 (up partials when SWIGLU and SPLIT_OUT)
        mask_ptr,  # [M, N_G] uint8
        M,
        N,
        K,
        G,
        NG,
        KPS,  # K per split (a multiple of BLOCK_K, or K)
        stride_xm,
        stride_wn,
        SWIGLU: tl.constexpr,
        ZERO: tl.constexpr,
        SPLIT_OUT: tl.constexpr,
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        n0 = tl.program_id(0) * BLOCK_N
        s = tl.program_id(1)
        g = n0 // G
        offs_m = tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        act = tl.load(mask_ptr + offs_m * NG + g, mask=in_m, other=0) != 0  # [BM]
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if tl.max(act.to(tl.int32), axis=0) > 0:
            offs_k = s * KPS + tl.arange(0, BLOCK_K)
            a_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            b_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
            b2_ptrs = w2_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            k_end = tl.minimum(s * KPS + KPS, K)
            for k0 in range(s * KPS, k_end, BLOCK_K):
                kk = (k0 + tl.arange(0, BLOCK_K)) < k_end
                a = tl.load(a_ptrs, mask=act[:, None] & kk[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=kk[None, :], other=0.0)
                acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
                if SWIGLU:
                    b2 = tl.load(b2_ptrs, mask=kk[None, :], other=0.0)
                    acc2 = tl.dot(a, tl.trans(b2), acc2, input_precision=PREC)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
                b2_ptrs += BLOCK_K
            if SPLIT_OUT:  # raw fp32 partials; the finishing pass applies mask / SwiGLU
                ws = (s * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
                tl.store(out_ptr + ws, acc, mask=in_m[:, None])
                if SWIGLU:
                    tl.store(out2_ptr + ws, acc2, mask=in_m[:, None])
            else:
                if SWIGLU:
                    acc = acc * tl.sigmoid(acc) * acc2
                y_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
                if ZERO:
                    out = tl.where(act[:, None], acc, 0.0)
                    tl.store(y_ptrs, out.to(out_ptr.dtype.element_ty), mask=in_m[:, None])
                else:
                    tl.store(y_ptrs, acc.to(out_ptr.dtype.element_ty), mask=act[:, None])
        elif not SPLIT_OUT and ZERO:
            y_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
            tl.store(y_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty), mask=in_m[:, None])

    _small_mn_tuned = triton.autotune(
        configs=[
            _cfg(16, 256, 4),
            _cfg(16, 512, 3),
            _cfg(32, 256, 4),
            _cfg(32, 128, 5),
            _cfg(64, 128, 4),
        ],
        key=["M", "N", "K", "G", "KPS", "SWIGLU", "ZERO", "SPLIT_OUT"],
        prune_configs_by={"early_config_prune": _prune_mn},
    )(_small_mn_kernel)

    @triton.jit
    def _finish_mn_kernel(
        ws_ptr, ws2_ptr, mask_ptr, y_ptr, M, N, G, NG, S,
        SWIGLU: tl.constexpr, ZERO: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """y[m, n] = sum_s ws[s, m, n] (SwiGLU of the two sums) where (m, n // G) is active."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * N
        keep = tl.load(mask_ptr + (offs // N) * NG + (offs % N) // G, mask=ok, other=0) != 0
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(0, S):  # fixed order: deterministic
            acc += tl.load(ws_ptr + s * M * N + offs, mask=ok & keep, other=0.0)
            if SWIGLU:
                acc2 += tl.load(ws2_ptr + s * M * N + offs, mask=ok & keep, other=0.0)
        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc2
        if ZERO:
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok & keep)

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
        KPS,  # K per split
        stride_xm,
        stride_wn,
        SPLIT_OUT: tl.constexpr,
        PREC: tl.constexpr,
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
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_lo = s * KPS
        k_hi = tl.minimum(k_lo + KPS, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            in_k = offs_k < k_hi
            grp = offs_k // G  # [BK] group of each column
            m2 = tl.load(mask_ptr + offs_m[:, None] * NG + grp[None, :], mask=in_m[:, None] & in_k[None, :], other=0)
            m2 = m2 != 0  # [BM, BK]: (row, column) active
            col = tl.max(m2.to(tl.int32), axis=0) != 0  # [BK]: some token runs the column's group
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m2, other=0.0)
            b = tl.load(
                w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                mask=in_n[:, None] & col[None, :],
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
            _cfg(32, 128, 4),
            _cfg(32, 256, 4),
            _cfg(64, 128, 4),
            _cfg(64, 256, 3),
            _cfg(16, 512, 3),
        ],
        key=["M", "N", "K", "G", "KPS"],
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


def split_count(m: int, n: int, k: int, unit: int) -> int:
    """K splits (a power of two, K/S a multiple of ``unit``): about 1024 programs of 32 output columns,
    while the fp32 workspace traffic (2·S·M·N·4 bytes) stays within ~3% of the weight bytes (N·K·2),
    i.e. 4·S·M <= 0.03·K."""
    s = 1
    while s < 16 and (n // 32) * s < 1024 and 4 * (s * 2) * m <= 0.03 * k and k % (s * 2 * unit) == 0:
        s *= 2
    return s


def small_gemm_mn(
    x: torch.Tensor,
    w: torch.Tensor,
    w2: torch.Tensor | None,
    mask: torch.Tensor,
    g: int,
    zero: bool,
    splits: int | None = None,
) -> torch.Tensor:
    """x: [M, K] (M <= 16), w/w2: [N, K], mask: [M, N_G] bool -> [M, N] (SwiGLU when ``w2`` is given).

    ``splits`` forces the K split count (default ``split_count``)."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    swiglu = w2 is not None
    s = splits or (split_count(m, n, k, 128) if x.is_cuda else (2 if k % 64 == 0 else 1))
    kps = k // s if s > 1 else k
    if s > 1:
        ws = torch.empty(s, m, n, device=x.device, dtype=torch.float32)
        ws2 = torch.empty_like(ws) if swiglu else ws
    else:
        ws = ws2 = y
    mask_u8 = mask.view(torch.uint8)
    args = (x, w, w2 if swiglu else w, ws, ws2, mask_u8, m, n, k, g, n // g, kps, x.stride(0), w.stride(0))
    flags = {"SWIGLU": swiglu, "ZERO": zero, "SPLIT_OUT": s > 1, "PREC": _prec(x), "BLOCK_M": SMALL_BLOCK_M}
    if x.is_cuda:
        _small_mn_tuned[lambda meta: (n // meta["BLOCK_N"], s)](*args, **flags)
    else:  # interpreter: one small config
        bn = largest_pow2_divisor(g, 32)
        _small_mn_kernel[(n // bn, s)](*args, **flags, BLOCK_N=bn, BLOCK_K=32)
    if s > 1:
        block = 1024
        grid = (triton.cdiv(m * n, block),)
        _finish_mn_kernel[grid](ws, ws2, mask_u8, y, m, n, g, n // g, s, SWIGLU=swiglu, ZERO=zero, BLOCK=block)
    return y


def small_gemm_k(
    x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, g: int, splits: int | None = None
) -> torch.Tensor:
    """x: [M, K] (M <= 16), w: [N, K], mask: [M, K // g] bool -> y [M, N] = sum of the active groups."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    unit = min(g, 128)
    s = splits or (split_count(m, n, k, unit) if x.is_cuda else (2 if k % (2 * unit) == 0 else 1))
    kps = k // s if s > 1 else k
    out = torch.empty(s, m, n, device=x.device, dtype=torch.float32) if s > 1 else y
    args = (x, w, out, mask.view(torch.uint8), m, n, k, g, k // g, kps, x.stride(0), w.stride(0))
    flags = {"SPLIT_OUT": s > 1, "PREC": _prec(x), "BLOCK_M": SMALL_BLOCK_M}
    if x.is_cuda:
        _small_k_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), s)](*args, **flags)
    else:
        _small_k_kernel[(triton.cdiv(n, 32), s)](*args, **flags, BLOCK_N=32, BLOCK_K=32)
    if s > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, s, BLOCK=block)
    return y
