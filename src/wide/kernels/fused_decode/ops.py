"""Op registration (``wide::`` custom ops: CUDA-graph safe, no host sync) and the checked public functions of
the fused decode layer; the launch shapes come from ``rules``, the CPU path from ``reference``."""

from __future__ import annotations

import math

import torch

from .._split_reduce import tile_counters
from .._triton_utils import (
    HAS_TRITON,
    check_dtype,
    interpret_mode,
    largest_pow2_divisor,
    next_pow2,
    pdl_launch,
    use_triton,
)
from .reference import (
    ffn_residual_norm_ref,
    o_proj_residual_norm_ref,
    qkv_rope_cache_ref,
    rms_norm_ref,
)
from .rules import (
    BLOCK_M,
    COMPACT_STAGES,
    MAX_BATCH,
    NARROW_DOWN_SPAN,
    _compact,
    _gemv_blocks,
    _k_lists,
    _norm_blocks,
    _ov,
    _prec,
    _sms,
    _stages,
    attn_num_splits,
    attn_programs,
    attn_split_cap,
    down_step,
    ffn_chunk,
    k_splits,
    qkv_row_slices,
)

if HAS_TRITON:
    import triton

    from .kernels import _attn_kernel, _ffn_kernel, _norm_kernel, _o_kernel, _qkv_kernel

_LOG2E = 1.4426950408889634


def _u8(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(1, dtype=torch.uint8) if mask is None else mask.contiguous().view(torch.uint8)


@torch.library.custom_op("wide::fused_rms_norm", mutates_args=())
def _norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not use_triton(x):
        return rms_norm_ref(x, weight, eps)
    h = torch.empty_like(x)
    b, d = x.shape
    _norm_kernel[(1,)](x, weight, h, b, d, eps, **_norm_blocks(b, d, x), num_warps=4, **pdl_launch(x))
    return h


@_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("wide::fused_qkv_rope_cache", mutates_args=("k_cache", "v_cache"))
def _qkv_op(
    h: torch.Tensor,
    w_qkv: torch.Tensor,
    b_qkv: torch.Tensor | None,
    mask: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_q: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    qk_eps: float,
) -> torch.Tensor:
    if not use_triton(h):
        return qkv_rope_cache_ref(h, w_qkv, b_qkv, cos, sin, pos, k_cache, v_cache, n_q, q_norm, k_norm, qk_eps)
    b, d_model = h.shape
    hk, hd = k_cache.shape[2], k_cache.shape[3]
    q = torch.empty(b, n_q, hd, dtype=h.dtype, device=h.device)
    n_heads = n_q + 2 * hk
    rs = qkv_row_slices(hd, q_norm is not None, n_heads, _sms(h))
    if q_norm is None:
        rs = _ov("qkv_slices", rs)
    bk, nw = _gemv_blocks(h)
    bk = min(bk, next_pow2(d_model))
    tiles = n_heads * rs
    ks = _ov("qkv_splits", k_splits(tiles, triton.cdiv(d_model, bk), _sms(h)))
    chunk = triton.cdiv(triton.cdiv(d_model, ks), bk) * bk
    dummy = h.new_empty(1)
    part = torch.empty(ks * tiles * BLOCK_M * hd if ks > 1 else 1, dtype=torch.float32, device=h.device)
    _qkv_kernel[(tiles * ks,)](
        h, w_qkv, b_qkv if b_qkv is not None else dummy, _u8(mask, h), cos.float().contiguous(),
        sin.float().contiguous(), q_norm if q_norm is not None else dummy, k_norm if k_norm is not None else dummy,
        pos, q, k_cache, v_cache, part, tile_counters(h, tiles), b, d_model, chunk, qk_eps,
        *k_cache.stride()[:3], *v_cache.stride()[:3], KS=ks,
        HQ=n_q, HK=hk, HEAD_D=hd, RS=rs, ROUTED=mask is not None, HAS_BIAS=b_qkv is not None,
        QK_NORM=q_norm is not None, BM=BLOCK_M, BLOCK_K=bk, PREC=_prec(h),
        num_warps=nw, **_stages(h), **pdl_launch(h),
    )  # fmt: skip
    return q


@_qkv_op.register_fake
def _(h, w_qkv, b_qkv, mask, cos, sin, pos, k_cache, v_cache, n_q, q_norm, k_norm, qk_eps):
    return h.new_empty((h.shape[0], n_q, k_cache.shape[3]))


@torch.library.custom_op("wide::fused_attn_decode", mutates_args=())
def _attn_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    mask: torch.Tensor | None,
    len_add: int,
    num_splits: int,  # 0: attn_num_splits' rule on the running pairs, read in the kernel
) -> torch.Tensor:
    from wide.kernels.attention.reference import attention_decode_ref

    b, hq, hd = q.shape
    hk = k_cache.shape[2]
    if not use_triton(q):
        run = torch.ones(b, hk, dtype=torch.bool, device=q.device) if mask is None else mask
        return attention_decode_ref(q, k_cache, v_cache, lens + len_add, run)
    hpg_p = max(16, next_pow2(hq // hk))
    o = torch.empty_like(q)
    pairs = b * hk
    fixed = num_splits > 0
    cap = num_splits if fixed else attn_split_cap(k_cache.shape[1])
    if interpret_mode() and not fixed:  # the CPU interpreter runs programs one by one: few splits keep tests short
        cap = min(cap, 2)
    programs = _ov("attn_programs", attn_programs(k_cache.shape[1], _sms(q)))
    ns_p = next_pow2(cap)
    op = torch.empty(max(1, pairs * hpg_p * ns_p * hd if cap > 1 else 1), dtype=torch.float32, device=q.device)
    lse = torch.empty(max(1, pairs * hpg_p * ns_p if cap > 1 else 1), dtype=torch.float32, device=q.device)
    cnt = tile_counters(q, pairs)
    # keys per step: 64 unless a split holds more than ~512 keys (fewer masked lanes in its last step); the
    # count a launch expects: every pair running (dense), half of them (routed)
    running = pairs if mask is None else max(1, pairs // 2)
    expect = cap if fixed else attn_num_splits(running, k_cache.shape[1], programs)
    bn = 128 if k_cache.shape[1] > 512 * expect else 64
    bn, nw, st = (16, 4, 1) if not q.is_cuda else (bn, 8 if hd >= 128 else 4, 3)
    bn, nw = _ov("attn_block_n", bn), _ov("attn_warps", nw)
    # work items: at most `programs` (one split each) once the pairs fill them, at least one per pair
    grid = pairs * cap if fixed else max(pairs, min(programs, pairs * cap))
    _attn_kernel[(grid,)](
        q, k_cache, v_cache, lens, _u8(mask, q), o, op, lse, cnt,
        _LOG2E / math.sqrt(hd), int(len_add), pairs, cap, int(fixed), programs,
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        HQ=hq, HK=hk, HPG_P=hpg_p, HEAD_D=hd, BLOCK_N=bn, NS_P=ns_p, PAIRS_P=next_pow2(pairs), PREC=_prec(q),
        ROUTED=mask is not None, num_warps=nw, num_stages=st, **pdl_launch(q),
    )  # fmt: skip
    return o


@_attn_op.register_fake
def _(q, k_cache, v_cache, lens, mask, len_add, num_splits):
    return torch.empty_like(q)


@torch.library.custom_op("wide::fused_o_proj_residual_norm", mutates_args=())
def _o_op(
    o: torch.Tensor,
    wo: torch.Tensor,
    bo: torch.Tensor | None,
    mask: torch.Tensor | None,
    x: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(o):
        return o_proj_residual_norm_ref(o, wo, bo, x, norm_w, eps)
    b, k = o.shape
    d = wo.shape[0]
    ng = 1 if mask is None else mask.shape[1]
    xo, h = torch.empty_like(x), torch.empty_like(x)
    bk, nw = _gemv_blocks(o)
    g = k // ng
    bk = largest_pow2_divisor(g, bk)
    bn = 16 if not o.is_cuda else _ov("o_block_n", 32)
    tiles = triton.cdiv(d, bn)
    ks = _ov("o_splits", k_splits(tiles, triton.cdiv(k, bk), _sms(o)))
    chunk = triton.cdiv(triton.cdiv(k, ks), bk) * bk  # a multiple of BLOCK_K: no step straddles a group
    ss = torch.empty(tiles * BLOCK_M, dtype=torch.float32, device=o.device)
    part = torch.empty(ks * tiles * BLOCK_M * bn if ks > 1 else 1, dtype=torch.float32, device=o.device)
    compact, ns_p = _compact(mask, triton.cdiv(chunk, bk))
    _o_kernel[(tiles * ks,)](
        o, wo, bo if bo is not None else o.new_empty(1), _u8(mask, o), x, xo, norm_w, h, ss, part,
        tile_counters(o, tiles + 1), _k_lists(o, tiles * ks, ns_p, compact), b, d, k, ng, g, chunk, eps,
        KS=ks, ROUTED=mask is not None, HAS_BIAS=bo is not None, BM=BLOCK_M, BLOCK_N=bn,
        BLOCK_K=bk, T_P=next_pow2(tiles), **_norm_blocks(b, d, o), PREC=_prec(o), COMPACT=compact, NS_P=ns_p,
        num_warps=nw, **_stages(o, COMPACT_STAGES if compact else None), **pdl_launch(o),
    )  # fmt: skip
    return xo, h


@_o_op.register_fake
def _(o, wo, bo, mask, x, norm_w, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("wide::fused_ffn_residual_norm", mutates_args=())
def _ffn_op(
    h: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    mask: torch.Tensor | None,
    x: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    group: int,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(h):
        return ffn_residual_norm_ref(h, w_gate, w_up, w_down, mask, x, norm_w, eps, bias)
    b, d = h.shape
    df = w_gate.shape[0]
    if mask is None:  # every channel runs: the tiling need not follow the routers' group size (a dense baseline)
        group = largest_pow2_divisor(df, 128)
    ng = df // group
    ch = _ov("ffn_chunk", ffn_chunk(group, ng, _sms(h))) if h.is_cuda else 16
    cpg = group // ch
    bk, nw = _gemv_blocks(h)
    bn = 16 if not h.is_cuda else _ov("ffn_block_n", 64)
    tiles = triton.cdiv(d, bn)
    ks = _ov("ffn_splits", k_splits(tiles, ng, _sms(h)))
    bkd, sub = down_step(group, ng, ks, _ov("down_block_k", bk), _ov("down_span", NARROW_DOWN_SPAN))
    compact, ns_p = _compact(mask, triton.cdiv(triton.cdiv(ng, ks) * (group // bkd), sub))
    a = torch.empty(b, df, dtype=h.dtype, device=h.device)
    xo, hn = torch.empty_like(x), torch.empty_like(x)
    ss = torch.empty(tiles * BLOCK_M, dtype=torch.float32, device=h.device)
    part = torch.empty(ks * tiles * BLOCK_M * bn if ks > 1 else 1, dtype=torch.float32, device=h.device)
    _ffn_kernel[(ng * cpg + tiles * ks,)](
        h, w_gate, w_up, w_down, bias if bias is not None else h.new_empty(1), _u8(mask, h), a, x, xo, norm_w, hn,
        ss, part, tile_counters(h, 2 + ks + tiles), _k_lists(h, tiles * ks, ns_p, compact), b, d, df, ng, group, eps,
        KS=ks, CPG=cpg, CH=ch, ROUTED=mask is not None, HAS_BIAS=bias is not None, BM=BLOCK_M,
        BLOCK_K=min(bk, next_pow2(d)), BLOCK_N=bn, BLOCK_KD=bkd, T_P=next_pow2(tiles), **_norm_blocks(b, d, h),
        PREC=_prec(h), COMPACT=compact, NS_P=ns_p, DSTAGES=_ov("down_stages", COMPACT_STAGES if compact else None),
        SUB=sub, num_warps=nw, **_stages(h), **pdl_launch(h),
    )  # fmt: skip
    return xo, hn


@_ffn_op.register_fake
def _(h, w_gate, w_up, w_down, mask, x, norm_w, eps, group, bias):
    return torch.empty_like(x), torch.empty_like(x)


# --------------------------------------------------------------------------------------------------
# Public functions (validation, then the op)
# --------------------------------------------------------------------------------------------------
def _check_batch(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or not 1 <= t.shape[0] <= MAX_BATCH:
        raise ValueError(f"{name} must be [B, D] with 1 <= B <= {MAX_BATCH} (decode), got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Caches [B_max, S, Hk, d] of any layout whose head_dim is contiguous (the kernels take the other strides)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"caches must be [B, S, Hk, d] with contiguous d, got {tuple(k_cache.shape)} "
                         f"strides {k_cache.stride()} / {tuple(v_cache.shape)} strides {v_cache.stride()}")  # fmt: skip


def _check_mask(mask: torch.Tensor | None, b: int, ng: int, name: str) -> None:
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (b, ng)):
        raise ValueError(f"{name} must be a bool [B, N_G] = [{b}, {ng}] mask, got {mask.dtype} {tuple(mask.shape)}")


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, D] -> RMSNorm(x) * weight in x's dtype (one program; decode-sized B)."""
    _check_batch(x, "x")
    check_dtype(x, weight)
    return _norm_op(x, weight, float(eps))


def qkv_rope_cache(
    h: torch.Tensor,
    w_qkv: torch.Tensor,
    b_qkv: torch.Tensor | None,
    mask: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_q: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    qk_eps: float = 0.0,
) -> torch.Tensor:
    """One launch: h [B, D] -> q [B, Hq, d] (RoPE'd; heads of groups no token runs are left unspecified
    when ``mask`` [B, Hk] is given) and the RoPE'd K / V of token b written at cache [b, pos[b]]."""
    _check_batch(h, "h")
    check_dtype(h, w_qkv, k_cache, v_cache)
    hk, hd = k_cache.shape[2], k_cache.shape[3]
    if w_qkv.shape != (n_q * hd + 2 * hk * hd, h.shape[1]) or not w_qkv.is_contiguous():
        raise ValueError(f"w_qkv {tuple(w_qkv.shape)} is not a contiguous [(Hq + 2 Hk) d, D] matrix")
    if hd % 32 or n_q % hk:
        raise ValueError(f"head_dim {hd} must be a multiple of 32 and Hq {n_q} a multiple of Hk {hk}")
    _check_cache(k_cache, v_cache)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together (Qwen3)")
    if cos.shape != (h.shape[0], hd) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be [B, d] = [{h.shape[0]}, {hd}], got {tuple(cos.shape)}")
    _check_mask(mask, h.shape[0], hk, "mask")
    return _qkv_op(h, w_qkv, b_qkv, mask, cos, sin, pos, k_cache, v_cache, int(n_q), q_norm, k_norm, float(qk_eps))


def attention_decode_merged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    len_add: int = 0,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Routed decode attention in one launch: q [B, Hq, d], caches [B_max, S, Hk, d], attend to positions
    < lens[b] + len_add, mask [B, Hk] bool (None: dense, every group runs) -> o [B, Hq, d] (zeros for skipped
    groups). ``num_splits``: KV splits of every running pair (None: ``attn_num_splits``' rule, applied in the
    kernel to the number of pairs the mask runs)."""
    b, hq, hd = q.shape
    if not q.is_contiguous() or b > MAX_BATCH:
        raise ValueError(f"q must be contiguous [B <= {MAX_BATCH}, Hq, d], got {tuple(q.shape)}")
    hk = k_cache.shape[2]
    _check_mask(mask, b, hk, "mask")
    _check_cache(k_cache, v_cache)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits}")
    ns = _ov("attn_splits", num_splits)
    return _attn_op(q, k_cache, v_cache, lens, mask, int(len_add), int(ns or 0))


def o_proj_residual_norm(
    o: torch.Tensor,
    wo: torch.Tensor,
    bo: torch.Tensor | None,
    mask: torch.Tensor | None,
    x: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: (x + o Wo^T (+ bo), its RMSNorm times ``norm_w``); o [B, Hq d] is zero where a
    (token, group) is skipped, and groups of ``mask`` [B, N_G] that no token runs are not read."""
    _check_batch(o, "o")
    _check_batch(x, "x")
    check_dtype(o, wo, x, norm_w)
    if mask is not None and o.shape[1] % mask.shape[1]:
        raise ValueError(f"O's input width {o.shape[1]} is not a multiple of {mask.shape[1]} groups")
    _check_mask(mask, o.shape[0], mask.shape[1] if mask is not None else 0, "mask")
    return _o_op(o, wo, bo, mask, x, norm_w, float(eps))


def ffn_residual_norm(
    h: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    mask: torch.Tensor | None,
    x: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    group: int,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: x + down(silu(gate h) * up h) (+ ``bias`` [D]) (channels of groups ``mask`` [B, D'/group]
    skips are zero, groups no token runs are not read) and its RMSNorm times ``norm_w``."""
    _check_batch(h, "h")
    _check_batch(x, "x")
    check_dtype(h, w_gate, w_up, w_down, x, norm_w)
    df = w_gate.shape[0]
    if group % 16 or df % group:
        raise ValueError(f"FFN group size {group} must be a multiple of 16 dividing D' = {df}")
    _check_mask(mask, h.shape[0], df // group, "mask")
    for name, t in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if bias is not None:
        check_dtype(h, bias)
        if bias.shape != (x.shape[1],):
            raise ValueError(f"bias must be [D] = [{x.shape[1]}], got {tuple(bias.shape)}")
    return _ffn_op(h, w_gate, w_up, w_down, mask, x, norm_w, float(eps), int(group), bias)
