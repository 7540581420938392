"""Token-wise whole-layer skipping (the Mixture-of-Depths / D-LLM family) on WideModel's public API.

One router per layer reads the normalised input of attention and decides, per token, whether the
whole layer runs: a skipped token's attention and FFN are both skipped, so the layer's output is its
input (the residual passes through; exact for pre-norm decoders whose o_proj / down_proj have no bias).

Built from a WideModel with one group per block (`WideConfig(method="layer-skip")` routes like module
skipping) plus a forward hook on each `post_attention_layernorm`, registered after WideModel's, that
replaces the layer's FFN decisions (every `ffn*` entry of `wm.last_masks[i]`: the applied mask with its
straight-through gradient, the argmax mask, the skip margins) by the attention decisions. The sparsity loss
therefore sees skip_ffn = skip_attn and eq. 6 becomes α·|S − mean_l skip_l|. The FFN routers are computed
but never used (no gradient reaches them); the meter counts one router per layer.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from wide.accounting import SparsityMeter
from wide.model.wide_model import WideModel, decoder_layers


class TiedMeter(SparsityMeter):
    """SparsityMeter of layer skipping: the attention decision of a layer is recorded for its FFN too,
    the FFN routers' own records are ignored, and only the attention routers' FLOPs are charged."""

    @torch.no_grad()
    def record(self, layer: int, kind: str, exec_mask: torch.Tensor) -> None:
        if kind != "attn":  # the FFN router's decision is replaced by the attention's (see module doc)
            return
        super().record(layer, "attn", exec_mask)
        super().record(layer, "ffn", exec_mask)
        if layer == 0:  # give back the FFN routers' cost charged by the base class
            f = self.flops
            ffn_router = f.routers_per_layer / 2  # both routers of a layer have one group: equal cost
            b, t = exec_mask.shape[:2]
            tm = self.token_mask
            n = float(tm.sum()) if tm is not None and tm.shape == (b, t) else float(b * t)
            self.saved_flops += ffn_router * f.dims.n_layers * n


class LayerSkipModel(WideModel):
    """A WideModel whose FFN decisions are tied to the attention decision of the same layer."""

    def __init__(self, model: nn.Module, config, *, base_model_id: str | None = None):
        if config.method != "layer-skip":
            raise ValueError(f"LayerSkipModel needs a config with method='layer-skip', got {config.method!r}")
        super().__init__(model, config, base_model_id=base_model_id, meter_cls=TiedMeter)
        self._tie_handles = [
            layer.post_attention_layernorm.register_forward_hook(self._tie_hook(i))
            for i, layer in enumerate(decoder_layers(model))
        ]

    def _tie_hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if self.mode == "dense":
                return
            masks = self.last_masks[layer]
            for key in [k for k in masks if k.startswith("attn")]:
                masks["ffn" + key[len("attn") :]] = masks[key]

        return hook

    def detach(self) -> None:
        super().detach()
        for h in self._tie_handles:
            h.remove()
        self._tie_handles.clear()
