"""The bf16 rule every kernel is held to (docs/kernels.md): error against fp32 at most twice plain PyTorch's."""

from __future__ import annotations

import torch


def within_bf16_rule(
    out: torch.Tensor, ref32: torch.Tensor, ref_lowp: torch.Tensor, factor: float = 2.0, atol: float = 1e-5
) -> tuple[bool, float, float]:
    """(|out − ref32| <= factor · |ref_lowp − ref32| + atol · max(1, |ref32|), the kernel's max abs error,
    plain PyTorch's): ref32 the fp32 reference, ref_lowp the same reference computed in the low precision."""
    scale = max(1.0, ref32.abs().max().item())
    err = (out.float() - ref32).abs().max().item()
    base = (ref_lowp.float() - ref32).abs().max().item()
    return err <= factor * base + atol * scale, err, base
