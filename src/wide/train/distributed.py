"""Data-parallel calibration over torch.distributed (launch with `torchrun --nproc-per-node N`).

Every rank holds the frozen model and the routers; each global batch is split across ranks, router
(and LoRA) gradients are averaged, rank 0 writes logs and checkpoints, every rank keeps its own RNG
stream (saved per rank so `--resume` stays exact).
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


def init_from_env() -> torch.device | None:
    """Join the process group torchrun describes (RANK / WORLD_SIZE / LOCAL_RANK); return this rank's
    device, or None when not launched by torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return None
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def shard(indices: list[int], rank: int, world_size: int) -> list[int]:
    """This rank's share of a global batch (strided, so every rank gets batch_size / world rows)."""
    return indices[rank::world_size]


def all_reduce_mean_(tensors: list[torch.Tensor]) -> None:
    """In-place mean over ranks (no-op on one process)."""
    _, ws = world()
    if ws == 1:
        return
    for t in tensors:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t.div_(ws)


def broadcast_(tensors: list[torch.Tensor], src: int = 0) -> None:
    if world()[1] > 1:
        for t in tensors:
            dist.broadcast(t, src)


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()
