"""Sparsity and real-FLOP accounting over non-padding tokens.

FLOPs count 2 per multiply-add. Per token at in-sequence position t (attending to t + 1 keys):
  attention: Q (2·D·Hq·d) + K, V (2·2·D·Hk·d, always dense) + scores and A·V (2·2·Hq·d·(t+1))
             + O (2·Hq·d·D);
  FFN:       gate, up, down (3·2·D·D');
  lm_head:   2·D·V (dense);
  routers:   2·(D·r + r·2·N_G) per router (WIDE only).
A skipped attention group removes its share of Q, scores/A·V and O; a skipped FFN group its share of
gate/up/down. The saving is 1 − WIDE FLOPs / dense FLOPs, router cost included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wide.config import ModelDims, RoutingShape


@dataclass(frozen=True)
class FlopModel:
    dims: ModelDims
    shape: RoutingShape
    router_rank: int

    @property
    def attn_prunable_linear(self) -> int:
        """Q and O FLOPs per token per layer (the part attention routing can skip)."""
        d = self.dims
        return 2 * 2 * d.hidden * d.n_q_heads * d.head_dim

    @property
    def attn_dense_linear(self) -> int:
        d = self.dims
        return 2 * 2 * d.hidden * d.n_kv_heads * d.head_dim

    def attn_scores(self, n_keys: torch.Tensor) -> torch.Tensor:
        d = self.dims
        return 2 * 2 * d.n_q_heads * d.head_dim * n_keys

    @property
    def ffn(self) -> int:
        return 3 * 2 * self.dims.hidden * self.dims.intermediate

    @property
    def lm_head(self) -> int:
        return 2 * self.dims.hidden * self.dims.vocab

    @property
    def routers_per_layer(self) -> int:
        d, r, s = self.dims.hidden, self.router_rank, self.shape
        return 2 * (d * r + r * 2 * s.attn_groups) + 2 * (d * r + r * 2 * s.ffn_groups)


class SparsityMeter:
    """Accumulates per-layer skip counts and FLOPs on device; `summary()` is the only host sync."""

    def __init__(self, flops: FlopModel, device: torch.device | str = "cpu"):
        self.flops = flops
        self.device = torch.device(device)
        self.token_mask: torch.Tensor | None = None  # [B, T] bool for the next forward
        self.position_offset = 0  # keys already in the cache (decode)
        self.reset()

    def reset(self) -> None:
        n = self.flops.dims.n_layers
        z = lambda: torch.zeros(n, dtype=torch.float64, device=self.device)  # noqa: E731
        self.attn_skipped, self.attn_total = z(), z()  # group decisions
        self.ffn_skipped, self.ffn_total = z(), z()
        self.tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self.dense_flops = torch.zeros((), dtype=torch.float64, device=self.device)
        self.saved_flops = torch.zeros((), dtype=torch.float64, device=self.device)
        self._counted_tokens = False

    def set_token_mask(self, token_mask: torch.Tensor | None) -> None:
        """token_mask: [B, T] (True = real token) applying to the following forward calls."""
        self.token_mask = None if token_mask is None else token_mask.bool()

    def _weights(self, exec_mask: torch.Tensor) -> torch.Tensor:
        b, t = exec_mask.shape[:2]
        if self.token_mask is not None and self.token_mask.shape == (b, t):
            return self.token_mask.to(self.device, torch.float64)
        return torch.ones(b, t, dtype=torch.float64, device=self.device)

    def _n_keys(self, b: int, t: int) -> torch.Tensor:
        pos = torch.arange(t, device=self.device, dtype=torch.float64) + 1 + self.position_offset
        return pos.expand(b, t)

    @torch.no_grad()
    def record(self, layer: int, kind: str, exec_mask: torch.Tensor) -> None:
        """exec_mask: [B, T, N_G] (True / 1 = executed) of one layer's attention or FFN router."""
        w = self._weights(exec_mask)  # [B, T]
        skip_frac = 1.0 - exec_mask.to(self.device, torch.float64).mean(-1)  # [B, T]
        n_groups = exec_mask.shape[-1]
        f = self.flops
        if kind == "attn":
            self.attn_skipped[layer] += (skip_frac * w).sum() * n_groups
            self.attn_total[layer] += w.sum() * n_groups
            per_tok = f.attn_prunable_linear + f.attn_scores(self._n_keys(*w.shape))
            self.saved_flops += (skip_frac * per_tok * w).sum()
            self.dense_flops += ((f.attn_dense_linear + per_tok) * w).sum()
            if layer == 0:  # once per forward: lm_head and router costs
                self.tokens += w.sum()
                self.dense_flops += f.lm_head * w.sum()
                self.saved_flops -= f.routers_per_layer * f.dims.n_layers * w.sum()
        elif kind == "ffn":
            self.ffn_skipped[layer] += (skip_frac * w).sum() * n_groups
            self.ffn_total[layer] += w.sum() * n_groups
            self.saved_flops += (skip_frac * f.ffn * w).sum()
            self.dense_flops += f.ffn * w.sum()
        else:
            raise ValueError(kind)

    def summary(self) -> dict:
        """Real sparsity reached (over non-padding tokens) and the FLOP saving, as plain floats."""
        at = self.attn_skipped.cpu() / self.attn_total.cpu().clamp_min(1)
        ft = self.ffn_skipped.cpu() / self.ffn_total.cpu().clamp_min(1)
        dense = float(self.dense_flops)
        return {
            "tokens": int(self.tokens),
            "attn_sparsity": float(self.attn_skipped.sum() / self.attn_total.sum().clamp_min(1)),
            "ffn_sparsity": float(self.ffn_skipped.sum() / self.ffn_total.sum().clamp_min(1)),
            "flop_saving": float(self.saved_flops) / dense if dense > 0 else 0.0,
            "per_layer": {"attn": [round(float(x), 5) for x in at], "ffn": [round(float(x), 5) for x in ft]},
        }
