"""The sparsity target, one owner: the loss that trains toward it (paper eq. 6 / 22, or FLOP-weighted), the FLOP
weights a FLOP target counts with, the per-layer rates a threshold fit recorded (``FittedRates``), and the rate the
runtime plans its kernel paths on (``planned_rates``). docs/design.md, "Train/inference consistency".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from wide.accounting import FlopModel
from wide.config import WideConfig


# ------------------------------------------------------------------------------------------------- the loss
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


# ------------------------------------------------------------------------------------- the rates trained at
@dataclass(frozen=True)
class FittedRates:
    """Per-layer skip rates a checkpoint's threshold fit recorded (argmax skips after the fit), per kind;
    None for a kind the fit did not record for every layer. ``WideRuntime`` plans its kernel paths on them."""

    attn: list[float] | None
    ffn: list[float] | None

    @classmethod
    def from_training(cls, training: dict, n_layers: int) -> FittedRates | None:
        """From a checkpoint's ``training`` record (``skip_bias_fit.argmax_skip_after``: ``attn0`` ... ->
        rate); None when it has no fit."""
        fit = (training.get("skip_bias_fit") or {}).get("argmax_skip_after") or {}
        per_kind = {
            kind: [float(fit[f"{kind}{i}"]) for i in range(n_layers)]
            if all(f"{kind}{i}" in fit for i in range(n_layers))
            else None
            for kind in ("attn", "ffn")
        }
        return None if per_kind["attn"] is None and per_kind["ffn"] is None else cls(**per_kind)


class TrainingRecord:
    """What a loaded checkpoint's training recorded, on the model that carries its routers: ``training_summary``
    (the checkpoint's ``training`` record) and ``fitted_rates`` (its threshold fit's per-layer rates, or None).
    The model's ``__init__`` sets both empty; ``record_training`` is the one writer."""

    training_summary: dict
    fitted_rates: FittedRates | None

    def record_training(self, training: dict) -> None:
        """Keep a checkpoint's ``training`` record and the rates its threshold fit recorded."""
        self.training_summary = dict(training)
        self.fitted_rates = FittedRates.from_training(self.training_summary, self.dims.n_layers)


def planned_rates(fitted: FittedRates | None, config: WideConfig, kind: str, n_layers: int) -> float | Sequence[float]:
    """The expected skip rate of the ``kind`` ('attn' / 'ffn') routers the runtime plans on, when no hint is
    given: the per-layer rates the threshold fit recorded, else the config's target for that kind, else its
    overall target."""
    rates = getattr(fitted, kind) if fitted is not None else None
    if rates is not None and len(rates) == n_layers:
        return rates
    own = getattr(config, f"{kind}_sparsity")
    return own if own is not None else config.sparsity
