"""Stage 2 (optional): LoRA recovery on all seven linear modules, trained together with the routers.

LoRA layers are injected into the base model *before* the routers are attached, so WIDE's masks act
on the inputs of the LoRA-wrapped o_proj / down_proj and cover the adapter's path too.
"""

from __future__ import annotations

import math

import torch.nn as nn

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_lora_args(r: int, alpha: float, dropout: float) -> None:
    """One-line errors for LoRA settings that cannot work (checked before any model loads)."""
    if r < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {r}")
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"--lora-alpha must be > 0, got {alpha}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {dropout}")


def apply_lora(
    model: nn.Module, *, r: int = 16, alpha: int = 32, dropout: float = 0.1, targets: tuple[str, ...] = LORA_TARGETS
):
    """Inject LoRA adapters into `model` in place (paper: r 16, α 32, dropout 0.1); returns the peft
    model (use it to save the adapter). The base weights stay frozen."""
    from peft import LoraConfig, get_peft_model

    check_lora_args(r, alpha, dropout)
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets), bias="none", task_type="CAUSAL_LM"
    )
    return get_peft_model(model, cfg)
