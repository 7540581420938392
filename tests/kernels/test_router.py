"""Router decisions kernel (``wide.kernels.router``) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import gpu
from wide.kernels.router import (
    margin_decisions,
    margin_decisions_ref,
    router_decisions,
    router_decisions_ref,
)


def _router(d, r, ng, dtype, device, seed=0, bias_shift=0.0):
    g = torch.Generator().manual_seed(seed)
    w_down = (torch.randn(r, d, generator=g) / d**0.5).to(device=device, dtype=dtype)
    w_margin = (torch.randn(ng, r, generator=g) / r**0.5).to(device)
    b_margin = (0.1 * torch.randn(ng, generator=g) + bias_shift).to(device)
    return w_down, w_margin, b_margin


def _hidden(m, d, dtype, device, seed=1):
    return torch.randn(m, d, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _margin32(h, w_down, w_margin, b_margin):
    """fp32 margins of the low-precision computation (r rounded to h's dtype, as the kernel does)."""
    r = (h.float() @ w_down.float().t()).to(h.dtype).float()
    return r @ w_margin.t() + b_margin


def _assert_same_decisions(out, ref, margin, tol):
    """Equal decisions, except where the margin is within ``tol`` of the threshold (sum order)."""
    assert out.dtype == torch.bool and out.shape == ref.shape
    differ = out != ref
    assert not differ[margin.abs() > tol].any(), f"{int(differ.sum())} decisions differ away from the threshold"
    assert differ.float().mean() < 0.05


# (M, D, r, N_G): D not a multiple of the tile, r below / at / above the 16-wide MMA, N_G over 64 groups
SHAPES = [(1, 64, 16, 3), (3, 200, 8, 70), (16, 96, 32, 130), (5, 576, 32, 12)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_router_matches_reference(shape, dtype, splits, kernel_device):
    m, d, r, ng = shape
    w_down, w_margin, b_margin = _router(d, r, ng, dtype, kernel_device)
    h = _hidden(m, d, dtype, kernel_device)
    ref = router_decisions_ref(h, w_down, w_margin, b_margin)
    out = router_decisions(h, w_down, w_margin, b_margin, config={"BLOCK_D": 32, "SPLITS": splits, "num_warps": 4})
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    _assert_same_decisions(out, ref, _margin32(h, w_down, w_margin, b_margin), tol)
    auto = router_decisions(h.view(1, m, d), w_down, w_margin, b_margin)  # custom op, default config
    assert auto.shape == (1, m, ng)
    _assert_same_decisions(auto[0], ref, _margin32(h, w_down, w_margin, b_margin), tol)


@pytest.mark.parametrize("shift", [-10.0, 10.0])
def test_router_all_run_and_all_skip(shift, kernel_device):
    w_down, w_margin, b_margin = _router(64, 16, 20, torch.float32, kernel_device, bias_shift=shift)
    out = router_decisions(_hidden(4, 64, torch.float32, kernel_device), w_down, w_margin, b_margin)
    assert bool(out.all()) is (shift < 0)  # margin <= 0 runs the group
    assert bool((~out).all()) is (shift > 0)


def test_router_repeats_identical(kernel_device):
    w_down, w_margin, b_margin = _router(256, 32, 40, torch.float16, kernel_device)
    h = _hidden(7, 256, torch.float16, kernel_device)
    conf = {"BLOCK_D": 32, "SPLITS": 8, "num_warps": 4}
    first = router_decisions(h, w_down, w_margin, b_margin, config=conf)
    for _ in range(3):
        assert torch.equal(router_decisions(h, w_down, w_margin, b_margin, config=conf), first)


def test_router_large_m_is_the_reference(kernel_device):
    w_down, w_margin, b_margin = _router(64, 16, 10, torch.float32, kernel_device)
    h = _hidden(40, 64, torch.float32, kernel_device)
    assert torch.equal(
        router_decisions(h, w_down, w_margin, b_margin), router_decisions_ref(h, w_down, w_margin, b_margin)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 16])
def test_margin_on_a_strided_projection(dtype, m, kernel_device):
    """The attention router's r is a column slice of the fused [K; V; r] output (strided rows)."""
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(m, 48 + 24, generator=g).to(device=kernel_device, dtype=dtype)
    r = fused[:, 48:]  # [M, 24], row stride 72
    w_margin = torch.randn(9, 24, generator=g).to(kernel_device)
    b_margin = torch.randn(9, generator=g).to(kernel_device)
    out = margin_decisions(r.view(1, m, 24), w_margin, b_margin)[0]
    ref = margin_decisions_ref(r, w_margin, b_margin)
    _assert_same_decisions(out, ref, r.float() @ w_margin.t() + b_margin, 1e-4)


def test_router_rejects_bad_heads(kernel_device):
    w_down, w_margin, b_margin = _router(64, 16, 10, torch.float32, kernel_device)
    h = _hidden(2, 64, torch.float32, kernel_device)
    with pytest.raises(ValueError, match="hidden size"):
        router_decisions(_hidden(2, 32, torch.float32, kernel_device), w_down, w_margin, b_margin)
    with pytest.raises(ValueError, match="rank-16"):
        router_decisions(h, w_down, w_margin[:, :8], b_margin)
    with pytest.raises(ValueError, match="fp32"):
        router_decisions(h, w_down, w_margin.half(), b_margin)
    with pytest.raises(ValueError, match="power of two"):
        router_decisions(h, w_down, w_margin, b_margin, config={"BLOCK_D": 32, "SPLITS": 3, "num_warps": 4})


@gpu
@pytest.mark.parametrize("m", [1, 16])
def test_router_bf16_llama_shapes_and_cuda_graph(m):
    """Llama-3.1-8B FFN router (D 4096, r 32, 112 groups): bf16 decisions as the reference's, in a graph."""
    w_down, w_margin, b_margin = _router(4096, 32, 112, torch.bfloat16, "cuda")
    h = _hidden(m, 4096, torch.bfloat16, "cuda")
    ref = router_decisions_ref(h, w_down, w_margin, b_margin)
    out = router_decisions(h, w_down, w_margin, b_margin)
    _assert_same_decisions(out, ref, _margin32(h, w_down, w_margin, b_margin), 2e-2)
    static_h = h.clone()
    router_decisions(static_h, w_down, w_margin, b_margin)  # warm (compile) outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = router_decisions(static_h, w_down, w_margin, b_margin)
    h2 = _hidden(m, 4096, torch.bfloat16, "cuda", seed=5)
    static_h.copy_(h2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, router_decisions(h2, w_down, w_margin, b_margin))
