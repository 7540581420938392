"""Calibration objectives beyond the paper's (docs/baselines.md, "Levers"):

- distillation: KL(p_dense || p_routed) of the next-token distributions, the teacher being the same
  weights with routing off (one extra no-grad forward), computed in token chunks so that the fp32
  logits [N, V] of student and teacher exist for one chunk at a time (as `chunked_lm_loss`), the LM
  loss from the same log-softmax of the student's logits (`wide.train.loss.chunked_task_losses`);
- a FLOP-weighted sparsity target: α·|S − FLOPs removed| where the FLOPs removed are the per-layer
  skip rates weighted by what skipping costs per token (`FlopWeights`), so that S = 0.5 means half
  of the forward's FLOPs removed rather than half of the groups.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from wide.accounting import FlopModel
from wide.config import WideConfig
from wide.routing import sparsity_loss
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


# --------------------------------------------------------------------- FLOP-weighted target
@dataclass(frozen=True)
class FlopWeights:
    """Per-token FLOPs of one layer's parts as fractions of the dense forward (wide.accounting's count),
    attention scores at the mean key count of a packed sequence of `seq_len` tokens ((T + 1) / 2)."""

    dense: float  # dense FLOPs per token (all layers, lm_head)
    attn: float  # one layer's Q, O and scores / A·V: what skipping all its attention groups removes
    kv: float  # one layer's K and V projections (dense under routing; removable by static pruning)
    ffn: float  # one layer's gate, up and down
    routers: float  # all routers of the model

    def removed(self, attn_skip: torch.Tensor, ffn_skip: torch.Tensor) -> torch.Tensor:
        """Fraction of the dense FLOPs removed by per-layer skip rates [L] (router cost subtracted)."""
        return self.attn * attn_skip.sum() + self.ffn * ffn_skip.sum() - self.routers


def flop_weights(flops: FlopModel, seq_len: int, routers_per_layer: int | None = None) -> FlopWeights:
    """FlopWeights of a model (FlopModel) at sequence length seq_len; routers_per_layer overrides the
    router FLOPs per token per layer (layer skipping runs one router per layer, not two)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    n = flops.dims.n_layers
    scores = float(flops.attn_scores(torch.tensor((seq_len + 1) / 2.0)))
    attn = flops.attn_prunable_linear + scores
    dense = n * (flops.attn_dense_linear + attn + flops.ffn) + flops.lm_head
    routers = flops.routers_per_layer if routers_per_layer is None else routers_per_layer
    return FlopWeights(
        dense=float(dense),
        attn=attn / dense,
        kv=flops.attn_dense_linear / dense,
        ffn=flops.ffn / dense,
        routers=n * routers / dense,
    )


def model_flop_weights(wm, seq_len: int) -> FlopWeights:
    """FlopWeights of a routed model: its meter's FlopModel, one router per layer for layer skipping."""
    f = wm.meter.flops
    # layer skipping: both routers of a layer have one group (equal cost) and only one of them counts
    w = flop_weights(f, seq_len, f.routers_per_layer // 2 if wm.config.method == "layer-skip" else None)
    n = f.dims.n_layers
    most = float(w.removed(torch.ones(n), torch.ones(n)))
    if wm.config.sparsity_kind == "flops" and wm.config.sparsity > most:
        raise ValueError(
            f"--sparsity {wm.config.sparsity} of the FLOPs cannot be removed by this routing: at most {most:.3f} "
            "(K/V projections, lm_head and the routers stay)"
        )
    return w


def routing_sparsity_loss(
    attn_skip: torch.Tensor, ffn_skip: torch.Tensor, config: WideConfig, weights: FlopWeights | None = None
) -> torch.Tensor:
    """The sparsity term: paper eq. 6 / 22 (sparsity_kind "groups"), or α·|S − FLOPs removed| ("flops").
    attn_skip, ffn_skip: per-layer skip rates [L]."""
    if config.sparsity_kind == "groups":
        return sparsity_loss(attn_skip, ffn_skip, config)
    if weights is None:
        raise ValueError("sparsity_kind='flops' needs the model's FlopWeights")
    return config.alpha * (config.sparsity - weights.removed(attn_skip, ffn_skip)).abs()
