"""The routers' decision rule, computed one way everywhere (docs/routing.md#the-decision-rule).

A router is a low-rank projection and a margin head. For a router input h [M, D] (the normed hidden
state) in the compute dtype ``dt`` (the model dtype; under autocast the autocast dtype):

  r      = h · W_downᵀ          W_down rounded to dt; exact products, fp32 accumulation -> r fp32 [M, R]
  margin = r · W_marginᵀ + b    fp32 [M, N_G]; W_margin = W_up[skip] − W_up[execute],
                                b = b_up[skip] − b_up[execute] + skip_bias   (``Router.head``)
  a group runs where margin <= 0 (argmax); Gumbel training samples on the same margin.

Training (``wide.routing.Router``), the masked evaluation path (``WideModel``) and the runtime call the
ops below, so a given h yields the same decisions whichever path serves it. Bit-equality between paths
needs more than one formula: row i's margin must not depend on how many other rows share the call
(decode sees one token, scoring a whole sequence), so the summation order is fixed per device:

* CUDA: one Triton kernel for every M. Programs of 16 rows x one slice of D (the slices depend on D
  only); fp32 partials summed in split order by the last program to arrive (``_split_reduce``), or, for
  many rows, by the one program that computed them in turn (the same partials, the same sum), or, for a
  head of many groups, by each of the head programs that share it (below); the head in fp32 FMA. Nothing
  in a row's arithmetic depends on M or on the other rows.
* CPU (and CUDA under the interpreter): products and sums in fp64, rounded to fp32 — exact up to the
  final rounding, so independent of any BLAS blocking.

The shared head (split schedule, ``SHARED_HEAD_MIN_GROUPS`` groups or more): a row block's programs draw
tickets; the first SPLITS compute the splits of D, the next HEAD_PROGS each wait for those partials (earlier
tickets: running or done), sum them in split order (every head program gets the same r) and compute every
HEAD_PROGS-th block of ``SHARED_HEAD_BLOCK_G`` groups. A group's margin is the same FMA chain over the rank
whichever program or step width computes it, so the bits do not change (docs/kernels.md#fused-decode-layer).

``router_margin`` returns the margin (differentiable: training), ``router_decisions`` the execute mask
(bool, the runtime); ``router_decisions_pair`` decides two routers that read the same input in one launch,
each router's programs running the single-router code with that router's own tile constants, so each mask
equals its own ``router_decisions`` bit for bit. All are ``torch.library`` custom ops (torch.compile /
CUDA-graph safe).
"""

from __future__ import annotations

import torch

from .._split_reduce import tile_counters
from .._triton_utils import HAS_TRITON, SUPPORTED_DTYPES, interpret_mode, next_pow2, pdl_launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .._split_reduce import arrive, sum_partials, wait_for
    from .._triton_utils import pdl_begin

ROUTER_BLOCK_M = 16  # rows per program, for every M (the row arithmetic must not depend on M)
# groups per step of the margin head; any width gives the same bits (docs/kernels.md#fused-decode-layer). Split
# schedule (few rows: decode): up to 512, one step; serial schedule (many rows): 128, whose registers let an SM
# hold more programs
MARGIN_MAX_BLOCK_G = 512
MARGIN_MAX_BLOCK_G_SERIAL = 128
MAX_RANK = 128
SERIAL_MIN_BLOCKS = 64  # row blocks from which one program per block runs all its splits (default_config)
# a head of this many groups or more is shared by one program per SHARED_HEAD_BLOCK_G groups (split schedule);
# fewer groups run faster as one step of the last split (docs/kernels.md#fused-decode-layer)
SHARED_HEAD_MIN_GROUPS = 129
SHARED_HEAD_BLOCK_G = 32


def default_config(d: int, m: int = 1) -> dict:
    """The launch for M rows of hidden size d. The arithmetic (BLOCK_D, SPLITS, num_warps: >= 512 columns of D
    per split, at most 8 splits) is a function of D alone, so every M runs the same per-row summation; M picks
    only the schedule: SERIAL (one program per row block runs its splits in turn) once the row blocks alone fill
    the GPU (docs/routing.md#the-decision-rule)."""
    splits = 1
    while splits < 8 and splits * 2 * 512 <= d:
        splits *= 2
    serial = int(splits > 1 and -(-m // ROUTER_BLOCK_M) >= SERIAL_MIN_BLOCKS)
    return {"BLOCK_D": 128, "SPLITS": splits, "num_warps": 4, "HEAD_FIRST": 1, "SERIAL": serial}


def head_schedule(ng: int, conf: dict) -> tuple[int, int]:
    """(BLOCK_G, HEAD_PROGS) of a head of ng groups under launch ``conf``: the groups a step, and the programs
    sharing the head (0: the program that sums the partials runs it alone). A config's BLOCK_G / HEAD_PROGS
    force them; neither changes a bit of the margins (the schedule, not the arithmetic)."""
    serial, splits = conf.get("SERIAL", 0), conf["SPLITS"]
    forced_g, forced_p = conf.get("BLOCK_G"), conf.get("HEAD_PROGS")
    shared = not serial and splits > 1 and (ng >= SHARED_HEAD_MIN_GROUPS if forced_p is None else forced_p > 0)
    if shared:
        block_g = forced_g or SHARED_HEAD_BLOCK_G
        return block_g, forced_p or -(-ng // block_g)
    cap = MARGIN_MAX_BLOCK_G_SERIAL if serial else MARGIN_MAX_BLOCK_G
    return forced_g or min(max(16, next_pow2(ng)), cap), 0


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a router reads ``x`` in: the autocast dtype inside an autocast region, else x's."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


# --------------------------------------------------------------------------------------------------
# Torch reference (CPU; the semantics)
# --------------------------------------------------------------------------------------------------
def router_margin_ref(
    h: torch.Tensor, w_down: torch.Tensor, w_margin: torch.Tensor, b_margin: torch.Tensor
) -> torch.Tensor:
    """h: [M, D] -> margin [M, N_G] fp32. Products and sums in fp64 (exact for bf16 / fp16 / fp32
    inputs up to the final rounding), so a row's value does not depend on M."""
    w = w_down.to(h.dtype).double()
    r = (h.double() @ w.t()).float()  # [M, R]: the fp32 projection
    return (r.double() @ w_margin.double().t() + b_margin.double()).float()


def router_decisions_ref(
    h: torch.Tensor, w_down: torch.Tensor, w_margin: torch.Tensor, b_margin: torch.Tensor
) -> torch.Tensor:
    """h: [M, D] -> execute mask [M, N_G] bool (margin <= 0)."""
    return router_margin_ref(h, w_down, w_margin, b_margin) <= 0


# --------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _head_block(wm_ptr, bm_ptr, g0, NG, R, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        """The margin head's groups g0 .. g0 + BLOCK_G: wm [BLOCK_G, BLOCK_R], bias [BLOCK_G] (fp32, 0 outside)."""
        offs_g = g0 + tl.arange(0, BLOCK_G)
        offs_r = tl.arange(0, BLOCK_R)
        in_g = offs_g < NG
        wm = tl.load(
            wm_ptr + offs_g[:, None] * R + offs_r[None, :], mask=in_g[:, None] & (offs_r < R)[None, :], other=0.0
        )
        return wm, tl.load(bm_ptr + offs_g, mask=in_g, other=0.0)

    @triton.jit
    def _margin_block(r, wm, bias, g0, row0, out_ptr, M, NG, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
                      OUT_MARGIN: tl.constexpr):  # fmt: skip
        """Rows row0.. x groups g0..: margin = r wmᵀ + bias in fp32 -> stored as margin or run flag (uint8)."""
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_g = g0 + tl.arange(0, BLOCK_G)
        margin = tl.dot(r, tl.trans(wm), input_precision="ieee") + bias[None, :]  # [BLOCK_M, BLOCK_G]
        ptrs = out_ptr + offs_m[:, None] * NG + offs_g[None, :]
        msk = (offs_m < M)[:, None] & (offs_g < NG)[None, :]
        if OUT_MARGIN:
            tl.store(ptrs, margin, mask=msk)
        else:
            tl.store(ptrs, (margin <= 0).to(tl.uint8), mask=msk)

    @triton.jit
    def _margin_store(r, row0, wm_ptr, bm_ptr, out_ptr, M, NG, R, wm0, b0, BLOCK_M: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, OUT_MARGIN: tl.constexpr,
                      HEAD_FIRST: tl.constexpr):  # fmt: skip
        """r: [BLOCK_M, BLOCK_R] fp32 (columns >= R are 0) for rows row0.. -> margin (fp32) or run (uint8).
        HEAD_FIRST: the head's first block (wm0, b0) was loaded earlier, off the reduction's critical path."""
        if HEAD_FIRST:
            wm, bias = wm0, b0
        else:
            wm, bias = _head_block(wm_ptr, bm_ptr, 0, NG, R, BLOCK_R, BLOCK_G)
        _margin_block(r, wm, bias, 0, row0, out_ptr, M, NG, BLOCK_M, BLOCK_G, OUT_MARGIN)
        for g0 in range(BLOCK_G, NG, BLOCK_G):
            wm, bias = _head_block(wm_ptr, bm_ptr, g0, NG, R, BLOCK_R, BLOCK_G)
            _margin_block(r, wm, bias, g0, row0, out_ptr, M, NG, BLOCK_M, BLOCK_G, OUT_MARGIN)

    @triton.jit
    def _dot_step(acc, h_ptr, wd_ptr, offs_m, in_m, d0, d_hi, R, stride_hm, stride_wd, PREC: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
        """acc [BLOCK_M, BLOCK_R] += h[offs_m, d0:d0 + BLOCK_D] @ w_down[:, d0:d0 + BLOCK_D].T, columns at or past
        d_hi (and rows past M, R) loaded as zeros: the one step both schedules run."""
        offs_r = tl.arange(0, BLOCK_R)
        in_r = offs_r < R
        offs_d = d0 + tl.arange(0, BLOCK_D)
        in_d = offs_d < d_hi
        a = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_d[None, :], mask=in_m[:, None] & in_d[None, :],
                    other=0.0)  # fmt: skip
        b = tl.load(wd_ptr + offs_r[:, None] * stride_wd + offs_d[None, :], mask=in_r[:, None] & in_d[None, :],
                    other=0.0)  # fmt: skip
        return tl.dot(a, tl.trans(b), acc, input_precision=PREC)

    @triton.jit
    def _split_dot(h_ptr, wd_ptr, offs_m, in_m, d_lo, d_hi, R, stride_hm, stride_wd, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
        """One split's partial: rows offs_m x columns d_lo..d_hi of D -> r [BLOCK_M, BLOCK_R] fp32."""
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for d0 in range(d_lo, d_hi, BLOCK_D):
            acc = _dot_step(acc, h_ptr, wd_ptr, offs_m, in_m, d0, d_hi, R, stride_hm, stride_wd, PREC, BLOCK_R,
                            BLOCK_D)  # fmt: skip
        return acc

    @triton.jit
    def _serial_splits(h_ptr, wd_ptr, base, offs_m, in_m, d_per, D, R, stride_hm, stride_wd,
                       PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                       SPLITS: tl.constexpr):  # fmt: skip
        """Every split's partial of rows offs_m, in split order, each stored at base + split x tile: the steps of
        ``_split_dot`` for split 0, 1, .. in one loop (one software pipeline across the split boundaries), the
        accumulator restarting from zero at each split's first step. A split's steps past D load zeros and add
        exact zeros, where ``_split_dot`` has no step: the same partials."""
        steps = d_per // BLOCK_D
        offs_t = tl.arange(0, BLOCK_M)[:, None] * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for it in range(0, SPLITS * steps):
            j = it // steps
            k = it - j * steps
            acc = _dot_step(acc, h_ptr, wd_ptr, offs_m, in_m, j * d_per + k * BLOCK_D, tl.minimum(j * d_per + d_per, D),
                            R, stride_hm, stride_wd, PREC, BLOCK_R, BLOCK_D)  # fmt: skip
            if k == steps - 1:  # the split's last step: its partial is complete
                tl.store(base + j * BLOCK_M * BLOCK_R + offs_t, acc)
                acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)

    @triton.jit
    def _router_program(h_ptr, wd_ptr, wm_ptr, bm_ptr, out_ptr, ws_ptr, cnt_ptr, s, pm, M, D, R, NG, stride_hm,
                        stride_wd, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, SPLITS: tl.constexpr,
                        OUT_MARGIN: tl.constexpr, HEAD_FIRST: tl.constexpr, SERIAL: tl.constexpr,
                        HEAD_PROGS: tl.constexpr):  # fmt: skip
        """One router's program (split s of D, row block pm): the arithmetic of a row depends on D and the
        tile constants only (docs/routing.md#the-decision-rule). HEAD_FIRST: every program loads the head's
        first block before its D loop (where the load overlaps), so whichever program reduces has it at hand.
        SERIAL: this program (s = 0) computes every split of its row block in turn and sums them itself: the
        same partials summed by the same code as when SPLITS programs each compute one (the schedule for many
        row blocks, which fill the GPU without splitting D across programs). HEAD_PROGS > 0: the shared head
        (``_shared_head_program``; counters 3 a row block)."""
        if HEAD_PROGS > 0:
            _shared_head_program(h_ptr, wd_ptr, wm_ptr, bm_ptr, out_ptr, ws_ptr, cnt_ptr + 3 * pm, pm, M, D, R, NG,
                                 stride_hm, stride_wd, PREC, BLOCK_M, BLOCK_R, BLOCK_D, BLOCK_G, SPLITS, OUT_MARGIN,
                                 HEAD_PROGS)  # fmt: skip
        else:
            _split_or_serial_program(h_ptr, wd_ptr, wm_ptr, bm_ptr, out_ptr, ws_ptr, cnt_ptr, s, pm, M, D, R, NG,
                                     stride_hm, stride_wd, PREC, BLOCK_M, BLOCK_R, BLOCK_D, BLOCK_G, SPLITS,
                                     OUT_MARGIN, HEAD_FIRST, SERIAL)  # fmt: skip

    @triton.jit
    def _shared_head_program(h_ptr, wd_ptr, wm_ptr, bm_ptr, out_ptr, ws_ptr, cnt, pm, M, D, R, NG, stride_hm,
                             stride_wd, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, SPLITS: tl.constexpr,
                             OUT_MARGIN: tl.constexpr, HEAD_PROGS: tl.constexpr):  # fmt: skip
        """Row block pm's SPLITS + HEAD_PROGS programs, each by its ticket (cnt[0]): tickets < SPLITS compute that
        split's partial and count it done (cnt[1]); the others wait for all SPLITS (earlier tickets), sum them as
        the last split would and compute head blocks p, p + HEAD_PROGS, ..; the last of them to finish (cnt[2])
        puts the counters back to 0."""
        ticket = tl.atomic_add(cnt, 1, sem="relaxed", scope="gpu")
        row0 = pm * BLOCK_M
        offs_m = row0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        tile = BLOCK_M * BLOCK_R
        base = ws_ptr + pm * SPLITS * tile
        if ticket < SPLITS:
            d_per = tl.cdiv(tl.cdiv(D, SPLITS), BLOCK_D) * BLOCK_D
            d_lo = ticket * d_per
            acc = _split_dot(h_ptr, wd_ptr, offs_m, in_m, d_lo, tl.minimum(d_lo + d_per, D), R, stride_hm, stride_wd,
                             PREC, BLOCK_M, BLOCK_R, BLOCK_D)  # fmt: skip
            offs_t = tl.arange(0, BLOCK_M)[:, None] * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
            tl.store(base + ticket * tile + offs_t, acc)
            tl.debug_barrier()  # every thread's partial stored before the (release) count
            tl.atomic_add(cnt + 1, 1, sem="release", scope="gpu")
        else:
            p = ticket - SPLITS
            wm, bias = _head_block(wm_ptr, bm_ptr, p * BLOCK_G, NG, R, BLOCK_R, BLOCK_G)  # off the wait's path
            wait_for(cnt + 1, SPLITS)
            tl.debug_barrier()
            red = sum_partials(base, tile, BLOCK_M, SPLITS, BLOCK_M, BLOCK_R)
            _margin_block(red, wm, bias, p * BLOCK_G, row0, out_ptr, M, NG, BLOCK_M, BLOCK_G, OUT_MARGIN)
            for g0 in range((p + HEAD_PROGS) * BLOCK_G, NG, HEAD_PROGS * BLOCK_G):
                wm, bias = _head_block(wm_ptr, bm_ptr, g0, NG, R, BLOCK_R, BLOCK_G)
                _margin_block(red, wm, bias, g0, row0, out_ptr, M, NG, BLOCK_M, BLOCK_G, OUT_MARGIN)
            if arrive(cnt + 2, HEAD_PROGS):  # every ticket drawn, every wait passed
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(cnt + 1, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _split_or_serial_program(h_ptr, wd_ptr, wm_ptr, bm_ptr, out_ptr, ws_ptr, cnt_ptr, s, pm, M, D, R, NG,
                                 stride_hm, stride_wd, PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                                 SPLITS: tl.constexpr, OUT_MARGIN: tl.constexpr, HEAD_FIRST: tl.constexpr,
                                 SERIAL: tl.constexpr):  # fmt: skip
        """``_router_program`` with the head run by the one program that sums the partials."""
        if HEAD_FIRST:
            wm0, b0 = _head_block(wm_ptr, bm_ptr, 0, NG, R, BLOCK_R, BLOCK_G)
        else:
            wm0 = tl.zeros([BLOCK_G, BLOCK_R], tl.float32)
            b0 = tl.zeros([BLOCK_G], tl.float32)
        row0 = pm * BLOCK_M
        offs_m = row0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        d_per = tl.cdiv(tl.cdiv(D, SPLITS), BLOCK_D) * BLOCK_D
        if SPLITS == 1:
            acc = _split_dot(h_ptr, wd_ptr, offs_m, in_m, 0, D, R, stride_hm, stride_wd, PREC, BLOCK_M, BLOCK_R,
                             BLOCK_D)  # fmt: skip
            _margin_store(acc, row0, wm_ptr, bm_ptr, out_ptr, M, NG, R, wm0, b0, BLOCK_M, BLOCK_R, BLOCK_G, OUT_MARGIN,
                          HEAD_FIRST)  # fmt: skip
        else:
            tile = BLOCK_M * BLOCK_R
            base = ws_ptr + pm * SPLITS * tile
            if SERIAL:
                _serial_splits(h_ptr, wd_ptr, base, offs_m, in_m, d_per, D, R, stride_hm, stride_wd, PREC, BLOCK_M,
                               BLOCK_R, BLOCK_D, SPLITS)  # fmt: skip
                tl.debug_barrier()  # every thread's partials visible to the whole program before the sum
                last = True
            else:
                d_lo = s * d_per
                acc = _split_dot(h_ptr, wd_ptr, offs_m, in_m, d_lo, tl.minimum(d_lo + d_per, D), R, stride_hm,
                                 stride_wd, PREC, BLOCK_M, BLOCK_R, BLOCK_D)  # fmt: skip
                offs_t = tl.arange(0, BLOCK_M)[:, None] * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
                tl.store(base + s * tile + offs_t, acc)
                last = arrive(cnt_ptr + pm, SPLITS)
            if last:
                red = sum_partials(base, tile, BLOCK_M, SPLITS, BLOCK_M, BLOCK_R)
                _margin_store(red, row0, wm_ptr, bm_ptr, out_ptr, M, NG, R, wm0, b0, BLOCK_M, BLOCK_R, BLOCK_G,
                              OUT_MARGIN, HEAD_FIRST)  # fmt: skip

    @triton.jit(do_not_specialize=["M"])
    def _router_kernel(
        h_ptr,  # [M, D]
        wd_ptr,  # [R, D] router down-projection (h's dtype)
        wm_ptr,  # [NG, R] fp32 margin head
        bm_ptr,  # [NG] fp32
        out_ptr,  # [M, NG] fp32 margins, or uint8 (a bool tensor's bytes)
        ws_ptr,  # fp32 partials [M blocks, SPLITS, BLOCK_M, BLOCK_R] when SPLITS > 1
        cnt_ptr,  # int32 ticket counters, one per block of rows (zero on entry and exit)
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
        OUT_MARGIN: tl.constexpr,
        HEAD_FIRST: tl.constexpr,
        SERIAL: tl.constexpr,
        HEAD_PROGS: tl.constexpr,  # programs sharing the head (0: the last split runs it)
        PDL: tl.constexpr,  # launched with programmatic dependent launch
    ):
        pdl_begin(PDL)
        _router_program(h_ptr, wd_ptr, wm_ptr, bm_ptr, out_ptr, ws_ptr, cnt_ptr, tl.program_id(0), tl.program_id(1),
                        M, D, R, NG, stride_hm, stride_wd, PREC, BLOCK_M, BLOCK_R, BLOCK_D, BLOCK_G, SPLITS,
                        OUT_MARGIN, HEAD_FIRST, SERIAL, HEAD_PROGS)  # fmt: skip

    @triton.jit(do_not_specialize=["M"])
    def _router_pair_kernel(
        h_ptr,  # [M, D]: the input both routers read
        wd_a, wm_a, bm_a, out_a, ws_a, cnt_a, R_A, NG_A, stride_wd_a,  # router a, as _router_kernel's arguments
        wd_b, wm_b, bm_b, out_b, ws_b, cnt_b, R_B, NG_B, stride_wd_b,  # router b
        M,
        D,
        stride_hm,
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
        SPLITS: tl.constexpr,
        BLOCK_R_A: tl.constexpr,
        BLOCK_G_A: tl.constexpr,
        BLOCK_R_B: tl.constexpr,
        BLOCK_G_B: tl.constexpr,
        HEAD_PROGS_A: tl.constexpr,
        HEAD_PROGS_B: tl.constexpr,
        PROGS_A: tl.constexpr,  # programs a row block of router a runs (axis 0: the larger of the two)
        PROGS_B: tl.constexpr,
        HEAD_FIRST: tl.constexpr,
        SERIAL: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid (max(PROGS_A, PROGS_B), row blocks, 2): axis 2 picks the router; each runs its single-launch
        program, the axis-0 programs past its own count none."""
        pdl_begin(PDL)
        s = tl.program_id(0)
        pm = tl.program_id(1)
        if tl.program_id(2) == 0:
            if s < PROGS_A:
                _router_program(h_ptr, wd_a, wm_a, bm_a, out_a, ws_a, cnt_a, s, pm, M, D, R_A, NG_A, stride_hm,
                                stride_wd_a, PREC, BLOCK_M, BLOCK_R_A, BLOCK_D, BLOCK_G_A, SPLITS, False,
                                HEAD_FIRST, SERIAL, HEAD_PROGS_A)  # fmt: skip
        else:
            if s < PROGS_B:
                _router_program(h_ptr, wd_b, wm_b, bm_b, out_b, ws_b, cnt_b, s, pm, M, D, R_B, NG_B, stride_hm,
                                stride_wd_b, PREC, BLOCK_M, BLOCK_R_B, BLOCK_D, BLOCK_G_B, SPLITS, False,
                                HEAD_FIRST, SERIAL, HEAD_PROGS_B)  # fmt: skip


def _check_head(r: int, w_margin: torch.Tensor, b_margin: torch.Tensor) -> None:
    if w_margin.dim() != 2 or w_margin.shape[1] != r:
        raise ValueError(f"margin head {tuple(w_margin.shape)} does not read a rank-{r} projection")
    if b_margin.shape != (w_margin.shape[0],):
        raise ValueError(f"margin bias {tuple(b_margin.shape)} vs {w_margin.shape[0]} groups")
    if w_margin.dtype != torch.float32 or b_margin.dtype != torch.float32:
        raise ValueError("the margin head is fp32 (Router.head / Router.fold build it so)")
    if r > MAX_RANK:
        raise ValueError(f"router rank {r} > {MAX_RANK}")


def _launch(m: int, d: int, config: dict | None) -> dict:
    """The kernel's launch constants; a config's BLOCK_G / HEAD_PROGS stay in it for ``head_schedule``."""
    conf = {**default_config(d, m), **(config or {})}  # a partial config overrides the rule's keys
    splits = conf["SPLITS"]
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"SPLITS must be a power of two, got {splits}")
    block_g = conf.get("BLOCK_G")
    if block_g is not None and (block_g < 16 or block_g & (block_g - 1)):
        raise ValueError(f"BLOCK_G must be a power of two >= 16, got {block_g}")
    progs = conf.get("HEAD_PROGS")
    if progs is not None and (progs < 0 or progs > 0 and (splits == 1 or conf["SERIAL"])):
        raise ValueError(f"HEAD_PROGS {progs}: the head is shared only in the split schedule (SPLITS > 1, SERIAL 0)")
    return conf


def _programs(conf: dict, head_progs: int) -> int:
    """Programs per row block (grid axis 0): the splits (one when SERIAL) and the head's sharers."""
    return 1 if conf["SERIAL"] else conf["SPLITS"] + head_progs


def _kernel_consts(conf: dict) -> dict:
    """conf without the head-schedule keys (``head_schedule`` turned them into per-router constants)."""
    return {k: v for k, v in conf.items() if k not in ("BLOCK_G", "HEAD_PROGS")}


def _counters(blocks: int, head_progs: int) -> int:
    """Ticket counters a launch takes: one a row block, or three with a shared head (tickets, splits done, head
    programs done; ``_shared_head_program``)."""
    return (3 if head_progs else 1) * blocks


def _workspace(h: torch.Tensor, blocks: int, splits: int, block_r: int) -> torch.Tensor:
    """fp32 partials [blocks, SPLITS, BLOCK_M, BLOCK_R] (one element when there is nothing to reduce)."""
    n = blocks * splits * ROUTER_BLOCK_M * block_r if splits > 1 else 1
    return torch.empty(n, dtype=torch.float32, device=h.device)


def _router_triton(h, w_down, w_margin, b_margin, config: dict | None, out_margin: bool) -> torch.Tensor:
    m, d = h.shape
    r, ng = w_down.shape[0], w_margin.shape[0]
    out = torch.empty(m, ng, dtype=torch.float32 if out_margin else torch.bool, device=h.device)
    if m == 0:
        return out
    conf = _launch(m, d, config)
    block_g, head_progs = head_schedule(ng, conf)  # the schedule, not the arithmetic
    blocks = triton.cdiv(m, ROUTER_BLOCK_M)
    block_r = max(16, next_pow2(r))
    ws = _workspace(h, blocks, conf["SPLITS"], block_r)
    cnt = tile_counters(h, _counters(blocks, head_progs))
    prec = "ieee" if h.dtype == torch.float32 else "tf32"
    _router_kernel[(_programs(conf, head_progs), blocks)](
        h, w_down, w_margin, b_margin, out if out_margin else out.view(torch.uint8), ws, cnt, m, d, r, ng,
        h.stride(0), w_down.stride(0), PREC=prec, BLOCK_M=ROUTER_BLOCK_M, BLOCK_R=block_r, BLOCK_G=block_g,
        OUT_MARGIN=out_margin, HEAD_PROGS=head_progs, **_kernel_consts(conf), **pdl_launch(h),
    )  # fmt: skip
    return out


def _router_pair_triton(h, router_a: tuple, router_b: tuple, config: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both routers' execute masks from one launch (h: [M, D]; each router (w_down in h's dtype, head))."""
    m, d = h.shape
    outs = tuple(torch.empty(m, w_margin.shape[0], dtype=torch.bool, device=h.device) for _, w_margin, _ in
                 (router_a, router_b))  # fmt: skip
    if m == 0:
        return outs
    conf = _launch(m, d, config)
    blocks = triton.cdiv(m, ROUTER_BLOCK_M)
    heads = [head_schedule(w_margin.shape[0], conf) for _, w_margin, _ in (router_a, router_b)]
    n_cnt = [_counters(blocks, progs) for _, progs in heads]
    cnt = tile_counters(h, sum(n_cnt))  # router a's tickets, then router b's
    args, tiles = [], {}
    for k, ((w_down, w_margin, b_margin), out, tickets, (block_g, progs)) in enumerate(
        zip((router_a, router_b), outs, (cnt[: n_cnt[0]], cnt[n_cnt[0] :]), heads)
    ):
        r, ng = w_down.shape[0], w_margin.shape[0]
        block_r = max(16, next_pow2(r))
        ws = _workspace(h, blocks, conf["SPLITS"], block_r)
        args += [w_down, w_margin, b_margin, out.view(torch.uint8), ws, tickets, r, ng, w_down.stride(0)]
        ab = "AB"[k]
        tiles |= {f"BLOCK_R_{ab}": block_r, f"BLOCK_G_{ab}": block_g, f"HEAD_PROGS_{ab}": progs,
                  f"PROGS_{ab}": _programs(conf, progs)}  # fmt: skip
    prec = "ieee" if h.dtype == torch.float32 else "tf32"
    _router_pair_kernel[(max(tiles["PROGS_A"], tiles["PROGS_B"]), blocks, 2)](
        h, *args, m, d, h.stride(0), PREC=prec, BLOCK_M=ROUTER_BLOCK_M, **tiles, **_kernel_consts(conf),
        **pdl_launch(h),
    )  # fmt: skip
    return outs


def _use_kernel(h: torch.Tensor) -> bool:
    """The kernel serves CUDA tensors; CPU tensors take the fp64 reference (also under the interpreter,
    which would be slow at a sequence's M: tests force the kernel with ``config``)."""
    return HAS_TRITON and h.is_cuda and not interpret_mode()


# --------------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("wide::router_margin", mutates_args=())
def _margin_op(h: torch.Tensor, w_down: torch.Tensor, w_margin: torch.Tensor, b_margin: torch.Tensor) -> torch.Tensor:
    if _use_kernel(h):
        return _router_triton(h, w_down.to(h.dtype).contiguous(), w_margin, b_margin, None, True)
    return router_margin_ref(h, w_down, w_margin, b_margin)


@_margin_op.register_fake
def _(h, w_down, w_margin, b_margin):
    return h.new_empty((h.shape[0], w_margin.shape[0]), dtype=torch.float32)


def _margin_setup(ctx, inputs, output) -> None:
    h, w_down, w_margin, _ = inputs
    ctx.save_for_backward(h, w_down, w_margin)


def _margin_backward(ctx, grad: torch.Tensor):
    """grad: [M, N_G] fp32. Gradients in fp32 (they do not affect any decision)."""
    h, w_down, w_margin = ctx.saved_tensors
    w = w_down.to(h.dtype).float()  # [R, D]
    hf = h.float()
    r = hf @ w.t()  # [M, R]
    dr = grad @ w_margin  # [M, R]
    dh = (dr @ w).to(h.dtype) if ctx.needs_input_grad[0] else None
    dw = (dr.t() @ hf).to(w_down.dtype) if ctx.needs_input_grad[1] else None
    dwm = grad.t() @ r if ctx.needs_input_grad[2] else None
    db = grad.sum(0) if ctx.needs_input_grad[3] else None
    return dh, dw, dwm, db


_margin_op.register_autograd(_margin_backward, setup_context=_margin_setup)


@torch.library.custom_op("wide::router_decisions", mutates_args=())
def _decisions_op(
    h: torch.Tensor, w_down: torch.Tensor, w_margin: torch.Tensor, b_margin: torch.Tensor
) -> torch.Tensor:
    if _use_kernel(h):
        return _router_triton(h, w_down.to(h.dtype).contiguous(), w_margin, b_margin, None, False)
    return router_decisions_ref(h, w_down, w_margin, b_margin)


@_decisions_op.register_fake
def _(h, w_down, w_margin, b_margin):
    return h.new_empty((h.shape[0], w_margin.shape[0]), dtype=torch.bool)


def _prepare(h: torch.Tensor, w_down: torch.Tensor, w_margin: torch.Tensor, b_margin: torch.Tensor) -> torch.Tensor:
    if h.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"router input dtype {h.dtype} not supported (fp16, bf16, fp32)")
    if w_down.dim() != 2 or w_down.shape[1] != h.shape[-1]:
        raise ValueError(f"router projection {tuple(w_down.shape)} does not read hidden size {h.shape[-1]}")
    if w_down.device != h.device or w_margin.device != h.device:
        raise ValueError(f"router weights on {w_down.device}, input on {h.device}")
    _check_head(w_down.shape[0], w_margin, b_margin)
    return h.reshape(-1, h.shape[-1]).contiguous()


def router_margin(
    h: torch.Tensor, w_down: torch.Tensor, w_margin: torch.Tensor, b_margin: torch.Tensor
) -> torch.Tensor:
    """h: [..., D] in the compute dtype -> skip margin [..., N_G] fp32 (> 0: skip). Differentiable in
    every input; w_down may be the fp32 master weight (it is rounded to h's dtype inside)."""
    h2 = _prepare(h, w_down, w_margin, b_margin)
    return _margin_op(h2, w_down, w_margin, b_margin).view(*h.shape[:-1], w_margin.shape[0])


def router_decisions(
    h: torch.Tensor,
    w_down: torch.Tensor,
    w_margin: torch.Tensor,
    b_margin: torch.Tensor,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """h: [..., D] -> execute mask [..., N_G] bool: exactly ``router_margin(...) <= 0``.

    ``config`` (BLOCK_D, SPLITS, num_warps; HEAD_FIRST, SERIAL, BLOCK_G, HEAD_PROGS: the schedule) forces the
    Triton kernel with those settings (tests and benchmarks; on CPU it needs TRITON_INTERPRET=1)."""
    h2 = _prepare(h, w_down, w_margin, b_margin)
    if config is not None:
        if not (HAS_TRITON and (h2.is_cuda or interpret_mode())):
            raise ValueError("config forces the Triton kernel: not runnable here (CPU without TRITON_INTERPRET=1)")
        out = _router_triton(h2, w_down.to(h2.dtype).contiguous(), w_margin.contiguous(), b_margin.contiguous(),
                             config, False)  # fmt: skip
    else:
        out = _decisions_op(h2, w_down, w_margin.contiguous(), b_margin.contiguous())
    return out.view(*h.shape[:-1], out.shape[-1])


@torch.library.custom_op("wide::router_decisions_pair", mutates_args=())
def _decisions_pair_op(
    h: torch.Tensor,
    w_down_a: torch.Tensor,
    w_margin_a: torch.Tensor,
    b_margin_a: torch.Tensor,
    w_down_b: torch.Tensor,
    w_margin_b: torch.Tensor,
    b_margin_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = (w_down_a, w_margin_a, b_margin_a), (w_down_b, w_margin_b, b_margin_b)
    if _use_kernel(h):
        return _router_pair_triton(h, (a[0].to(h.dtype).contiguous(), *a[1:]), (b[0].to(h.dtype).contiguous(), *b[1:]),
                                   None)  # fmt: skip
    return router_decisions_ref(h, *a), router_decisions_ref(h, *b)


@_decisions_pair_op.register_fake
def _(h, w_down_a, w_margin_a, b_margin_a, w_down_b, w_margin_b, b_margin_b):
    m = h.shape[0]
    return tuple(h.new_empty((m, wm.shape[0]), dtype=torch.bool) for wm in (w_margin_a, w_margin_b))


def router_decisions_pair(
    h: torch.Tensor, router_a: tuple, router_b: tuple, *, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """h: [..., D]; router_a / router_b: (w_down, w_margin, b_margin) -> their execute masks [..., N_G_a] /
    [..., N_G_b], each exactly ``router_decisions(h, *router)``, decided in one launch on CUDA (the runtime's
    layer start when the FFN router reads the layer input). ``config`` as in ``router_decisions``."""
    h2 = _prepare(h, *router_a)
    _prepare(h2, *router_b)  # router b's checks (h2 is already the [M, D] contiguous view)
    ra = (router_a[0], router_a[1].contiguous(), router_a[2].contiguous())
    rb = (router_b[0], router_b[1].contiguous(), router_b[2].contiguous())
    if config is not None:
        if not (HAS_TRITON and (h2.is_cuda or interpret_mode())):
            raise ValueError("config forces the Triton kernel: not runnable here (CPU without TRITON_INTERPRET=1)")
        rounded = [(w.to(h2.dtype).contiguous(), wm, bm) for w, wm, bm in (ra, rb)]
        out_a, out_b = _router_pair_triton(h2, rounded[0], rounded[1], config)
    else:
        out_a, out_b = _decisions_pair_op(h2, *ra, *rb)
    lead = h.shape[:-1]
    return out_a.view(*lead, out_a.shape[-1]), out_b.view(*lead, out_b.shape[-1])


def router_margin_kernel(
    h: torch.Tensor, w_down: torch.Tensor, w_margin: torch.Tensor, b_margin: torch.Tensor, *, config: dict | None = None
) -> torch.Tensor:
    """The Triton kernel's margins (no autograd), forced where it can run: tests compare it with the ops."""
    h2 = _prepare(h, w_down, w_margin, b_margin)
    if not (HAS_TRITON and (h2.is_cuda or interpret_mode())):
        raise ValueError("the router kernel needs CUDA or TRITON_INTERPRET=1")
    out = _router_triton(h2, w_down.to(h2.dtype).contiguous(), w_margin.contiguous(), b_margin.contiguous(),
                         config, True)  # fmt: skip
    return out.view(*h.shape[:-1], out.shape[-1])
