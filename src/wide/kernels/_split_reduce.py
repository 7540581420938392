"""In-kernel split-K reduction: the last program of a tile to finish sums the partials.

Decode-sized kernels (one token, a few thousand output columns) have too few output tiles to keep
HBM busy, so they split the reduction axis over several programs. A second "sum the splits" kernel
costs one more launch, which at decode is as long as the GEMM itself. Instead every split writes its
fp32 partial to a workspace, then takes a ticket from a per-tile counter (``arrive``); the program
that draws the last ticket sums the partials **in split order** (bit-identical whatever the arrival
order, so the result is deterministic), writes the output and resets the counter to 0.

The counters live in one zeroed int32 buffer per (device, stream) that every kernel leaves zeroed,
so the kernels stay CUDA-graph safe with no memset per call. Two kernels sharing a buffer must not
run concurrently, which holds for launches on one stream.
"""

from __future__ import annotations

import torch

from ._triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

COUNTER_SLOTS = 1 << 16  # tiles one launch may split (int32 each: 256 KiB per buffer)
_BUFFERS: dict[tuple, torch.Tensor] = {}


def tile_counters(like: torch.Tensor, n_tiles: int) -> torch.Tensor:
    """Zeroed ticket counters (at least ``n_tiles``) for a kernel reading ``like``'s device.

    Eager: the persistent buffer of the current stream. While ``like`` is a tracing tensor (fake /
    functional: a caller traced by torch.compile outside the ``wide::`` ops) a fresh ``torch.zeros`` that
    the graph owns, so no real tensor leaks into the trace.
    """
    if n_tiles > COUNTER_SLOTS:
        raise ValueError(f"{n_tiles} split tiles exceed the {COUNTER_SLOTS} counter slots")
    device = like.device
    if type(like) is not torch.Tensor:
        return torch.zeros(n_tiles, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _BUFFERS.get(key)
    if buf is None:
        buf = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
        _BUFFERS[key] = buf
    return buf


if HAS_TRITON:

    @triton.jit
    def arrive(counter_ptr, SPLITS):
        """After this program stored its partial: True for the last of SPLITS programs to arrive (SPLITS: a
        constexpr or a runtime count).

        The barrier orders every thread's partial stores before the (release) ticket; the acquire
        half makes the other programs' partials visible to the winner, which resets the counter.
        """
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        last = ticket == SPLITS - 1
        if last:
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        return last

    @triton.jit
    def wait_for(counter_ptr, n):
        """Spin until the counter reaches n (acquire: the writes released before each increment are visible).
        Only ever wait for programs that drew an earlier ticket (already running or done), so the wait cannot
        deadlock; under the CPU interpreter programs run in ticket order and the first read passes."""
        done = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        while done < n:
            done = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")

    @triton.jit
    def sum_partials(part_ptr, split_stride, rows, SPLITS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
        """Sum of SPLITS fp32 partials [rows <= ROWS, COLS] (row stride COLS) at part_ptr + j·split_stride.

        One load of all splits (not a chain of SPLITS dependent L2 round trips), summed by a reduction
        whose order is fixed by the compiled code: repeats are bit-identical. SPLITS: a power of two.
        """
        offs_s = tl.arange(0, SPLITS)[:, None, None]
        offs_r = tl.arange(0, ROWS)[None, :, None]
        offs_c = tl.arange(0, COLS)[None, None, :]
        ptrs = part_ptr + offs_s * split_stride + offs_r * COLS + offs_c
        p = tl.load(ptrs, mask=offs_r < rows, other=0.0, cache_modifier=".cg")  # [SPLITS, ROWS, COLS]
        return tl.sum(p, axis=0)
