"""Torch references of routed attention (same semantics as the Triton kernels in `ops.py`).

Routing is one decision per KV-head group: mask [B, Tq, Hk] (prefill) or [B, Hk] (decode), True =
execute. A skipped (b, t, g) gives output 0 for all Hq/Hk query heads of group g. K/V stay dense.
"""

from __future__ import annotations

import math

import torch


def _expand_heads(x: torch.Tensor, hpg: int, dim: int) -> torch.Tensor:
    """Repeat each KV head (or group decision) hpg times along `dim` (GQA)."""
    return x if hpg == 1 else x.repeat_interleave(hpg, dim=dim)


def _zero_skipped(o: torch.Tensor, mask: torch.Tensor, hpg: int, head_dim: int) -> torch.Tensor:
    """o with the heads of skipped groups set to 0: mask [..., Hk] bool, heads on o's axis head_dim."""
    keep = _expand_heads(mask.bool(), hpg, head_dim)  # [..., Hq]
    return torch.where(keep[..., None], o, torch.zeros((), dtype=o.dtype, device=o.device))


def attention_prefill_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    sm_scale: float | None = None,
    causal: bool = True,
    *,
    upcast: bool = True,
) -> torch.Tensor:
    """Routed prefill attention by plain math.

    q [B,Tq,Hq,d], k/v [B,Tk,Hk,d], mask [B,Tq,Hk] bool -> o [B,Tq,Hq,d] (dtype of q).
    Causal is bottom-right aligned: query t sits at absolute position Tk - Tq + t.
    upcast=True computes in fp32; False computes in the input dtype (the "plain PyTorch" error bar).
    """
    bsz, tq, hq, d = q.shape
    tk, hk = k.shape[1], k.shape[2]
    hpg = hq // hk
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    cdt = torch.float32 if upcast else q.dtype
    qh = q.to(cdt).transpose(1, 2)  # [B,Hq,Tq,d]
    kh = _expand_heads(k.to(cdt).transpose(1, 2), hpg, 1)  # [B,Hq,Tk,d]
    vh = _expand_heads(v.to(cdt).transpose(1, 2), hpg, 1)  # [B,Hq,Tk,d]
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [B,Hq,Tq,Tk]
    if causal:
        qpos = torch.arange(tq, device=q.device)[:, None] + (tk - tq)
        kpos = torch.arange(tk, device=q.device)[None, :]
        s = s.masked_fill(kpos > qpos, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.matmul(p, vh).transpose(1, 2)  # [B,Tq,Hq,d]
    o = _zero_skipped(o, mask, hpg, 2)  # o: [B, Tq, Hq, d]
    return o.to(q.dtype)


def attention_prefill_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    sm_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """The torch path the routed prefill takes without Triton: SDPA in the input dtype, as the Hugging
    Face attention computes it, then the skipped groups' heads zeroed. Bit-equal to the masked path
    (WideModel) on the same device, so the runtime serves what was evaluated (docs/routing.md).
    Shapes as ``attention_prefill_ref``; Tq != Tk under causal masking falls back to it."""
    bsz, tq, hq, d = q.shape
    tk, hk = k.shape[1], k.shape[2]
    if causal and tq != tk:
        return attention_prefill_ref(q, k, v, mask, sm_scale, causal)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True, scale=sm_scale
    ).transpose(1, 2)  # [B, Tq, Hq, d]
    return _zero_skipped(o, mask, hq // hk, 2)


def attention_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    mask: torch.Tensor,
    sm_scale: float | None = None,
    *,
    upcast: bool = True,
) -> torch.Tensor:
    """Routed single-token decode attention by plain math.

    q [B,Hq,d], k_cache/v_cache [B,S,Hk,d], cache_lens [B] (attend to positions < len),
    mask [B,Hk] bool -> o [B,Hq,d]. A sequence of length 0 or a skipped group gives zeros.
    """
    bsz, hq, d = q.shape
    s_max, hk = k_cache.shape[1], k_cache.shape[2]
    hpg = hq // hk
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    cdt = torch.float32 if upcast else q.dtype
    valid = torch.arange(s_max, device=q.device)[None, :] < cache_lens.to(q.device)[:, None]  # [B,S]
    # slots past a sequence's length may hold anything (NaN / inf): zero them before any product
    live = valid[:, :, None, None]
    kh = _expand_heads(torch.where(live, k_cache, 0).to(cdt).transpose(1, 2), hpg, 1)  # [B,Hq,S,d]
    vh = _expand_heads(torch.where(live, v_cache, 0).to(cdt).transpose(1, 2), hpg, 1)  # [B,Hq,S,d]
    s = torch.matmul(kh, q.to(cdt)[..., None]).squeeze(-1) * scale  # [B,Hq,S]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows of length 0 -> 0
    o = torch.matmul(p[:, :, None, :], vh).squeeze(2)  # [B,Hq,d]
    o = _zero_skipped(o, mask, hpg, 1)  # o: [B, Hq, d]
    return o.to(q.dtype)


def attention_decode_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    mask: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The torch path routed decode takes without Triton (CPU): SDPA in the input dtype over the cached
    prefix when every sequence has the same length (``generate``), as the Hugging Face attention
    computes the last row of a whole sequence; otherwise ``attention_decode_ref``. Reads the lengths on
    the host: CPU tensors only. Shapes as ``attention_decode_ref``."""
    tracing = torch.compiler.is_compiling() or type(cache_lens) is not torch.Tensor  # fake / functional tensors
    if cache_lens.is_cuda or cache_lens.numel() == 0 or tracing:  # no host reads in a trace
        return attention_decode_ref(q, k_cache, v_cache, cache_lens, mask, sm_scale)
    n = int(cache_lens[0])
    if n < 1 or not bool((cache_lens == n).all()):
        return attention_decode_ref(q, k_cache, v_cache, cache_lens, mask, sm_scale)
    hq, hk = q.shape[1], k_cache.shape[2]
    o = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k_cache[:, :n].transpose(1, 2), v_cache[:, :n].transpose(1, 2), enable_gqa=True, scale=sm_scale
    )[:, :, 0]  # [B, Hq, d]
    return _zero_skipped(o, mask, hq // hk, 1)
