"""Calibration objectives beyond the paper's (docs/baselines.md, "Levers"):

- distillation: KL(p_dense || p_routed) of the next-token distributions, the teacher being the same
  weights with routing off (one extra no-grad forward), computed in token chunks so that the fp32
  logits [N, V] of student and teacher exist for one chunk at a time (as `chunked_lm_loss`), the LM
  loss from the same log-softmax of the student's logits (`wide.train.loss.chunked_task_losses`);
(the sparsity target's terms, FLOP-weighted or not: ``wide.target``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from wide.train.loss import chunked_task_losses


# ------------------------------------------------------------------------- distillation
def chunked_kl_loss(
    hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head: torch.nn.Linear,
    chunk_tokens: int = 8192,
) -> torch.Tensor:
    """Mean over the positions the LM loss scores (next label != IGNORE) of KL(p_teacher || p_student)
    (``chunked_task_losses``' second term). hidden: [B, T, D]; teacher_hidden: [B, T, D]; labels: [B, T]."""
    return chunked_task_losses(hidden, teacher_hidden, labels, lm_head, chunk_tokens)[1]


@torch.no_grad()
def teacher_hidden(wm, ids: torch.Tensor, attention_mask: torch.Tensor, adapter=None) -> torch.Tensor | None:
    """The frozen dense model's final hidden states [B, T, D] (routing off; LoRA off in stage 2), or
    None when the config does not distil. Call it before the student forward: a forward resets the
    routing masks the sparsity loss reads."""
    if wm.config.distill == "none":
        return None
    off = adapter.disable_adapter() if adapter is not None else nullcontext()
    with off, wm.routing("dense"):
        return wm.hidden_states(ids, attention_mask=attention_mask)


def task_loss(
    wm,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    teacher: torch.Tensor | None,
    chunk_tokens: int,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective, LM loss): the LM loss, the KL to the teacher, or their sum (config.distill), from one
    pass over the logits (``chunked_task_losses``; compiled: through torch.compile). The LM loss is always
    returned for logging; it carries no gradient when it is not optimised."""
    mode = wm.config.distill
    distil = mode != "none" and teacher is not None
    lm, kl = chunked_task_losses(hidden, teacher if distil else None, labels, wm.model.lm_head, chunk_tokens, compiled)
    if not distil:
        return lm, lm
    if mode == "kl":
        return kl, lm.detach()
    return lm + kl, lm
