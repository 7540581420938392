"""WideModel: attaches WIDE routers to a Hugging Face decoder in place, through forward hooks.

Per decoder layer:
  input_layernorm  (forward hook)  -> attention router decides N_G = Hq / heads_per_group groups
  self_attn.o_proj (pre-hook)      -> input rows of skipped groups are zeroed: their Q columns, heads
                                      and O rows contribute nothing (K / V stay dense)
  post_attention_layernorm (hook)  -> FFN router decides D' / G_ffn channel groups
  mlp.down_proj    (pre-hook)      -> skipped channel groups zeroed: their gate/up columns and down
                                      rows contribute nothing
This masked-dense path is exact (it equals slicing the weights per token) and is the path used for
training and evaluation; the routed kernels in `wide.kernels` skip the work for real.
No weight is copied: the base model keeps its parameters, the routers live in `WideModel.routers`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from wide.accounting import FlopModel, SparsityMeter
from wide.config import ModelDims, RoutingShape, WideConfig
from wide.routing import Router, RoutingMode, hard_gumbel_execute, masked_mean
from wide.target import FittedRates, TrainingRecord

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The model's architecture is not one WIDE knows how to route."""


class LayerRouters(nn.Module):
    def __init__(self, dims: ModelDims, shape: RoutingShape, config: WideConfig):
        super().__init__()
        s_attn = config.attn_sparsity if config.separate_targets else config.sparsity
        s_ffn = config.ffn_sparsity if config.separate_targets else config.sparsity
        self.attn = Router(dims.hidden, shape.attn_groups, config.router_rank, init_skip=s_attn)
        self.ffn = Router(dims.hidden, shape.ffn_groups, config.router_rank, init_skip=s_ffn)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a supported causal LM, or a clear error."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r}: WIDE routes {', '.join(SUPPORTED_FAMILIES)} models"
        )
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no model.layers; pass a *ForCausalLM model")
    for i, layer in enumerate(layers):
        for path in ("input_layernorm", "post_attention_layernorm", "self_attn.o_proj", "mlp.down_proj"):
            try:
                layer.get_submodule(path)
            except AttributeError as e:
                raise UnsupportedModelError(f"{model_type} layer {i} lacks {path}") from e
    return layers


def model_id_of(model: nn.Module) -> str:
    """The base model's id a router checkpoint records: WIDE's own tag, else the HF name or path."""
    return getattr(model.config, "wide_model_id", None) or getattr(model.config, "_name_or_path", "unknown")


class _Slot:
    """What the hooks of one layer and kind need: the layer index (metering), the router, the masks."""

    __slots__ = ("layer", "router", "masks")

    def __init__(self, layer: int, router: Router, masks: dict[str, torch.Tensor]):
        self.layer, self.router, self.masks = layer, router, masks


class WideModel(TrainingRecord, nn.Module):
    """A Hugging Face causal LM with WIDE routers attached in place.

    After construction, calling either `wide_model(...)` or the base model itself runs routed.
    `mode`: "argmax" (inference, default), "gumbel" (training), "dense" (routers bypassed).
    """

    def __init__(
        self,
        model: nn.Module,
        config: WideConfig,
        *,
        base_model_id: str | None = None,
        meter_cls: type[SparsityMeter] = SparsityMeter,
    ):
        """``meter_cls``: the accounting of the method (a baseline's own meter; same constructor)."""
        super().__init__()
        layers = decoder_layers(model)
        self.model = model
        self.config = config
        self.dims = ModelDims.from_hf_config(model.config)
        self.shape = config.routing_shape(self.dims)
        self.base_model_id = base_model_id or model_id_of(model)
        device = next(model.parameters()).device
        self.routers = nn.ModuleList(LayerRouters(self.dims, self.shape, config) for _ in layers).to(device)
        self.mode: RoutingMode = "argmax"
        # τ lives in a tensor updated in place, so compiled layers read it instead of guarding on it
        self.register_buffer("_tau", torch.tensor(float(config.tau_start), device=device), persistent=False)
        self.meter = meter_cls(FlopModel(self.dims, self.shape, config.router_rank), device)
        self.metering = False
        self.training_summary: dict = {}  # a loaded checkpoint's training record (record_training)
        self.fitted_rates: FittedRates | None = None  # its threshold fit's per-layer rates (wide.target)
        self.token_mask: torch.Tensor | None = None  # [B, T] bool: real tokens of the current batch
        self.last_masks: list[dict[str, torch.Tensor]] = [{} for _ in layers]  # execute masks [B, T, N_G]
        self._handles: list = []
        self._slotted: list[nn.Module] = []  # the modules carrying a `_wide_slot`
        self._attach(layers)

    # ------------------------------------------------------------------ hooks
    # One hook function per kind and position, shared by every layer: the layer's routers and masks are
    # found through a plain attribute (`_wide_slot_<kind>` on the norm a router reads, `_wide_slot` on the
    # projection it masks; not registered submodules, so the base model's state_dict is untouched) on the
    # hooked module. Nothing layer-specific (no layer index, no per-layer closure) is read on the traced
    # path, so torch.compile traces the decoder layer once and reuses that code for every layer (see
    # compile_layers). Every layer's norms and projections carry the same hooks: a layer without one would
    # let Dynamo run its cached code for another layer (docs/negative-results.md, "Compiled lookahead layers").
    def _attach(self, layers: nn.ModuleList) -> None:
        hooks = {kind: (self._router_hook(kind), self._mask_hook(kind)) for kind in ("attn", "ffn")}
        layer_input = self.config.ffn_router_source == "layer"  # the FFN router reads the attention's norm
        for i, layer in enumerate(layers):
            for kind, norm, proj in (
                ("attn", layer.input_layernorm, layer.self_attn.o_proj),
                ("ffn", layer.input_layernorm if layer_input else layer.post_attention_layernorm, layer.mlp.down_proj),
            ):
                slot = _Slot(i, getattr(self.routers[i], kind), self.last_masks[i])
                setattr(norm, "_wide_slot_" + kind, slot)
                proj._wide_slot = slot
                router_hook, mask_hook = hooks[kind]
                self._handles += [norm.register_forward_hook(router_hook), proj.register_forward_pre_hook(mask_hook)]
                self._slotted += [norm, proj]

    def set_out_bias(self, layer: int, kind: str, bias: torch.Tensor) -> None:
        """Add the constant ``bias`` [D] to the output of layer ``layer``'s O (kind 'attn') or down ('ffn')
        projection whenever routing is on (stored on that router: ``Router.set_out_bias``)."""
        router = getattr(self.routers[layer], kind)
        had = getattr(router, "out_bias", None) is not None
        router.set_out_bias(bias.to(next(router.parameters()).device))
        if not had:
            lyr = decoder_layers(self.model)[layer]
            proj = lyr.self_attn.o_proj if kind == "attn" else lyr.mlp.down_proj
            self._handles.append(proj.register_forward_hook(self._out_bias_hook()))

    def _out_bias_hook(self):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if self.mode == "dense":
                return None
            return output + module._wide_slot.router.out_bias.to(output.dtype)  # after the projection's rounding

        return hook

    def detach(self) -> None:
        """Remove the hooks: the base model runs dense again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in self._slotted:
            for name in ("_wide_slot", "_wide_slot_attn", "_wide_slot_ffn"):
                m.__dict__.pop(name, None)
        self._slotted.clear()

    def _router_hook(self, kind: str):
        attr = "_wide_slot_" + kind

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if self.mode == "dense":
                return
            slot = getattr(module, attr)
            x = output if self.config.router_input == "normed" else args[0]  # x: [B, T, D]
            margin = slot.router.skip_margin(x)  # [B, T, N_G] fp32: the one decision rule (wide.routing)
            argmax_exec = margin <= 0  # [B, T, N_G] bool
            if self.mode == "gumbel":
                # a copy of τ: the autograd graph must not see later in-place updates of the buffer
                exec_mask = hard_gumbel_execute(margin, self._tau.clone())  # {0., 1.} with ST gradient
                slot.masks[kind + "_argmax"] = argmax_exec
                slot.masks[kind + "_margin"] = margin
            else:
                exec_mask = argmax_exec
            slot.masks[kind] = exec_mask
            if self.metering:
                self.meter.record(slot.layer, kind, exec_mask)

        return hook

    def _mask_hook(self, kind: str):
        width = self.shape.attn_heads_per_group * self.dims.head_dim if kind == "attn" else (self.shape.ffn_group_size)

        def hook(module: nn.Module, args: tuple):
            if self.mode == "dense":
                return None
            h = args[0]  # h: [B, T, N_G * width]
            m = module._wide_slot.masks[kind]  # [B, T, N_G]
            gate = m.to(h.dtype).repeat_interleave(width, dim=-1)  # [B, T, N_G * width]
            return (h * gate,) + tuple(args[1:])

        return hook

    def _new_forward(self, attention_mask: torch.Tensor | None) -> None:
        self.token_mask = None if attention_mask is None else attention_mask.bool()
        self.meter.set_token_mask(self.token_mask)
        for m in self.last_masks:  # every forward starts from empty dicts: compiled layers see one layout
            m.clear()

    @property
    def tau(self) -> float:
        """Gumbel-Softmax temperature of training-mode routing."""
        return float(self._tau)

    @tau.setter
    def tau(self, value: float) -> None:
        self._tau.fill_(float(value))

    def compile_layers(self, **kwargs) -> None:
        """torch.compile every decoder layer (hooks included); τ and the routing mode stay switchable.

        All layers run the same code object, and the hooks read nothing layer-specific, so Dynamo
        traces it once and every layer reuses it. A few variants remain, each independent of the
        depth: the first layer's input does not require grad, and no_grad / routing modes (the
        threshold fit, evaluation) trace their own graphs."""
        for layer in decoder_layers(self.model):
            # in place (nn.Module.compile): parameter names stay the model's, which peft's adapter naming,
            # checkpoints and resuming under the other setting rely on
            layer.compile(**kwargs)

    # ------------------------------------------------------------------ running
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """Run the routed model; padding (attention_mask == 0) is excluded from skip rates. No KV cache
        unless use_cache=True is passed (scoring needs none; the cache also makes compiled layers
        specialise on the layer index)."""
        self._new_forward(attention_mask)
        kwargs.setdefault("use_cache", False)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Routed final hidden states [B, T, D] (after the final norm), without computing the logits."""
        self._new_forward(attention_mask)
        return self.model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

    def skip_rates(self, which: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """Per-layer skip rates [L] (attention, FFN) of the last forward over real tokens.

        which="" gives the rates of the masks actually applied (differentiable, straight-through, in
        gumbel mode); which="_argmax" the rates argmax routing would have reached on the same input."""

        def rates(kind: str) -> torch.Tensor:
            return torch.stack([1 - masked_mean(m[kind + which].float(), self.token_mask) for m in self.last_masks])

        return rates("attn"), rates("ffn")

    @contextmanager
    def routing(self, mode: RoutingMode, tau: float | None = None) -> Iterator[WideModel]:
        """Temporarily switch the routing mode (and temperature)."""
        old = (self.mode, self.tau)
        self.mode, self.tau = mode, self.tau if tau is None else tau
        try:
            yield self
        finally:
            self.mode, self.tau = old

    def meter_to(self, device: torch.device) -> None:
        """Keep the sparsity accounting on ``device`` (a fresh meter of the same class: it holds no history
        before a run starts it)."""
        if self.meter.device != device:
            self.meter = type(self.meter)(self.meter.flops, device)

    def start_meter(self) -> SparsityMeter:
        """Reset and enable the sparsity meter for the forwards that follow."""
        self.meter.reset()
        self.metering = True
        return self.meter

    def stop_meter(self) -> dict:
        self.metering = False
        return self.meter.summary()

    def router_parameters(self) -> Iterator[nn.Parameter]:
        return self.routers.parameters()

    def freeze_base(self) -> None:
        for p in self.model.parameters():
            p.requires_grad_(False)

    # --------------------------------------------------------------- checkpoints
    def save(self, out_dir: str, training: dict | None = None) -> None:
        from wide.model.checkpoint import save_routers

        save_routers(self, out_dir, training=training)

    @classmethod
    def from_pretrained(cls, model: nn.Module, routers_dir: str, *, strict_base: bool = True) -> WideModel:
        from wide.model.checkpoint import load_routers

        return load_routers(model, routers_dir, strict_base=strict_base)
