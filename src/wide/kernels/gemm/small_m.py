"""Decode-sized routed GEMMs (M <= SMALL_M): the kernels read the routing mask itself, no reorder.

At decode a routing decision covers a handful of tokens, so the cost is the weight bytes read. A
weight tile is read only when some token of the batch runs its group: at M = 1 and 50% active,
about half of the weight bytes. Masks are [M, N_G] bool (viewed as uint8).

* ``small_gemm_mn`` (Q, gate/up, fused SwiGLU): programs own (K split, BLOCK_N output columns inside
  one group); a program whose group no token runs writes its zero tile (or nothing) and exits.
* ``small_gemm_k`` (O, down): programs own (split of the K groups, n-tile); a program first compacts
  the split's groups that some token runs into a short list, then loops over their K tiles only (one
  flat loop, so the weight loads stay software-pipelined); A rows inactive for a group load as 0.
  (Looping over every group with predicated-off loads for unused ones is slower:
  docs/kernels.md#decode-gemm-k-loop-over-the-active-groups-only.)

Both split K when one split per output tile would leave HBM idle (Q: 4,096 columns, half of them
skipped, is 64 programs of 32 columns). The splits are reduced inside the kernel by the last program
of each tile, in split order (``_split_reduce``): one launch, bit-identical repeats. The autotuner
picks the split count with the tile shape. On sm_90+ both launch with programmatic dependent launch
(``_triton_utils.pdl_launch``): scheduled as soon as the previous kernel's programs exit, they wait for
its writes as their first statement (docs/kernels.md#pdl).
"""

from __future__ import annotations

import torch

from .._split_reduce import tile_counters
from .._triton_utils import HAS_TRITON, autotune_subset, largest_pow2_divisor, next_pow2, pdl_launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .._split_reduce import arrive, sum_partials
    from .._triton_utils import pdl_begin

SMALL_BLOCK_M = 16  # tensor-core minimum: rows M..15 are padding


def _mn_cfg(bn, bk, stages, warps=4, splits=1):
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLITS": splits}, num_stages=stages, num_warps=warps)


def _prune_mn(configs, named_args, **kwargs):
    """BLOCK_N inside one group; a K split at least one BLOCK_K deep."""
    g, k = named_args["G"], named_args["K"]
    keep = [
        c
        for c in configs
        if g % c.kwargs["BLOCK_N"] == 0 and (c.kwargs["SPLITS"] == 1 or k >= c.kwargs["SPLITS"] * c.kwargs["BLOCK_K"])
    ]
    return autotune_subset(keep) or [_mn_cfg(largest_pow2_divisor(g, 64), 128, 3)]


def _prune_k(configs, named_args, **kwargs):
    """BLOCK_K inside one group; no more splits than groups."""
    g, ng = named_args["G"], named_args["NG"]
    keep = [c for c in configs if g % c.kwargs["BLOCK_K"] == 0 and c.kwargs["SPLITS"] <= ng]
    return autotune_subset(keep) or [_mn_cfg(32, largest_pow2_divisor(g, 128), 3)]


if HAS_TRITON:

    @triton.jit
    def _mn_epilogue(acc, acc2, y_ptr, mask_ptr, offs_m, offs_n, M, NG, g, stride_ym, SWIGLU, ZERO):
        """acc (, acc2): [R, BLOCK_N] fp32 for rows offs_m -> y (silu(acc)·acc2 when SWIGLU)."""
        in_m = offs_m < M
        act = tl.load(mask_ptr + offs_m * NG + g, mask=in_m, other=0) != 0
        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc2
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        if ZERO:
            tl.store(y_ptrs, tl.where(act[:, None], acc, 0.0).to(y_ptr.dtype.element_ty), mask=in_m[:, None])
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=act[:, None])

    @triton.jit
    def _small_mn_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        w2_ptr,  # [N, K] (up weight when SWIGLU)
        y_ptr,  # [M, N]
        mask_ptr,  # [M, N_G] uint8
        ws_ptr,  # fp32 partials [N // BLOCK_N, SPLITS, 1 + SWIGLU, M, BLOCK_N] when SPLITS > 1
        cnt_ptr,  # int32 [N // BLOCK_N] tile counters (zero on entry and exit)
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
        SPLITS: tl.constexpr,
        BLOCK_MR: tl.constexpr,  # next_pow2(M): rows of the split reduction
        PDL: tl.constexpr,  # launched with programmatic dependent launch
    ):
        pdl_begin(PDL)
        s = tl.program_id(0)  # K split (fastest: the splits of a tile stream its weight rows together)
        pid_n = tl.program_id(1)
        n0 = pid_n * BLOCK_N
        g = n0 // G
        offs_m = tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        act = tl.load(mask_ptr + offs_m * NG + g, mask=in_m, other=0) != 0  # [BM]
        offs_n = n0 + tl.arange(0, BLOCK_N)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        if tl.max(act.to(tl.int32), axis=0) > 0:
            k_per = tl.cdiv(tl.cdiv(K, SPLITS), BLOCK_K) * BLOCK_K
            k_lo = s * k_per
            k_hi = tl.minimum(k_lo + k_per, K)
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = x_ptr + offs_m[:, None] * stride_xm + k_lo + offs_k[None, :]
            b_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k_lo + offs_k[None, :]
            b2_ptrs = w2_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k_lo + offs_k[None, :]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                kk = (k0 + offs_k) < k_hi
                a = tl.load(a_ptrs, mask=act[:, None] & kk[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=kk[None, :], other=0.0)
                acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
                if SWIGLU:
                    b2 = tl.load(b2_ptrs, mask=kk[None, :], other=0.0)
                    acc2 = tl.dot(a, tl.trans(b2), acc2, input_precision=PREC)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
                b2_ptrs += BLOCK_K
            if SPLITS == 1:
                _mn_epilogue(acc, acc2, y_ptr, mask_ptr, offs_m, offs_n, M, NG, g, stride_ym, SWIGLU, ZERO)
            else:  # partials [tile, split, plane, M, BLOCK_N]; the last split of the tile sums them
                plane = M * BLOCK_N
                tile = plane * (2 if SWIGLU else 1)
                part = ws_ptr + (pid_n * SPLITS).to(tl.int64) * tile
                offs_t = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                tl.store(part + s * tile + offs_t, acc, mask=in_m[:, None])
                if SWIGLU:
                    tl.store(part + s * tile + plane + offs_t, acc2, mask=in_m[:, None])
                if arrive(cnt_ptr + pid_n, SPLITS):
                    red = sum_partials(part, tile, M, SPLITS, BLOCK_MR, BLOCK_N)  # [BLOCK_MR, BLOCK_N]
                    red2 = red
                    if SWIGLU:
                        red2 = sum_partials(part + plane, tile, M, SPLITS, BLOCK_MR, BLOCK_N)
                    offs_r = tl.arange(0, BLOCK_MR)
                    _mn_epilogue(red, red2, y_ptr, mask_ptr, offs_r, offs_n, M, NG, g, stride_ym, SWIGLU, ZERO)
        elif ZERO:  # noqa: SIM102 - constexpr test, then a runtime one
            if s == 0:
                zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=y_ptr.dtype.element_ty)
                tl.store(y_ptrs, zero, mask=in_m[:, None])

    _small_mn_tuned = triton.autotune(
        configs=[  # the first one is the WIDE_AUTOTUNE_MAX=1 pick: a split one, so fast test runs cover it
            _mn_cfg(32, 128, 4, splits=4),
            _mn_cfg(64, 128, 4, splits=4),
            _mn_cfg(64, 128, 4, splits=2),
            _mn_cfg(16, 256, 4, splits=1),
            _mn_cfg(32, 256, 4, splits=1),
            _mn_cfg(32, 128, 5, splits=1),
            _mn_cfg(64, 128, 4, splits=1),
            _mn_cfg(32, 128, 4, splits=8),
        ],
        key=["M", "N", "K", "G", "SWIGLU", "ZERO"],
        prune_configs_by={"early_config_prune": _prune_mn},
    )(_small_mn_kernel)

    @triton.jit
    def _small_k_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        y_ptr,  # [M, N]
        mask_ptr,  # [M, N_G] uint8
        ws_ptr,  # fp32 partials [cdiv(N, BLOCK_N), SPLITS, M, BLOCK_N] when SPLITS > 1
        cnt_ptr,  # int32 [cdiv(N, BLOCK_N)] tile counters (zero on entry and exit)
        list_ptr,  # int32 [SPLITS, NG_P] scratch: each split's active groups
        M,
        N,
        K,
        G,
        NG,
        stride_xm,
        stride_wn,
        NG_P: tl.constexpr,  # next_pow2(NG)
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLITS: tl.constexpr,
        BLOCK_MR: tl.constexpr,  # next_pow2(M): rows of the split reduction
        PDL: tl.constexpr,  # launched with programmatic dependent launch
    ):
        pdl_begin(PDL)
        s = tl.program_id(0)  # split of the K groups (fastest: the splits of a tile read whole rows together)
        pid_n = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        gps = tl.cdiv(NG, SPLITS)  # groups per split
        g_lo = s * gps
        n_groups = tl.maximum(tl.minimum(gps, NG - g_lo), 0)
        # The split's groups that some token runs, compacted into list_ptr[s] (every n-tile program of
        # split s writes the same list; a barrier makes it visible to the whole program).
        offs_g = tl.arange(0, NG_P)
        g_in = offs_g < n_groups
        m_tile = tl.load(mask_ptr + offs_m[:, None] * NG + (g_lo + offs_g)[None, :], mask=in_m[:, None] & g_in[None, :])
        used = tl.max(tl.where(in_m[:, None] & g_in[None, :], m_tile, 0).to(tl.int32), axis=0) != 0  # [NG_P]
        slot = tl.cumsum(used.to(tl.int32), axis=0) - 1
        n_act = tl.sum(used.to(tl.int32), axis=0)
        lst = list_ptr + s * NG_P
        tl.store(lst + slot, g_lo + offs_g, mask=used)
        tl.debug_barrier()
        tiles_per_group = G // BLOCK_K
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for t in range(0, n_act * tiles_per_group):  # active groups only: every load carries bytes
            grp = tl.load(lst + t // tiles_per_group)
            row_act = tl.load(mask_ptr + offs_m * NG + grp, mask=in_m, other=0) != 0  # [BM]
            k0 = grp * G + (t % tiles_per_group) * BLOCK_K
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k0 + offs_k[None, :], mask=row_act[:, None], other=0.0)
            b = tl.load(
                w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k0 + offs_k[None, :],
                mask=in_n[:, None],
                other=0.0,
            )
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
        if SPLITS == 1:
            o_ptrs = y_ptr + offs_m[:, None] * N + offs_n[None, :]
            tl.store(o_ptrs, acc.to(y_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])
        else:  # partials [tile, split, M, BLOCK_N]; the last split of the tile sums them
            tile = M * BLOCK_N
            part = ws_ptr + (pid_n * SPLITS).to(tl.int64) * tile
            offs_t = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tl.store(part + s * tile + offs_t, acc, mask=in_m[:, None])
            if arrive(cnt_ptr + pid_n, SPLITS):
                red = sum_partials(part, tile, M, SPLITS, BLOCK_MR, BLOCK_N)  # [BLOCK_MR, BLOCK_N]
                offs_r = tl.arange(0, BLOCK_MR)
                o_ptrs = y_ptr + offs_r[:, None] * N + offs_n[None, :]
                tl.store(o_ptrs, red.to(y_ptr.dtype.element_ty), mask=(offs_r < M)[:, None] & in_n[None, :])

    _small_k_tuned = triton.autotune(
        configs=[  # first: the decode sweep's fastest (docs/kernels.md#split-k-at-decode)
            _mn_cfg(64, 64, 5, splits=8),
            _mn_cfg(64, 64, 5, splits=4),
            _mn_cfg(64, 128, 4, splits=16),
            _mn_cfg(32, 128, 4, splits=16),
            _mn_cfg(32, 128, 4, splits=8),
            _mn_cfg(64, 128, 4, splits=4),
            _mn_cfg(32, 256, 3, splits=4),
            # G 32: 32-column tiles (BLOCK_N divides the group)
            _mn_cfg(64, 32, 8, splits=8),
            _mn_cfg(64, 32, 5, splits=16),
            _mn_cfg(32, 32, 6, splits=8),
        ],
        key=["M", "N", "K", "G"],
        prune_configs_by={"early_config_prune": _prune_k},
    )(_small_k_kernel)


MN_MAX_SPLITS = max(c.kwargs["SPLITS"] for c in _small_mn_tuned.configs) if HAS_TRITON else 1
K_MAX_SPLITS = max(c.kwargs["SPLITS"] for c in _small_k_tuned.configs) if HAS_TRITON else 1


def _prec(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _workspace(x: torch.Tensor, n: int, splits: int, planes: int = 1) -> torch.Tensor:
    """fp32 split partials, [n_tiles, splits, planes, M, BLOCK_N] for any BLOCK_N (uninitialised)."""
    return torch.empty(n * splits * planes * x.shape[0], device=x.device, dtype=torch.float32)


def _check_splits(config: dict | None) -> None:
    if config is not None and (config["SPLITS"] < 1 or config["SPLITS"] & (config["SPLITS"] - 1)):
        raise ValueError(f"SPLITS must be a power of two, got {config['SPLITS']}")


def _interp_config(bn: int, bk: int, splits: int) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLITS": splits, "num_warps": 4}


def small_gemm_mn(
    x: torch.Tensor,
    w: torch.Tensor,
    w2: torch.Tensor | None,
    mask: torch.Tensor,
    g: int,
    zero: bool,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """x: [M, K] (M <= 16), w/w2: [N, K], mask: [M, N_G] bool -> [M, N] (SwiGLU when ``w2`` is given).

    ``config`` (BLOCK_N, BLOCK_K, SPLITS, num_warps, num_stages) bypasses the autotuner (benchmarks).
    """
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    swiglu = w2 is not None
    if config is None and not x.is_cuda:  # interpreter: one small config, two K splits when K allows
        config = _interp_config(largest_pow2_divisor(g, 32), 32, 2 if k >= 64 else 1)
    max_splits = MN_MAX_SPLITS if config is None else config["SPLITS"]
    ws = _workspace(x, n, max_splits, 2 if swiglu else 1)
    cnt = tile_counters(x, n // 16)
    args = (x, w, w2 if swiglu else w, y, mask.view(torch.uint8), ws, cnt, m, n, k, g, n // g)
    args += (x.stride(0), w.stride(0), y.stride(0))
    flags = {"SWIGLU": swiglu, "ZERO": zero, "PREC": _prec(x), "BLOCK_M": SMALL_BLOCK_M, "BLOCK_MR": next_pow2(m)}
    flags |= pdl_launch(x)
    _check_splits(config)
    if config is None:
        _small_mn_tuned[lambda meta: (meta["SPLITS"], n // meta["BLOCK_N"])](*args, **flags)
    else:
        _small_mn_kernel[(config["SPLITS"], n // config["BLOCK_N"])](*args, **flags, **config)
    return y


def small_gemm_k(
    x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, g: int, *, config: dict | None = None
) -> torch.Tensor:
    """x: [M, K] (M <= 16), w: [N, K], mask: [M, K // g] bool -> y [M, N] = sum of the active groups.

    K groups are split over SPLITS programs per output tile, reduced in-kernel in split order.
    ``config`` (BLOCK_N, BLOCK_K, SPLITS, num_warps, num_stages) bypasses the autotuner (benchmarks).
    """
    m, k = x.shape
    n = w.shape[0]
    ng = k // g
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    if config is None and not x.is_cuda:  # interpreter: one small config
        config = _interp_config(32, largest_pow2_divisor(g, 32), 4 if ng >= 4 else (2 if ng >= 2 else 1))
    max_splits = K_MAX_SPLITS if config is None else config["SPLITS"]
    n_pad = triton.cdiv(n, 32) * 64  # tiles of >= 32 columns, each padded to at most 64
    ws = _workspace(x, n_pad, max_splits)
    cnt = tile_counters(x, triton.cdiv(n, 32))
    lists = torch.empty(max_splits * next_pow2(ng), device=x.device, dtype=torch.int32)
    args = (x, w, y, mask.view(torch.uint8), ws, cnt, lists, m, n, k, g, ng, x.stride(0), w.stride(0))
    flags = {"NG_P": next_pow2(ng), "PREC": _prec(x), "BLOCK_M": SMALL_BLOCK_M, "BLOCK_MR": next_pow2(m)}
    flags |= pdl_launch(x)
    _check_splits(config)
    if config is None:
        _small_k_tuned[lambda meta: (meta["SPLITS"], triton.cdiv(n, meta["BLOCK_N"]))](*args, **flags)
    else:
        _small_k_kernel[(config["SPLITS"], triton.cdiv(n, config["BLOCK_N"]))](*args, **flags, **config)
    return y
