"""Routed flash attention (WIDE §3.3, appendix B): prefill over reordered query rows, split-KV decode.

Routing: one decision per KV-head group (GQA-aligned), True = execute. A skipped (b, t, g) writes 0
for the Hq/Hk query heads of group g; K/V stay dense (the KV cache stays complete).

Prefill: one program = one sorted query tile of one (b, g). The Hq/Hk heads of the group are stacked
as rows (row r -> token slot r // HPG, head r % HPG) so every K/V tile is loaded once for the whole
group. Tiles whose first slot is past the active count only write zeros for their (inactive) rows,
so no separate zero-fill runs. Tiles are launched from the last (heaviest under causality) first.

Decode: split-KV flash-decoding, one program per (b, g, split); an inactive (b, g) reads no KV. A
small reduce kernel combines the splits by log-sum-exp (skipped when there is one split): it spreads the
NS x HPG partials over B*Hq programs, where merging inside the split kernel (the last split of a group
merges) reads them in one program after its own split (slower: docs/kernels.md#split-k-at-decode).

Dispatch (``_triton_utils.use_triton``, shared with the GEMMs): Triton on CUDA; on CPU Triton's
interpreter when TRITON_INTERPRET=1 at import, else the torch reference. Both ops are `torch.library`
ops (`wide::attn_prefill`, `wide::attn_decode`), free of host syncs, so they run under torch.compile and
CUDA-graph capture.
"""

from __future__ import annotations

import math

import torch

from wide.kernels._triton_utils import HAS_TRITON, next_pow2, use_triton
from wide.kernels.attention.reference import (
    attention_decode_ref,
    attention_decode_sdpa,
    attention_prefill_ref,
    attention_prefill_sdpa,
)
from wide.kernels.route.reorder import RouteIndex, has_index, reorder, reorder_reference

if HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels.attention.split_kv import softmax_step, split_kv_softmax

_HEAD_DIMS = (16, 32, 64, 128, 256)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634

__all__ = [
    "routed_attention_prefill",
    "routed_attention_decode",
    "attention_prefill_ref",
    "attention_decode_ref",
    "decode_num_splits",
]

DECODE_WAVES = 3  # decode programs per SM the split count aims for (default of ``decode_num_splits``)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _prefill_kernel(
        Q, K, V, O, IDX, COUNT, BSTART, BCOUNT,
        qk_scale, Tq, Tk,
        s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_ob, s_ot, s_oh, s_ig,
        HK: tl.constexpr, HPG: tl.constexpr, HEAD_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TPT: tl.constexpr,
        CAUSAL: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        qk_scale = tl.cast(qk_scale, tl.float32)  # inductor may hand scalars over as fp64
        bg = tl.program_id(0)  # b * HK + g
        tile = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest (last) tiles first
        b = bg // HK
        g = bg % HK
        b64 = b.to(tl.int64)  # batch offsets can pass 2**31 elements
        cnt = tl.load(BCOUNT + bg)  # active rows of (b, g)
        start = tl.load(BSTART + bg)  # where they start in IDX[g]
        cnt_g = tl.load(COUNT + g)  # active rows of g over the batch
        r = tl.arange(0, BLOCK_M)
        slot = tile * TPT + r // HPG  # [BM] row slot inside (b, g): actives first, then inactives
        head = g * HPG + r % HPG  # [BM] query head
        in_tile = (r < TPT * HPG) & (slot < Tq)
        active = in_tile & (slot < cnt)
        # inactive rows of batch b sit contiguously after all active rows (ascending flat ids)
        pos = tl.where(slot < cnt, start + slot, cnt_g + b * Tq - start + (slot - cnt))
        row = tl.load(IDX + g * s_ig + pos, mask=in_tile, other=0)  # flat id b*Tq + t
        t = row - b * Tq  # [BM] original query index
        offs_d = tl.arange(0, HEAD_D)
        o_ptrs = O + b64 * s_ob + t[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :]
        if tile * TPT >= cnt:  # level-0 skip: no active row, zeros only
            tl.store(o_ptrs, tl.zeros([BLOCK_M, HEAD_D], O.dtype.element_ty), mask=in_tile[:, None])
            return
        q_ptrs = Q + b64 * s_qb + t[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=active[:, None], other=0.0)  # [BM, D] gathered rows
        off = Tk - Tq  # bottom-right causal alignment
        if CAUSAL:
            t_max = tl.max(tl.where(active, t, -1), 0)
            t_min = tl.min(tl.where(active, t, Tq), 0)
            hi = tl.minimum(t_max + off + 1, Tk)  # rows ascending: last row bounds the tile
            full_end = (t_min + off + 1) // BLOCK_N * BLOCK_N  # keys visible to every row
            lim = tl.where(active, t + off, Tk - 1)  # last visible key per row
        else:
            hi = Tk
            full_end = Tk // BLOCK_N * BLOCK_N
            lim = tl.zeros([BLOCK_M], tl.int32) + (Tk - 1)
        offs_n = tl.arange(0, BLOCK_N)
        k_base = K + b64 * s_kb + g * s_kh + offs_d[None, :]
        v_base = V + b64 * s_vb + g * s_vh + offs_d[None, :]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
        for n0 in range(0, full_end, BLOCK_N):  # fully visible tiles: no predicates
            kn = n0 + offs_n
            k = tl.load(k_base + kn[:, None] * s_kt)
            v = tl.load(v_base + kn[:, None] * s_vt)
            acc, l_i, m_i = softmax_step(q, k, v, acc, l_i, m_i, qk_scale, None, False, PREC)
        for n0 in range(full_end, hi, BLOCK_N):  # boundary tiles: causal / length predicates
            kn = n0 + offs_n
            kin = (kn < Tk)[:, None]
            k = tl.load(k_base + kn[:, None] * s_kt, mask=kin, other=0.0)
            v = tl.load(v_base + kn[:, None] * s_vt, mask=kin, other=0.0)
            valid = kn[None, :] <= lim[:, None]
            acc, l_i, m_i = softmax_step(q, k, v, acc, l_i, m_i, qk_scale, valid, True, PREC)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out = tl.where(active[:, None], out, 0.0)
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=in_tile[:, None])

    @triton.jit
    def _decode_split_kernel(
        Q, K, V, LENS, MASK, O, OP, LSE,
        qk_scale,
        s_qb, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ob, s_oh,
        HK: tl.constexpr, HPG: tl.constexpr, HPG_P: tl.constexpr, HEAD_D: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        qk_scale = tl.cast(qk_scale, tl.float32)
        bg = tl.program_id(0)  # b * HK + g
        split = tl.program_id(1)
        b = bg // HK
        g = bg % HK
        b64 = b.to(tl.int64)
        act = tl.load(MASK + bg).to(tl.int32)  # bool mask (*i1)
        h = tl.arange(0, HPG_P)
        hmask = h < HPG
        head = g * HPG + h  # [HPG_P]
        offs_d = tl.arange(0, HEAD_D)
        if NUM_SPLITS == 1:
            o_ptrs = O + b64 * s_ob + head[:, None] * s_oh + offs_d[None, :]
            if act == 0:  # skipped group: write zeros, read no KV
                tl.store(o_ptrs, tl.zeros([HPG_P, HEAD_D], O.dtype.element_ty), mask=hmask[:, None])
                return
        elif act == 0:  # the reduce kernel writes the zeros
            return
        n_len = tl.load(LENS + b)
        chunk = tl.cdiv(tl.cdiv(n_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n_len)
        q = tl.load(Q + b64 * s_qb + head[:, None] * s_qh + offs_d[None, :], mask=hmask[:, None], other=0.0)
        k_base = K + b64 * s_kb + g * s_kh + offs_d[None, :]
        v_base = V + b64 * s_vb + g * s_vh + offs_d[None, :]
        out, lse = split_kv_softmax(q, k_base, v_base, s_ks, s_vs, lo, hi, qk_scale, HPG_P, HEAD_D, BLOCK_N, PREC)
        if NUM_SPLITS == 1:
            tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=hmask[:, None])
        else:
            row = (b * HK * HPG + head) * NUM_SPLITS + split  # OP [B, Hq, NS, D], LSE [B, Hq, NS]
            tl.store(OP + row[:, None] * HEAD_D + offs_d[None, :], out, mask=hmask[:, None])
            tl.store(LSE + row, lse, mask=hmask)

    @triton.jit
    def _decode_reduce_kernel(
        OP, LSE, MASK, O, s_ob, s_oh,
        HQ: tl.constexpr, HPG: tl.constexpr, HEAD_D: tl.constexpr,
        NUM_SPLITS: tl.constexpr, NS_P: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0)  # b * HQ + h
        b = bh // HQ
        h = bh % HQ
        b64 = b.to(tl.int64)
        offs_d = tl.arange(0, HEAD_D)
        o_ptrs = O + b64 * s_ob + h * s_oh + offs_d
        act = tl.load(MASK + b * (HQ // HPG) + h // HPG).to(tl.int32)
        if act == 0:
            tl.store(o_ptrs, tl.zeros([HEAD_D], O.dtype.element_ty))
            return
        s = tl.arange(0, NS_P)
        smask = s < NUM_SPLITS
        lse = tl.load(LSE + bh * NUM_SPLITS + s, mask=smask, other=float("-inf"))  # [NS_P]
        m = tl.max(lse, 0)
        w = tl.where(lse > float("-inf"), tl.math.exp2(lse - m), 0.0)  # [NS_P]
        w = w / tl.where(tl.sum(w, 0) > 0, tl.sum(w, 0), 1.0)
        part = tl.load(OP + (bh * NUM_SPLITS + s)[:, None] * HEAD_D + offs_d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(part * w[:, None], 0)  # [D]
        tl.store(o_ptrs, out.to(O.dtype.element_ty))


# --------------------------------------------------------------------------------------------------
# Validation and launch configuration
# --------------------------------------------------------------------------------------------------
def _check_common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hq: int, hk: int, d: int) -> None:
    if q.dtype not in _DTYPES:
        raise ValueError(f"routed attention supports fp16/bf16/fp32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hk})")
    if d not in _HEAD_DIMS:
        raise ValueError(f"head dim {d} not supported; use one of {_HEAD_DIMS}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on one device")


def _check_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"expected q [B,Tq,Hq,d], k/v [B,Tk,Hk,d]; got {tuple(q.shape)}, {tuple(k.shape)}")
    bsz, tq, hq, d = q.shape
    _check_common(q, k, v, hq, k.shape[2], d)
    if k.shape[0] != bsz or k.shape[3] != d:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)}")
    if tq > k.shape[1]:
        raise ValueError(f"Tq ({tq}) > Tk ({k.shape[1]}) is not supported (queries must be the cache's tail)")
    if tuple(mask.shape) != (bsz, tq, k.shape[2]) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool [B,Tq,Hk] = {(bsz, tq, k.shape[2])}, got {mask.dtype} {tuple(mask.shape)}")


def _check_decode(q, k_cache, v_cache, cache_lens, mask) -> None:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"expected q [B,Hq,d], caches [B,S,Hk,d]; got {tuple(q.shape)}, {tuple(k_cache.shape)}")
    bsz, hq, d = q.shape
    _check_common(q, k_cache, v_cache, hq, k_cache.shape[2], d)
    if k_cache.shape[0] != bsz or k_cache.shape[3] != d:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not match q {tuple(q.shape)}")
    if tuple(cache_lens.shape) != (bsz,) or cache_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cache_lens must be int [B] = ({bsz},), got {cache_lens.dtype} {tuple(cache_lens.shape)}")
    if tuple(mask.shape) != (bsz, k_cache.shape[2]) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool [B,Hk] = {(bsz, k_cache.shape[2])}, got {mask.dtype} {tuple(mask.shape)}")


def _prefill_config(
    hpg: int, d: int, tk: int, interpret: bool, programs_128: int = 1 << 30, config: list[int] | None = None
) -> tuple[int, int, int, int]:
    """(BLOCK_M stacked rows, BLOCK_N, num_warps, num_stages); ``programs_128``: grid size at BLOCK_M 128;
    ``config``: the caller's (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of the defaults."""
    if config is not None:
        bm, bn, w, s = config
    elif interpret:
        bm, bn, w, s = 32, 16, 4, 1
    elif d <= 64:
        bm, bn, w, s = 128, 64, 4, 3
    elif d == 128:  # long keys want BLOCK_N 128, shorter 64; small grids want 64-row tiles (more programs)
        if tk >= 8192:
            bm, bn, w, s = 128, 128, 8, 3
        elif programs_128 <= 2048:
            bm, bn, w, s = 64, 64, 4, 3
        else:
            bm, bn, w, s = 128, 64, 8, 3
    else:
        bm, bn, w, s = 64, 32, 4, 2
    return max(bm, next_pow2(hpg)), bn, w, s


def _decode_config(d: int, interpret: bool, config: list[int] | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages); ``config``: the caller's instead of the defaults."""
    if config is not None:
        bn, w, s = config
        return bn, w, s
    if interpret:
        return 16, 4, 1
    return (128, 8, 3) if d >= 128 else (128, 4, 3)  # tuned on Llama shapes (docs/kernels.md#measuring)


def decode_num_splits(
    batch: int, hk: int, seq: int, device: torch.device | None = None, waves: int = DECODE_WAVES
) -> int:
    """Static split count (shapes only, no host sync): ~``waves`` programs per SM, >= 256 keys each."""
    sms = 132
    if device is not None and device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-waves * sms // max(1, batch * hk))
    return int(max(1, min(want, seq // 256, 64)))


# --------------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------------
def _prefill_impl(q, k, v, idx, count, batch_start, batch_count, sm_scale: float, causal: bool, mask, config):
    bsz, tq, hq, d = q.shape
    tk, hk = k.shape[1], k.shape[2]
    hpg = hq // hk
    o = torch.empty_like(q)
    programs_128 = bsz * hk * triton.cdiv(tq * hpg, 128)
    bm, bn, nw, ns = _prefill_config(hpg, d, tk, not q.is_cuda, programs_128, config)
    tpt = bm // hpg  # token slots per tile
    grid = (bsz * hk, triton.cdiv(tq, tpt))
    prec = "ieee" if q.dtype == torch.float32 else None
    _prefill_kernel[grid](
        q, k, v, o, idx, count, batch_start, batch_count,
        sm_scale * _LOG2E, tq, tk,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), idx.stride(0),
        HK=hk, HPG=hpg, HEAD_D=d, BLOCK_M=bm, BLOCK_N=bn, TPT=tpt, CAUSAL=causal, PREC=prec,
        num_warps=nw, num_stages=ns,
    )  # fmt: skip
    return o


def _decode_impl(q, k_cache, v_cache, cache_lens, mask, sm_scale: float, num_splits: int, config):
    bsz, hq, d = q.shape
    hk = k_cache.shape[2]
    hpg = hq // hk
    o = torch.empty_like(q)
    bn, nw, ns = _decode_config(d, not q.is_cuda, config)
    prec = "ieee" if q.dtype == torch.float32 else None
    if num_splits > 1:
        op = torch.empty((bsz, hq, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((bsz, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        op = lse = o  # unused
    _decode_split_kernel[(bsz * hk, num_splits)](
        q, k_cache, v_cache, cache_lens, mask, o, op, lse,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), o.stride(0), o.stride(1),
        HK=hk, HPG=hpg, HPG_P=max(16, next_pow2(hpg)), HEAD_D=d,
        BLOCK_N=bn, NUM_SPLITS=num_splits, PREC=prec, num_warps=nw, num_stages=ns,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(bsz * hq,)](
            op, lse, mask, o, o.stride(0), o.stride(1),
            HQ=hq, HPG=hpg, HEAD_D=d, NUM_SPLITS=num_splits, NS_P=next_pow2(num_splits), num_warps=4,
        )  # fmt: skip
    return o


def _define_ops():
    def attn_prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        idx: torch.Tensor,
        count: torch.Tensor,
        batch_start: torch.Tensor,
        batch_count: torch.Tensor,
        sm_scale: float,
        causal: bool,
        config: list[int] | None,
    ) -> torch.Tensor:
        if use_triton(q):
            return _prefill_impl(q, k, v, idx, count, batch_start, batch_count, sm_scale, causal, mask, config)
        return attention_prefill_sdpa(q, k, v, mask, sm_scale, causal)

    def attn_decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_lens: torch.Tensor,
        mask: torch.Tensor,
        sm_scale: float,
        num_splits: int,
        config: list[int] | None,
    ) -> torch.Tensor:
        if use_triton(q):  # bool mask: no dtype view (inductor)
            return _decode_impl(q, k_cache, v_cache, cache_lens, mask, sm_scale, num_splits, config)
        return attention_decode_sdpa(q, k_cache, v_cache, cache_lens, mask, sm_scale)

    # every wide op is an opaque custom op with a fake impl (docs/kernels.md#ops)
    prefill = torch.library.custom_op("wide::attn_prefill", attn_prefill, mutates_args=())
    decode = torch.library.custom_op("wide::attn_decode", attn_decode, mutates_args=())
    prefill.register_fake(lambda q, *a, **kw: torch.empty_like(q))
    decode.register_fake(lambda q, *a, **kw: torch.empty_like(q))
    return prefill, decode


_attn_prefill_op, _attn_decode_op = _define_ops()


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------
def _scale(d: int, sm_scale: float | None) -> float:
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if not scale > 0:
        raise ValueError(f"sm_scale must be > 0, got {scale}")
    return scale


def _compute_route(mask: torch.Tensor) -> RouteIndex:
    return reorder(mask) if mask.is_cuda else reorder_reference(mask)


def routed_attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    route: RouteIndex | None = None,
    sm_scale: float | None = None,
    causal: bool = True,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Routed causal/full attention for prefill.

    q [B,Tq,Hq,d], k/v [B,Tk,Hk,d], mask [B,Tq,Hk] bool (True = execute) -> o [B,Tq,Hq,d];
    skipped (b, t, g) rows are 0. Causal is bottom-right aligned (query t at Tk - Tq + t).
    `route`: the decision's route (`plan_route(mask, plan)`, shared with the Q/O projections); its index
    is used where its plan reordered (`route.plan.reorder`), else the kernel's index is computed here
    (also for `route=None`; a plan-less `reorder(mask)` route is used as it is). ``config``: a launch
    configuration (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of the defaults (benchmark sweeps).
    """
    _check_prefill(q, k, v, mask)
    indexed = route is not None and (route.plan.reorder if route.plan is not None else has_index(route))
    if not indexed:
        route = _compute_route(mask)
    scale = _scale(q.shape[-1], sm_scale)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    idx, count, bstart, bcount = (x.to(torch.int32).contiguous() for x in tuple(route)[:4])
    cfg = None if config is None else [int(c) for c in config]
    return _attn_prefill_op(q, k, v, mask, idx, count, bstart, bcount, scale, bool(causal), cfg)


def routed_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    mask: torch.Tensor,
    *,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Routed single-token decode (split-KV flash-decoding).

    q [B,Hq,d], k_cache/v_cache [B,S,Hk,d], cache_lens [B] int (attend to positions < len),
    mask [B,Hk] bool (True = execute) -> o [B,Hq,d]; skipped groups are 0 and read no KV.
    ``num_splits``: default ``decode_num_splits``; ``config``: a launch configuration (BLOCK_N, num_warps,
    num_stages) instead of the defaults (benchmark sweeps).
    """
    _check_decode(q, k_cache, v_cache, cache_lens, mask)
    bsz, s_max, hk = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    if num_splits is None:
        num_splits = decode_num_splits(bsz, hk, s_max, q.device)
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
    scale = _scale(q.shape[-1], sm_scale)
    q, k_cache, v_cache = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_cache, v_cache))
    lens = cache_lens.to(torch.int32).contiguous()
    cfg = None if config is None else [int(c) for c in config]
    return _attn_decode_op(q, k_cache, v_cache, lens, mask.contiguous(), scale, int(num_splits), cfg)
