"""Training-free activation thresholding (TEAL-style): per layer and per linear input, entries with
|x| <= t are zeroed, t a magnitude threshold from calibration statistics.

Sites per decoder layer (one threshold each; projections reading the same tensor share it):
  "qkv"    the normalised input of q_proj, k_proj, v_proj
  "o"      the input of o_proj (the attention heads' outputs)
  "gateup" the normalised input of gate_proj, up_proj
  "down"   the input of down_proj
This is unstructured, per-token sparsity (any entry of any token), not group sparsity: a kernel saves
the weight columns matching zeroed entries, so the FLOPs removed at a site are its zeroed fraction times
that projection's FLOPs. Accounting (`TealMeter`) uses wide.accounting's dense count: attention scores,
lm_head and nothing else change; K/V projections are thresholded too.

Calibration: t_site = the `s` quantile of |x| at that site over the real tokens of the calibration
batches (a uniform random sample of at most `max_samples` entries per site), first with every site
dense, then `refine` more passes with the thresholds applied (later sites see the sparsified model they
run in). s is the config's target for sparsity_kind "groups" (the fraction of activations zeroed) or,
for "flops", the fraction that removes S of the dense forward's FLOPs (uniform over sites).
Checkpoint: wide_config.json (method "teal") + routers.safetensors holding the thresholds [4] per layer.

Speed: the samples stay on the model's device in its dtype (|x| of a bf16 entry is a bf16 value, so the
float32 quantile sees the same numbers) and each threshold is written as a device tensor, so a pass has
no host synchronisation per site. The sample indices come from a CPU generator seeded with `seed`, one
draw per site and batch in forward order, so the samples (and thresholds) do not depend on the device.
`quantile` equals torch.quantile (linear) and, on the CPU, avoids its full sort.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from wide.accounting import FlopModel
from wide.config import ModelDims, WideConfig
from wide.model.wide_model import decoder_layers, model_id_of
from wide.target import FittedRates, TrainingRecord, flop_weights

SITES = ("qkv", "o", "gateup", "down")
# (site, module path in the layer, whether this module's hook records the site in the meter)
HOOKS = (
    ("qkv", "self_attn.q_proj", True),
    ("qkv", "self_attn.k_proj", False),
    ("qkv", "self_attn.v_proj", False),
    ("o", "self_attn.o_proj", True),
    ("gateup", "mlp.gate_proj", True),
    ("gateup", "mlp.up_proj", False),
    ("down", "mlp.down_proj", True),
)


def site_flops(dims: ModelDims) -> dict[str, int]:
    """FLOPs per token of the projections reading each site (2 per multiply-add)."""
    d, qd, kvd, ff = dims.hidden, dims.n_q_heads * dims.head_dim, dims.n_kv_heads * dims.head_dim, dims.intermediate
    return {"qkv": 2 * d * (qd + 2 * kvd), "o": 2 * qd * d, "gateup": 2 * 2 * d * ff, "down": 2 * ff * d}


class TealMeter:
    """Zeroed fractions per layer and site, and the FLOP saving, over real tokens (the SparsityMeter
    interface: set_token_mask, reset, summary). attn_sparsity / ffn_sparsity are the FLOP-weighted
    zeroed fractions of the attention (q, k, v, o) and FFN (gate, up, down) projections."""

    def __init__(self, flops: FlopModel, device: torch.device | str = "cpu"):
        self.flops = flops
        self.site_flops = site_flops(flops.dims)
        self.device = torch.device(device)
        self.token_mask: torch.Tensor | None = None
        self.position_offset = 0
        self.reset()

    def reset(self) -> None:
        L = self.flops.dims.n_layers
        self.zeroed = torch.zeros(L, len(SITES), dtype=torch.float64, device=self.device)  # Σ tokens · fraction
        self.counted = torch.zeros(L, len(SITES), dtype=torch.float64, device=self.device)  # Σ tokens
        self.tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self.dense_flops = torch.zeros((), dtype=torch.float64, device=self.device)
        self.saved_flops = torch.zeros((), dtype=torch.float64, device=self.device)

    def set_token_mask(self, token_mask: torch.Tensor | None) -> None:
        self.token_mask = None if token_mask is None else token_mask.bool()

    @torch.no_grad()
    def record(self, layer: int, site: str, keep: torch.Tensor) -> None:
        """keep: [B, T, C] bool, the entries of the site's input that stay (non-zero after thresholding)."""
        b, t = keep.shape[:2]
        tm = self.token_mask
        w = (
            tm.to(self.device, torch.float64)
            if tm is not None and tm.shape == (b, t)
            else torch.ones(b, t, dtype=torch.float64, device=self.device)
        )
        frac = 1.0 - keep.to(self.device, torch.float64).mean(-1)  # [B, T]
        j = SITES.index(site)
        self.zeroed[layer, j] += (frac * w).sum()
        self.counted[layer, j] += w.sum()
        self.saved_flops += (frac * w).sum() * self.site_flops[site]
        if layer == 0 and site == "qkv":  # once per forward: the dense FLOPs of every token
            f = self.flops
            n_keys = torch.arange(t, device=self.device, dtype=torch.float64) + 1 + self.position_offset
            per_layer = f.attn_dense_linear + f.attn_prunable_linear + f.attn_scores(n_keys) + f.ffn  # [T]
            self.dense_flops += (w * (f.dims.n_layers * per_layer + f.lm_head)).sum()
            self.tokens += w.sum()

    def summary(self) -> dict:
        sf = torch.tensor([self.site_flops[s] for s in SITES], dtype=torch.float64)
        z, c = self.zeroed.cpu(), self.counted.cpu().clamp_min(1)
        frac = z / c  # [L, 4]

        def kind(cols: list[int]) -> tuple[float, list[float]]:
            per_layer = (frac[:, cols] * sf[cols]).sum(1) / sf[cols].sum()
            total = float((z[:, cols] * sf[cols]).sum() / (c[:, cols] * sf[cols]).sum().clamp_min(1e-30))
            return total, [round(float(x), 5) for x in per_layer]

        attn, attn_l = kind([0, 1])
        ffn, ffn_l = kind([2, 3])
        dense = float(self.dense_flops)
        return {
            "tokens": int(self.tokens),
            "attn_sparsity": attn,
            "ffn_sparsity": ffn,
            "flop_saving": float(self.saved_flops) / dense if dense > 0 else 0.0,
            "per_layer": {"attn": attn_l, "ffn": ffn_l},
            "per_site": {s: [round(float(x), 5) for x in frac[:, j]] for j, s in enumerate(SITES)},
        }


class TealThresholds(nn.Module):
    """One layer's thresholds, a buffer [4] in SITES order (what the checkpoint stores)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("thresholds", torch.zeros(len(SITES), dtype=torch.float32))


class TealModel(TrainingRecord, nn.Module):
    """A Hugging Face causal LM with TEAL thresholding hooks on its linear inputs.

    The WideModel interface the evaluation uses: model, config, meter, metering, start_meter /
    stop_meter, routing (only "dense" turns thresholding off), forward, hidden_states, save, detach.
    `routers` holds the thresholds (TealThresholds per layer), so save_routers writes them."""

    def __init__(self, model: nn.Module, config: WideConfig, *, base_model_id: str | None = None):
        super().__init__()
        if config.method != "teal":
            raise ValueError(f"TealModel needs a config with method='teal', got {config.method!r}")
        layers = decoder_layers(model)
        self.model, self.config = model, config
        self.dims = ModelDims.from_hf_config(model.config)
        self.shape = config.routing_shape(self.dims)
        self.base_model_id = base_model_id or model_id_of(model)
        device = next(model.parameters()).device
        self.routers = nn.ModuleList(TealThresholds() for _ in layers).to(device)
        self.mode = "argmax"
        self.meter = TealMeter(FlopModel(self.dims, self.shape, config.router_rank), device)
        self.metering = False
        self.training_summary: dict = {}  # the checkpoint's training record (record_training)
        self.fitted_rates: FittedRates | None = None  # thresholds, no fit: stays None
        self._collect: dict | None = None  # calibration: site -> list of |x| samples
        self._handles = []
        for i, layer in enumerate(layers):
            for site, path, records in HOOKS:
                h = layer.get_submodule(path).register_forward_pre_hook(self._hook(i, site, records))
                self._handles.append(h)

    def _hook(self, layer: int, site: str, records: bool):
        j = SITES.index(site)

        def pre(module: nn.Module, args: tuple):
            if self.mode == "dense":
                return None
            x = args[0]  # [B, T, C]
            if self._collect is not None and records:
                self._collect_sample(layer, site, x)
            if self._collect is not None and not self._collect["apply"]:
                return None
            keep = x.abs() > self.routers[layer].thresholds[j].to(x.dtype)  # [B, T, C]
            if self.metering and records:
                self.meter.record(layer, site, keep)
            return (x * keep.to(x.dtype),) + tuple(args[1:])

        return pre

    def _collect_sample(self, layer: int, site: str, x: torch.Tensor) -> None:
        """Append |x| at a uniform sample of at most per_batch of the real tokens' entries (x's dtype, device).

        Entry i of the real tokens' entries is (real token i // C, channel i % C), real tokens in (row,
        position) order; the draw uses the CPU generator exactly when there are more entries than per_batch."""
        c = self._collect
        x = x.detach()
        ch = x.shape[-1]
        flat = x.reshape(-1, ch)  # [B*T, C]
        padded = c["rows"] is not None and c["mask_shape"] == x.shape[:-1]
        n = (c["rows"].numel() if padded else flat.shape[0]) * ch
        if n > c["per_batch"]:
            pin = x.device.type == "cuda"
            idx = torch.randint(0, n, (c["per_batch"],), generator=c["gen"], pin_memory=pin)  # [per_batch] CPU
            idx = idx.to(x.device, non_blocking=True)
            if padded:  # entry i of the real tokens -> entry of flat: skip the padding before its token
                idx = idx + c["gap"][idx.div(ch, rounding_mode="floor")] * ch
            v = flat.reshape(-1).take(idx).abs()  # [per_batch]
        else:
            v = (flat[c["rows"]] if padded else flat).abs().flatten()  # [n]
        c["samples"].setdefault((layer, site), []).append(v)

    # ------------------------------------------------------------------ running
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        self.meter.set_token_mask(attention_mask)
        kwargs.setdefault("use_cache", False)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.meter.set_token_mask(attention_mask)
        return self.model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

    @contextmanager
    def routing(self, mode: str, tau: float | None = None) -> Iterator[TealModel]:
        """ "dense" turns thresholding off; any other mode leaves it on (TEAL has no routers to sample)."""
        old = self.mode
        self.mode = mode
        try:
            yield self
        finally:
            self.mode = old

    def start_meter(self) -> TealMeter:
        self.meter.reset()
        self.metering = True
        return self.meter

    def stop_meter(self) -> dict:
        self.metering = False
        return self.meter.summary()

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def save(self, out_dir: str, training: dict | None = None) -> None:
        from wide.model.checkpoint import save_routers

        save_routers(self, out_dir, training=training)

    # -------------------------------------------------------------- calibration
    def activation_fraction(self, seq_len: int) -> float:
        """The fraction of activations to zero at every site for the config's target."""
        cfg = self.config
        if cfg.separate_targets:
            raise ValueError("teal: use the shared --sparsity target (one fraction for every site)")
        if cfg.sparsity_kind == "groups":
            return cfg.sparsity
        w = flop_weights(self.meter.flops, seq_len, routers_per_layer=0)
        linear = self.dims.n_layers * sum(site_flops(self.dims).values()) / w.dense
        s = cfg.sparsity / linear
        if s >= 1.0:
            raise ValueError(f"--sparsity {cfg.sparsity} of the FLOPs cannot be removed: the linears are {linear:.3f}")
        return s

    @torch.no_grad()
    def calibrate(
        self,
        batches: list[dict],
        device: torch.device,
        seq_len: int,
        *,
        refine: int = 2,
        max_samples: int = 1 << 22,
        seed: int = 0,
    ) -> dict:
        """Fit every threshold (module docstring); returns the fraction and the per-site thresholds."""
        s = self.activation_fraction(seq_len)
        gen = torch.Generator().manual_seed(seed)
        for p in range(1 + refine):
            self._collect = {
                "samples": {},
                "gen": gen,
                "apply": p > 0,
                "rows": None,
                "gap": None,
                "mask_shape": None,
                "per_batch": max(1, max_samples // max(1, len(batches))),
            }
            try:
                for batch in batches:
                    am_host = batch["attention_mask"].bool()  # [B, T]
                    ids, am = batch["input_ids"].to(device), batch["attention_mask"].to(device)
                    # rows: [N] flat indices b*T + t of the real tokens, ascending (None: every token is real);
                    # gap: [N] rows - arange(N), the padded tokens before each real one
                    rows = am_host.flatten().nonzero().squeeze(1)
                    full = rows.numel() == am_host.numel()
                    self._collect["rows"] = None if full else rows.to(device)
                    self._collect["gap"] = None if full else (rows - torch.arange(rows.numel())).to(device)
                    self._collect["mask_shape"] = am_host.shape
                    self.hidden_states(ids, attention_mask=am)
                samples = self._collect["samples"]
            finally:
                self._collect = None
            # thresholds change only here, after the pass: all of its samples saw the previous pass's
            while samples:  # popped: a site's samples are freed once its threshold is set
                (i, site), vals = samples.popitem()
                v = torch.cat(vals).float()  # [n] float32, n the entries drawn over the batches
                t = quantile(v, s) if s > 0 else torch.zeros((), device=v.device)
                self.routers[i].thresholds[SITES.index(site)] = t
        th = torch.stack([r.thresholds for r in self.routers]).cpu()  # [L, 4]
        return {
            "activation_fraction": s,
            "refine": refine,
            "thresholds": {site: th[:, j].tolist() for j, site in enumerate(SITES)},
        }


def quantile(v: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile(v, q) of a 1-D float32 tensor (linear interpolation, NaN if v has one), a 0-d tensor
    on v's device. On the CPU two order statistics are selected instead of sorting all of v; elsewhere the
    sort is torch.quantile's own (fast on an accelerator, and no host synchronisation)."""
    if v.device.type != "cpu":
        return torch.quantile(v, q)
    if v.dim() != 1 or v.numel() == 0 or v.dtype != torch.float32 or not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile: needs a non-empty 1-D float32 tensor and q in [0, 1], got {v.shape} {v.dtype} {q}")
    if bool(v.isnan().any()):
        return torch.full((), float("nan"))
    n = v.numel()
    rank = torch.tensor(q, dtype=torch.float32) * (n - 1)  # float32, as torch.quantile computes it
    lo, hi = int(rank), int(rank.ceil())
    weight = rank - lo  # float32 in [0, 1)
    below = v.kthvalue(lo + 1).values  # the (lo + 1)-th smallest
    # the (hi + 1)-th smallest: `below` again when hi == lo or when more than hi entries are <= it (ties),
    # else the smallest entry above it
    above = below if hi == lo or int((v <= below).sum()) > hi else v[v > below].min()
    return torch.lerp(below, above, weight)
