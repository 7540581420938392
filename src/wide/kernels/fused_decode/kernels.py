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

The launch shapes are ``rules.py``'s, the ops that launch these kernels ``ops.py``'s (``torch.library``
custom ops: CUDA-graph safe, no host sync); the counters come from the zeroed per-stream buffer of
``_split_reduce`` and every kernel leaves them zeroed.
"""

from __future__ import annotations

from .._triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .._split_reduce import arrive, sum_partials, wait_for
    from .._triton_utils import pdl_begin
    from ..attention.split_kv import split_kv_softmax


_LOG2E = 1.4426950408889634


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
        k_base = kc_ptr + b64 * s_kb + g * s_kh + offs_d[None, :]
        v_base = vc_ptr + b64 * s_vb + g * s_vh + offs_d[None, :]
        out, lse = split_kv_softmax(q, k_base, v_base, s_ks, s_vs, lo, hi, qk_scale, HPG_P, HEAD_D, BLOCK_N, PREC)
        if ns == 1:
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
        else:
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
