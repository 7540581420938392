from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import HAS_CUDA, gpu
from wide.kernels.route.reorder import (
    ORDER_MAX_ROWS,
    RouteIndex,
    pattern_order,
    pattern_order_reference,
    reorder,
    reorder_reference,
)


def _check(mask):
    got, ref = reorder(mask), reorder_reference(mask)
    assert isinstance(got, RouteIndex)
    for name in ("idx", "count", "batch_start", "batch_count"):
        a, b = getattr(got, name), getattr(ref, name)
        assert a.dtype == torch.int32, name
        assert torch.equal(a.cpu(), b.cpu()), name


@pytest.mark.parametrize("shape", [(7, 3), (1, 1), (2, 5, 4), (3, 1, 2), (3, 33, 5), (1, 300, 2)])
@pytest.mark.parametrize("mode", ["random", "all", "none"])
def test_reorder_matches_reference(shape, mode, kernel_device):
    g = torch.Generator().manual_seed(sum(shape))
    if mode == "random":
        m = torch.rand(shape, generator=g) < 0.5
    else:
        m = torch.full(shape, mode == "all", dtype=torch.bool)
    _check(m.to(kernel_device))


def test_reorder_multi_chunk(kernel_device):
    # M > the kernel's 4096-row chunk: exercises the carried prefix sums
    m = torch.rand(2, 2500, 2, generator=torch.Generator().manual_seed(1)) < 0.3
    _check(m.to(kernel_device))


def test_reorder_accepts_int_mask_and_rejects_bad_rank():
    m = (torch.rand(5, 3) < 0.5).to(torch.int32)
    assert torch.equal(reorder(m).idx, reorder_reference(m.bool()).idx)
    with pytest.raises(ValueError):
        reorder(torch.ones(2, 2, 2, 2, dtype=torch.bool))


def _tile_groups_used(mask: torch.Tensor, order: torch.Tensor, rows: int) -> float:
    """Mean fraction of groups some row of a tile of ``rows`` consecutive ordered rows runs."""
    m = mask[order.long()]
    pad = (-m.shape[0]) % rows
    m = torch.cat([m, m.new_zeros(pad, m.shape[1])]).view(-1, rows, m.shape[1])
    return m.any(1).float().mean().item()


@pytest.mark.parametrize("gray", [True, False])
def test_pattern_order_sorts_patterns(gray):
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 1500, 8, generator=g) < 0.5  # [B, T, N_G]
    order = pattern_order(mask, gray=gray)
    assert order.dtype == torch.int32 and torch.equal(order.sort().values, torch.arange(3000, dtype=torch.int32))
    flat = mask.reshape(-1, 8)[order.long()]
    code = (flat.int() * (1 << torch.arange(7, -1, -1))).sum(1)  # binary pattern, group 0 highest
    if gray:  # consecutive distinct patterns differ in exactly one group
        changes = code[1:] != code[:-1]
        assert ((flat[1:] ^ flat[:-1]).sum(1)[changes] == 1).all()
    else:
        assert (code[1:] >= code[:-1]).all()
    same = code[1:] == code[:-1]  # stable: equal patterns keep their row order
    assert (order[1:][same] > order[:-1][same]).all()
    # what the order is for: tiles of consecutive rows leave groups unused (natural order: none)
    natural = torch.arange(3000)
    assert _tile_groups_used(mask.reshape(-1, 8), natural, 64) > 0.99
    assert _tile_groups_used(mask.reshape(-1, 8), order, 64) < (0.86 if gray else 0.9)


@pytest.mark.parametrize("shape", [(7, 3), (2, 150, 8), (300, 12), (129, 1)])
@pytest.mark.parametrize("mode", ["random", "all", "none"])
def test_pattern_order_kernel_matches_reference(shape, mode, kernel_device):
    if mode == "random":
        m = torch.rand(shape, generator=torch.Generator().manual_seed(len(shape))) < 0.5
    else:
        m = torch.full(shape, mode == "all", dtype=torch.bool)
    m = m.to(kernel_device)
    for gray in (True, False):
        assert torch.equal(pattern_order(m, gray=gray).cpu(), pattern_order_reference(m.cpu(), gray))


def test_pattern_order_edge_masks():
    assert torch.equal(pattern_order(torch.ones(5, 3, dtype=torch.bool)), torch.arange(5, dtype=torch.int32))
    assert torch.equal(pattern_order(torch.zeros(1, 1, dtype=torch.bool)), torch.zeros(1, dtype=torch.int32))
    wide_mask = torch.rand(40, 100, generator=torch.Generator().manual_seed(0)) < 0.5  # > 30 groups
    assert torch.equal(pattern_order(wide_mask).sort().values, torch.arange(40, dtype=torch.int32))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 8), (16, 1, 112), (4, 4096, 8), (1, 16384, 448), (3, 1001, 3)])
def test_reorder_gpu(shape):
    assert HAS_CUDA
    m = torch.rand(shape, device="cuda") < 0.5
    _check(m)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [(4096, 8), (4, 4096, 8), (16384, 8), (3, 1001, 3), (70000, 16), (ORDER_MAX_ROWS + 5, 8)]
)
def test_pattern_order_gpu(shape):
    m = torch.rand(shape, device="cuda") < 0.5
    assert torch.equal(pattern_order(m), pattern_order_reference(m))


@gpu
@pytest.mark.gpu
def test_pattern_order_cuda_graph():
    m = torch.rand(5000, 8, device="cuda") < 0.5
    pattern_order(m)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pattern_order(m)
    for p in (0.3, 0.0, 1.0):  # replays leave the ticket counter at zero for the next one
        m.copy_(torch.rand(5000, 8, device="cuda") < p)
        graph.replay()
        assert torch.equal(out, pattern_order_reference(m))


@gpu
@pytest.mark.gpu
def test_reorder_cuda_graph():
    m = torch.rand(2, 512, 8, device="cuda") < 0.5
    reorder(m)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = reorder(m)
    m.copy_(torch.rand(2, 512, 8, device="cuda") < 0.3)
    graph.replay()
    ref = reorder_reference(m)
    for a, b in zip(out[:4], ref[:4], strict=True):
        assert torch.equal(a, b)
