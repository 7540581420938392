"""Mask reordering: per routing group, the active token rows first (stable), computed on device.

One RouteIndex is computed per routing decision (``plan_route``) and shared by every operator governed
by it (Q projection -> attention -> O projection; gate/up -> down); it carries the decision's ``Plan``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._split_reduce import tile_counters
from .._triton_utils import HAS_TRITON, next_pow2, use_triton
from .plan import Plan, check_plan

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .._split_reduce import arrive


class RouteIndex(NamedTuple):
    """Reordered routing metadata.

    idx:         [N_G, M] int32 — per group, flattened row ids (b*T + t) of active rows first in
                 ascending order, then the inactive rows (ascending).
    count:       [N_G] int32 — active rows per group over all M rows.
    batch_start: [B, N_G] int32 — where batch b's active rows start inside idx[g] (exclusive
                 prefix sum of batch_count over b).
    batch_count: [B, N_G] int32 — active rows of batch b in group g.
    mask:        [M, N_G] bool (optional, appended) — the flattened routing mask itself; GEMM-K
                 reads it for per-row predicates. ``route_mask`` rebuilds it when absent.
    order:       [M] int32 (optional) — one row order for all groups (``pattern_order``): rows with
                 equal or Gray-adjacent group patterns next to each other, so that a tile of
                 consecutive rows leaves whole groups unused. The 'ordered' GEMM-K reads it.
    plan:        the paths of this decision's operators (``plan_route``); the routed GEMMs read it.
    """

    idx: torch.Tensor
    count: torch.Tensor
    batch_start: torch.Tensor
    batch_count: torch.Tensor
    mask: torch.Tensor | None = None
    order: torch.Tensor | None = None
    plan: Plan | None = None


def _as_btg(mask: torch.Tensor) -> torch.Tensor:
    if mask.dim() == 2:
        return mask.unsqueeze(0)  # [1, M, N_G]
    if mask.dim() == 3:
        return mask
    raise ValueError(f"routing mask must be [M, N_G] or [B, T, N_G], got shape {tuple(mask.shape)}")


def reorder_reference(mask: torch.Tensor) -> RouteIndex:
    """Torch reference of the reordering (same semantics as the kernel; uses a stable sort)."""
    m3 = _as_btg(mask).bool()  # [B, T, N_G]
    b, t, ng = m3.shape
    flat = m3.reshape(b * t, ng)  # [M, N_G]
    key = (~flat).to(torch.int8).t().contiguous()  # [N_G, M]: 0 active, 1 inactive
    idx = torch.sort(key, dim=1, stable=True).indices.to(torch.int32)  # [N_G, M]
    count = flat.sum(0, dtype=torch.int32)  # [N_G]
    batch_count = m3.sum(1, dtype=torch.int32)  # [B, N_G]
    batch_start = (torch.cumsum(batch_count, 0, dtype=torch.int32) - batch_count).to(torch.int32)
    return RouteIndex(idx, count, batch_start, batch_count, flat.contiguous())


def route_mask(route: RouteIndex) -> torch.Tensor:
    """[M, N_G] bool mask of a RouteIndex (its ``mask`` field, or rebuilt from idx/count on device)."""
    if route.mask is not None:
        return route.mask
    ng, m = route.idx.shape
    pos = torch.arange(m, device=route.idx.device)[None, :] < route.count[:, None]  # [N_G, M]
    out = torch.zeros(ng, m, dtype=torch.bool, device=route.idx.device)
    out.scatter_(1, route.idx.long(), pos)
    return out.t().contiguous()


# ----------------------------------------------------------------------------------------------
# Triton prefix-sum compaction: one program per group, two passes over the group's mask column.
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _reorder_kernel(
        mask_ptr,  # [B, T, N_G] uint8
        idx_ptr,  # [N_G, M] int32
        count_ptr,  # [N_G] int32
        bstart_ptr,  # [B, N_G] int32
        bcount_ptr,  # [B, N_G] int32
        B,
        T,
        NG,
        BLOCK_B: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        g = tl.program_id(0)
        M = B * T
        # pass 1: per-batch active counts -> batch_count, batch_start (exclusive scan), count
        total = tl.sum(tl.zeros([BLOCK_B], dtype=tl.int32), axis=0)
        for b0 in range(0, B, BLOCK_B):
            ob = b0 + tl.arange(0, BLOCK_B)
            acc = tl.zeros([BLOCK_B], dtype=tl.int32)
            for t0 in range(0, T, BLOCK_T):
                ot = t0 + tl.arange(0, BLOCK_T)
                ok = (ob[:, None] < B) & (ot[None, :] < T)
                a = tl.load(mask_ptr + (ob[:, None] * T + ot[None, :]) * NG + g, mask=ok, other=0)
                acc += tl.sum((a != 0).to(tl.int32), axis=1)
            incl = tl.cumsum(acc, axis=0)
            tl.store(bcount_ptr + ob * NG + g, acc, mask=ob < B)
            tl.store(bstart_ptr + ob * NG + g, total + incl - acc, mask=ob < B)
            total += tl.sum(acc, axis=0)
        tl.store(count_ptr + g, total)
        # pass 2: stable compaction. active row -> #active before it; inactive row r -> total +
        # #inactive before it (= r - #active before it).
        seen = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
        for m0 in range(0, M, BLOCK):
            om = m0 + tl.arange(0, BLOCK)
            ok = om < M
            a = (tl.load(mask_ptr + om * NG + g, mask=ok, other=0) != 0).to(tl.int32)
            before = seen + tl.cumsum(a, axis=0) - a  # active rows before om
            pos = tl.where(a != 0, before, total + om - before)
            tl.store(idx_ptr + g * M + pos, om, mask=ok)
            seen += tl.sum(a, axis=0)


def _reorder_triton(m3: torch.Tensor) -> tuple[torch.Tensor, ...]:
    b, t, ng = m3.shape
    m = b * t
    dev = m3.device
    idx = torch.empty(ng, m, dtype=torch.int32, device=dev)
    count = torch.empty(ng, dtype=torch.int32, device=dev)
    bstart = torch.empty(b, ng, dtype=torch.int32, device=dev)
    bcount = torch.empty(b, ng, dtype=torch.int32, device=dev)
    if m == 0 or ng == 0:
        return idx, count.zero_(), bstart.zero_(), bcount.zero_()
    block_t = min(next_pow2(t), 2048)
    block_b = min(next_pow2(b), max(1, 2048 // block_t))
    block = min(next_pow2(m), 4096)
    _reorder_kernel[(ng,)](
        m3.view(torch.uint8),
        idx,
        count,
        bstart,
        bcount,
        b,
        t,
        ng,
        BLOCK_B=block_b,
        BLOCK_T=block_t,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return idx, count, bstart, bcount


@torch.library.custom_op("wide::reorder", mutates_args=())
def _reorder_op(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    m3 = _as_btg(mask).to(torch.bool).contiguous()
    if use_triton(m3):
        return _reorder_triton(m3)
    r = reorder_reference(m3)
    return r.idx, r.count, r.batch_start, r.batch_count


@_reorder_op.register_fake
def _(mask):
    m3 = _as_btg(mask)
    b, t, ng = m3.shape
    e = mask.new_empty
    return (
        e((ng, b * t), dtype=torch.int32),
        e((ng,), dtype=torch.int32),
        e((b, ng), dtype=torch.int32),
        e((b, ng), dtype=torch.int32),
    )


def reorder(mask: torch.Tensor) -> RouteIndex:
    """Per-group stable compaction of a routing mask ``[M, N_G]`` or ``[B, T, N_G]`` (True = active).

    One Triton kernel on CUDA (no host sync, CUDA-graph capturable); the torch reference on CPU
    unless ``TRITON_INTERPRET=1``.
    """
    m3 = _as_btg(mask)
    if m3.dtype != torch.bool:
        m3 = m3 != 0
    idx, count, bstart, bcount = _reorder_op(m3)
    return RouteIndex(idx, count, bstart, bcount, m3.reshape(-1, m3.shape[-1]))


ORDER_BITS = 8  # groups entering the pattern key (256 buckets); tiles share fewer leading bits anyway
ORDER_MAX_CHUNKS = 128  # programs of the Triton counting sort (its scan holds [chunks, 256] in registers)
ORDER_MAX_ROWS = ORDER_MAX_CHUNKS * 4096  # rows per program: 256 ... 4096


def _pattern_key_ref(mask2: torch.Tensor, gray: bool) -> torch.Tensor:
    """[M, N_G] bool -> [M] int32 key: the first ORDER_BITS groups' bits (group 0 highest), as a rank
    in the reflected Gray sequence (``gray``) or plain binary."""
    nb = min(mask2.shape[1], ORDER_BITS)
    weights = 1 << torch.arange(nb - 1, -1, -1, device=mask2.device, dtype=torch.int32)
    key = (mask2[:, :nb].to(torch.int32) * weights).sum(1, dtype=torch.int32)  # [M]
    if gray:  # Gray rank = prefix XOR of the bits from the top (the inverse Gray code)
        for shift in (1, 2, 4):
            key = key ^ (key >> shift)
    return key


def pattern_order_reference(mask: torch.Tensor, gray: bool = True) -> torch.Tensor:
    """Torch reference of ``pattern_order`` (a stable argsort of the pattern keys)."""
    m2 = _as_btg(mask).reshape(-1, mask.shape[-1]) != 0
    return torch.argsort(_pattern_key_ref(m2, gray), stable=True).to(torch.int32)


if HAS_TRITON:

    @triton.jit
    def _pattern_key(mask_ptr, rows, M, NG, NB: tl.constexpr, GRAY: tl.constexpr):
        key = tl.zeros_like(rows)
        for g in tl.static_range(NB):
            bit = tl.load(mask_ptr + rows * NG + g, mask=rows < M, other=0) != 0
            key = key * 2 + bit.to(tl.int32)
        if GRAY:
            key = key ^ (key >> 1)
            key = key ^ (key >> 2)
            key = key ^ (key >> 4)
        return key

    @triton.jit
    def _order_count_kernel(
        mask_ptr,  # [M, N_G] uint8
        hist_ptr,  # [P, NBINS] int32: rows of each key per chunk
        delta_ptr,  # [P, NBINS] int32: destination of a chunk's sorted row i is i + delta[p, key]
        cnt_ptr,  # int32 ticket counter (zero on entry and exit)
        M,
        NG,
        P,
        NB: tl.constexpr,
        GRAY: tl.constexpr,
        CHUNK: tl.constexpr,
        NBINS: tl.constexpr,
        P_P2: tl.constexpr,
    ):
        p = tl.program_id(0)
        rows = p * CHUNK + tl.arange(0, CHUNK)
        key = _pattern_key(mask_ptr, rows, M, NG, NB, GRAY)
        bins = tl.arange(0, NBINS)
        hist = tl.histogram(key, NBINS)  # rows past M have key 0: taken off bin 0
        hist -= tl.where(bins == 0, tl.sum((rows >= M).to(tl.int32), axis=0), 0)
        tl.store(hist_ptr + p * NBINS + bins, hist)
        if arrive(cnt_ptr, P):  # the last chunk: offsets of every (chunk, key) in the sorted order
            offs_p = tl.arange(0, P_P2)
            h = tl.load(hist_ptr + offs_p[:, None] * NBINS + bins[None, :], mask=(offs_p < P)[:, None], other=0)
            key_start = tl.cumsum(tl.sum(h, axis=0), axis=0) - tl.sum(h, axis=0)  # [NBINS]
            before_chunk = tl.cumsum(h, axis=0) - h  # same key, earlier chunks
            smaller_in_chunk = tl.cumsum(h, axis=1) - h  # same chunk, smaller keys
            delta = key_start[None, :] + before_chunk - smaller_in_chunk
            tl.store(delta_ptr + offs_p[:, None] * NBINS + bins[None, :], delta, mask=(offs_p < P)[:, None])

    @triton.jit
    def _order_scatter_kernel(
        mask_ptr,  # [M, N_G] uint8
        delta_ptr,  # [P, NBINS] int32
        order_ptr,  # [M] int32 out
        M,
        NG,
        NB: tl.constexpr,
        GRAY: tl.constexpr,
        CHUNK: tl.constexpr,
        NBINS: tl.constexpr,
    ):
        p = tl.program_id(0)
        local = tl.arange(0, CHUNK)
        rows = p * CHUNK + local
        key = tl.where(rows < M, _pattern_key(mask_ptr, rows, M, NG, NB, GRAY), NBINS)  # padding sorts last
        s = tl.sort(key * CHUNK + local)  # stable within the chunk: ties broken by row
        k = s // CHUNK
        valid = k < NBINS
        dest = local + tl.load(delta_ptr + p * NBINS + k, mask=valid, other=0)
        tl.store(order_ptr + dest, p * CHUNK + s % CHUNK, mask=valid)


def _pattern_order_triton(m2: torch.Tensor, gray: bool) -> torch.Tensor:
    m, ng = m2.shape
    order = torch.empty(m, dtype=torch.int32, device=m2.device)
    if m == 0:
        return order
    nb = min(ng, ORDER_BITS)
    nbins = 1 << nb
    # small chunks sort fast; interpreter: 64 rows, many programs
    chunk = min(max(next_pow2(triton.cdiv(m, ORDER_MAX_CHUNKS)), 256), 4096) if m2.is_cuda else 64
    p = triton.cdiv(m, chunk)
    hist = torch.empty(p, nbins, dtype=torch.int32, device=m2.device)
    delta = torch.empty_like(hist)
    flat = m2.view(torch.uint8)
    common = {"NB": nb, "GRAY": gray, "CHUNK": chunk, "NBINS": nbins}
    _order_count_kernel[(p,)](
        flat, hist, delta, tile_counters(m2, 1), m, ng, p, P_P2=next_pow2(p), num_warps=4, **common
    )
    _order_scatter_kernel[(p,)](flat, delta, order, m, ng, num_warps=4, **common)
    return order


@torch.library.custom_op("wide::pattern_order", mutates_args=())
def _pattern_order_op(mask: torch.Tensor, gray: bool) -> torch.Tensor:
    m2 = mask.contiguous()
    if use_triton(m2) and m2.shape[0] <= ORDER_MAX_ROWS:
        return _pattern_order_triton(m2, gray)
    return pattern_order_reference(m2, gray)


@_pattern_order_op.register_fake
def _(mask, gray):
    return mask.new_empty((mask.shape[0],), dtype=torch.int32)


def pattern_order(mask: torch.Tensor, *, gray: bool = True) -> torch.Tensor:
    """One row order shared by all groups: rows sorted (stably) by the rank of their group pattern
    in the reflected Gray sequence (``gray=False``: plain binary order, group 0 most significant).

    mask: [M, N_G] (or [B, T, N_G]) -> order [M] int32, a permutation of the flattened rows. Under
    i.i.d. masks a tile of R consecutive rows of M then shares its first ~log2(M / R) groups' bits
    (Gray order: one more, as every bit's runs are twice as long), so a tile skips those groups
    wherever they are off. The key holds the first ORDER_BITS groups. On CUDA a two-launch counting
    sort (per-chunk histograms, the last chunk's program scans them; each chunk sorts its rows and
    scatters them), no host sync; the torch reference elsewhere.
    """
    m2 = _as_btg(mask).reshape(-1, mask.shape[-1])
    return _pattern_order_op(m2 if m2.dtype == torch.bool else m2 != 0, gray)


def has_index(route: RouteIndex) -> bool:
    """False for the index-less routes of ``plan_route`` (mask only)."""
    return route.mask is None or route.idx.shape[1] == route.mask.shape[0]


def plan_route(mask: torch.Tensor, plan: Plan) -> RouteIndex:
    """The route of one routing decision, carrying its ``plan`` (``wide.kernels.route.plan``), built once and
    shared by the decision's operators, which take their paths from ``route.plan``.

    ``plan.reorder`` (the sorted GEMM-MN): the full ``reorder``; else the mask alone (idx [N_G, 0],
    count/batch fields empty) — the small and dense paths read the mask, so no reorder kernel runs at
    decode; routed attention prefill computes its own index then. The 'ordered' GEMM-K computes its
    ``pattern_order`` itself unless the route carries one.
    """
    check_plan(plan)
    m3 = _as_btg(mask)
    if m3.dtype != torch.bool:
        m3 = m3 != 0
    b, t, ng = m3.shape
    if plan.reorder:
        return reorder(m3)._replace(plan=plan)
    e = torch.empty(0, dtype=torch.int32, device=m3.device)
    return RouteIndex(
        e.new_empty((ng, 0)), e, e.new_empty((0, ng)), e.new_empty((0, ng)), m3.reshape(b * t, ng), None, plan
    )
