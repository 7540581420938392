"""Causal-LM loss computed in token chunks, so the fp32 logits [B·T, V] never exist at once.

Hugging Face's causal-LM loss materialises the logits of every position and upcasts them to fp32
(16 × 4096 × 128k vocab = 33 GB for Llama-3); here each chunk's logits are recomputed in the backward
pass (activation checkpointing), which keeps the peak at one chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100


def _chunk_ce_sum(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h: [N, D], y: [N] -> summed fp32 cross-entropy of lm_head logits (ignoring IGNORE labels)."""
    logits = F.linear(h, weight).float()  # [N, V]
    return F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")


def chunked_lm_loss(
    hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.nn.Linear, chunk_tokens: int = 8192
) -> torch.Tensor:
    """Mean next-token cross-entropy, as transformers' ForCausalLMLoss computes it.

    hidden: [B, T, D] final hidden states (after the final norm); labels: [B, T] with IGNORE on padding.
    """
    if lm_head.bias is not None:
        raise ValueError("chunked_lm_loss expects an lm_head without bias")
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # [B·(T-1), D]
    y = labels[:, 1:].reshape(-1).to(h.device)  # [B·(T-1)]
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[0], chunk_tokens):
        hc, yc = h[s : s + chunk_tokens], y[s : s + chunk_tokens]
        if torch.is_grad_enabled() and hc.requires_grad:
            total = total + checkpoint(_chunk_ce_sum, hc, yc, lm_head.weight, use_reentrant=False)
        else:
            total = total + _chunk_ce_sum(hc, yc, lm_head.weight)
    return total / (y != IGNORE).sum().clamp_min(1)
