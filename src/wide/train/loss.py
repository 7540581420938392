"""Causal-LM loss (and the distillation KL) computed in token chunks, so the fp32 logits [B·T, V] never
exist at once.

Hugging Face's causal-LM loss materialises the logits of every position and upcasts them to fp32
(16 × 4096 × 128k vocab = 33 GB for Llama-3); here each chunk's logits are recomputed in the backward
pass (activation checkpointing), which keeps the peak at one chunk. One pass over a chunk's logits gives
both the cross-entropy and, with a teacher, KL(p_teacher || p_student) (docs/baselines.md, "Levers").
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100


def _chunk_sums(
    h: torch.Tensor, ht: torch.Tensor | None, y: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """h, ht: [N, D] student / teacher hidden states (ht None: no KL); y: [N] next-token labels (IGNORE:
    not scored) -> (Σ cross-entropy, Σ KL(teacher || student)) over the scored positions, fp32, both from
    one log-softmax of the student's logits."""
    s = F.log_softmax(F.linear(h, weight).float(), dim=-1)  # [N, V]
    valid = y != IGNORE  # [N]
    ce = -(s.gather(1, y.clamp_min(0)[:, None]).squeeze(1) * valid).sum()
    if ht is None:
        return ce, torch.zeros_like(ce)
    t = F.log_softmax(F.linear(ht, weight).float(), dim=-1)  # [N, V]
    kl = (F.kl_div(s, t, log_target=True, reduction="none").sum(-1) * valid).sum()
    return ce, kl


def _chunk_sums_ckpt(h, ht, y, weight):
    """_chunk_sums whose fp32 logits are recomputed in the backward pass instead of kept."""
    return checkpoint(_chunk_sums, h, ht, y, weight, use_reentrant=False)


@functools.cache
def _compiled_chunk_sums():
    # one fused kernel per reduction instead of materialised fp32 logits, log-probs and their gradients
    return torch.compile(_chunk_sums_ckpt, dynamic=False)


def chunked_task_losses(
    hidden: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    labels: torch.Tensor,
    lm_head: torch.nn.Linear,
    chunk_tokens: int = 8192,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-token cross-entropy, mean KL(p_teacher || p_student)) over the scored positions (next label
    != IGNORE), in token chunks so that the fp32 logits [N, V] of student and teacher exist for one chunk at a
    time; each chunk's logits are recomputed in the backward pass. The KL is 0 without a teacher.

    hidden: [B, T, D] routed final hidden states (after the final norm); teacher_hidden: [B, T, D] (no grad)
    or None; labels: [B, T]. compiled: the chunk through torch.compile (same values up to fp32 rounding)."""
    if lm_head.bias is not None:
        raise ValueError("chunked losses expect an lm_head without bias")
    d = hidden.shape[-1]
    h = hidden[:, :-1].reshape(-1, d)  # [B·(T-1), D]
    ht = None if teacher_hidden is None else teacher_hidden[:, :-1].reshape(-1, d).detach().to(h.dtype)
    y = labels[:, 1:].reshape(-1).to(h.device)  # [B·(T-1)]
    grad = torch.is_grad_enabled() and h.requires_grad
    fn = (_compiled_chunk_sums() if compiled else _chunk_sums_ckpt) if grad else _chunk_sums
    ce = kl = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[0], chunk_tokens):
        c, k = fn(h[s : s + chunk_tokens], None if ht is None else ht[s : s + chunk_tokens], y[s : s + chunk_tokens],
                  lm_head.weight)  # fmt: skip
        ce, kl = ce + c, kl + k
    n = (y != IGNORE).sum().clamp_min(1)
    return ce / n, kl / n


def chunked_lm_loss(
    hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.nn.Linear, chunk_tokens: int = 8192
) -> torch.Tensor:
    """Mean next-token cross-entropy, as transformers' ForCausalLMLoss computes it (``chunked_task_losses``
    without a teacher). hidden: [B, T, D] final hidden states (after the final norm); labels: [B, T] with
    IGNORE on padding."""
    return chunked_task_losses(hidden, None, labels, lm_head, chunk_tokens)[0]
