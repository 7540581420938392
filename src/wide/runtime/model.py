"""A lean inference model over the routed kernels, with a static KV cache (prefill + decode).

It reads the weights of a Hugging Face Llama-family model in place (no copies) and the routers of a
`WideModel`, and runs every prunable operator through `wide.kernels`:

  attention: plan_route(mask) -> routed_gemm_mn (Q) -> routed attention -> routed_gemm_k (O)
  FFN:       plan_route(mask) -> routed_swiglu (gate+up) -> routed_gemm_k (down)

`plan_route` runs the reorder only when M = B*T > DENSE_M (decode reads the mask directly). Q leaves
its inactive heads unspecified (attention skips them); attention and SwiGLU write zeros there, so O
and down are told their input is pre-zeroed (``x_zeroed``).

K/V projections, norms, RoPE and lm_head stay dense. `routed=False` gives the dense baseline through
the same code (cuBLAS linears, SDPA prefill, split-KV decode with every group active). No host
synchronisation in `prefill` / `decode`: positions and cache lengths live on the device, so the decode
step can be captured in a CUDA graph (see `wide.runtime.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wide import kernels as K
from wide.model.wide_model import WideModel, decoder_layers
from wide.routing import EXECUTE, SKIP


@dataclass
class StaticCache:
    """k, v: [L, B, S, Hk, d]; lens: [B] int32 — tokens already in the cache per sequence."""

    k: torch.Tensor
    v: torch.Tensor
    lens: torch.Tensor

    @classmethod
    def empty(cls, n_layers: int, batch: int, max_seq: int, n_kv: int, head_dim: int, dtype, device):
        shape = (n_layers, batch, max_seq, n_kv, head_dim)
        z = torch.zeros(shape, dtype=dtype, device=device)
        return cls(z, torch.zeros_like(z), torch.zeros(batch, dtype=torch.int32, device=device))

    def reset(self) -> None:
        self.lens.zero_()


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    return norm(x)  # the HF RMSNorm module (fp32 inside, model dtype out)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, d]; cos, sin: [B, T, d]."""
    c, s = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    return x * c + _rotate_half(x) * s


class WideRuntime:
    """Prefill / decode over a static cache; routed through the kernels (or dense with routed=False)."""

    def __init__(self, wm: WideModel, *, max_batch: int, max_seq: int, routed: bool = True, gemm_k_algo: str = "auto"):
        self.wm, self.hf = wm, wm.model
        self.layers = decoder_layers(self.hf)
        d, s = wm.dims, wm.shape
        if routed and s.attn_heads_per_group != d.gqa_group:
            raise ValueError(
                f"the routed kernels take one attention decision per KV group ({d.gqa_group} heads); these "
                f"routers decide per {s.attn_heads_per_group} heads: run them with the masked path (WideModel)"
            )
        self.routed, self.algo = routed, gemm_k_algo
        self.g_attn = s.attn_heads_per_group * d.head_dim
        self.g_ffn = s.ffn_group_size
        p = next(self.hf.parameters())
        # per layer: the attention and FFN routers folded for inference (see _router_head)
        self.heads = [(self._router_head(r.attn, p.dtype), self._router_head(r.ffn, p.dtype)) for r in wm.routers]
        self.cache = StaticCache.empty(d.n_layers, max_batch, max_seq, d.n_kv_heads, d.head_dim, p.dtype, p.device)

    # ------------------------------------------------------------------ pieces
    @staticmethod
    def _router_head(router, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A router folded for inference: (W_down [r, D] in the model dtype, W_margin [N_G, r] fp32,
        b_margin [N_G] fp32) with margin = logit(skip) - logit(execute) + skip_bias = W_margin·(W_down·h)
        + b_margin. Read once, when the runtime is built: build it after calibration / threshold fits."""
        w = router.up.weight.detach().float().view(router.n_groups, 2, -1)  # [N_G, 2, r]
        b = router.up.bias.detach().float().view(router.n_groups, 2)  # [N_G, 2]
        w_margin = (w[:, SKIP] - w[:, EXECUTE]).contiguous()
        b_margin = (b[:, SKIP] - b[:, EXECUTE] + router.skip_bias.detach().float()).contiguous()
        return router.down.weight.detach().to(dtype).contiguous(), w_margin, b_margin

    def _decisions(self, head: tuple[torch.Tensor, torch.Tensor, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """h: [B, T, D] -> execute mask [B, T, N_G] bool (argmax routing).

        The D -> r projection runs in h's dtype (cuBLAS accumulates in fp32): an fp32 copy of h would
        cost more than the projection (fp32 router GEMMs + casts: ~5 ms of a 4,096-token Llama-8B prefill
        in bench/results/reverted-eec4a8a/profile_e2e.txt). The margin
        head and the comparison stay fp32, as in training. In fp32 this is the masked path's decision up
        to rounding of the folded head; in bf16 a decision within rounding of its threshold can differ."""
        w_down, w_margin, b_margin = head
        r = F.linear(h, w_down).float()  # [B, T, r]
        return torch.addmm(b_margin, r.flatten(0, -2), w_margin.t()).view(*h.shape[:-1], -1) <= 0

    def _linear_routed_n(self, x2: torch.Tensor, w: torch.Tensor, route, g: int, bias, mask2) -> torch.Tensor:
        y = K.routed_gemm_mn(x2, w, route, g, zero_inactive=False)  # attention ignores inactive heads
        if bias is not None:  # bias only where the group runs (inactive outputs stay 0)
            y = y + bias * mask2.repeat_interleave(g, dim=-1).to(y.dtype)
        return y

    def _attention(self, i: int, layer, x: torch.Tensor, pos: torch.Tensor, decode: bool) -> torch.Tensor:
        """x: [B, T, D] -> attention block output [B, T, D]; writes this layer's K/V into the cache."""
        at, d = layer.self_attn, self.wm.dims
        b, t, _ = x.shape
        h = _rms(x, layer.input_layernorm)
        h2 = h.reshape(b * t, -1)  # [M, D]
        if self.routed:
            mask = self._decisions(self.heads[i][0], h)  # [B, T, Hk]
            route = K.plan_route(mask)
            q = self._linear_routed_n(h2, at.q_proj.weight, route, self.g_attn, at.q_proj.bias, mask.reshape(b * t, -1))
        else:
            mask, route, q = None, None, F.linear(h2, at.q_proj.weight, at.q_proj.bias)
        k = F.linear(h2, at.k_proj.weight, at.k_proj.bias)
        v = F.linear(h2, at.v_proj.weight, at.v_proj.bias)
        q = q.view(b, t, d.n_q_heads, d.head_dim)
        k = k.view(b, t, d.n_kv_heads, d.head_dim)
        v = v.view(b, t, d.n_kv_heads, d.head_dim)
        if hasattr(at, "q_norm"):  # Qwen3
            q, k = at.q_norm(q), at.k_norm(k)
        cos, sin = self.hf.model.rotary_emb(v, pos)  # [B, T, d]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        ck, cv = self.cache.k[i], self.cache.v[i]  # [B, S, Hk, d]
        bidx = torch.arange(b, device=x.device)[:, None]
        ck[bidx, pos] = k
        cv[bidx, pos] = v
        if decode:
            lens = self.cache.lens[:b] + 1
            m = mask[:, 0] if mask is not None else torch.ones(b, d.n_kv_heads, dtype=torch.bool, device=x.device)
            o = K.routed_attention_decode(q[:, 0], ck[:b], cv[:b], lens, m).unsqueeze(1)  # [B, 1, Hq, d]
        elif self.routed:
            o = K.routed_attention_prefill(q, ck[:b, :t], cv[:b, :t], mask, route=route)
        else:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            ).transpose(1, 2)
        o2 = o.reshape(b * t, -1)  # [M, Hq * d]
        if self.routed:
            y = K.routed_gemm_k(o2, at.o_proj.weight, route, self.g_attn, algo=self.algo, x_zeroed=True)
        else:
            y = F.linear(o2, at.o_proj.weight)
        if at.o_proj.bias is not None:
            y = y + at.o_proj.bias
        return y.view(b, t, -1)

    def _ffn(self, i: int, layer, x: torch.Tensor) -> torch.Tensor:
        mlp = layer.mlp
        b, t, _ = x.shape
        h = _rms(x, layer.post_attention_layernorm)
        h2 = h.reshape(b * t, -1)
        if self.routed:
            route = K.plan_route(self._decisions(self.heads[i][1], h))
            a = K.routed_swiglu(h2, mlp.gate_proj.weight, mlp.up_proj.weight, route, self.g_ffn)  # zeros if inactive
            y = K.routed_gemm_k(a, mlp.down_proj.weight, route, self.g_ffn, algo=self.algo, x_zeroed=True)
        else:
            a = F.silu(F.linear(h2, mlp.gate_proj.weight)) * F.linear(h2, mlp.up_proj.weight)
            y = F.linear(a, mlp.down_proj.weight)
        return y.view(b, t, -1)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, decode: bool) -> torch.Tensor:
        """ids: [B, T], pos: [B, T] absolute positions -> logits of the last position [B, V]."""
        x = self.hf.model.embed_tokens(ids)  # [B, T, D]
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer, x, pos, decode)
            x = x + self._ffn(i, layer, x)
        x = self.hf.model.norm(x[:, -1])
        return self.hf.lm_head(x).float()

    # ------------------------------------------------------------------ API
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """A fresh batch of equal-length prompts ids: [B, T] -> next-token logits [B, V]."""
        b, t = ids.shape
        if t > self.cache.k.shape[2] or b > self.cache.k.shape[1]:
            raise ValueError(
                f"prompt batch {tuple(ids.shape)} exceeds the cache (max_batch, max_seq) = "
                f"{tuple(self.cache.k.shape[1:3])}"
            )
        pos = torch.arange(t, device=ids.device).expand(b, t)
        logits = self._forward(ids, pos, decode=False)
        self.cache.lens[:b] = t
        return logits

    @torch.no_grad()
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """One step: ids [B, 1] at each sequence's cache length -> logits [B, V]. No host sync."""
        b = ids.shape[0]
        pos = self.cache.lens[:b].long()[:, None]  # [B, 1]
        logits = self._forward(ids, pos, decode=True)
        self.cache.lens[:b] += 1
        return logits
