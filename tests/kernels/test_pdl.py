"""Programmatic dependent launch (``WIDE_PDL``): when it is on, and that it changes no result."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import gpu
from wide.kernels._triton_utils import pdl_launch


def test_pdl_off_without_a_hopper_gpu(monkeypatch):
    """CPU tensors (interpreter or not) never launch with PDL; WIDE_PDL=0 turns it off everywhere."""
    assert pdl_launch(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setenv("WIDE_PDL", "0")
    if torch.cuda.is_available():
        assert pdl_launch(torch.zeros(1, device="cuda")) == {"PDL": False}


def _decode_ffn_chain(x, w_down_r, w_margin, b_margin, w_gate, w_up, w_down):
    """One routed FFN at decode, each kernel reading the previous one's output:
    router -> mask -> gate/up (SwiGLU) -> down (GEMM-K) -> residual."""
    from wide.kernels import plan, plan_route, routed_gemm_k, routed_swiglu, router_decisions

    mask = router_decisions(x, w_down_r, w_margin, b_margin)
    route = plan_route(mask, plan(x.shape[0], 128, mask.shape[-1]))
    a = routed_swiglu(x, w_gate, w_up, route, 128)
    return x + routed_gemm_k(a, w_down, route, 128, x_zeroed=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_pdl_chain_in_a_cuda_graph_equals_plain_launches(m, monkeypatch):
    """Llama-3.1-8B FFN shapes: ten chained FFN steps captured in one CUDA graph with PDL launches give
    bit-identical output to the same steps launched plainly (the kernels are deterministic), so every
    PDL kernel saw its predecessor's writes."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    gen = torch.Generator(device="cuda").manual_seed(0)
    d, dff = 4096, 14336
    w = {
        "w_down_r": (torch.randn(32, d, device="cuda", generator=gen) / d**0.5).bfloat16(),
        "w_margin": torch.randn(112, 32, device="cuda", generator=gen) / 32**0.5,
        "b_margin": 0.1 * torch.randn(112, device="cuda", generator=gen),
        "w_gate": (torch.randn(dff, d, device="cuda", generator=gen) / d**0.5).bfloat16(),
        "w_up": (torch.randn(dff, d, device="cuda", generator=gen) / d**0.5).bfloat16(),
        "w_down": (torch.randn(d, dff, device="cuda", generator=gen) / dff**0.5).bfloat16(),
    }
    x0 = torch.randn(m, d, device="cuda", generator=gen).bfloat16()

    def steps(x):
        for _ in range(10):
            x = _decode_ffn_chain(x, **w)
        return x

    monkeypatch.setenv("WIDE_PDL", "0")
    plain = steps(x0.clone())
    monkeypatch.setenv("WIDE_PDL", "1")
    assert pdl_launch(x0)["PDL"]
    eager = steps(x0.clone())
    static_x = x0.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = steps(static_x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, plain)
    assert torch.equal(static_out, plain)
