"""Torch references of the fused decode layer's ops: the semantics, in the order torch computes them (the
kernels are tested against these; production code does not call them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
