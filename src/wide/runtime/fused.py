"""The fused decode step of ``WideRuntime(fused_decode=True)``: each decoder layer in at most six launches.

Per layer (``wide.kernels.fused_decode``; docs/kernels.md, "Fused decode layer"):

  routed:  router_decisions(h) -> qkv_rope_cache -> attention_decode_merged -> o_proj_residual_norm
           -> router_decisions(h') -> ffn_residual_norm                                  (6 launches)
  routed, FFN router on the layer input (ffn_router_source="layer"):
           router_decisions_pair(h) -> qkv_rope_cache -> attention_decode_merged
           -> o_proj_residual_norm -> ffn_residual_norm                                  (5 launches)
  dense:   qkv_rope_cache -> attention_decode_merged -> o_proj_residual_norm -> ffn_residual_norm (4)

On a GPU (``FD.router_overlap``; ``launch_overrides(router_overlap=0)`` turns it off) a routed layer's first router
launch runs on a side stream beside qkv_rope_cache, which then computes every Q head; attention waits for both. Off
the critical path, the router costs the Q heads it would have skipped instead of its latency
(docs/kernels.md#fused-decode-layer).

The hidden state h a router reads is the RMSNorm the previous kernel wrote in the model dtype (the
first layer's by one norm launch per step; the last layer's FFN kernel applies the model's final norm),
and the decision is ``router_decisions`` on it: the same op, on the same kind of input, as the unfused
runtime (routers with ``router_input="residual"`` read the residual stream x the kernels also write; with
``ffn_router_source="layer"`` the FFN router decides at the layer's start, in the attention router's launch).
One code path serves ``routed=True`` and the dense baseline (``mask=None``: every group runs). Prefill is
unchanged (``wide.runtime.layer.layer_step``). No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch

from wide.kernels import fused_decode as FD
from wide.kernels.router import router_decisions
from wide.runtime.layer import decide


class FusedLayer(NamedTuple):
    """One decoder layer's tensors as the fused kernels read them (views of the runtime's weights)."""

    ln_attn: torch.Tensor  # [D]
    eps_attn: float
    w_qkv: torch.Tensor  # [(Hq + 2 Hk) d, D]
    b_qkv: torch.Tensor | None
    q_norm: torch.Tensor | None  # [d] (Qwen3)
    k_norm: torch.Tensor | None
    wo: torch.Tensor  # [D, Hq d]
    bo: torch.Tensor | None
    ln_ffn: torch.Tensor  # [D]
    eps_ffn: float
    w_gate: torch.Tensor  # [D', D]
    w_up: torch.Tensor  # [D', D]
    w_down: torch.Tensor  # [D, D']
    router_attn: tuple | None  # (W_down [r, D], W_margin [Hk, r], b_margin [Hk]); None: dense
    router_ffn: tuple | None
    b_down: torch.Tensor | None = None  # [D] after the down projection (a router's out_bias)


def _rows_view(first: torch.Tensor, second: torch.Tensor | None, n_rows: int) -> torch.Tensor | None:
    """The first ``n_rows`` rows of the buffer in which ``second`` directly follows ``first`` (no copy),
    else their concatenation (one copy, at build time)."""
    if second is None:
        return None if first is None else first
    width = first.shape[1:] if first.dim() > 1 else ()
    follows = (
        first.is_contiguous()
        and second.is_contiguous()
        and second.data_ptr() == first.data_ptr() + first.numel() * first.element_size()
    )
    if follows:
        stride = first.stride() if first.dim() > 1 else (1,)
        return first.as_strided((n_rows, *width), stride, first.storage_offset())
    return torch.cat([first, second])[:n_rows].contiguous()


def build_fused_layers(rt) -> list[FusedLayer]:
    """The fused view of a ``WideRuntime``'s weights (shares their storage where the runtime fused them)."""
    d = rt.wm.dims
    n_qkv = (d.n_q_heads + 2 * d.n_kv_heads) * d.head_dim
    layers = []
    for i, (w, layer) in enumerate(zip(rt.weights, rt.layers, strict=True)):
        if rt.routed:  # [Q; K; V] is one buffer: Q's view followed by [K; V]'s
            w_qkv = _rows_view(w.wq, w.w_kv, n_qkv)
            b_qkv = None if w.bq is None else _rows_view(w.bq, w.b_kv, n_qkv)
            w_gate, w_up = w.w_gate, w.w_up
            routers = (rt.heads[i][0], rt.heads[i][1])
        else:
            w_qkv, b_qkv = w.w_qkv, w.b_qkv
            df = w.w_down.shape[1]
            w_gate, w_up = w.w_gate_up[:df], w.w_gate_up[df:]
            routers = (None, None)
        layers.append(
            FusedLayer(
                w.ln_attn,
                float(layer.input_layernorm.variance_epsilon),
                w_qkv.contiguous(),
                None if b_qkv is None else b_qkv.contiguous(),
                w.q_norm,
                w.k_norm,
                w.wo.contiguous(),
                w.bo if w.out_bias_attn is None else w.out_bias_attn,  # check_fused: never both
                w.ln_ffn,
                float(layer.post_attention_layernorm.variance_epsilon),
                w_gate.contiguous(),
                w_up.contiguous(),
                w.w_down.contiguous(),
                *routers,
                w.out_bias_ffn,
            )  # fmt: skip
        )
    return layers


def fused_unsupported(rt, max_batch: int) -> str | None:
    """Why the fused decode cannot serve this runtime (one line), or None when it can."""
    d = rt.wm.dims
    if max_batch > FD.MAX_BATCH:
        return f"fused_decode serves batches of at most {FD.MAX_BATCH} tokens, max_batch={max_batch}"
    if d.head_dim % 32:
        return f"fused_decode needs head_dim a multiple of 32, got {d.head_dim}"
    if any(w.bo is not None and w.out_bias_attn is not None for w in rt.weights):
        return "fused_decode adds one bias after O: an O bias and a router's out_bias together are not served"
    df = rt.layers[0].mlp.down_proj.weight.shape[1]
    if rt.g_ffn % 16 or df % rt.g_ffn:
        return f"fused_decode needs an FFN group size that is a multiple of 16 dividing {df}: {rt.g_ffn}"
    return None


def check_fused(rt, max_batch: int) -> None:
    """ValueError when the fused decode cannot serve this runtime (flag: ``fused_decode``)."""
    why = fused_unsupported(rt, max_batch)
    if why is not None:
        raise ValueError(why)


@torch.no_grad()
def fused_decode_step(
    rt, ids: torch.Tensor, pos: torch.Tensor, active: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """ids [B, 1] at positions pos [B, 1] (= the cache lengths) -> (logits [B, V], per routed layer its masks
    (attention [B, Hk], FFN [B, G])); writes each layer's K/V at pos. The caller advances ``rt.cache.lens``
    and keeps the masks (``WideRuntime.fused_masks``). ``active`` [B] bool: routed rows set False run no group
    (dense ones attend to their own position alone); ``rt.attn_splits`` fixes attention's split count."""
    b = ids.shape[0]
    layers, st = rt.fused_layers, rt.step_configs[True][0]
    x = rt.hf.model.embed_tokens(ids)  # [B, 1, D]
    cos, sin = rt.hf.model.rotary_emb(x, pos)  # [B, 1, d]
    cos, sin = cos[:, 0].float().contiguous(), sin[:, 0].float().contiguous()
    x = x[:, 0].contiguous()  # [B, D]
    p = pos[:, 0]
    lens = rt.cache.lens[:b]
    h = FD.fused_rms_norm(x, layers[0].ln_attn, layers[0].eps_attn)
    final = rt.hf.model.norm
    masks = []  # per layer (attention [B, Hk], FFN [B, G]) when routed: the runtime keeps them (fused_masks)
    early = st.ffn_router_from_layer  # the FFN router reads the layer input
    overlap = rt.routed and FD.router_overlap(x.is_cuda)
    side = rt.router_stream if overlap else None  # None on the CPU: the same launches, in order
    main = torch.cuda.current_stream(x.device) if side is not None else None
    for i, w in enumerate(layers):
        rin = x if st.router_residual else h  # [B, D]: what the routers read
        if side is not None:  # fork: the side stream starts once h is written
            side.wait_stream(main)
        # The masks are allocated on the side stream and read on the main one: they stay alive in the runtime's
        # fused_masks until the next step ends, and the side stream allocates again only after a fork, which waits
        # for every read queued on the main stream.
        with torch.cuda.stream(side) if side is not None else nullcontext():
            mask_a, mask_f = decide(rin, w.router_attn, w.router_ffn if early else None)
            if active is not None and mask_a is not None:  # idle rows of a padded batch run no group
                mask_a = mask_a & active[:, None]
                mask_f = None if mask_f is None else mask_f & active[:, None]
        q = FD.qkv_rope_cache(
            h, w.w_qkv, w.b_qkv, None if overlap else mask_a, cos, sin, p, rt.cache.k[i], rt.cache.v[i], st.n_q,
            w.q_norm, w.k_norm, st.qk_eps,
        )  # fmt: skip
        if side is not None:  # join: attention reads the attention mask
            main.wait_stream(side)
        o = FD.attention_decode_merged(
            q, rt.cache.k[i], rt.cache.v[i], lens, mask_a, len_add=1, num_splits=rt.attn_splits
        )
        x, h = FD.o_proj_residual_norm(o.view(b, -1), w.wo, w.bo, mask_a, x, w.ln_ffn, w.eps_ffn)
        if w.router_ffn is not None and not early:  # the FFN router reads the FFN block's input
            mask_f = router_decisions(x if st.router_residual else h, *w.router_ffn)
            if active is not None:
                mask_f = mask_f & active[:, None]
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        norm_w, eps = (nxt.ln_attn, nxt.eps_attn) if nxt is not None else (final.weight, final.variance_epsilon)
        x, h = FD.ffn_residual_norm(h, w.w_gate, w.w_up, w.w_down, mask_f, x, norm_w, float(eps), rt.g_ffn, w.b_down)
        if mask_a is not None:
            masks.append((mask_a, mask_f))
    return rt.hf.lm_head(h).float(), masks  # h: the final norm of the last position
