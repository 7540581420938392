"""Routers (paper eq. 4–5), hard Gumbel-Softmax / argmax decisions, and the sparsity loss (eq. 6, 22)."""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn as nn

RoutingMode = Literal["gumbel", "argmax", "dense"]
EXECUTE, SKIP = 0, 1


class Router(nn.Module):
    """Bottleneck router D -> r -> 2·N_G; class 0 = execute, class 1 = skip.

    Parameters stay fp32 whatever the model's dtype. Only the difference of the two classes' logits
    matters (argmax and the two-class Gumbel-Softmax both read it), so every path computes the skip
    margin ``logit(skip) - logit(execute) + skip_bias`` through one op, ``wide.kernels.router_margin``:
    the rule is in docs/routing.md#the-decision-rule. `skip_bias` is a per-router offset fitted after
    training so that the argmax skip rate matches the rate the model was trained under
    (`wide.train.threshold_fit`).
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

    def set_out_bias(self, bias: torch.Tensor) -> None:
        """A constant [D_out] fp32 vector added to the output of the projection this router gates (the
        expected contribution of the groups it removes for good: static width's bias compensation,
        docs/baselines.md). A persistent buffer: router checkpoints carry it as ``<router>.out_bias``."""
        self.register_buffer("out_bias", bias.detach().float().clone())

    def head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The margin head (differentiable): W_margin [N_G, r] and b_margin [N_G], fp32, with
        margin = W_margin · r + b_margin for the projection r = W_down · x."""
        w = self.up.weight.view(self.n_groups, 2, -1)  # [N_G, 2, r]
        b = self.up.bias.view(self.n_groups, 2)  # [N_G, 2]
        return w[:, SKIP] - w[:, EXECUTE], b[:, SKIP] - b[:, EXECUTE] + self.skip_bias

    @torch.no_grad()
    def fold(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router for inference: (W_down [r, D] rounded to ``dtype``, W_margin, b_margin fp32),
        the arguments of ``wide.kernels.router_decisions``. A snapshot: fold after threshold fits."""
        w_margin, b_margin = self.head()
        return self.down.weight.to(dtype).contiguous(), w_margin.contiguous(), b_margin.contiguous()

    def skip_margin(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> skip margin [..., N_G] fp32; > 0 means skip under argmax. x is read in the
        compute dtype (the autocast dtype inside autocast, else x's own)."""
        from wide.kernels.router import compute_dtype, router_margin

        dt = compute_dtype(x)  # read before autocast is switched off below
        with torch.autocast(device_type=x.device.type, enabled=False):
            return router_margin(x.to(dt), self.down.weight, *self.head())

    def forward(self, x: torch.Tensor, mode: RoutingMode, tau: float = 1.0) -> torch.Tensor:
        """Execute mask [..., N_G]: {0, 1} floats with a straight-through gradient in gumbel mode,
        bool in argmax mode."""
        if mode == "argmax":
            return self.skip_margin(x) <= 0
        if mode == "gumbel":
            return hard_gumbel_execute(self.skip_margin(x), tau)
        raise ValueError(f"router mode must be 'gumbel' or 'argmax', got {mode!r}")


def split_router_groups(state: dict[str, torch.Tensor], kind: str, factor: int) -> dict[str, torch.Tensor]:
    """A routers' state dict (``LayerRouters`` keys, ``"{layer}.{kind}.up.weight"`` ...) with every ``kind``
    router's groups split ``factor`` ways: new group ``g * factor + i`` takes coarse group ``g``'s two output
    rows. Groups are contiguous channel ranges, so each narrower group lies inside its coarse group, and the
    split routers take the coarse routers' decisions, expanded to the narrower groups, until training moves
    them apart (a warm start for a smaller group size: ``wide calibrate --init-routers``)."""
    if factor < 1:
        raise ValueError(f"split factor must be >= 1, got {factor}")
    out = dict(state)
    for key, v in state.items():
        if key.endswith((f".{kind}.up.weight", f".{kind}.up.bias")):
            rows = v.view(-1, 2, *v.shape[1:])  # [N_G, 2(, r)]: the execute / skip rows of each group
            out[key] = rows.repeat_interleave(factor, dim=0).reshape(-1, *v.shape[1:]).contiguous()
    return out


def hard_gumbel_execute(margin: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:
    """Hard two-class Gumbel-Softmax on skip margins, with a straight-through gradient.

    margin: [..., N_G] (logit(skip) - logit(execute)) -> execute mask [..., N_G] in {0., 1.} (forward),
    d/dmargin of the soft sample (backward). With Gumbel noise g per class, the two-class softmax is
    sigmoid((margin + g_skip - g_execute) / tau) and its argmax skips where that argument is > 0."""
    g = -torch.empty(*margin.shape, 2, dtype=margin.dtype, device=margin.device).exponential_().log()
    z = margin + g[..., SKIP] - g[..., EXECUTE]
    soft_skip = torch.sigmoid(z / tau)
    hard_skip = (z > 0).to(soft_skip.dtype)
    skip = hard_skip - soft_skip.detach() + soft_skip
    return 1.0 - skip


def masked_mean(x: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of x: [B, T, N_G] over groups and the tokens where token_mask: [B, T] is True."""
    if token_mask is None:
        return x.float().mean()
    w = token_mask.to(x.dtype).unsqueeze(-1).expand_as(x)
    return (x * w).sum() / w.sum().clamp_min(1)


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
