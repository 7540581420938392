"""Router decisions at decode in one launch: h [M, D] -> execute mask [M, N_G] bool.

A router folded for inference (``WideRuntime._router_head``) is a low-rank projection and an fp32
margin head: ``r = h W_down^T`` (D -> r, in h's dtype, as ``F.linear`` computes it), ``margin = r
W_margin^T + b_margin`` (fp32), and the group runs where ``margin <= 0``. In torch that is three or
four launches — at decode on the H200 a cuBLAS split-K GEMV and its reduce, an fp32 GEMV and a compare,
~8 µs per router (bench/results/profile-e2e-h200-6729301.txt) — for r x D weights that take ~1 µs to read.
Measured (router-h200.json, M 1, D 4096, r 32): 6.6 µs for 112 groups against 10.6 µs for the torch path.

* ``router_decisions``: SPLITS programs each project a slice of D into fp32 partials; the last to
  arrive (``_split_reduce``) sums them in split order, rounds r to h's dtype (what ``F.linear``
  returns), applies the margin head and writes the mask. One launch, bit-identical repeats.
* ``margin_decisions``: the margin head alone, for a projection computed elsewhere (the attention
  router's D -> r rides in the K/V GEMM of the runtime).

Both take the Triton kernel for M <= SMALL_M (decode) and the torch reference otherwise (cuBLAS is
efficient once M is large), and are ``torch.library`` custom ops (compile / CUDA-graph safe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._split_reduce import tile_counters
from ._triton_utils import HAS_TRITON, SMALL_M, check_dtype, next_pow2, pdl_launch, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._split_reduce import arrive, sum_partials
    from ._triton_utils import pdl_begin

ROUTER_BLOCK_M = 16  # tensor-core minimum: rows M..15 are padding
MARGIN_MAX_BLOCK_G = 128  # groups per step of the margin head (one step for Llama's 112 FFN groups)
MAX_RANK = 128


def default_config(d: int) -> dict:
    """(BLOCK_D, SPLITS, num_warps): >= 512 columns of D per program, at most 8 programs (H200 sweep
    at D 4096, bench/results/router-h200.json: 4-8 splits of 128-wide tiles fastest, 16-32 slower)."""
    splits = 1
    while splits < 8 and splits * 2 * 512 <= d:
        splits *= 2
    return {"BLOCK_D": 128, "SPLITS": splits, "num_warps": 4}


def _block_g(ng: int) -> int:
    return min(max(16, next_pow2(ng)), MARGIN_MAX_BLOCK_G)


# --------------------------------------------------------------------------------------------------
# Torch references (the semantics; the large-M path)
# --------------------------------------------------------------------------------------------------
def margin_decisions_ref(r: torch.Tensor, w_margin: torch.Tensor, b_margin: torch.Tensor) -> torch.Tensor:
    """r: [M, r] -> execute mask [M, N_G] bool: fp32 ``r W_margin^T + b_margin <= 0``."""
    return torch.addmm(b_margin, r.float(), w_margin.t()) <= 0


def router_decisions_ref(
    h: torch.Tensor, w_down: torch.Tensor, w_margin: torch.Tensor, b_margin: torch.Tensor
) -> torch.Tensor:
    """h: [M, D] -> execute mask [M, N_G] bool; the projection in h's dtype, the head in fp32.

    The projection stays in h's dtype (fp32 accumulation): an fp32 copy of h would cost more than the
    projection (fp32 router GEMMs + casts: ~5 ms of a 4,096-token Llama-8B prefill in
    bench/results/reverted-eec4a8a/profile_e2e.txt). In fp32 this is the masked path's decision up to
    rounding of the folded head; in bf16 a decision within rounding of its threshold can differ."""
    return margin_decisions_ref(F.linear(h, w_down), w_margin, b_margin)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _load_head(wm_ptr, bm_ptr, g0, NG, R, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        """Groups [g0, g0 + BLOCK_G) of the margin head: W_margin [BLOCK_G, BLOCK_R], b [BLOCK_G] (fp32)."""
        offs_g = g0 + tl.arange(0, BLOCK_G)
        offs_r = tl.arange(0, BLOCK_R)
        in_g = offs_g < NG
        wm = tl.load(
            wm_ptr + offs_g[:, None] * R + offs_r[None, :], mask=in_g[:, None] & (offs_r < R)[None, :], other=0.0
        )
        return wm, tl.load(bm_ptr + offs_g, mask=in_g, other=0.0)

    @triton.jit
    def _margin_store(r, wm0, b0, wm_ptr, bm_ptr, out_ptr, M, NG, R, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_G: tl.constexpr):  # fmt: skip
        """r: [BLOCK_M, BLOCK_R] fp32 (columns >= R are 0) -> out[m, g] = (r[m]·W_margin[g] + b[g] <= 0).

        wm0 / b0: the first BLOCK_G groups, loaded by the caller ahead of time (their latency hides
        behind the projection); further blocks are loaded here."""
        offs_m = tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        wm, bias = wm0, b0
        for g0 in range(0, NG, BLOCK_G):
            if g0 > 0:
                wm, bias = _load_head(wm_ptr, bm_ptr, g0, NG, R, BLOCK_R, BLOCK_G)
            offs_g = g0 + tl.arange(0, BLOCK_G)
            margin = tl.dot(r, tl.trans(wm), input_precision="ieee") + bias[None, :]  # [BLOCK_M, BLOCK_G]
            run = (margin <= 0).to(tl.uint8)
            tl.store(out_ptr + offs_m[:, None] * NG + offs_g[None, :], run, mask=in_m[:, None] & (offs_g < NG)[None, :])

    @triton.jit
    def _router_kernel(
        h_ptr,  # [M, D]
        wd_ptr,  # [R, D] router down-projection (h's dtype)
        wm_ptr,  # [NG, R] fp32 margin head
        bm_ptr,  # [NG] fp32
        out_ptr,  # [M, NG] uint8 (a bool tensor's bytes)
        ws_ptr,  # fp32 partials [SPLITS, BLOCK_M, BLOCK_R] when SPLITS > 1
        cnt_ptr,  # int32 ticket counter (zero on entry and exit)
        M,
        D,
        R,
        NG,
        stride_hm,
        stride_wd,
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_G: tl.constexpr,
        SPLITS: tl.constexpr,
        PDL: tl.constexpr,  # launched with programmatic dependent launch
    ):
        pdl_begin(PDL)
        s = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        in_m = offs_m < M
        in_r = offs_r < R
        wm0, b0 = _load_head(wm_ptr, bm_ptr, 0, NG, R, BLOCK_R, BLOCK_G)  # used by the last program only
        d_per = tl.cdiv(tl.cdiv(D, SPLITS), BLOCK_D) * BLOCK_D
        d_lo = s * d_per
        d_hi = tl.minimum(d_lo + d_per, D)
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for d0 in range(d_lo, d_hi, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            in_d = offs_d < d_hi
            a_ptrs = h_ptr + offs_m[:, None] * stride_hm + offs_d[None, :]
            b_ptrs = wd_ptr + offs_r[:, None] * stride_wd + offs_d[None, :]
            a = tl.load(a_ptrs, mask=in_m[:, None] & in_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
            b = tl.load(b_ptrs, mask=in_r[:, None] & in_d[None, :], other=0.0)  # [BLOCK_R, BLOCK_D]
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
        if SPLITS == 1:
            r = acc.to(h_ptr.dtype.element_ty).to(tl.float32)  # F.linear's output dtype
            _margin_store(r, wm0, b0, wm_ptr, bm_ptr, out_ptr, M, NG, R, BLOCK_M, BLOCK_R, BLOCK_G)
        else:
            tile = BLOCK_M * BLOCK_R
            offs_t = offs_m[:, None] * BLOCK_R + offs_r[None, :]
            tl.store(ws_ptr + s * tile + offs_t, acc)
            if arrive(cnt_ptr, SPLITS):
                red = sum_partials(ws_ptr, tile, BLOCK_M, SPLITS, BLOCK_M, BLOCK_R)
                r = red.to(h_ptr.dtype.element_ty).to(tl.float32)
                _margin_store(r, wm0, b0, wm_ptr, bm_ptr, out_ptr, M, NG, R, BLOCK_M, BLOCK_R, BLOCK_G)

    @triton.jit
    def _margin_kernel(
        r_ptr, wm_ptr, bm_ptr, out_ptr, M, NG, R, stride_rm,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_begin(PDL)
        offs_m = tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        mask = (offs_m < M)[:, None] & (offs_r < R)[None, :]
        wm0, b0 = _load_head(wm_ptr, bm_ptr, 0, NG, R, BLOCK_R, BLOCK_G)
        r = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_r[None, :], mask=mask, other=0.0).to(tl.float32)
        _margin_store(r, wm0, b0, wm_ptr, bm_ptr, out_ptr, M, NG, R, BLOCK_M, BLOCK_R, BLOCK_G)


def _check_head(r: int, w_margin: torch.Tensor, b_margin: torch.Tensor) -> None:
    if w_margin.dim() != 2 or w_margin.shape[1] != r:
        raise ValueError(f"margin head {tuple(w_margin.shape)} does not read a rank-{r} projection")
    if b_margin.shape != (w_margin.shape[0],):
        raise ValueError(f"margin bias {tuple(b_margin.shape)} vs {w_margin.shape[0]} groups")
    if w_margin.dtype != torch.float32 or b_margin.dtype != torch.float32:
        raise ValueError("the margin head is fp32 (WideRuntime._router_head folds it so)")
    if r > MAX_RANK:
        raise ValueError(f"router rank {r} > {MAX_RANK}")


def _router_triton(h, w_down, w_margin, b_margin, config: dict | None):
    m, d = h.shape
    r, ng = w_down.shape[0], w_margin.shape[0]
    out = torch.empty(m, ng, dtype=torch.bool, device=h.device)
    if m == 0:
        return out
    conf = dict(config or default_config(d))
    splits = conf["SPLITS"]
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"SPLITS must be a power of two, got {splits}")
    block_r = max(16, next_pow2(r))
    ws = torch.empty(splits * ROUTER_BLOCK_M * block_r, dtype=torch.float32, device=h.device)
    cnt = tile_counters(h, 1)
    prec = "ieee" if h.dtype == torch.float32 else "tf32"
    _router_kernel[(splits,)](
        h, w_down, w_margin, b_margin, out.view(torch.uint8), ws, cnt, m, d, r, ng, h.stride(0), w_down.stride(0),
        PREC=prec, BLOCK_M=ROUTER_BLOCK_M, BLOCK_R=block_r, BLOCK_G=_block_g(ng), **conf, **pdl_launch(h),
    )  # fmt: skip
    return out


def _margin_triton(r, w_margin, b_margin):
    m, rank = r.shape
    ng = w_margin.shape[0]
    out = torch.empty(m, ng, dtype=torch.bool, device=r.device)
    if m == 0:
        return out
    _margin_kernel[(1,)](
        r, w_margin, b_margin, out.view(torch.uint8), m, ng, rank, r.stride(0),
        BLOCK_M=ROUTER_BLOCK_M, BLOCK_R=max(16, next_pow2(rank)), BLOCK_G=_block_g(ng), num_warps=4,
        **pdl_launch(r),
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------
# Custom ops and public functions
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("wide::router_decisions", mutates_args=())
def _router_op(h: torch.Tensor, w_down: torch.Tensor, w_margin: torch.Tensor, b_margin: torch.Tensor) -> torch.Tensor:
    if use_triton(h) and h.shape[0] <= SMALL_M:
        return _router_triton(h, w_down, w_margin, b_margin, None)
    return router_decisions_ref(h, w_down, w_margin, b_margin)


@_router_op.register_fake
def _(h, w_down, w_margin, b_margin):
    return h.new_empty((h.shape[0], w_margin.shape[0]), dtype=torch.bool)


@torch.library.custom_op("wide::router_margin", mutates_args=())
def _margin_op(r: torch.Tensor, w_margin: torch.Tensor, b_margin: torch.Tensor) -> torch.Tensor:
    if use_triton(r) and r.shape[0] <= SMALL_M:
        return _margin_triton(r, w_margin, b_margin)
    return margin_decisions_ref(r, w_margin, b_margin)


@_margin_op.register_fake
def _(r, w_margin, b_margin):
    return r.new_empty((r.shape[0], w_margin.shape[0]), dtype=torch.bool)


def router_decisions(
    h: torch.Tensor,
    w_down: torch.Tensor,
    w_margin: torch.Tensor,
    b_margin: torch.Tensor,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """h: [..., D] -> execute mask [..., N_G] bool from a folded router (w_down [r, D] in h's dtype,
    w_margin [N_G, r] and b_margin [N_G] fp32). One Triton launch for M <= SMALL_M tokens.

    ``config`` (BLOCK_D, SPLITS, num_warps, num_stages) forces the kernel with those settings (benchmarks).
    """
    check_dtype(h, w_down)
    if w_down.dim() != 2 or w_down.shape[1] != h.shape[-1]:
        raise ValueError(f"router projection {tuple(w_down.shape)} does not read hidden size {h.shape[-1]}")
    _check_head(w_down.shape[0], w_margin, b_margin)
    h2 = h.reshape(-1, h.shape[-1]).contiguous()
    if config is not None:
        if not use_triton(h2):
            raise ValueError("config forces the Triton kernel: not runnable here (CPU without TRITON_INTERPRET=1)")
        out = _router_triton(h2, w_down.contiguous(), w_margin.contiguous(), b_margin.contiguous(), config)
    else:
        out = _router_op(h2, w_down.contiguous(), w_margin.contiguous(), b_margin.contiguous())
    return out.view(*h.shape[:-1], -1)


def margin_decisions(r: torch.Tensor, w_margin: torch.Tensor, b_margin: torch.Tensor) -> torch.Tensor:
    """r: [..., r] (a router's D -> r projection; rows may be strided) -> execute mask [..., N_G] bool."""
    _check_head(r.shape[-1], w_margin, b_margin)
    r2 = r.reshape(-1, r.shape[-1])
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    return _margin_op(r2, w_margin.contiguous(), b_margin.contiguous()).view(*r.shape[:-1], -1)
