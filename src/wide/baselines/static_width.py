"""Static structured width pruning (FLAP / Wanda-sp style): attention groups (one GQA group: its query
heads, their K/V head, their O rows) and FFN channel groups removed once for every token, chosen from
calibration activations, no training.

Score of a group (docs/baselines.md): over the real tokens of the calibration batches, run dense,
  score(group) = Σ_{c in group} mean_tokens |x_c| · ||W[:, c]||_2
where x is the input of the projection that writes the group back into the residual stream
(`o_proj` for attention: the group's heads' outputs; `down_proj` for the FFN: the group's channels
after the gate) and W[:, c] the column of that projection reading channel c. It estimates how much
the group adds to the residual stream. Selection: remove the fraction s of the groups of each kind with
the lowest scores, standardised within each layer and ranked over all layers ("standardized", FLAP's
allocation), ranked raw over all layers ("global") or the same count in every layer ("uniform").
s is the target for sparsity_kind "groups" (attention / FFN targets when separate) and, for "flops",
the fraction that removes S of the dense forward's FLOPs (a removed attention group takes its K/V
projections with it; no router runs).

Bias compensation (FLAP; off by default: on SmolLM2 it measured worse, docs/negative-results.md): the
removed groups' mean contribution on the calibration tokens,
b = Σ_{c removed} W[:, c] · mean_tokens x_c, is added after the projection (``Router.set_out_bias``: the
masked path's hooks and the kernel runtime add it after O / down), so the residual stream keeps its mean.

The masks are stored as constant routers in the routers' checkpoint format (zero weights, the per-group
skip / execute logits in the bias), so loading, evaluation, LoRA recovery and the runtime read them as
any router checkpoint; argmax and Gumbel routing give the same mask.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from wide.accounting import SparsityMeter
from wide.config import WideConfig
from wide.model.wide_model import WideModel, decoder_layers
from wide.routing import EXECUTE, SKIP, Router
from wide.target import FlopWeights, flop_weights

ALLOCATIONS = ("standardized", "global", "uniform")
CONSTANT_LOGIT = 30.0  # |skip − execute| logit of a constant router: Gumbel noise flips it with p = 1/(1+e^30)


def token_weights(meter: SparsityMeter, exec_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] fp64 weights of the meter's real tokens for a record of exec_mask: [B, T, N_G]."""
    b, t = exec_mask.shape[:2]
    tm = meter.token_mask
    if tm is not None and tm.shape == (b, t):
        return tm.to(meter.device, torch.float64)
    return torch.ones(b, t, dtype=torch.float64, device=meter.device)


class StaticWidthMeter(SparsityMeter):
    """SparsityMeter of static width pruning: a removed attention group also removes its K/V projections
    (its KV head serves no query) and the constant routers cost nothing (the weights can be sliced)."""

    @torch.no_grad()
    def record(self, layer: int, kind: str, exec_mask: torch.Tensor) -> None:
        super().record(layer, kind, exec_mask)
        if kind != "attn":
            return
        f, w = self.flops, token_weights(self, exec_mask)
        skip_frac = 1.0 - exec_mask.to(self.device, torch.float64).mean(-1)  # [B, T]
        self.saved_flops += (skip_frac * f.attn_dense_linear * w).sum()
        if layer == 0:
            self.saved_flops += f.routers_per_layer * f.dims.n_layers * w.sum()


def set_constant_routes(router: Router, skip: torch.Tensor) -> None:
    """Make router decide skip: [N_G] bool (True = skip) for every input, in every routing mode."""
    if skip.shape != (router.n_groups,):
        raise ValueError(f"skip mask has shape {tuple(skip.shape)}, the router has {router.n_groups} groups")
    with torch.no_grad():
        for p in router.parameters():
            p.zero_()
        router.skip_bias.zero_()
        b = router.up.bias.view(router.n_groups, 2)
        b[:, EXECUTE] = 0.0
        b[:, SKIP] = torch.where(skip.to(b.device), CONSTANT_LOGIT, -CONSTANT_LOGIT)
        probe = torch.randn(3, router.down.in_features, device=b.device)
        got = router.skip_margin(probe) > 0  # [3, N_G]
    if not torch.equal(got, skip.to(got.device).expand_as(got)):
        raise RuntimeError("constant routes do not reproduce the mask: the Router's parameter layout changed")


@torch.no_grad()
def input_stats(wm: WideModel, batches: list[dict], device: torch.device) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per kind ('attn': the input of o_proj, 'ffn': of down_proj), over the real tokens of batches run
    dense: (mean |x_c|, mean x_c), each [L, C] fp64 (fp32 per batch, fp64 totals)."""
    layers = decoder_layers(wm.model)
    L, dims = len(layers), wm.dims
    width = {"attn": dims.n_q_heads * dims.head_dim, "ffn": dims.intermediate}
    sums = {k: torch.zeros(2, L, c, dtype=torch.float64, device=device) for k, c in width.items()}  # |x|, x
    state: dict = {"mask": None, "tokens": 0.0}

    def hook(kind: str, i: int):
        def pre(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().float()  # [B, T, C]
            m = state["mask"].to(x.device, torch.float32)  # [B, T]
            sums[kind][0, i] += torch.einsum("btc,bt->c", x.abs(), m).double()
            sums[kind][1, i] += torch.einsum("btc,bt->c", x, m).double()

        return pre

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(hook("attn", i)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(hook("ffn", i)))
    try:
        with wm.routing("dense"):
            for batch in batches:
                ids, am = batch["input_ids"].to(device), batch["attention_mask"].to(device)
                state["mask"] = am.bool()
                state["tokens"] += float(am.sum())
                wm.hidden_states(ids, attention_mask=am)
    finally:
        for h in handles:
            h.remove()
    n = max(state["tokens"], 1.0)
    return {k: (v[0] / n, v[1] / n) for k, v in sums.items()}


def _projections(wm: WideModel) -> dict[str, list[torch.Tensor]]:
    """The weights [D, C] of the projections that write each kind's groups into the residual stream."""
    layers = decoder_layers(wm.model)
    return {
        "attn": [lyr.self_attn.o_proj.weight.detach() for lyr in layers],
        "ffn": [lyr.mlp.down_proj.weight.detach() for lyr in layers],
    }


def _widths(wm: WideModel) -> dict[str, int]:
    return {"attn": wm.shape.attn_heads_per_group * wm.dims.head_dim, "ffn": wm.shape.ffn_group_size}


def scores_from_stats(wm: WideModel, stats: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (module docstring) of every attention group [L, N_attn] and FFN group [L, N_ffn] (fp64)."""
    out = []
    for kind, ws in _projections(wm).items():
        abs_mean = stats[kind][0]
        col_norm = torch.stack([w.double().norm(dim=0) for w in ws]).to(abs_mean.device)  # [L, C]
        per_channel = abs_mean * col_norm  # [L, C]
        out.append(per_channel.view(per_channel.shape[0], -1, _widths(wm)[kind]).sum(-1))  # [L, N_G]
    return out[0], out[1]


@torch.no_grad()
def group_scores(wm: WideModel, batches: list[dict], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (module docstring) of every attention group [L, N_attn] and FFN group [L, N_ffn] (fp64)."""
    return scores_from_stats(wm, input_stats(wm, batches, device))


def compensation(wm: WideModel, stats: dict, removed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FLAP's bias compensation: per kind [L, D] fp64, b = W[:, c] · mean x_c summed over the channels c
    of the removed groups (removed[kind]: [L, N_G] bool), the mean contribution those groups made to the
    residual stream on the calibration tokens."""
    out = {}
    for kind, ws in _projections(wm).items():
        mean = stats[kind][1]  # [L, C]
        cols = removed[kind].to(mean.device).repeat_interleave(_widths(wm)[kind], dim=1)  # [L, C]
        out[kind] = torch.stack([w.double().to(mean.device) @ (mean[i] * cols[i]) for i, w in enumerate(ws)])
    return out


def select_removed(scores: torch.Tensor, fraction: float, allocation: str = "standardized") -> torch.Tensor:
    """Boolean [L, N] (True = removed): the round(fraction·L·N) lowest scores over all layers ("global"),
    the same count of the lowest scores standardised within each layer ((s − mean) / std of the layer's
    groups, FLAP's adaptive structure search: "standardized"), or the round(fraction·N) lowest of every
    layer ("uniform"); ties go to the lower index. Raw scores grow with depth (so does the residual
    stream), so "global" strips the first layers whole (docs/baselines.md)."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the fraction of groups to remove must be in [0, 1], got {fraction}")
    L, N = scores.shape
    removed = torch.zeros(L, N, dtype=torch.bool, device=scores.device)
    if allocation in ("global", "standardized"):
        if allocation == "standardized":
            std = scores.std(dim=1, keepdim=True) if N > 1 else torch.ones_like(scores[:, :1])
            scores = (scores - scores.mean(dim=1, keepdim=True)) / std.clamp_min(1e-12)
        k = round(fraction * L * N)
        idx = torch.sort(scores.flatten(), stable=True).indices[:k]
        removed.view(-1)[idx] = True
    else:
        k = round(fraction * N)
        idx = torch.sort(scores, dim=1, stable=True).indices[:, :k]  # [L, k]
        removed.scatter_(1, idx, True)
    return removed


def static_weights(wm: WideModel, seq_len: int) -> FlopWeights:
    """FlopWeights of static pruning: no router cost."""
    return flop_weights(wm.meter.flops, seq_len, routers_per_layer=0)


def target_fractions(config: WideConfig, weights: FlopWeights, n_layers: int) -> tuple[float, float]:
    """(attention, FFN) fraction of groups to remove for the config's target and sparsity_kind."""
    if config.sparsity_kind == "groups":
        if config.separate_targets:
            return config.attn_sparsity, config.ffn_sparsity
        return config.sparsity, config.sparsity
    # one fraction s for both kinds; removing s of every group removes s·L·(attn + kv + ffn) of the FLOPs
    per_unit = n_layers * (weights.attn + weights.kv + weights.ffn)
    s = config.sparsity / per_unit
    if s > 1.0:
        raise ValueError(
            f"--sparsity {config.sparsity} of the FLOPs cannot be removed by width pruning: at most {per_unit:.3f}"
        )
    return s, s


@torch.no_grad()
def calibrate_static_width(
    wm: WideModel,
    batches: list[dict],
    device: torch.device,
    seq_len: int,
    allocation: str = "standardized",
    compensate: bool = False,
) -> dict:
    """Score the groups on batches, remove the target fraction, write the masks into wm's routers and,
    with ``compensate``, the removed groups' mean contribution as the projections' output bias (FLAP).
    Returns a summary (fractions, removed counts, the analytic FLOP saving at seq_len)."""
    stats = input_stats(wm, batches, device)
    attn_scores, ffn_scores = scores_from_stats(wm, stats)
    w = static_weights(wm, seq_len)
    fa, ff = target_fractions(wm.config, w, wm.dims.n_layers)
    attn_rm = select_removed(attn_scores, fa, allocation)
    ffn_rm = select_removed(ffn_scores, ff, allocation)
    for i, r in enumerate(wm.routers):
        set_constant_routes(r.attn, attn_rm[i])
        set_constant_routes(r.ffn, ffn_rm[i])
    if compensate:
        removed = {"attn": attn_rm, "ffn": ffn_rm}
        for kind, b in compensation(wm, stats, removed).items():
            for i in torch.nonzero(removed[kind].any(1)).flatten().tolist():  # a layer that keeps all: no bias
                wm.set_out_bias(i, kind, b[i])
    a_rate, f_rate = attn_rm.double().mean(1), ffn_rm.double().mean(1)  # [L]
    saving = float(w.removed(a_rate, f_rate)) + float(a_rate.sum()) * w.kv
    return {
        "allocation": allocation,
        "bias_compensation": compensate,
        "fractions": {"attn": fa, "ffn": ff},
        "removed_groups": {"attn": int(attn_rm.sum()), "ffn": int(ffn_rm.sum())},
        "attn_sparsity": float(attn_rm.double().mean()),
        "ffn_sparsity": float(ffn_rm.double().mean()),
        "flop_saving_at_seq_len": saving,
        "per_layer": {"attn": a_rate.tolist(), "ffn": f_rate.tolist()},
        "scores": {"attn": attn_scores.cpu().tolist(), "ffn": ffn_scores.cpu().tolist()},
    }
