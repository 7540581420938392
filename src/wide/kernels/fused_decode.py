"""A fused decode layer: the decoder layer of one decode step in four kernels (+ two router launches).

At decode (M = B tokens, B 1..16) every kernel here reads its weights once, skipping the groups that no
token of the batch runs (the union of the batch's masks), and reduces across programs inside the kernel
in a fixed order (deterministic, no second "sum the splits" launch). Per decoder layer (docs/kernels.md,
"Fused decode layer"):

  [router_decisions(h)]      attention mask [B, Hk]            (wide.kernels.router, routed only)
  qkv_rope_cache             [Q; K; V] GEMV (Q heads of groups no token runs: skipped), + bias,
                             Qwen3 q/k RMSNorm, RoPE; Q -> q [B, Hq, d], K/V -> the cache at pos
  attention_decode_merged    split-KV decode attention; the last split of a (token, group) to finish
                             merges the splits (log-sum-exp, split order)
  o_proj_residual_norm       x + O·o (+ bias) -> x'; the last program normalises x' -> h' (next norm)
  [router_decisions(h')]     FFN mask [B, G]                    (routed only)
  ffn_residual_norm          producers: gate/up -> SwiGLU per (group, channel chunk) into an [B, D']
                             scratch; consumers: down + residual per output tile once every producer
                             arrived; the last consumer normalises x'' with the next norm's weight

The routers stay the project's own op on the normed h that these kernels write, so a decision is the
one ``router_decisions`` takes on that h (``wide.kernels.router``). The normalisation itself is this
module's ``_norm_rows`` (fp32 inside, rounded to the model dtype, times the weight, as
``rms_norm_ref``); its reduction order is the kernel's, so h equals torch's up to fp32
rounding of the mean (see tests/kernels/test_fused_decode.py).

The FFN's producer/consumer split is one launch: every program draws a ticket (an atomic counter) and
the first P1 tickets are producers, the rest consumers. A consumer only ever waits for programs that
drew an earlier ticket, which are already running or done, so the wait cannot deadlock; under the CPU
interpreter programs run in ticket order and never wait. The SwiGLU intermediate goes through a
[B, D'] scratch (at most 16 x D' values: it stays in L2) instead of per-program [B, D] fp32 partials.

Every op is a ``torch.library`` custom op (CUDA-graph safe, no host sync); the counters come from the
zeroed per-stream buffer of ``_split_reduce`` and every kernel leaves them zeroed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from ._split_reduce import tile_counters
from ._triton_utils import (
    HAS_TRITON,
    check_dtype,
    interpret_mode,
    largest_pow2_divisor,
    next_pow2,
    pdl_launch,
    use_triton,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._split_reduce import arrive, sum_partials, wait_for
    from ._triton_utils import pdl_begin

MAX_BATCH = 16  # decode only: one 16-row tensor-core tile holds the batch


_SWITCHES = ("compact_k", "router_overlap", "long_context")  # LaunchOverrides fields that are 0 / 1


@dataclass(frozen=True)
class LaunchOverrides:
    """Launch shapes that replace this module's shape rules (None: the rule), for GPU sweeps
    (``launch_overrides``). block_k / num_warps / num_stages: the weight-streaming loops; qkv_slices: row
    slices per head; *_splits: K splits (powers of two); o_block_n / ffn_block_n: output columns per tile;
    ffn_chunk: channels per FFN producer; down_block_k / down_stages: K step and pipeline depth of the FFN's
    down-projection loop alone (block_k and down_block_k >= 16, a tensor-core dot's K); down_span: columns a
    down step gathers from whole groups narrower than it (``down_step``; the rule: NARROW_DOWN_SPAN;
    down_span=G gives one group a step);
    compact_k: 1 (the rule) the routed O and down loops visit only the K steps of groups some token runs (a
    list per program), 0 they predicate the others off; norm_tile: elements per step of the norm tails;
    attn_splits: KV splits of every running pair of decode attention (any count; the rule: ``attn_num_splits``
    on the running pairs), attn_programs: the programs that rule aims for (the rule: the SM count), attn_block_n:
    keys per step (a power of two >= 16), attn_warps; router_overlap: 1 the layer's routers run on a side stream
    beside a QKV launch that computes every Q head, 0 (the rule) they run before it and QKV skips the Q heads of
    groups no token runs (``router_overlap``); long_context: 1 (the rule) decode attention over a cache of at
    least ``LONG_CONTEXT`` keys takes the long-context split rule (``attn_num_splits``), 0 the short one at any
    length."""

    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    qkv_slices: int | None = None
    qkv_splits: int | None = None
    o_block_n: int | None = None
    o_splits: int | None = None
    ffn_block_n: int | None = None
    ffn_chunk: int | None = None
    ffn_splits: int | None = None
    down_block_k: int | None = None
    down_span: int | None = None
    down_stages: int | None = None
    compact_k: int | None = None
    norm_tile: int | None = None
    attn_splits: int | None = None
    attn_programs: int | None = None
    attn_block_n: int | None = None
    attn_warps: int | None = None
    router_overlap: int | None = None
    long_context: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _SWITCHES and v not in (None, 0, 1):
                raise ValueError(f"launch override {f.name} must be 0 or 1, got {v!r}")
            if f.name not in _SWITCHES and v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"launch override {f.name} must be a positive int, got {v!r}")
            pow2 = f.name.endswith("_splits") and f.name != "attn_splits" or f.name in ("attn_block_n", "down_span")
            if v is not None and pow2 and v & (v - 1):
                raise ValueError(f"launch override {f.name} must be a power of two, got {v}")
            if v is not None and f.name in ("block_k", "down_block_k") and v < 16:  # a tensor-core dot's K
                raise ValueError(f"launch override {f.name} must be at least 16, got {v}")


_OVERRIDES: ContextVar[LaunchOverrides | None] = ContextVar("wide_fused_launch", default=None)  # None: no overrides


@contextmanager
def launch_overrides(**shapes: int) -> Iterator[LaunchOverrides]:
    """Within the block (and CUDA graphs captured in it) the fused kernels launch with these shapes
    instead of the shape rules; keys are ``LaunchOverrides``' fields (an unknown key: TypeError)."""
    ov = LaunchOverrides(**shapes)
    token = _OVERRIDES.set(ov)
    try:
        yield ov
    finally:
        _OVERRIDES.reset(token)


def _ov(name: str, rule):
    """The override of ``name`` if one is set, else ``rule`` (a value)."""
    ov = _OVERRIDES.get()
    v = None if ov is None else getattr(ov, name)
    return rule if v is None else v


BLOCK_M = 16
_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------------
# Torch references (the semantics, in the order torch computes them)
# --------------------------------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm as the Hugging Face module computes it (the runtime's norm): fp32 inside, x's dtype
    out, times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation: [a, b] -> [-b, a] over the last axis."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def qkv_rope_cache_ref(
    h: torch.Tensor,
    w_qkv: torch.Tensor,
    b_qkv: torch.Tensor | None,
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
    """h [B, D], w_qkv [(Hq + 2 Hk) d, D], cos/sin [B, d], pos [B] -> q [B, Hq, d] (RoPE'd); writes the
    RoPE'd K and V of token b at k_cache/v_cache [b, pos[b]] ([B_max, S, Hk, d]). Every Q head is
    computed (the kernel leaves heads of groups no token runs unspecified)."""
    b = h.shape[0]
    hk, d = k_cache.shape[2], k_cache.shape[3]
    q, k, v = F.linear(h, w_qkv, b_qkv).split([n_q * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(b, n_q, d), k.view(b, hk, d), v.view(b, hk, d)
    if q_norm is not None:
        q, k = rms_norm_ref(q, q_norm, qk_eps), rms_norm_ref(k, k_norm, qk_eps)
    c, s = cos[:, None, :].to(h.dtype), sin[:, None, :].to(h.dtype)
    q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    idx = torch.arange(b, device=h.device)
    k_cache[idx, pos.long()] = k
    v_cache[idx, pos.long()] = v
    return q


def o_proj_residual_norm_ref(
    o: torch.Tensor,
    wo: torch.Tensor,
    bo: torch.Tensor | None,
    x: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o [B, Hq d] (zeros where a group is skipped), x [B, D] -> (x + O o (+ bo), rms_norm of it)."""
    y = F.linear(o, wo)
    if bo is not None:
        y = y + bo
    xn = x + y
    return xn, rms_norm_ref(xn, norm_w, eps)


def ffn_residual_norm_ref(
    h: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    mask: torch.Tensor | None,
    x: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h, x [B, D]; mask [B, G] bool or None (dense) -> (x + down(silu(gate h) * up h) (+ bias [D], added
    after the projection's rounding) with the channels of skipped groups zero, rms_norm of it)."""
    a = F.silu(F.linear(h, w_gate)) * F.linear(h, w_up)  # [B, D']
    if mask is not None:
        a = a * mask.repeat_interleave(w_gate.shape[0] // mask.shape[1], dim=-1).to(a.dtype)
    y = F.linear(a, w_down)
    if bias is not None:
        y = y + bias
    xn = x + y
    return xn, rms_norm_ref(xn, norm_w, eps)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _any_row(mask_ptr, g, B, NG, BM: tl.constexpr):
        """True when some token b < B runs group g (mask [B, NG] uint8)."""
        offs = tl.arange(0, BM)
        m = tl.load(mask_ptr + offs * NG + g, mask=offs < B, other=0)
        return tl.max(m.to(tl.int32), 0) > 0

    @triton.jit
    def _k_step(acc, a_ptr, w_ptr, offs_m, in_m, offs_n, in_n, k0, k_hi, K, run, PRED: tl.constexpr,
                BLOCK_K: tl.constexpr, PREC: tl.constexpr, CG: tl.constexpr):  # fmt: skip
        """acc += a[:, k0:k0+BLOCK_K] W[n, k0:k0+BLOCK_K]^T, columns >= k_hi as 0; PRED: every column as 0 unless
        the scalar run is true (loads predicated off read nothing)."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_hi
        if PRED:
            in_k = in_k & (tl.zeros([BLOCK_K], tl.int32) + run.to(tl.int32) > 0)
        am = in_m[:, None] & in_k[None, :]
        if CG:  # written earlier in the same kernel by other programs
            a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=am, other=0.0, cache_modifier=".cg")
        else:
            a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=am, other=0.0)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], mask=in_n[:, None] & in_k[None, :],
                    other=0.0)  # fmt: skip
        return tl.dot(a, tl.trans(w), acc, input_precision=PREC)

    @triton.jit
    def _routed_k_loop(acc, a_ptr, w_ptr, offs_m, in_m, offs_n, in_n, k_lo, k_hi, K, mask_ptr, B, NG, G, list_ptr,
                       ROUTED: tl.constexpr, BM: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                       CG: tl.constexpr, COMPACT: tl.constexpr, NS_P: tl.constexpr, STAGES: tl.constexpr,
                       SUB: tl.constexpr):  # fmt: skip
        """acc [BM, BLOCK_N] += a[:, k] W[n, k]^T for k in [k_lo, k_hi) (a: [B, K], W: [N, K], row-major),
        reading no column of a group no token runs. A step is SUB sub-steps of BLOCK_K columns; BLOCK_K divides
        the group width G (SUB > 1: equals it) and k_lo is a multiple of the step, so a sub-step lies in one
        group and its predicate is one scalar (the loads stay vectorised and the loop pipelined). COMPACT
        (routed): the first columns of the steps where some token runs some group go to this program's list
        (list_ptr, NS_P >= the range's step count; SUB > 1: plus, in the low bits, which of its groups run) and
        the loop visits those only, in K order; the skipped (sub-)steps add exact zeros otherwise, so both loops
        give the same bits. STAGES: the loop's own pipeline depth (None: the kernel's num_stages). Several
        groups a step keep narrow groups' loop as short as wide ones' (docs/kernels.md#fused-decode-layer)."""
        STEP: tl.constexpr = BLOCK_K * SUB
        tl.static_assert((1 << SUB) <= STEP, "a step's run bits must fit below its first column (down_step)")
        if ROUTED and COMPACT:
            offs_s = tl.arange(0, NS_P)
            k_s = k_lo + offs_s * STEP  # [NS_P] each step's first column
            in_s = k_s < k_hi
            bits = tl.zeros([NS_P], tl.int32)  # bit i: some token runs sub-step i's group
            for i in tl.static_range(SUB):
                k_i = k_s + i * BLOCK_K
                run = tl.load(mask_ptr + offs_m[:, None] * NG + (k_i // G)[None, :],
                              mask=in_m[:, None] & (k_i < k_hi)[None, :], other=0)  # fmt: skip
                bits = bits | ((tl.max(run.to(tl.int32), 0) > 0).to(tl.int32) << i)
            used = (bits > 0) & in_s
            slot = tl.where(used, tl.cumsum(used.to(tl.int32), 0) - 1, -1)  # [NS_P] rank among the used steps
            entry = k_s
            if SUB > 1:
                entry = k_s + bits  # bits < 2**SUB <= STEP: the step's first column keeps them apart
            tl.store(list_ptr + slot, entry, mask=used)
            tl.debug_barrier()  # the list, written by the program's threads, is read by all of them
            n_act = tl.sum(used.to(tl.int32), 0)
            # a listed column is a multiple of the step: said so, the compiler can prove the loads' alignment and
            # software-pipeline the loop as it does the predicated one (docs/kernels.md#fused-decode-layer)
            for t in tl.range(0, n_act, num_stages=STAGES):
                e = tl.load(list_ptr + t)
                if SUB == 1:
                    k0 = tl.multiple_of(e, BLOCK_K)
                    acc = _k_step(acc, a_ptr, w_ptr, offs_m, in_m, offs_n, in_n, k0, k_hi, K, 0, False, BLOCK_K,
                                  PREC, CG)  # fmt: skip
                else:
                    k0 = tl.multiple_of((e // STEP) * STEP, STEP)
                    for i in tl.static_range(SUB):
                        acc = _k_step(acc, a_ptr, w_ptr, offs_m, in_m, offs_n, in_n, k0 + i * BLOCK_K, k_hi, K,
                                      (e >> i) & 1, True, BLOCK_K, PREC, CG)  # fmt: skip
        else:
            for k0 in tl.range(k_lo, k_hi, STEP, num_stages=STAGES):
                for i in tl.static_range(SUB):
                    run = 0
                    if ROUTED:
                        g = (k0 + i * BLOCK_K) // G
                        if SUB > 1:  # a sub-step past k_hi reads nothing: its group index only has to exist
                            g = tl.minimum(g, NG - 1)
                        run = _any_row(mask_ptr, g, B, NG, BM)
                    acc = _k_step(acc, a_ptr, w_ptr, offs_m, in_m, offs_n, in_n, k0 + i * BLOCK_K, k_hi, K, run,
                                  ROUTED, BLOCK_K, PREC, CG)  # fmt: skip
        return acc

    @triton.jit
    def _split_k_sum(acc, part_ptr, cnt_ptr, tile, n_tiles, s, KS: tl.constexpr, BM: tl.constexpr,
                     BLOCK_N: tl.constexpr):  # fmt: skip
        """Split s of output tile ``tile`` stores its fp32 partial acc [BM, BLOCK_N] (part: [KS, n_tiles, BM,
        BLOCK_N]) and arrives at the tile's counter. Returns (True, the KS partials summed in split order)
        for the last split of the tile to arrive, else (False, acc): the sum does not depend on the arrival
        order, so repeats are bit-identical."""
        tsz: tl.constexpr = BM * BLOCK_N
        offs = tl.arange(0, BM)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part_ptr + (s * n_tiles + tile) * tsz + offs, acc)
        last = arrive(cnt_ptr + tile, KS)
        if last:
            acc = sum_partials(part_ptr + tile * tsz, n_tiles * tsz, BM, KS, BM, BLOCK_N)
        return last, acc

    @triton.jit
    def _norm_apply(x_ptr, w_ptr, h_ptr, rs, B, D, RB: tl.constexpr, NB: tl.constexpr):
        """h[b] = w * (x[b] * rs[b]).to(dtype) for b < B; rs: [RB] fp32; [RB, NB] tiles (rows of stride D).
        Reads x with .cg: the rows were written by other programs of the same kernel."""
        offs_r = tl.arange(0, RB)
        in_r = offs_r < B
        for d0 in range(0, D, NB):
            offs = d0 + tl.arange(0, NB)
            inb = offs < D
            m2 = in_r[:, None] & inb[None, :]
            v = tl.load(x_ptr + offs_r[:, None] * D + offs[None, :], mask=m2, other=0.0, cache_modifier=".cg")
            w = tl.load(w_ptr + offs, mask=inb, other=0.0).to(tl.float32)
            hn = (v.to(tl.float32) * rs[:, None]).to(h_ptr.dtype.element_ty).to(tl.float32)
            tl.store(h_ptr + offs_r[:, None] * D + offs[None, :], (w[None, :] * hn).to(h_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _norm_rows(x_ptr, w_ptr, h_ptr, B, D, eps, RB: tl.constexpr, NB: tl.constexpr):
        """RMSNorm of rows b < B: sum of squares over [RB, NB] tiles, then ``_norm_apply``."""
        offs_r = tl.arange(0, RB)
        in_r = offs_r < B
        ss = tl.zeros([RB, NB], tl.float32)
        for d0 in range(0, D, NB):
            offs = d0 + tl.arange(0, NB)
            m2 = in_r[:, None] & (offs < D)[None, :]
            v = tl.load(x_ptr + offs_r[:, None] * D + offs[None, :], mask=m2, other=0.0, cache_modifier=".cg")
            v = v.to(tl.float32)
            ss += v * v
        rs = tl.math.rsqrt(tl.sum(ss, 1) / D + eps)
        _norm_apply(x_ptr, w_ptr, h_ptr, rs, B, D, RB, NB)

    @triton.jit
    def _norm_tail(x_ptr, w_ptr, h_ptr, ss_ptr, n_tiles, B, D, eps, BM: tl.constexpr, T_P: tl.constexpr,
                   RB: tl.constexpr, NB: tl.constexpr):  # fmt: skip
        """The last program of a kernel whose n_tiles programs each wrote their columns' sum of squares per
        row (ss [n_tiles, BM] fp32): sums them in tile order, then normalises every row."""
        offs_t = tl.arange(0, T_P)
        offs_r = tl.arange(0, RB)
        p = tl.load(ss_ptr + offs_t[:, None] * BM + offs_r[None, :], mask=(offs_t < n_tiles)[:, None], other=0.0,
                    cache_modifier=".cg")  # fmt: skip
        rs = tl.math.rsqrt(tl.sum(p, 0) / D + eps)  # [RB]
        _norm_apply(x_ptr, w_ptr, h_ptr, rs, B, D, RB, NB)

    @triton.jit
    def _pick(a_ptr, b_ptr, offs, first):
        """a[offs] where ``first`` else b[offs], as fp32."""
        return tl.where(first, tl.load(a_ptr + offs).to(tl.float32), tl.load(b_ptr + offs).to(tl.float32))

    @triton.jit
    def _norm_kernel(x_ptr, w_ptr, h_ptr, B, D, eps, RB: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        _norm_rows(x_ptr, w_ptr, h_ptr, B, D, eps, RB, NB)

    @triton.jit
    def _qkv_kernel(
        h_ptr,  # [B, D]
        w_ptr,  # [(HQ + 2 HK) * HEAD_D, D]
        bias_ptr,  # [(HQ + 2 HK) * HEAD_D] or dummy
        mask_ptr,  # [B, HK] uint8 (routed) or dummy
        cos_ptr,  # [B, HEAD_D] fp32
        sin_ptr,
        qn_ptr,  # [HEAD_D] q norm weight (Qwen3) or dummy
        kn_ptr,
        pos_ptr,  # [B] int: the slot each token's K/V goes to
        q_ptr,  # [B, HQ, HEAD_D] out
        kc_ptr,  # [B_max, S, HK, HEAD_D] (strided)
        vc_ptr,
        part_ptr,  # [KS, n_tiles, 2, BM, HEAD_D // 2 // RS] fp32 split partials (KS > 1) or dummy
        cnt_ptr,  # n_tiles counters: splits arrived per (head, slice)
        B,
        D,
        K_CHUNK,
        qk_eps,
        s_kb, s_ks, s_kh, s_vb, s_vs, s_vh,
        KS: tl.constexpr,  # K splits
        HQ: tl.constexpr,
        HK: tl.constexpr,
        HEAD_D: tl.constexpr,
        RS: tl.constexpr,  # row slices per head (RS = 1 with q/k norm: it needs the whole head)
        ROUTED: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        QK_NORM: tl.constexpr,
        BM: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PREC: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_begin(PDL)
        pid = tl.program_id(0)
        tile = pid // KS  # (head, slice)
        head = tile // RS
        s = tile % RS
        HPG: tl.constexpr = HQ // HK
        if ROUTED:  # noqa: SIM102 - constexpr branch, then a runtime one
            skip = (head < HQ) & (_any_row(mask_ptr, tl.minimum(head // HPG, HK - 1), B, HK, BM) == 0)
            if skip:
                return  # no token runs this head's group: its Q stays unspecified (attention skips it)
        HALF: tl.constexpr = HEAD_D // 2
        SUB: tl.constexpr = HALF // RS
        offs_m = tl.arange(0, BM)
        in_m = offs_m < B
        cols_lo = s * SUB + tl.arange(0, SUB)  # [SUB] columns of the head, and their RoPE partners
        cols_hi = cols_lo + HALF
        rows_lo = head * HEAD_D + cols_lo
        rows_hi = head * HEAD_D + cols_hi
        acc_lo = tl.zeros([BM, SUB], tl.float32)
        acc_hi = tl.zeros([BM, SUB], tl.float32)
        k_lo = (pid % KS) * K_CHUNK
        k_hi = tl.minimum(k_lo + K_CHUNK, D)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            in_k = offs_k < k_hi
            a = tl.load(h_ptr + offs_m[:, None] * D + offs_k[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
            w_lo = tl.load(w_ptr + rows_lo.to(tl.int64)[:, None] * D + offs_k[None, :], mask=in_k[None, :], other=0.0)
            w_hi = tl.load(w_ptr + rows_hi.to(tl.int64)[:, None] * D + offs_k[None, :], mask=in_k[None, :], other=0.0)
            acc_lo = tl.dot(a, tl.trans(w_lo), acc_lo, input_precision=PREC)
            acc_hi = tl.dot(a, tl.trans(w_hi), acc_hi, input_precision=PREC)
        if KS > 1:  # the last split of the tile to arrive sums the partials (split order) and goes on
            n_tiles = tl.num_programs(0) // KS
            tsz: tl.constexpr = BM * SUB
            offs = offs_m[:, None] * SUB + tl.arange(0, SUB)[None, :]
            pbase = part_ptr + ((pid % KS) * n_tiles + tile) * 2 * tsz
            tl.store(pbase + offs, acc_lo)
            tl.store(pbase + tsz + offs, acc_hi)
            if not arrive(cnt_ptr + tile, KS):
                return
            acc_lo = sum_partials(part_ptr + tile * 2 * tsz, n_tiles * 2 * tsz, BM, KS, BM, SUB)
            acc_hi = sum_partials(part_ptr + tile * 2 * tsz + tsz, n_tiles * 2 * tsz, BM, KS, BM, SUB)
        dt = h_ptr.dtype.element_ty
        if HAS_BIAS:
            acc_lo += tl.load(bias_ptr + rows_lo).to(tl.float32)[None, :]
            acc_hi += tl.load(bias_ptr + rows_hi).to(tl.float32)[None, :]
        y_lo = acc_lo.to(dt).to(tl.float32)  # F.linear's output dtype
        y_hi = acc_hi.to(dt).to(tl.float32)
        pos = tl.load(pos_ptr + offs_m, mask=in_m, other=0).to(tl.int64)
        if head < HQ + HK:  # Q or K: (q/k norm) + RoPE
            if QK_NORM:
                var = (tl.sum(y_lo * y_lo, 1) + tl.sum(y_hi * y_hi, 1)) / HEAD_D
                rs = tl.math.rsqrt(var + qk_eps)
                y_lo = (y_lo * rs[:, None]).to(dt).to(tl.float32) * _pick(qn_ptr, kn_ptr, cols_lo, head < HQ)[None, :]
                y_hi = (y_hi * rs[:, None]).to(dt).to(tl.float32) * _pick(qn_ptr, kn_ptr, cols_hi, head < HQ)[None, :]
                y_lo = y_lo.to(dt).to(tl.float32)
                y_hi = y_hi.to(dt).to(tl.float32)
            c_lo = tl.load(cos_ptr + offs_m[:, None] * HEAD_D + cols_lo[None, :], mask=in_m[:, None], other=0.0)
            c_hi = tl.load(cos_ptr + offs_m[:, None] * HEAD_D + cols_hi[None, :], mask=in_m[:, None], other=0.0)
            s_lo = tl.load(sin_ptr + offs_m[:, None] * HEAD_D + cols_lo[None, :], mask=in_m[:, None], other=0.0)
            s_hi = tl.load(sin_ptr + offs_m[:, None] * HEAD_D + cols_hi[None, :], mask=in_m[:, None], other=0.0)
            r_lo = y_lo * c_lo - y_hi * s_lo  # rotate_half: [-hi, lo]
            r_hi = y_hi * c_hi + y_lo * s_hi
            if head < HQ:
                q_base = q_ptr + offs_m[:, None] * (HQ * HEAD_D) + head * HEAD_D
                tl.store(q_base + cols_lo[None, :], r_lo.to(q_ptr.dtype.element_ty), mask=in_m[:, None])
                tl.store(q_base + cols_hi[None, :], r_hi.to(q_ptr.dtype.element_ty), mask=in_m[:, None])
            else:
                kh = head - HQ
                base = kc_ptr + offs_m.to(tl.int64)[:, None] * s_kb + pos[:, None] * s_ks + kh * s_kh
                tl.store(base + cols_lo[None, :], r_lo.to(kc_ptr.dtype.element_ty), mask=in_m[:, None])
                tl.store(base + cols_hi[None, :], r_hi.to(kc_ptr.dtype.element_ty), mask=in_m[:, None])
        else:  # V: straight into the cache
            vh = head - HQ - HK
            base = vc_ptr + offs_m.to(tl.int64)[:, None] * s_vb + pos[:, None] * s_vs + vh * s_vh
            tl.store(base + cols_lo[None, :], y_lo.to(vc_ptr.dtype.element_ty), mask=in_m[:, None])
            tl.store(base + cols_hi[None, :], y_hi.to(vc_ptr.dtype.element_ty), mask=in_m[:, None])

    @triton.jit
    def _attn_kernel(
        q_ptr, kc_ptr, vc_ptr, lens_ptr, mask_ptr, o_ptr, op_ptr, lse_ptr, cnt_ptr,
        qk_scale, LEN_ADD, N_PAIRS, CAP, FIXED, PROGRAMS,
        s_kb, s_ks, s_kh, s_vb, s_vs, s_vh,
        HQ: tl.constexpr, HK: tl.constexpr, HPG_P: tl.constexpr, HEAD_D: tl.constexpr,
        BLOCK_N: tl.constexpr, NS_P: tl.constexpr, PAIRS_P: tl.constexpr, PREC: tl.constexpr,
        ROUTED: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Work items (running pair r, split) over a 1-D grid: the batch's running (token b, KV group g) pairs,
        in pair order, each split ``ns`` ways, program p taking item (p // ns, p % ns). ns: CAP if FIXED, else
        the running-pair rule ``attn_num_splits(n_run, ...)`` from the mask (every program reads all of it, at
        most PAIRS_P bytes). An item runs online softmax over its slice of the cache; the last split of a pair
        to arrive merges the splits' partials by log-sum-exp in split order. Programs p < N_PAIRS also write
        the zeros of pair p if it is skipped (ROUTED; else every pair runs and no mask is read).
        q/o: [B, HQ, HEAD_D] contiguous; partials [B*HK, HPG_P, NS_P, HEAD_D] (NS_P >= CAP)."""
        pdl_begin(PDL)
        HPG: tl.constexpr = HQ // HK
        pid = tl.program_id(0)
        hh = tl.arange(0, HPG_P)
        hmask = hh < HPG
        offs_d = tl.arange(0, HEAD_D)
        n_run = N_PAIRS
        if ROUTED:
            offs_p = tl.arange(0, PAIRS_P)
            run = tl.load(mask_ptr + offs_p, mask=offs_p < N_PAIRS, other=0).to(tl.int32)
            n_run = tl.sum(run, 0)
            if tl.load(mask_ptr + pid, mask=pid < N_PAIRS, other=1) == 0:  # pair pid is skipped: its zeros
                zb = (pid // HK).to(tl.int64) * HQ + (pid % HK) * HPG + hh
                tl.store(o_ptr + zb[:, None] * HEAD_D + offs_d[None, :],
                         tl.zeros([HPG_P, HEAD_D], o_ptr.dtype.element_ty), mask=hmask[:, None])  # fmt: skip
        ns = CAP
        if FIXED == 0:
            ns = tl.maximum(1, tl.minimum(CAP, PROGRAMS // tl.maximum(n_run, 1)))
        r = pid // ns
        split = pid % ns
        if r >= n_run:
            return
        bg = r  # b * HK + g: the r-th running pair
        if ROUTED:
            rank = tl.cumsum(run, 0)
            bg = tl.sum(tl.where((run > 0) & (rank == r + 1), offs_p, 0), 0)
        b = bg // HK
        g = bg % HK
        b64 = b.to(tl.int64)
        head = g * HPG + hh
        o_ptrs = o_ptr + (b64 * HQ + head)[:, None] * HEAD_D + offs_d[None, :]
        n_len = tl.load(lens_ptr + b).to(tl.int32) + LEN_ADD
        chunk = tl.cdiv(tl.cdiv(n_len, ns), 16) * 16  # every split has keys (not BLOCK_N-rounded)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n_len)
        q = tl.load(q_ptr + (b64 * HQ + head)[:, None] * HEAD_D + offs_d[None, :], mask=hmask[:, None], other=0.0)
        offs_n = tl.arange(0, BLOCK_N)
        k_base = kc_ptr + b64 * s_kb + g * s_kh + offs_d[None, :]
        v_base = vc_ptr + b64 * s_vb + g * s_vh + offs_d[None, :]
        m_i = tl.full([HPG_P], float("-inf"), tl.float32)
        l_i = tl.zeros([HPG_P], tl.float32)
        acc = tl.zeros([HPG_P, HEAD_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            kn = n0 + offs_n
            kin = kn < hi
            k = tl.load(k_base + kn[:, None].to(tl.int64) * s_ks, mask=kin[:, None], other=0.0)
            v = tl.load(v_base + kn[:, None].to(tl.int64) * s_vs, mask=kin[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC)
            qk = tl.where(kin[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            p = tl.math.exp2(qk * qk_scale - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if ns == 1:
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
        else:
            lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            row = (bg * HPG_P + hh) * NS_P + split
            tl.store(op_ptr + row[:, None] * HEAD_D + offs_d[None, :], out, mask=hmask[:, None])
            tl.store(lse_ptr + row, lse, mask=hmask)
            if arrive(cnt_ptr + bg, ns):  # merge: weights from every split's LSE, then a fixed-order sum
                ss = tl.arange(0, NS_P)
                lses = tl.load(lse_ptr + (bg * HPG_P + hh)[:, None] * NS_P + ss[None, :],
                               mask=hmask[:, None] & (ss < ns)[None, :], other=float("-inf"),
                               cache_modifier=".cg")  # fmt: skip
                mx = tl.max(lses, 1)
                mx = tl.where(mx > float("-inf"), mx, 0.0)
                tot = tl.sum(tl.where(lses > float("-inf"), tl.math.exp2(lses - mx[:, None]), 0.0), 1)
                inv = 1.0 / tl.where(tot > 0, tot, 1.0)
                merged = tl.zeros([HPG_P, HEAD_D], tl.float32)
                for sp in range(0, ns):
                    rw = (bg * HPG_P + hh) * NS_P + sp
                    ls = tl.load(lse_ptr + rw, mask=hmask, other=float("-inf"), cache_modifier=".cg")
                    wgt = tl.where(ls > float("-inf"), tl.math.exp2(ls - mx), 0.0) * inv
                    part = tl.load(op_ptr + rw[:, None] * HEAD_D + offs_d[None, :], mask=hmask[:, None], other=0.0,
                                   cache_modifier=".cg")  # fmt: skip
                    merged += part * wgt[:, None]
                tl.store(o_ptrs, merged.to(o_ptr.dtype.element_ty), mask=hmask[:, None])

    @triton.jit
    def _o_kernel(
        o_ptr,  # [B, K] (K = HQ * d; zeros where a (token, group) is skipped)
        w_ptr,  # [D, K]
        bias_ptr,  # [D] or dummy
        mask_ptr,  # [B, NG] uint8 or dummy
        x_ptr,  # [B, D] residual in
        xo_ptr,  # [B, D] residual out
        nw_ptr,  # [D] next norm weight
        h_ptr,  # [B, D] normed out
        ss_ptr,  # [n_tiles, BM] fp32: each tile's sum of squares per row
        part_ptr,  # [KS, n_tiles, BM, BLOCK_N] fp32 split partials (KS > 1) or dummy
        cnt_ptr,  # n_tiles + 1 counters: splits arrived per tile, tiles done
        list_ptr,  # [programs, NS_P] int32 scratch (COMPACT) or dummy
        B, D, K, NG, G, K_CHUNK, eps,
        KS: tl.constexpr, ROUTED: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, T_P: tl.constexpr, RB: tl.constexpr, NB: tl.constexpr, PREC: tl.constexpr,
        COMPACT: tl.constexpr, NS_P: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One program per (BLOCK_N output columns, K split of K_CHUNK): the last split of a tile to arrive
        adds bias and residual; the last tile to finish normalises the new residual rows."""
        pdl_begin(PDL)
        pid = tl.program_id(0)
        tile = pid // KS
        n_tiles = tl.num_programs(0) // KS
        k_lo = (pid % KS) * K_CHUNK
        offs_m = tl.arange(0, BM)
        in_m = offs_m < B
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = offs_n < D
        acc = tl.zeros([BM, BLOCK_N], tl.float32)
        acc = _routed_k_loop(acc, o_ptr, w_ptr, offs_m, in_m, offs_n, in_n, k_lo, tl.minimum(k_lo + K_CHUNK, K), K,
                             mask_ptr, B, NG, G, list_ptr + pid * NS_P, ROUTED, BM, BLOCK_K, PREC, False, COMPACT,
                             NS_P, None, 1)  # fmt: skip
        last = True
        if KS > 1:
            last, acc = _split_k_sum(acc, part_ptr, cnt_ptr, tile, n_tiles, pid % KS, KS, BM, BLOCK_N)
        if last:
            dt = xo_ptr.dtype.element_ty
            y = acc.to(dt)
            if HAS_BIAS:
                bv = tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)
                y = (y.to(tl.float32) + bv[None, :]).to(dt)
            io = offs_m[:, None] * D + offs_n[None, :]
            msk = in_m[:, None] & in_n[None, :]
            xr = tl.load(x_ptr + io, mask=msk, other=0.0).to(tl.float32)
            xn = (xr + y.to(tl.float32)).to(dt)
            tl.store(xo_ptr + io, xn, mask=msk)
            xf = tl.where(msk, xn.to(tl.float32), 0.0)
            tl.store(ss_ptr + tile * BM + offs_m, tl.sum(xf * xf, 1))
            if arrive(cnt_ptr + n_tiles, n_tiles):
                _norm_tail(xo_ptr, nw_ptr, h_ptr, ss_ptr, n_tiles, B, D, eps, BM, T_P, RB, NB)

    @triton.jit
    def _ffn_kernel(
        h_ptr,  # [B, D] normed input
        wg_ptr,  # [DF, D]
        wu_ptr,  # [DF, D]
        wd_ptr,  # [D, DF]
        bias_ptr,  # [D] added after the down projection, or dummy
        mask_ptr,  # [B, NG] uint8 or dummy
        a_ptr,  # [B, DF] scratch (dtype): the SwiGLU output
        x_ptr,  # [B, D] residual in
        xo_ptr,  # [B, D] residual out
        nw_ptr,  # [D] next norm weight
        hn_ptr,  # [B, D] normed out
        ss_ptr,  # [n_tiles, BM] fp32: each output tile's sum of squares per row
        part_ptr,  # [KS, n_tiles, BM, BLOCK_N] fp32 split partials (KS > 1) or dummy
        cnt_ptr,  # 1 + KS + n_tiles + 1 counters: tickets, producers done per split, splits per tile, tiles
        list_ptr,  # [consumers, NS_P] int32 scratch (COMPACT) or dummy
        B, D, DF, NG, G, eps,
        KS: tl.constexpr,  # down-projection K splits (split s: groups [s NG / KS, (s + 1) NG / KS))
        CPG: tl.constexpr,  # channel chunks per group (producers: NG * CPG)
        CH: tl.constexpr,  # channels per chunk (G = CPG * CH)
        ROUTED: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_KD: tl.constexpr, T_P: tl.constexpr, RB: tl.constexpr, NB: tl.constexpr,
        PREC: tl.constexpr, COMPACT: tl.constexpr, NS_P: tl.constexpr, DSTAGES: tl.constexpr, PDL: tl.constexpr,
        SUB: tl.constexpr,  # groups per down-projection K step (BLOCK_KD = G when > 1)
    ):  # fmt: skip
        pdl_begin(PDL)
        n_prod = NG * CPG
        n_tiles = (tl.num_programs(0) - n_prod) // KS
        ticket = tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")
        offs_m = tl.arange(0, BM)
        in_m = offs_m < B
        dt = xo_ptr.dtype.element_ty
        if ticket < n_prod:  # producer: a[:, chunk] = silu(h Wg^T) * (h Wu^T), zero where the group is skipped
            g = ticket // CPG
            run = True
            if ROUTED:
                run = _any_row(mask_ptr, g, B, NG, BM)
            if run:
                offs_c = g * G + (ticket % CPG) * CH + tl.arange(0, CH)
                in_c = offs_c < (g + 1) * G
                acc_g = tl.zeros([BM, CH], tl.float32)
                acc_u = tl.zeros([BM, CH], tl.float32)
                for k0 in range(0, D, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    in_k = offs_k < D
                    a = tl.load(h_ptr + offs_m[:, None] * D + offs_k[None, :], mask=in_m[:, None] & in_k[None, :],
                                other=0.0)  # fmt: skip
                    wmask = in_c[:, None] & in_k[None, :]
                    wg = tl.load(wg_ptr + offs_c.to(tl.int64)[:, None] * D + offs_k[None, :], mask=wmask, other=0.0)
                    wu = tl.load(wu_ptr + offs_c.to(tl.int64)[:, None] * D + offs_k[None, :], mask=wmask, other=0.0)
                    acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=PREC)
                    acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=PREC)
                gv = acc_g.to(dt).to(tl.float32)  # F.linear outputs in the model dtype
                uv = acc_u.to(dt).to(tl.float32)
                sg = (gv / (1.0 + tl.exp(-gv))).to(dt).to(tl.float32)  # F.silu in the model dtype
                av = sg * uv
                if ROUTED:
                    tok = tl.load(mask_ptr + offs_m * NG + g, mask=in_m, other=0).to(tl.int32)
                    av = tl.where(tok[:, None] > 0, av, 0.0)
                tl.store(a_ptr + offs_m[:, None] * DF + offs_c[None, :], av.to(dt), mask=in_m[:, None] & in_c[None, :])
            tl.debug_barrier()
            tl.atomic_add(cnt_ptr + 1 + ((g + 1) * KS - 1) // NG, 1, sem="release", scope="gpu")  # g's split
        else:  # consumer (split-major tickets): columns [tile*BLOCK_N, ...) of split s's a Wd^T
            j = ticket - n_prod
            s = j // n_tiles
            tile = j % n_tiles
            g_lo = s * NG // KS
            g_hi = (s + 1) * NG // KS
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            in_n = offs_n < D
            wait_for(cnt_ptr + 1 + s, (g_hi - g_lo) * CPG)  # only this split's producers (earlier tickets)
            acc = tl.zeros([BM, BLOCK_N], tl.float32)
            acc = _routed_k_loop(acc, a_ptr, wd_ptr, offs_m, in_m, offs_n, in_n, g_lo * G, g_hi * G, DF, mask_ptr, B,
                                 NG, G, list_ptr + j * NS_P, ROUTED, BM, BLOCK_KD, PREC, True, COMPACT, NS_P,
                                 DSTAGES, SUB)  # fmt: skip
            last = True
            if KS > 1:
                last, acc = _split_k_sum(acc, part_ptr, cnt_ptr + 1 + KS, tile, n_tiles, s, KS, BM, BLOCK_N)
            if last:  # the tile's sum: + residual, its sum of squares
                io = offs_m[:, None] * D + offs_n[None, :]
                msk = in_m[:, None] & in_n[None, :]
                xr = tl.load(x_ptr + io, mask=msk, other=0.0).to(tl.float32)
                y = acc.to(dt)
                if HAS_BIAS:  # after the projection's rounding, as F.linear(a, W) + bias
                    y = (
                        y.to(tl.float32) + tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
                    ).to(dt)
                xn = (xr + y.to(tl.float32)).to(dt)
                tl.store(xo_ptr + io, xn, mask=msk)
                xf = tl.where(msk, xn.to(tl.float32), 0.0)
                tl.store(ss_ptr + tile * BM + offs_m, tl.sum(xf * xf, 1))
                if arrive(cnt_ptr + 1 + KS + n_tiles, n_tiles):  # the last tile: counters back to 0, next norm
                    tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
                    for sp in range(0, KS):
                        tl.atomic_xchg(cnt_ptr + 1 + sp, 0, sem="relaxed", scope="gpu")
                    _norm_tail(xo_ptr, nw_ptr, hn_ptr, ss_ptr, n_tiles, B, D, eps, BM, T_P, RB, NB)


# --------------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------------
def router_overlap(cuda: bool) -> bool:
    """Whether a routed decode layer runs its routers beside the QKV launch (on a side stream;
    QKV then computes every Q head, which the routed attention and O ignore for groups no token runs) instead
    of before it. A Q head is the same GEMV whether or not its neighbours run, so both give the same logits bit
    for bit. The rule: beside QKV wherever a side stream exists (cuda), before it on the CPU, where the launches
    run in order anyway (docs/kernels.md#fused-decode-layer); ``launch_overrides(router_overlap=0 / 1)`` forces
    either, also on the CPU (no side stream there: the same launches in order, for the tests)."""
    return bool(_ov("router_overlap", int(cuda)))


def _prec(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _sms(t: torch.Tensor) -> int:
    if t.is_cuda:
        return torch.cuda.get_device_properties(t.device).multi_processor_count
    return 132


def _gemv_blocks(t: torch.Tensor) -> tuple[int, int]:
    """(BLOCK_K, num_warps) of the weight-streaming loops: wide K tiles on the GPU, small in the interpreter."""
    if not t.is_cuda:
        return 64, 1
    return _ov("block_k", 256), _ov("num_warps", 4)


def _stages(t: torch.Tensor, rule: int | None = None) -> dict:
    """The kernel's num_stages: the override, else ``rule``, else Triton's default."""
    stages = _ov("num_stages", rule)
    return {"num_stages": stages} if t.is_cuda and stages is not None else {}


# A list-driven K loop keeps about (stages - 1) / 2 weight tiles in flight where the predicated loop keeps
# stages - 1, so it runs deeper than Triton's default (docs/kernels.md#fused-decode-layer).
COMPACT_STAGES = 5
# The down loop gathers whole groups narrower than this into steps of up to this many columns (``down_step``;
# wider groups step one at a time), so that narrow groups take no more loop trips than 128-column ones
# (docs/kernels.md#fused-decode-layer).
NARROW_DOWN_SPAN = 128


def _norm_blocks(b: int, d: int, t: torch.Tensor) -> dict:
    """Row and column tile of the single-program RMSNorm passes: [RB, NB] with RB * NB = 16384 elements on the
    GPU, 256 in the interpreter. The pass runs in one program after every tile is done, so its dependent steps
    are on the critical path; wider steps win over the registers they take from the kernel (a sweep of
    ``norm_tile``, docs/kernels.md#fused-decode-layer)."""
    rb = max(2, next_pow2(b))
    total = _ov("norm_tile", 16384) if t.is_cuda else 256
    return {"RB": rb, "NB": max(16, min(next_pow2(d), total // rb))}


def qkv_row_slices(head_dim: int, qk_norm: bool, n_heads: int, sms: int) -> int:
    """Row slices per head for the QKV kernel: each slice >= 32 rows of each RoPE half (then the K split,
    ``k_splits``, fills the SMs: wider tiles read faster than more of them)."""
    if qk_norm:
        return 1
    rs = 1
    while rs * 2 * 64 <= head_dim and n_heads * rs < 2 * sms:
        rs *= 2
    return rs


# Caches of at least this many keys take the long-context split rule; LONG_WAVES: the programs per SM it aims
# for (docs/kernels.md#split-count-at-long-context).
LONG_CONTEXT = 8192
LONG_WAVES = 4


def long_context(max_len: int) -> bool:
    """Whether decode attention over a cache of ``max_len`` keys takes the long-context split rule (the
    ``long_context`` override, else: from ``LONG_CONTEXT`` keys)."""
    return max_len >= LONG_CONTEXT and bool(_ov("long_context", 1))


def attn_split_cap(max_len: int) -> int:
    """The most KV splits a decode attention call takes: at most 16, each of at least 256 keys; at long
    context (``long_context``) at most 32, each of at least 512 keys."""
    if long_context(max_len):
        return max(1, min(32, max_len // 512))
    return max(1, min(16, max_len // 256))


def attn_programs(max_len: int, sms: int) -> int:
    """The programs the split rule aims for: one per SM; at long context ``LONG_WAVES`` per SM, so that the
    running pairs' count rounds the last wave off by a small part (``attn_num_splits``)."""
    return sms * (LONG_WAVES if long_context(max_len) else 1)


def attn_num_splits(running: int, max_len: int, programs: int) -> int:
    """KV splits of each running (token, group) pair, from how many of the batch's pairs run: ``programs //
    running`` (``attn_programs``: about one program per SM, at long context several) within ``attn_split_cap``.
    At short context more programs lose (the merging program reads every split's partials in turn), fewer
    leave SMs idle, with every pair running and with half of them skipped alike
    (docs/kernels.md#fused-decode-layer); at long context a split's keys outweigh its merge, and one program
    per SM leaves up to half of them idle when the running count passes a divisor of the SM count
    (docs/kernels.md#split-count-at-long-context). The kernel applies it to the count it reads from the mask,
    so the count, and with it a token's rounding, depends on the batch's masks (a repeat is bit-identical)."""
    return max(1, min(attn_split_cap(max_len), programs // max(1, running)))


def k_splits(n_tiles: int, max_splits: int, sms: int) -> int:
    """K splits of an output-tiled GEMV (O, down): the largest power of two <= max_splits that keeps the
    programs at most ~2 per SM, so that every SM streams weights with several programs (docs/kernels.md,
    "Fused decode layer")."""
    ks = 1
    while ks * 2 <= max_splits and n_tiles * ks * 2 <= 2 * sms:
        ks *= 2
    return ks


def ffn_chunk(group: int, n_groups: int, sms: int) -> int:
    """Channels per FFN producer: the group's largest power-of-two divisor (<= 128), halved down to 16
    while there are fewer than ~2 producers per SM."""
    ch = largest_pow2_divisor(group, 128)
    if ch < 16:
        raise ValueError(f"FFN group size {group} is not a multiple of 16 channels")
    while ch > 16 and n_groups * (group // ch) < 2 * sms:
        ch //= 2
    return ch


def down_step(group: int, n_groups: int, splits: int, step: int, span: int) -> tuple[int, int]:
    """(BLOCK_KD, SUB) of the FFN's down-projection loop: sub-steps of the group's largest power-of-two divisor
    <= step, and SUB > 1 whole groups a step, up to ``span`` columns (0: one group), where every K split starts
    on a step (split s starts at group s * n_groups // splits) and the step's SUB run bits fit below its first
    column (2**SUB <= the step's columns: at most 8 groups of 32 a step). Narrow groups then take as few loop trips as
    ``span``-wide ones and read the same bytes (docs/kernels.md#fused-decode-layer)."""
    bkd = largest_pow2_divisor(group, step)
    sub = 1
    if bkd == group:
        # a list entry is the step's first column (a multiple of bkd * sub) plus SUB run bits: 2**SUB <= bkd * sub
        while (
            bkd * sub * 2 <= span
            and 2 ** (sub * 2) <= bkd * sub * 2
            and all(s * n_groups // splits % (sub * 2) == 0 for s in range(splits))
        ):
            sub *= 2
    return bkd, sub


def _compact(mask: torch.Tensor | None, steps: int) -> tuple[bool, int]:
    """(COMPACT, NS_P) of a routed K loop of at most ``steps`` steps a program: the list-driven loop (the rule;
    ``compact_k=0`` predicates instead), its list length a power of two >= steps; 1 without a list, so that the
    predicated loop's compiled kernel does not depend on the step count."""
    compact = mask is not None and bool(_ov("compact_k", 1))
    return compact, next_pow2(max(steps, 1)) if compact else 1


def _k_lists(t: torch.Tensor, programs: int, ns_p: int, compact: bool) -> torch.Tensor:
    """int32 scratch [programs, NS_P]: each program's list of the K steps it visits (COMPACT), else a dummy."""
    return torch.empty(programs * ns_p if compact else 1, dtype=torch.int32, device=t.device)


# --------------------------------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------------------------------
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
    from wide.kernels.attention_reference import attention_decode_ref

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
