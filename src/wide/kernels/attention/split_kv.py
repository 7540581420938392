"""The online-softmax step every attention kernel takes, and the split-KV decode loop built on it: online softmax of
one (token, KV group)'s query heads over one slice of its cache.

The routed prefill kernel (``ops._prefill_kernel``) takes the step over its query tiles. Both decode attentions
run the loop: the routed decode op (``ops._decode_split_kernel``, splits merged by a reduce kernel) and the fused
decode layer (``fused_decode.kernels._attn_kernel``, splits merged by the last split to arrive). They differ in how
they pick splits and merge them, never in how a split reads its keys
(docs/kernels.md#split-k-at-decode).
"""

from __future__ import annotations

from .._triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def softmax_step(q, k, v, acc, l_i, m_i, qk_scale, valid, MASKED: tl.constexpr, PREC: tl.constexpr):
        """One online-softmax step in the log2 domain, shared by every attention kernel: q [M, D], k / v [N, D],
        valid [M, N] if MASKED (masked scores are -inf) -> (acc, l_i, m_i) updated. A row whose scores so far are
        all masked keeps m_i -inf and adds nothing (m_safe: no inf - inf)."""
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)  # [M, N] fp32, unscaled (qk_scale > 0)
        if MASKED:
            qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.math.exp2(qk * qk_scale - m_safe[:, None])  # one FMA per element
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        return acc, l_i, m_new

    @triton.jit
    def split_kv_softmax(
        q, k_base, v_base, s_ks, s_vs, lo, hi, qk_scale,
        HPG_P: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """q: [HPG_P, HEAD_D] (the group's query heads, padded rows zero); keys [lo, hi) at k_base / v_base +
        key * s_ks / s_vs (k_base, v_base already offset to the group and the head-dim columns [1, HEAD_D]).
        -> (out [HPG_P, HEAD_D] fp32, normalised; lse [HPG_P] fp32 in the log2 domain, -inf when the slice is
        empty). Log2 domain: qk_scale includes log2(e)."""
        offs_n = tl.arange(0, BLOCK_N)
        m_i = tl.full([HPG_P], float("-inf"), tl.float32)
        l_i = tl.zeros([HPG_P], tl.float32)
        acc = tl.zeros([HPG_P, HEAD_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            kn = n0 + offs_n
            kin = kn < hi
            k = tl.load(k_base + kn[:, None].to(tl.int64) * s_ks, mask=kin[:, None], other=0.0)
            v = tl.load(v_base + kn[:, None].to(tl.int64) * s_vs, mask=kin[:, None], other=0.0)
            acc, l_i, m_i = softmax_step(q, k, v, acc, l_i, m_i, qk_scale, kin[None, :], True, PREC)
        ok = l_i > 0
        out = acc / tl.where(ok, l_i, 1.0)[:, None]
        lse = tl.where(ok, m_i + tl.math.log2(tl.where(ok, l_i, 1.0)), float("-inf"))
        return out, lse
