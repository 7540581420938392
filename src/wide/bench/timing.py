"""GPU timing shared by the kernel benchmarks.

`time_calls(fns)`: a CUDA graph holding R back-to-back calls (R sized to ~3 ms of work), replayed a
few times; the median replay divided by R is the time per call. `fns` are equivalent calls on
rotated copies of the inputs, together larger than the L2 cache, so weights and caches come from HBM
as in a model where every layer has its own. This is how an operator runs inside a decode step (one
graph of thousands of kernels), so the fixed cost of launching a graph is not charged to each call.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

L2_BYTES = 256 << 20  # rotate inputs over at least this many bytes (H200 L2: 50 MiB)
MAX_COPIES = 16


def tree_commit() -> str:
    """The commit a record's tree came from: ``WIDE_COMMIT`` when set (a GPU machine's copy of the working tree
    may carry stale git metadata, so device drivers pass the hash), else ``git rev-parse --short HEAD`` of this
    checkout; "unknown" without git."""
    if os.environ.get("WIDE_COMMIT"):
        return os.environ["WIDE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True,
                                       stderr=subprocess.DEVNULL).strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def card_tag(device: str | torch.device | None = None) -> str:
    """The short name a result file carries for the machine it ran on: ``h100`` / ``h200`` for those cards,
    else the CUDA device name lower-cased with non-alphanumerics as ``-``; ``cpu`` without CUDA."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for card in ("h100", "h200"):
        if card in name:
            return card
    return "-".join(filter(None, "".join(c if c.isalnum() else " " for c in name).split()))


def copies_for(bytes_per_call: int) -> int:
    """How many input copies a call needs so that rotating over them exceeds ``L2_BYTES``."""
    return int(min(MAX_COPIES, max(1, math.ceil(L2_BYTES / max(1, bytes_per_call)))))


def _event_ms(fn: Callable[[], object], n: int = 3) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def capture_calls(fns: Sequence[Callable[[], object]], target_ms: float = 3.0) -> tuple[torch.cuda.CUDAGraph, int]:
    """A CUDA graph of R back-to-back calls cycling through ``fns`` (R sized to ~target_ms), and R."""
    for f in fns:  # warm-up: compile, autotune, allocator
        f()
    torch.cuda.synchronize()
    one = max(_event_ms(fns[0]), 1e-3)
    reps = int(min(400, max(len(fns), math.ceil(target_ms / one))))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # allocations of the captured calls come from a warm pool
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    return graph, reps


def time_interleaved(captured: Sequence[tuple[torch.cuda.CUDAGraph, int]], replays: int = 9) -> list[float]:
    """Median ms per call of each captured graph, replayed in turn (A B C A B C ...) so that a slow
    drift of the GPU's clocks reaches every variant alike."""
    samples: list[list[float]] = [[] for _ in captured]
    for _ in range(replays):
        for i, (graph, reps) in enumerate(captured):
            samples[i].append(_event_ms(graph.replay, 1) / reps)
    return [statistics.median(s) for s in samples]


def time_calls(fns: Sequence[Callable[[], object]], target_ms: float = 3.0, replays: int = 7) -> float:
    """Median ms per call of CUDA-graph replays of back-to-back calls cycling through ``fns``."""
    return time_interleaved([capture_calls(fns, target_ms)], replays)[0]


def time_together(fn_lists: Sequence[Sequence[Callable[[], object]]], target_ms: float = 3.0) -> list[float]:
    """``time_calls`` of several variants (e.g. dense and WIDE), their replays interleaved."""
    return time_interleaved([capture_calls(fns, target_ms) for fns in fn_lists])


def median_ms(fn: Callable[[], object], reps: int, device: str | torch.device) -> float:
    """Median wall time of ``reps`` calls of fn in ms: CUDA events around each call on a GPU (synchronised
    after each), the host clock over all calls elsewhere (CPU smoke runs)."""
    if not str(device).startswith("cuda"):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e3
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]
