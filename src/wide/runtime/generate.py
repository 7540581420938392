"""Greedy generation over WideRuntime; on CUDA the decode step is replayed from a CUDA graph."""

from __future__ import annotations

import torch

from wide.runtime.model import WideRuntime


class GraphedDecode:
    """The runtime's decode step captured once in a CUDA graph (static input ids, static logits)."""

    def __init__(self, rt: WideRuntime, batch: int):
        dev = rt.cache.k.device
        self.rt, self.ids = rt, torch.zeros(batch, 1, dtype=torch.long, device=dev)
        lens = rt.cache.lens.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up: compile / autotune kernels outside the capture
            for _ in range(2):
                rt.decode(self.ids)
        torch.cuda.current_stream().wait_stream(s)
        rt.cache.lens.copy_(lens)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = rt.decode(self.ids)
        rt.cache.lens.copy_(lens)  # capture recorded the step; nothing ran

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.graph.replay()
        return self.logits


@torch.no_grad()
def generate(rt: WideRuntime, ids: torch.Tensor, max_new_tokens: int, *, cuda_graph: bool = True) -> torch.Tensor:
    """ids: [B, T] equal-length prompts -> [B, T + max_new_tokens] (greedy)."""
    rt.cache.reset()
    nxt = rt.prefill(ids).argmax(-1, keepdim=True)  # [B, 1]
    out = [ids, nxt]
    step = GraphedDecode(rt, ids.shape[0]) if (cuda_graph and ids.is_cuda) else rt.decode
    for _ in range(max_new_tokens - 1):
        nxt = step(nxt).argmax(-1, keepdim=True)
        out.append(nxt)
    return torch.cat(out, dim=1)
