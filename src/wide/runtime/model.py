"""A lean inference model over the routed kernels, with a static KV cache (prefill + decode).

It takes the weights of a Hugging Face Llama-family model and the routers of a `WideModel`, and runs
every prunable operator through `wide.kernels`:

  attention: router -> plan_route(mask, plan) -> routed_gemm_mn (Q) ; [K; V] in one GEMM
             -> routed attention -> routed_gemm_k (O)
  FFN:       router -> plan_route(mask, plan) -> routed_swiglu (gate+up) -> routed_gemm_k (down)

The routers decide through ``wide.kernels.router_decisions``, the op the masked path and training
use too (docs/routing.md#the-decision-rule): the runtime serves the decisions that were evaluated.
Projections that read the same input share one GEMM: dense runs [Q; K; V] and [gate; up] as one
each (as serving engines do), WIDE runs [K; V] as one.
The fused weights are row blocks of one buffer per layer; the Hugging Face modules' weights are
re-pointed to views of it (same values, no second copy).

Each routing decision is planned once (`wide.kernels.route.plan`: from M = B*T, the group size, the number of
groups and the expected sparsity of the layer's routers, the runtime's hints); `plan_route` runs the
reorder only when Q / gate-up take the sorted path (decode reads the mask directly). Q leaves
its inactive heads unspecified (attention skips them); attention and SwiGLU write zeros there, so O
and down are told their input is pre-zeroed (``x_zeroed``).

K/V projections, norms, RoPE and lm_head stay dense. `routed=False` gives the dense baseline through
the same code (cuBLAS linears, SDPA prefill, split-KV decode with every group active). No host
synchronisation in `prefill` / `decode`: positions and cache lengths live on the device, so the decode
step can be captured in a CUDA graph (see `wide.runtime.generate`).

Each layer runs through `layer_step` (``wide.runtime.layer``), a function of tensors only; `compile=True`
compiles it once with `torch.compile` (the routed kernels are custom ops inside the graph) so the norms, RoPE,
router heads, cache writes and residual adds fuse into a few kernels for every layer, for WIDE and dense alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from wide import kernels as K
from wide.config import NO_GROUP_ROUTERS
from wide.model.wide_model import WideModel, decoder_layers
from wide.runtime.layer import LayerWeights, Masks, StepConfig, layer_step
from wide.target import planned_rates

# How the cache is laid out in memory (docs/long-context.md#cache-layout). Every reader and writer sees the same
# [L, B, S, Hk, d] tensors and takes their strides, so the layout is the allocation alone:
#   "nhd": token-major, storage [L, B, S, Hk, d]: a token's K of every group side by side;
#   "hnd": head-major, storage [L, B, Hk, S, d]: one (sequence, group) pair's keys contiguous, so a decode step that
#          skips a pair skips one contiguous block instead of a d-wide strip of every token's row.
KV_LAYOUTS = ("nhd", "hnd")


@dataclass
class StaticCache:
    """k, v: [L, B, S, Hk, d] (views of the storage ``layout`` names); lens: [B] int32 — tokens already in the
    cache per sequence."""

    k: torch.Tensor
    v: torch.Tensor
    lens: torch.Tensor
    layout: str = "nhd"

    @classmethod
    def empty(
        cls, n_layers: int, batch: int, max_seq: int, n_kv: int, head_dim: int, dtype, device, layout: str = "nhd"
    ) -> StaticCache:
        if layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {layout!r}")
        head_major = layout == "hnd"
        storage = (n_layers, batch, *((n_kv, max_seq) if head_major else (max_seq, n_kv)), head_dim)
        k, v = (torch.zeros(storage, dtype=dtype, device=device) for _ in range(2))
        if head_major:  # the [L, B, S, Hk, d] view every reader and writer takes
            k, v = k.transpose(2, 3), v.transpose(2, 3)
        return cls(k, v, torch.zeros(batch, dtype=torch.int32, device=device), layout)

    def reset(self) -> None:
        self.lens.zero_()

    def release(self, row: int) -> None:
        """Row ``row`` holds no tokens (its entries stay in memory until a prefill overwrites them)."""
        self.lens[row] = 0


# The routed attention kernels' tiles fit shared memory for fp16 / fp32 only up to this head_dim.
MAX_HEAD_DIM_WIDE_DTYPES = 64


def _rows(t: torch.Tensor | None, lo: int, hi: int | None) -> torch.Tensor | None:
    return None if t is None else t[lo:hi]


@torch.no_grad()
def fuse_linears(linears: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum of out_features, in] buffer holding the weights of ``linears`` (nn.Linear reading the
    same input) one after another, and their biases (0 where absent; None if none has one).

    Each module's weight (and bias) is re-pointed to its view of the buffer: same values, no second copy,
    and the module keeps working.
    """
    w = torch.cat([m.weight for m in linears])  # [sum N_i, D]
    b = None
    if any(m.bias is not None for m in linears):
        b = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in linears])
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = w[start : start + n]
        if m.bias is not None:
            m.bias.data = b[start : start + n]
        start += n
    return w, b


def sliding_window(config) -> int | None:
    """Keys a query attends back to, when the model's config limits them (Mistral's ``sliding_window``; Qwen2 /
    Qwen3 layers of type "sliding_attention"), else None."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if getattr(config, "use_sliding_window", None) is False or (types is not None and "sliding_attention" not in types):
        return None  # Qwen2 / Qwen3 keep a window size in the config with the window switched off
    return window or None


def unserved_features(model: torch.nn.Module, max_seq: int) -> str | None:
    """What of this Hugging Face model the runtime's layer step would compute differently, or None: an MLP
    activation other than SiLU (the step's is SwiGLU), biases in the MLP projections (the step reads their
    weights only), a sliding attention window shorter than the cache (the step attends to every cached key)."""
    act = getattr(model.config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        return f"its MLP activation is {act!r}, the runtime's is SiLU"
    for i, layer in enumerate(decoder_layers(model)):
        mlp = layer.mlp
        if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i}'s MLP projections have biases"
    window = sliding_window(model.config)
    if window is not None and window < max_seq:
        return f"its attention looks back {window} keys at most, the cache holds max_seq={max_seq}"
    return None


class WideRuntime:
    """Prefill / decode over a static cache; routed through the kernels (or dense with routed=False).

    The weight tensors and folded router heads are taken when the runtime is built: build it after
    calibration, threshold fits and LoRA merges. Building it re-points the model's q/k/v and gate/up
    weights to views of per-layer fused buffers (``fuse_linears``): the model computes as before and
    ``save_pretrained`` still works (it clones tensors that share a buffer). ``attn_sparsity_hint`` /
    ``ffn_sparsity_hint``: the fraction of attention / FFN groups the routers skip, one value or one per
    layer (default: the per-layer rates a calibrated checkpoint recorded, else the config's targets),
    from which ``wide.kernels.route.plan`` picks each decision's paths (Q and gate/up: cuBLAS at large M when
    too little is skipped; O: the 'ordered' GEMM-K at large M when enough is); pass what you measured on
    your data (``WideModel.start_meter``, ``stop_meter()["per_layer"]``) when it differs. ``force_k``:
    one GEMM-K path ('small' | 'dense' | 'ordered') for O and down instead of the plan's choice.
    ``compile=True``: the layer step runs through ``torch.compile`` (first calls compile; raises
    dynamo's recompile limit to 64 for the process). ``fused_decode``: decode steps run the fused decode
    layer (``wide.runtime.fused``: at most six launches per layer, max_batch <= 16; prefill is unchanged);
    None (default): on a GPU wherever it serves the runtime, else the unfused step; True: the fused layer
    or a ValueError saying why not; False: the unfused step. ``batch_invariant``: the fused decode attention
    splits every running pair's keys into ``attn_split_cap(max_seq)`` parts (the cache size alone) instead of a
    count read from the batch's running pairs, so that a row's rounding does not depend on its batch-mates' masks
    (docs/serving.md#batch-invariant-mode; the serving engine also fixes the padded batch size in that mode).
    ``kv_layout``: the cache's memory layout, "nhd" (token-major, the default) or "hnd" (head-major: each
    (sequence, KV group) pair's keys contiguous); the same [L, B, S, Hk, d] tensors either way
    (``KV_LAYOUTS``, docs/long-context.md#cache-layout).

    Slots (``wide.serve``): ``prefill(ids, slot=s)`` fills cache row s alone (other rows are neither read nor
    written); ``decode(ids, active)`` steps rows [0, B) each at its own ``cache.lens``, rows with ``active`` False
    running no group (docs/serving.md#what-idle-rows-compute)."""

    def __init__(
        self,
        wm: WideModel,
        *,
        max_batch: int,
        max_seq: int,
        routed: bool = True,
        force_k: str | None = None,
        attn_sparsity_hint: float | Sequence[float] | None = None,
        ffn_sparsity_hint: float | Sequence[float] | None = None,
        compile: bool = False,
        fused_decode: bool | None = None,
        batch_invariant: bool = False,
        kv_layout: str = "nhd",
    ):
        self.wm, self.hf = wm, wm.model
        self.layers = decoder_layers(self.hf)
        d, s = wm.dims, wm.shape
        if routed and wm.config.method in NO_GROUP_ROUTERS:
            raise ValueError(
                f"WideRuntime serves per-group routers; these are {wm.config.method}'s: run them with the masked "
                "path (the routed model itself)"
            )
        if routed and s.attn_heads_per_group != d.gqa_group:
            raise ValueError(
                f"the routed kernels take one attention decision per KV group ({d.gqa_group} heads); these "
                f"routers decide per {s.attn_heads_per_group} heads: run them with the masked path (WideModel)"
            )
        if force_k is not None and force_k not in K.K_PATHS:
            raise ValueError(f"force_k must be one of {K.K_PATHS} or None, got {force_k!r}")
        self.routed, self.force_k = routed, force_k
        p = next(self.hf.parameters())
        if max_batch < 1 or max_seq < 1:
            raise ValueError(f"max_batch and max_seq must be >= 1, got {max_batch}, {max_seq}")
        why = unserved_features(self.hf, max_seq)
        if why is not None:
            raise ValueError(f"WideRuntime does not serve this model: {why} (WideModel runs it)")
        if p.is_cuda and p.dtype != torch.bfloat16 and d.head_dim > MAX_HEAD_DIM_WIDE_DTYPES:
            raise ValueError(
                f"WideRuntime serves {p.dtype} models up to head_dim {MAX_HEAD_DIM_WIDE_DTYPES} on the GPU (bf16 at "
                f"any head_dim); this model has head_dim {d.head_dim}: load it in bf16 (or use WideModel)"
            )
        self.attn_sparsity_hints = self._hints("attn", attn_sparsity_hint, len(self.layers))
        self.ffn_sparsity_hints = self._hints("ffn", ffn_sparsity_hint, len(self.layers))
        self.g_attn = s.attn_heads_per_group * d.head_dim
        self.g_ffn = s.ffn_group_size
        # per layer: the attention and FFN routers folded for inference (Router.fold)
        self.heads = [(r.attn.fold(p.dtype), r.ffn.fold(p.dtype)) for r in wm.routers]
        self.weights = [self._layer_weights(i, layer) for i, layer in enumerate(self.layers)]
        self.cache = StaticCache.empty(
            d.n_layers, max_batch, max_seq, d.n_kv_heads, d.head_dim, p.dtype, p.device, layout=kv_layout
        )
        self.batch_invariant = batch_invariant
        self.attn_splits: int | None = None  # fused decode attention's fixed split count (None: the running-pair rule)
        self.last_masks: list[Masks] = []  # the unfused path's last forward: per layer, its execute masks
        # per layer, prefill and decode; layers whose hints pick the same schedules share a config
        hints = list(zip(self.attn_sparsity_hints, self.ffn_sparsity_hints, strict=True))
        self.step_configs = {dec: [self._step_config(dec, *h) for h in hints] for dec in (False, True)}
        self.step = layer_step
        if compile:  # one compiled layer step (per static config) serves every layer
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self.step = torch.compile(layer_step, dynamic=None)
        from wide.runtime.fused import build_fused_layers, check_fused, fused_unsupported

        # auto: on the GPU wherever the fused layer serves (docs/kernels.md#fused-decode-layer)
        if fused_decode is None:
            fused_decode = p.is_cuda and fused_unsupported(self, max_batch) is None
        self.fused_layers = None  # fused_decode: decode runs wide.runtime.fused (<= 6 launches per layer)
        self.router_stream = None  # the fused step's side stream for the routers (fused_decode_step)
        # the last fused decode step's masks per routed layer (attention [B, Hk], FFN [B, G]; benchmarks read them)
        self.fused_masks: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        if fused_decode:
            check_fused(self, max_batch)
            self.fused_layers = build_fused_layers(self)
            if batch_invariant:
                from wide.kernels.fused_decode import attn_split_cap

                self.attn_splits = attn_split_cap(max_seq)
            self.router_stream = torch.cuda.Stream(p.device) if p.is_cuda and routed else None

    def _layer_weights(self, i: int, layer) -> LayerWeights:
        at, mlp = layer.self_attn, layer.mlp
        qn = getattr(at, "q_norm", None)
        kn = getattr(at, "k_norm", None)
        nq = at.q_proj.weight.shape[0]
        if self.routed:  # [Q; K; V]: Q alone (routed), K and V together
            w_in, b_in = fuse_linears([at.q_proj, at.k_proj, at.v_proj])
            attn = (None, None, w_in[:nq], _rows(b_in, 0, nq), w_in[nq:], _rows(b_in, nq, None))
            ffn = (None, mlp.gate_proj.weight, mlp.up_proj.weight)  # routed SwiGLU reads both anyway
            heads = self.heads[i]
            out_bias = tuple(self._out_bias(getattr(self.wm.routers[i], k), at.o_proj.weight) for k in ("attn", "ffn"))
        else:
            w_in, b_in = fuse_linears([at.q_proj, at.k_proj, at.v_proj])
            attn = (w_in, b_in, None, None, None, None)
            ffn = (fuse_linears([mlp.gate_proj, mlp.up_proj])[0], None, None)
            heads = (None, None)
            out_bias = (None, None)
        return LayerWeights(
            layer.input_layernorm.weight, *attn, at.o_proj.weight, at.o_proj.bias,
            None if qn is None else qn.weight, None if kn is None else kn.weight,
            layer.post_attention_layernorm.weight, *ffn, mlp.down_proj.weight, *heads, *out_bias,
        )  # fmt: skip

    @staticmethod
    def _out_bias(router, like: torch.Tensor) -> torch.Tensor | None:
        """A router's output bias in the model's dtype and device, or None."""
        b = getattr(router, "out_bias", None)
        return None if b is None else b.to(like.dtype).to(like.device).contiguous()

    def _hints(self, kind: str, hint: float | Sequence[float] | None, n_layers: int) -> list[float]:
        """Per-layer expected sparsity of the ``kind`` ('attn' / 'ffn') routers: the given value(s); else
        the per-layer rates a loaded checkpoint's threshold fit recorded (``WideModel.fitted_rates``);
        else the config's target."""
        name = f"{kind}_sparsity_hint"
        if hint is None:
            hint = planned_rates(self.wm.fitted_rates, self.wm.config, kind, n_layers)
        hints = [float(hint)] * n_layers if isinstance(hint, (int, float)) else [float(h) for h in hint]
        if len(hints) != n_layers:
            raise ValueError(f"{name} has {len(hints)} values for {n_layers} layers")
        if not all(0.0 <= h <= 1.0 for h in hints):
            raise ValueError(f"{name} must lie in [0, 1], got {hints}")
        return hints

    def _step_config(self, decode: bool, attn_hint: float, ffn_hint: float) -> StepConfig:
        d, layer = self.wm.dims, self.layers[0]
        qn = getattr(layer.self_attn, "q_norm", None)
        return StepConfig(
            routed=self.routed,
            decode=decode,
            n_q=d.n_q_heads,
            n_kv=d.n_kv_heads,
            head_dim=d.head_dim,
            g_attn=self.g_attn,
            g_ffn=self.g_ffn,
            eps=float(layer.input_layernorm.variance_epsilon),
            qk_eps=float(qn.variance_epsilon) if qn is not None else 0.0,
            force_k=self.force_k,
            router_residual=self.wm.config.router_input == "residual",
            ffn_router_from_layer=self.wm.config.ffn_router_source == "layer",
            attn_sparsity_hint=K.sparsity_bucket(attn_hint, self.g_attn),
            ffn_sparsity_hint=K.sparsity_bucket(ffn_hint, self.g_ffn),
        )

    # ------------------------------------------------------------------ pieces
    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        decode: bool,
        every_position: bool = False,
        slot: int = 0,
        active: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ids: [B, T], pos: [B, T] absolute positions -> fp32 logits of the last position [B, V], or with
        ``every_position`` the logits of every position [B, T, V] in the model dtype (scoring). The batch runs in
        cache rows [slot, slot + B) (views: no other row is read or written); ``active``: see ``layer_step``."""
        x = self.hf.model.embed_tokens(ids)  # [B, T, D]
        cos, sin = self.hf.model.rotary_emb(x, pos)  # [B, T, d], once for every layer
        rows = slice(slot, slot + ids.shape[0])
        lens = self.cache.lens[rows]
        meter = self.wm.meter if (self.wm.metering and self.routed) else None
        self.last_masks = []
        for i, (w, st) in enumerate(zip(self.weights, self.step_configs[decode], strict=True)):
            ck, cv = self.cache.k[i][rows], self.cache.v[i][rows]  # [B, S, Hk, d] views
            x, masks = self.step(x, cos, sin, pos, lens, w, ck, cv, st, active)
            if self.routed:
                self.last_masks.append(masks)
            if meter is not None:
                meter.record(i, "attn", masks.attn)
                meter.record(i, "ffn", masks.ffn)
        if every_position:
            return self.hf.lm_head(self.hf.model.norm(x))
        x = self.hf.model.norm(x[:, -1])
        return self.hf.lm_head(x).float()

    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        if ids.dim() != 2:
            raise ValueError(f"{what} takes token ids [B, T], got shape {tuple(ids.shape)}")
        if ids.device != self.cache.k.device:
            raise ValueError(f"{what}: ids on {ids.device}, the model on {self.cache.k.device}")
        b, t = ids.shape
        max_batch, max_seq = self.cache.k.shape[1:3]
        if b > max_batch or t > max_seq or b == 0 or t == 0:
            raise ValueError(f"{what}: batch {tuple(ids.shape)} outside the cache (max_batch, max_seq) = "
                             f"({max_batch}, {max_seq})")  # fmt: skip

    # ------------------------------------------------------------------ API
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """A fresh batch of equal-length prompts ids: [B, T] -> next-token logits [B, V] (fp32), written to
        cache rows [slot, slot + B) (a serving engine prefills one request into its own slot: B = 1)."""
        self._check_ids(ids, "prefill")
        b, t = ids.shape
        if not 0 <= slot <= self.cache.k.shape[1] - b:
            raise ValueError(f"prefill: rows [{slot}, {slot + b}) outside the cache's {self.cache.k.shape[1]}")
        pos = torch.arange(t, device=ids.device).expand(b, t)
        logits = self._forward(ids, pos, decode=False, slot=slot)
        self.cache.lens[slot : slot + b] = t
        return logits

    @torch.no_grad()
    def score(self, ids: torch.Tensor) -> torch.Tensor:
        """Prefill a fresh batch ids: [B, T] and return the logits of every position [B, T, V] (model
        dtype), as ``model(ids).logits`` does: the served path, for evaluation. Right padding is safe
        (causal: later tokens never change earlier logits). While ``wm.start_meter()`` is active, the
        runtime's own decisions are metered (set the meter's token mask to exclude padding)."""
        self._check_ids(ids, "score")
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device).expand(b, t)
        logits = self._forward(ids, pos, decode=False, every_position=True)
        self.cache.lens[:b] = t
        return logits

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """One step: ids [B, 1] at each sequence's cache length -> logits [B, V]. No host sync: the
        caller keeps the cache length below max_seq (``generate`` checks it once). ``active`` [B] bool (serving:
        a padded batch of slots): rows set False restart at length 0 and run no attention or FFN group; they still
        write one K/V entry at position 0 of their own row (docs/serving.md#what-idle-rows-compute)."""
        if ids.dim() != 2 or ids.shape[1] != 1 or ids.shape[0] > self.cache.k.shape[1]:
            raise ValueError(f"decode takes ids [B <= {self.cache.k.shape[1]}, 1], got shape {tuple(ids.shape)}")
        if ids.device != self.cache.k.device:
            raise ValueError(f"decode: ids on {ids.device}, the model on {self.cache.k.device}")
        b = ids.shape[0]
        if active is not None:  # idle rows: length 0, so their one K/V write stays at position 0 of their row
            self.cache.lens[:b].mul_(active)
        pos = self.cache.lens[:b].long()[:, None]  # [B, 1]
        if self.fused_layers is not None:
            from wide.runtime.fused import fused_decode_step

            # under CUDA-graph capture the masks are the graph's outputs, refreshed by every replay
            logits, self.fused_masks = fused_decode_step(self, ids, pos, active)
        else:
            logits = self._forward(ids, pos, decode=True, active=active)
        self.cache.lens[:b] += 1
        return logits
