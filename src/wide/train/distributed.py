"""Data-parallel calibration over torch.distributed (launch with `torchrun --nproc-per-node N`).

Each global batch is split across ranks without overlap; the loss terms are made the global batch's
(`global_batch_terms`), router (and, in replica mode, LoRA) gradients are averaged, rank 0 writes logs
and checkpoints, every rank keeps its own RNG stream (saved per rank so `--resume` on the same number
of ranks stays exact). Replica mode holds the whole frozen model on every rank; `--parallel fsdp`
shards it (wide.train.fsdp, docs/training.md).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_env(single_process: bool = False) -> torch.device | None:
    """Join the process group torchrun describes (RANK / WORLD_SIZE / LOCAL_RANK) and return this
    rank's device; None when not launched by torchrun. single_process: outside torchrun, create a
    one-rank group first (FSDP needs one even on a single device; gloo for CPU tensors, NCCL for CUDA)."""
    if not dist.is_available():
        return None
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        if single_process and not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return None
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def rank_seed(seed: int, rank: int, step: int) -> int:
    """A fresh seed for rank's RNG streams when a run resumes at `step` on another number of ranks."""
    return (seed * 1_000_003 + step) * 1_009 + rank


def shard(indices: list[int], rank: int, world_size: int) -> list[int]:
    """This rank's share of a global batch (strided, so every rank gets batch_size / world rows)."""
    return indices[rank::world_size]


def all_reduce_mean_(tensors: list[torch.Tensor]) -> None:
    """In-place mean over ranks (no-op on one process). DTensors (FSDP-sharded gradients, which FSDP
    has reduced already) are left alone."""
    _, ws = world()
    if ws == 1:
        return
    from wide.train.fsdp import is_sharded

    for t in tensors:
        if is_sharded(t):
            continue
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t.div_(ws)


def global_batch_terms(
    lm: torch.Tensor,
    attn: torch.Tensor,
    ffn: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor,
    *more: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """This rank's loss terms turned into the global batch's, for gradients that are then averaged
    over ranks (identity on one process).

    lm: this rank's loss, a mean over its label tokens (the LM loss, the distillation KL or their sum);
    attn, ffn: [L] skip rates over this rank's real tokens; labels, attention_mask: [B_local, T];
    more: further means over the label tokens (e.g. the LM loss logged beside a distillation
    objective). Returns (lm', attn', ffn', *more'): lm' and more' are weighted by this rank's share of
    the label tokens (the ranks' mean of lm' is the global mean); attn' and ffn' have the global
    batch's values (token-weighted over ranks, one all-reduce) and a gradient scaled so that the
    ranks' mean gradient is the gradient of the global rates. The sparsity loss, a non-linear function
    of the rates, then sees the same rates as a one-process run over the whole batch."""
    _, ws = world()
    if ws == 1:
        return (lm, attn, ffn, *more)
    rates = torch.stack([attn, ffn])  # [2, L]
    n = torch.stack([(labels[:, 1:] != -100).sum(), attention_mask.sum()]).to(rates.device, torch.float32)
    buf = torch.cat([n, (rates.detach() * n[1]).flatten()])  # [2 + 2L]
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    n_all, rates_all = buf[:2], buf[2:].view_as(rates) / buf[1].clamp_min(1)
    share = n[0] * ws / n_all[0].clamp_min(1)  # this rank's label tokens / the ranks' mean
    rates_w = rates_all + (rates - rates.detach()) * (n[1] * ws / n_all[1].clamp_min(1))
    return (lm * share, rates_w[0], rates_w[1], *(m * share for m in more))


def all_gather_floats(value: float, device: torch.device) -> list[float]:
    """[value of rank 0, value of rank 1, ...] ([value] on one process)."""
    _, ws = world()
    if ws == 1:
        return [float(value)]
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(ws)]
    dist.all_gather(out, t)
    return [float(o) for o in out]


def broadcast_(tensors: list[torch.Tensor], src: int = 0) -> None:
    """In-place broadcast from rank src; CPU tensors go through this rank's GPU under NCCL (a model
    loaded on the CPU for FSDP)."""
    if world()[1] == 1:
        return
    nccl = dist.get_backend() == "nccl"
    for t in tensors:
        if nccl and t.device.type == "cpu":
            tmp = t.to(torch.device("cuda", torch.cuda.current_device()))
            dist.broadcast(tmp, src)
            t.copy_(tmp)
        else:
            dist.broadcast(t, src)


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()
