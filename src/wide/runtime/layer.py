"""One decoder layer of the runtime as a function of tensors (``layer_step``): the weights a layer carries
(``LayerWeights``), the static side a compiled step specialises on (``StepConfig``), and the layer's routing
decisions (``decide``), which the fused decode step (``wide.runtime.fused``) takes through the same function.

The norms and RoPE are the Hugging Face modules' math in torch (``rms_norm``, ``rotate_half``); the kernels'
references (``wide.kernels.fused_decode.reference``) are the tests' oracles, not this module's math.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from wide import kernels as K


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] -> Llama RMSNorm as the Hugging Face module computes it: fp32 inside, x's dtype out, times the
    weight [D]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """x: [..., d] -> [-x[..., d/2:], x[..., :d/2]] (RoPE's rotation, as Hugging Face's Llama)."""
    lo, hi = x.chunk(2, dim=-1)
    return torch.cat((-hi, lo), dim=-1)


class LayerWeights(NamedTuple):
    """One decoder layer's tensors (None: absent, or not used by this runtime's mode)."""

    ln_attn: torch.Tensor  # [D]
    w_qkv: torch.Tensor | None  # dense: [Q; K; V] = [(Hq + 2 Hk)*d, D]
    b_qkv: torch.Tensor | None
    wq: torch.Tensor | None  # routed: [Hq*d, D]
    bq: torch.Tensor | None
    w_kv: torch.Tensor | None  # routed: [K; V] = [2 Hk*d, D]
    b_kv: torch.Tensor | None
    wo: torch.Tensor  # [D, Hq*d]
    bo: torch.Tensor | None
    q_norm: torch.Tensor | None  # [d] (Qwen3)
    k_norm: torch.Tensor | None
    ln_ffn: torch.Tensor  # [D]
    w_gate_up: torch.Tensor | None  # dense: [gate; up] = [2 D', D]
    w_gate: torch.Tensor | None  # routed: [D', D] each
    w_up: torch.Tensor | None
    w_down: torch.Tensor  # [D, D']
    head_attn: tuple | None  # routed: the attention router folded for inference (Router.fold)
    head_ffn: tuple | None  # routed: the FFN router folded for inference
    # routed: constant biases added after O / down (the routers' out_bias: static width's compensation)
    out_bias_attn: torch.Tensor | None = None  # [D]
    out_bias_ffn: torch.Tensor | None = None  # [D]


class StepConfig(NamedTuple):
    """The static (Python) side of a layer step: a compiled step specialises on these values."""

    routed: bool
    decode: bool
    n_q: int
    n_kv: int
    head_dim: int
    g_attn: int
    g_ffn: int
    eps: float
    qk_eps: float
    force_k: str | None  # GEMM-K path forced for O and down (None: the plan's choice)
    router_residual: bool  # the routers read the residual stream, not its norm (WideConfig.router_input)
    ffn_router_from_layer: bool  # the FFN router reads the layer's input (WideConfig.ffn_router_source)
    # expected skipped fractions (bucketed: ``K.sparsity_bucket``), what ``K.plan`` reads per decision
    attn_sparsity_hint: float | None = None
    ffn_sparsity_hint: float | None = None


class Masks(NamedTuple):
    """One layer's execute masks (None: dense, or not decided yet)."""

    attn: torch.Tensor | None  # [B, T, Hk]
    ffn: torch.Tensor | None  # [B, T, N_G]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, d]; cos, sin: [B, T, d]."""
    c, s = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    return x * c + rotate_half(x) * s


def _attention(
    x: torch.Tensor,
    cos,
    sin,
    pos,
    lens,
    w: LayerWeights,
    ck: torch.Tensor,
    cv: torch.Tensor,
    st: StepConfig,
    active: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Masks]:
    """x: [B, T, D] -> (attention block output [B, T, D], this layer's masks: the attention router's on this
    layer's input, and the FFN's too when it reads the layer input; None when dense or not decided here) and
    writes this layer's K/V into the cache. ``active`` [B] bool (decode): rows set False run no attention or FFN
    group (their masks are all False: they read no KV and add nothing to the weights the batch's union reads)."""
    b, t, _ = x.shape
    h2 = rms_norm(x, w.ln_attn, st.eps).reshape(b * t, -1)  # [M, D]
    kv_width = st.n_kv * st.head_dim
    ffn_mask = None
    if st.routed:
        rin = x if st.router_residual else h2.view(b, t, -1)  # [B, T, D]: what the routers read
        mask, ffn_mask = decide(rin, w.head_attn, w.head_ffn if st.ffn_router_from_layer else None)
        if active is not None:  # idle rows of a padded decode batch: no group runs
            mask = mask & active[:, None, None]
            ffn_mask = None if ffn_mask is None else ffn_mask & active[:, None, None]
        k, v = F.linear(h2, w.w_kv, w.b_kv).split([kv_width, kv_width], dim=-1)  # [M, Hk*d] each
        plan = K.plan(b * t, st.g_attn, mask.shape[-1], st.attn_sparsity_hint, force_k=st.force_k)
        route = K.plan_route(mask, plan)
        # Q's inactive heads stay unspecified: attention ignores them
        q = K.routed_gemm_mn(h2, w.wq, route, st.g_attn, zero_inactive=False)
        if w.bq is not None:  # bias only where the group runs (inactive outputs stay 0)
            q = q + w.bq * mask.reshape(b * t, -1).repeat_interleave(st.g_attn, dim=-1).to(q.dtype)
    else:
        mask, route = None, None
        q, k, v = F.linear(h2, w.w_qkv, w.b_qkv).split([st.n_q * st.head_dim, kv_width, kv_width], dim=-1)
    k = k.reshape(b, t, st.n_kv, st.head_dim)
    v = v.reshape(b, t, st.n_kv, st.head_dim)
    q = q.reshape(b, t, st.n_q, st.head_dim)
    if w.q_norm is not None:  # Qwen3
        q, k = rms_norm(q, w.q_norm, st.qk_eps), rms_norm(k, w.k_norm, st.qk_eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    bidx = torch.arange(b, device=x.device)[:, None]
    ck.index_put_((bidx, pos), k)  # ck, cv: [B_max, S, Hk, d]
    cv.index_put_((bidx, pos), v)
    if st.decode:
        m = mask[:, 0] if mask is not None else torch.ones(b, st.n_kv, dtype=torch.bool, device=x.device)
        if mask is None and active is not None:
            m = m & active[:, None]
        o = K.routed_attention_decode(q[:, 0], ck[:b], cv[:b], lens + 1, m).unsqueeze(1)  # [B, 1, Hq, d]
    elif st.routed:
        o = K.routed_attention_prefill(q, ck[:b, :t], cv[:b, :t], mask, route=route)
    else:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        ).transpose(1, 2)
    o2 = o.reshape(b * t, -1)  # [M, Hq * d]
    if st.routed:
        y = K.routed_gemm_k(o2, w.wo, route, st.g_attn, x_zeroed=True)
    else:
        y = F.linear(o2, w.wo)
    if w.bo is not None:
        y = y + w.bo
    if w.out_bias_attn is not None:
        y = y + w.out_bias_attn
    return y.view(b, t, -1), Masks(mask, ffn_mask)


def decide(
    rin: torch.Tensor, head_attn: tuple | None, head_ffn: tuple | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """rin: [..., D] -> the attention router's mask [..., Hk] and, given its head, the FFN router's [..., N_G] on
    the same input (one launch for both: ``router_decisions_pair``); (None, None) without routers (dense).
    Both runtime paths decide through it."""
    if head_attn is None:
        return None, None
    if head_ffn is None:
        return K.router_decisions(rin, *head_attn), None
    return K.router_decisions_pair(rin, head_attn, head_ffn)


def _ffn(
    x: torch.Tensor,
    w: LayerWeights,
    st: StepConfig,
    mask: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [B, T, D] -> (FFN block output [B, T, D], execute mask [B, T, N_G] or None when dense); ``mask``:
    the decisions already taken from the layer input (ffn_router_from_layer), else the router reads x's."""
    b, t, _ = x.shape
    h2 = rms_norm(x, w.ln_ffn, st.eps).reshape(b * t, -1)
    if st.routed:
        if mask is None:
            mask = K.router_decisions(x if st.router_residual else h2.view(b, t, -1), *w.head_ffn)  # [B, T, N_G]
            if active is not None:
                mask = mask & active[:, None, None]
        plan = K.plan(b * t, st.g_ffn, mask.shape[-1], st.ffn_sparsity_hint, force_k=st.force_k)
        route = K.plan_route(mask, plan)
        a = K.routed_swiglu(h2, w.w_gate, w.w_up, route, st.g_ffn)  # zeros if inactive
        y = K.routed_gemm_k(a, w.w_down, route, st.g_ffn, x_zeroed=True)
        if w.out_bias_ffn is not None:
            y = y + w.out_bias_ffn
    else:
        gate, up = F.linear(h2, w.w_gate_up).chunk(2, dim=-1)  # [M, D'] each, one GEMM
        y = F.linear(F.silu(gate) * up, w.w_down)
    return y.view(b, t, -1), mask


def layer_step(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    lens: torch.Tensor,
    w: LayerWeights,
    ck: torch.Tensor,
    cv: torch.Tensor,
    st: StepConfig,
    active: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Masks]:
    """One decoder layer: x [B, T, D] at positions pos [B, T] (cos/sin [B, T, d]; lens [B]: cached
    tokens before this step) -> (x [B, T, D], this layer's execute masks, None when dense). Tensors only
    (plus the static ``st``), so that one compiled step serves every layer. ``active`` [B] bool: rows that run
    (None: all); the others run no group (``_attention``)."""
    a, masks = _attention(x, cos, sin, pos, lens, w, ck, cv, st, active)
    x = x + a
    f, ffn_mask = _ffn(x, w, st, masks.ffn, active)
    return x + f, Masks(masks.attn, ffn_mask)
