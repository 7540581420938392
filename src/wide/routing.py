"""Routers (paper eq. 4–5), hard Gumbel-Softmax / argmax decisions, and the sparsity loss (eq. 6, 22)."""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from wide.config import WideConfig

RoutingMode = Literal["gumbel", "argmax", "dense"]
EXECUTE, SKIP = 0, 1


class Router(nn.Module):
    """Bottleneck router D -> r -> 2·N_G; class 0 = execute, class 1 = skip.

    Parameters stay fp32 whatever the model's dtype; the router runs outside autocast.
    `skip_bias` is a per-router offset added to the skip logit, fitted after training so that the
    argmax skip rate matches the rate the model was trained under (see `fit_skip_bias`).
    """

    def __init__(self, d_in: int, n_groups: int, rank: int, init_skip: float = 0.5):
        super().__init__()
        self.n_groups = n_groups
        self.down = nn.Linear(d_in, rank, bias=False, dtype=torch.float32)
        self.up = nn.Linear(rank, 2 * n_groups, bias=True, dtype=torch.float32)
        nn.init.normal_(self.down.weight, std=1.0 / math.sqrt(d_in))
        nn.init.normal_(self.up.weight, std=0.01)
        # Start every group at P(skip) = init_skip so calibration begins near the target.
        p = min(max(init_skip, 1e-3), 1 - 1e-3)
        with torch.no_grad():
            self.up.bias.view(n_groups, 2)[:, EXECUTE] = 0.0
            self.up.bias.view(n_groups, 2)[:, SKIP] = math.log(p / (1 - p))
        self.register_buffer("skip_bias", torch.zeros((), dtype=torch.float32))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> logits [..., N_G, 2] in fp32."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            r = self.up(self.down(x.float()))
        r = r.unflatten(-1, (self.n_groups, 2))
        return r + torch.stack([torch.zeros_like(self.skip_bias), self.skip_bias])

    def skip_margin(self, x: torch.Tensor) -> torch.Tensor:
        """logit(skip) - logit(execute): [..., N_G]; > 0 means skip under argmax."""
        r = self.logits(x)
        return r[..., SKIP] - r[..., EXECUTE]

    def forward(self, x: torch.Tensor, mode: RoutingMode, tau: float = 1.0) -> torch.Tensor:
        """Execute mask [..., N_G]: {0, 1} floats with a straight-through gradient in gumbel mode,
        bool in argmax mode."""
        if mode == "argmax":
            return self.skip_margin(x) <= 0
        if mode == "gumbel":
            return hard_gumbel_execute(self.logits(x), tau)
        raise ValueError(f"router mode must be 'gumbel' or 'argmax', got {mode!r}")


def hard_gumbel_execute(logits: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:
    """Hard Gumbel-Softmax over the last axis (2 classes) with straight-through gradient.

    logits: [..., N_G, 2] -> execute mask [..., N_G] in {0., 1.} (forward), d/dlogits of the soft
    sample (backward)."""
    g = -torch.empty_like(logits).exponential_().log()
    soft = ((logits + g) / tau).softmax(-1)
    hard = F.one_hot(soft.argmax(-1), 2).to(soft.dtype)
    y = hard - soft.detach() + soft
    return y[..., EXECUTE]


def masked_mean(x: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of x: [B, T, N_G] over groups and the tokens where token_mask: [B, T] is True."""
    if token_mask is None:
        return x.float().mean()
    w = token_mask.to(x.dtype).unsqueeze(-1).expand_as(x)
    return (x * w).sum() / w.sum().clamp_min(1)


def sparsity_loss(attn_skip: torch.Tensor, ffn_skip: torch.Tensor, config: WideConfig) -> torch.Tensor:
    """α·|S − mean_l ½(skip_attn_l + skip_ffn_l)| (eq. 6), or with separate targets
    α/2·(|S_a − mean skip_attn| + |S_f − mean skip_ffn|) (eq. 22). Inputs: per-layer rates [L]."""
    if config.separate_targets:
        return (
            config.alpha
            / 2
            * ((config.attn_sparsity - attn_skip.mean()).abs() + (config.ffn_sparsity - ffn_skip.mean()).abs())
        )
    return config.alpha * (config.sparsity - 0.5 * (attn_skip + ffn_skip).mean()).abs()


def fit_skip_bias(margins: torch.Tensor, target_rate: float) -> float:
    """The offset δ such that the fraction of (margin + δ > 0) equals target_rate.

    margins: 1-D fp32 sample of skip margins for one router (argmax-time decisions)."""
    m = margins.flatten().float()
    if m.numel() == 0:
        return 0.0
    if target_rate <= 0:
        return float(-(m.max() + 1e-3))
    if target_rate >= 1:
        return float(-(m.min() - 1e-3))
    # (margin + δ > 0) for the top target_rate fraction: δ = -quantile(1 - target_rate)
    q = (
        torch.quantile(m, 1.0 - target_rate)
        if m.numel() <= 16_000_000
        else m.sort().values[int((1.0 - target_rate) * (m.numel() - 1))]
    )
    return float(-q)
