"""Kernel tests: on a CPU-only machine, run the Triton kernels through the interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated (at import of ``wide.kernels.*``), so the
variable is set here, before any test module imports the kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from wide.bench.checks import within_bf16_rule  # noqa: E402
from wide.kernels.route.plan import plan  # noqa: E402
from wide.kernels.route.reorder import RouteIndex, plan_route, reorder  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu  # the root conftest skips it without CUDA; `pytest -m gpu` is the GPU suite


def make_route(mode: str, b: int, t: int, ng: int, device="cpu", p: float = 0.5, seed: int = 0):
    """Routing mask [B, T, N_G] ('all', 'none', 'random') and its RouteIndex."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if mode == "all":
        m = torch.ones(b, t, ng, dtype=torch.bool)
    elif mode == "none":
        m = torch.zeros(b, t, ng, dtype=torch.bool)
    else:
        m = torch.rand(b, t, ng, generator=gen) < p
    m = m.to(device)
    return m, reorder(m if b > 1 else m[0])


def planned(
    mask: torch.Tensor, gs: int, mn: str | None = None, k: str | None = None, sparsity: float | None = None
) -> RouteIndex:
    """``plan_route(mask, plan(...))`` for a mask [M, N_G] or [B, T, N_G]; ``mn`` / ``k``: forced paths
    (None or 'auto': the plan's own choice)."""
    m = mask.numel() // mask.shape[-1]
    force = {"force_mn": None if mn in (None, "auto") else mn, "force_k": None if k in (None, "auto") else k}
    return plan_route(mask, plan(m, gs, mask.shape[-1], sparsity, **force))


def assert_close_to_ref(out, ref32, ref_lowp, rtol_factor: float = 2.0, atol: float = 1e-5):
    """Flash-attention style: |out - ref32| <= 2 |ref_lowp - ref32| + atol (max abs)."""
    ok, err, base = within_bf16_rule(out, ref32, ref_lowp, rtol_factor, atol)
    assert ok, f"kernel err {err:.3e} vs torch err {base:.3e}"


@pytest.fixture(scope="session")
def kernel_device():
    """'cuda' on a GPU machine; 'cpu' with the interpreter active (fails loudly if it is not)."""
    if HAS_CUDA:
        return "cuda"
    from wide.kernels._triton_utils import use_triton

    assert use_triton(torch.empty(1)), "TRITON_INTERPRET=1 was not active when the kernels were imported"
    return "cpu"
