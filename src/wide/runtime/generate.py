"""Greedy generation over WideRuntime; on CUDA the decode step is replayed from a CUDA graph.

``GraphedPrefill`` captures a whole prefill of one prompt shape: a server that pads prompts to a few
length buckets replays it with no host work per kernel. The routed path issues a few dozen kernels per
layer through Python, so at batch 1 issuing them can take as long as running them
(docs/kernels.md#open-problems-measured-see-the-summary).
"""

from __future__ import annotations

import torch

from wide.runtime.model import WideRuntime


class GraphedDecode:
    """The runtime's decode step captured once in a CUDA graph (static input ids, static logits).

    ``rows=True`` (serving): the step also reads a static ``active`` [B] bool (``WideRuntime.decode``'s idle
    rows) and keeps the step's execute masks (``masks``: per layer (attention [B, Hk], FFN [B, N_G]), routed only)
    and the groups each row ran (``ran``: ``groups_run`` of those masks, [B, 2], computed inside the graph),
    refreshed by every replay."""

    def __init__(self, rt: WideRuntime, batch: int, rows: bool = False):
        dev = rt.cache.k.device
        self.rt, self.ids = rt, torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.active = torch.ones(batch, dtype=torch.bool, device=dev) if rows else None
        lens = rt.cache.lens.clone()
        _warm(lambda: rt.decode(self.ids, self.active))
        rt.cache.lens.copy_(lens)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = rt.decode(self.ids, self.active)
            self.masks = step_masks(rt)
            self.ran = groups_run(self.masks, batch) if rows and self.masks else None
        rt.cache.lens.copy_(lens)  # capture recorded the step; nothing ran

    def __call__(self, ids: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        self.ids.copy_(ids)
        if active is not None:
            self.active.copy_(active)
        self.graph.replay()
        return self.logits


def step_masks(rt: WideRuntime) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The execute masks of the runtime's last decode step, per layer (attention [B, ..., Hk], FFN [B, ..., N_G]);
    empty when dense."""
    if not rt.routed:
        return []
    if rt.fused_layers is not None:
        return list(rt.fused_masks)
    return [(m.attn, m.ffn) for m in rt.last_masks]


def groups_run(masks: list[tuple[torch.Tensor, torch.Tensor]], b: int) -> torch.Tensor:
    """Groups each of the b rows ran in one forward, summed over layers and tokens -> [b, 2] float64 (attention,
    FFN); ``masks`` as ``step_masks`` gives them."""
    a = torch.cat([m.reshape(b, -1) for m, _ in masks], 1).sum(1, dtype=torch.float64)
    f = torch.cat([m.reshape(b, -1) for _, m in masks], 1).sum(1, dtype=torch.float64)
    return torch.stack([a, f], 1)


def _warm(fn, n: int = 2) -> None:
    """Run fn n times on a side stream (compile, autotune: nothing of that may happen in a capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(s)


class GraphedPrefill:
    """The runtime's prefill of [B, T] prompts captured once in a CUDA graph (static ids and logits).

    Replaying it writes the cache like ``rt.prefill`` (the sequences' K/V, lengths set to T)."""

    def __init__(self, rt: WideRuntime, batch: int, length: int):
        dev = rt.cache.k.device
        self.rt = rt  # the graph reads and writes rt's weights and cache: keep them alive with it
        self.ids = torch.zeros(batch, length, dtype=torch.long, device=dev)
        _warm(lambda: rt.prefill(self.ids))
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = rt.prefill(self.ids)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape != self.ids.shape:
            raise ValueError(f"this graph serves prompts {tuple(self.ids.shape)}, got {tuple(ids.shape)}")
        self.ids.copy_(ids)
        self.graph.replay()
        return self.logits


@torch.no_grad()
def generate(rt: WideRuntime, ids: torch.Tensor, max_new_tokens: int, *, cuda_graph: bool = True) -> torch.Tensor:
    """ids: [B, T] equal-length prompts -> [B, T + max_new_tokens] (greedy)."""
    max_seq = rt.cache.k.shape[2]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if ids.dim() == 2 and ids.shape[1] + max_new_tokens - 1 > max_seq:
        raise ValueError(f"prompt {ids.shape[1]} + {max_new_tokens} new tokens exceed the runtime's max_seq {max_seq}")
    rt.cache.reset()
    nxt = rt.prefill(ids).argmax(-1, keepdim=True)  # [B, 1]
    out = [ids, nxt]
    step = GraphedDecode(rt, ids.shape[0]) if (cuda_graph and ids.is_cuda) else rt.decode
    for _ in range(max_new_tokens - 1):
        nxt = step(nxt).argmax(-1, keepdim=True)
        out.append(nxt)
    return torch.cat(out, dim=1)
