from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import assert_close_to_ref, gpu, make_route, planned
from wide.kernels import Plan, plan, sparsity_bucket
from wide.kernels.gemm.gemm_k import routed_gemm_k
from wide.kernels.gemm.reference import routed_gemm_k_ref
from wide.kernels.route.reorder import RouteIndex, plan_route, reorder, route_mask

# (B, T, N, K, G): K routed; N and M not multiples of the tiles; decode-sized M
CPU_SHAPES = [
    (1, 37, 40, 96, 32),
    (2, 10, 70, 64, 16),
    (1, 9, 48, 256, 128),
    (3, 7, 33, 64, 32),
    (1, 1, 40, 512, 32),
    (4, 1, 33, 96, 16),
]
PATHS = ["small", "dense", "ordered", "auto"]
DTYPES = [torch.float32, torch.float16]


def _inputs(m, n, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) / k**0.25
    w = torch.randn(n, k, generator=g) / k**0.25
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def _check_k(x, w, route, gs, x_zeroed=False):
    y = routed_gemm_k(x, w, route, gs, x_zeroed=x_zeroed)
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype
    ref32 = routed_gemm_k_ref(x.float(), w.float(), route, gs)
    assert_close_to_ref(y, ref32, routed_gemm_k_ref(x, w, route, gs))


@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["random", "all", "none"])
@pytest.mark.parametrize("path", PATHS)
def test_gemm_k_matches_reference(shape, dtype, mode, path, kernel_device):
    b, t, n, k, gs = shape
    if path == "small" and b * t > 16:
        pytest.skip("the small path serves M <= 16")
    x, w = _inputs(b * t, n, k, dtype, kernel_device)
    mask, _ = make_route(mode, b, t, k // gs, kernel_device)
    route = planned(mask, gs, k=path)
    assert route.plan.k == path or path == "auto"
    _check_k(x, w, route, gs)


@pytest.mark.parametrize("m", [3, 40])
def test_gemm_k_x_zeroed_and_planned_route(m, kernel_device):
    """A pre-zeroed x (what routed SwiGLU / attention produce) gives the same product on the fast path."""
    x, w = _inputs(m, 40, 64, torch.float32, kernel_device)
    mask, route = make_route("random", 1, m, 4, kernel_device)
    xz = x * mask[0].repeat_interleave(16, 1).to(x.dtype)
    ref = routed_gemm_k_ref(x, w, route, 16)
    for mn in ("auto", "sorted"):  # with and without the reorder index
        for path in ("auto", "ordered"):
            r = planned(mask[0], 16, mn=mn, k=path)
            torch.testing.assert_close(routed_gemm_k(xz, w, r, 16, x_zeroed=True), ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(routed_gemm_k(x, w, r, 16), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ng", [3, 16, 20])  # group ids packed in one scalar up to 16 groups, searched beyond
def test_gemm_k_ordered_group_counts(ng, kernel_device):
    x, w = _inputs(45, 24, 16 * ng, torch.float32, kernel_device)
    mask, _ = make_route("random", 1, 45, ng, kernel_device, p=0.3)
    route = planned(mask[0], 16, k="ordered")
    for zeroed in (False, True):
        xs = x * route_mask(route).repeat_interleave(16, 1).to(x.dtype) if zeroed else x
        _check_k(xs, w, route, 16, x_zeroed=zeroed)


def test_gemm_k_deterministic_and_mask_rebuild(kernel_device):
    x, w = _inputs(19, 40, 64, torch.float32, kernel_device)
    mask, _ = make_route("random", 1, 19, 4, kernel_device)
    for path in ("dense", "ordered", "auto", "small"):
        xa, ma = (x[:7], mask[0, :7]) if path == "small" else (x, mask[0])
        ra = planned(ma, 16, mn="sorted", k=path)
        a = routed_gemm_k(xa, w, ra, 16)
        b = routed_gemm_k(xa, w, ra, 16)
        assert torch.equal(a, b)
        no_mask = RouteIndex(*ra[:4], plan=ra.plan)  # mask field absent -> rebuilt from idx / count
        assert torch.equal(routed_gemm_k(xa, w, no_mask, 16), a)


def test_plan_k_paths():
    def k(m, g, n_groups=8, s=None):
        return plan(m, g, n_groups, s).k

    assert k(1, 128) == "small" and k(4, 512) == "small" and k(5, 512) == "dense"
    assert k(1, 32) == "small" and k(4, 32) == "dense"  # narrow groups: M 1 only
    assert k(16, 128) == "dense" and k(4096, 128) == "dense"
    # 'ordered' needs few groups, a large M and the caller's word that enough is skipped
    assert k(16384, 512, 8, 0.5) == "ordered"
    assert k(8192, 512, 8, 0.7) == "ordered"
    assert k(16384, 512, 8) == "dense"
    assert k(16384, 512, 8, 0.1) == "dense"
    assert k(8192, 512, 8, 0.5) == "dense"
    assert k(4096, 512, 8, 0.7) == "dense"
    assert k(16384, 128, 112, 0.5) == "dense" and k(16384, 128, 16, 0.5) == "ordered"
    assert plan(4096, 512, 8, 0.0, force_k="ordered") == Plan("dense", "ordered", False)
    # the runtime specialises on the bucket: every path must be chosen as for the raw sparsity
    for h in (None, 0.0, 0.05, 0.1, 0.12, 0.13, 0.2, 0.22, 0.39, 0.4, 0.45, 0.55, 0.6, 0.9):
        for m in (1, 4, 16, 300, 1024, 2048, 4096, 8192, 16384):
            for g in (32, 64, 128, 512):
                b = sparsity_bucket(h, g)
                assert plan(m, g, 8, b if h is not None else None) == plan(m, g, 8, h)


def test_gemm_k_errors():
    x, w = _inputs(8, 32, 64, torch.float32, "cpu")
    mask, unplanned = make_route("random", 1, 8, 4)
    route = planned(mask[0], 16)
    with pytest.raises(ValueError, match="divisible"):
        routed_gemm_k(x[:, :48], w[:, :48], route, 32)
    with pytest.raises(ValueError, match="route"):
        routed_gemm_k(x, w, route, 32)
    with pytest.raises(ValueError, match="K="):
        routed_gemm_k(x, w[:, :32], route, 16)
    with pytest.raises(ValueError, match="no plan"):
        routed_gemm_k(x, w, unplanned, 16)
    with pytest.raises(ValueError, match="unknown force_k"):
        plan(8, 16, 4, force_k="masked_dense")
    with pytest.raises(ValueError, match="sparsity"):
        plan(8, 16, 4, -0.1)
    ordered = planned(mask[0], 16, k="ordered")
    with pytest.raises(ValueError, match="route.order"):
        routed_gemm_k(x, w, ordered._replace(order=torch.arange(5, dtype=torch.int32)), 16)
    with pytest.raises(ValueError, match="M <= 16"):
        plan(40, 16, 4, force_k="small")
    x40 = torch.randn(40, 64)
    m40, _ = make_route("random", 1, 40, 4)
    with pytest.raises(ValueError, match="M <= 16"):
        routed_gemm_k(x40, w, plan_route(m40[0], Plan("dense", "small", False)), 16)


def test_gemm_k_compiles(monkeypatch):
    x, w = _inputs(12, 32, 64, torch.float32, "cpu")
    mask = torch.rand(12, 4, generator=torch.Generator().manual_seed(5)) < 0.5
    r = reorder(mask)
    torch.library.opcheck(
        torch.ops.wide.routed_gemm_k.default,
        (x, w, r.idx, r.count, r.mask, r.idx.new_empty(0), 16, "dense", False),
        test_utils=("test_schema", "test_faketensor"),
    )
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    f = torch.compile(lambda x, m: routed_gemm_k(x, w, planned(m, 16), 16), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(x, mask), routed_gemm_k_ref(x, w, r, 16))


# ---------------------------------------------------------------------------------------------- GPU
SMOL = [("o", 576, 576, 192), ("down", 576, 1536, 128), ("down", 576, 1536, 32)]
LLAMA = [("o", 4096, 4096, 512), ("down", 4096, 14336, 128), ("down", 4096, 14336, 32)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("op", SMOL + LLAMA, ids=lambda o: f"{o[0]}-{o[1]}x{o[2]}-G{o[3]}")
@pytest.mark.parametrize("bt", [(1, 1), (4, 1), (16, 1), (1, 77), (2, 2048)], ids=str)
@pytest.mark.parametrize("mode", ["random", "all", "none"])
def test_gemm_k_gpu(op, bt, mode):
    _, n, k, gs = op
    b, t = bt
    if mode != "random" and k > 1536 and b * t > 1:
        pytest.skip("all/none masks covered at the small shapes")
    x, w = _inputs(b * t, n, k, torch.bfloat16, "cuda")
    mask, _ = make_route(mode, b, t, k // gs, "cuda")
    _check_k(x, w, planned(mask, gs), gs)
    _check_k(x, w, planned(mask, gs, k="dense"), gs)
    _check_k(x, w, planned(mask, gs, k="ordered"), gs)
    xz = x * mask.reshape(b * t, -1).repeat_interleave(gs, 1).to(x.dtype)
    _check_k(xz, w, planned(mask, gs), gs, x_zeroed=True)
    _check_k(xz, w, planned(mask, gs, k="ordered"), gs, x_zeroed=True)
    if b * t <= 16:
        _check_k(x, w, planned(mask, gs, k="small"), gs)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 300, 4096])
def test_gemm_k_deterministic_gpu(m):
    x, w = _inputs(m, 4096, 4096, torch.bfloat16, "cuda")
    mask, _ = make_route("random", 1, m, 8, "cuda")
    for path in ("auto", "dense", "ordered"):
        route = planned(mask[0], 512, k=path)
        outs = [routed_gemm_k(x, w, route, 512) for _ in range(3)]
        assert all(torch.equal(outs[0], o) for o in outs[1:])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("path,m", [("auto", 600), ("dense", 600), ("ordered", 600), ("ordered", 5), ("auto", 3)])
def test_gemm_k_cuda_graph(path, m):
    x, w = _inputs(m, 576, 1536, torch.bfloat16, "cuda")
    mask = torch.rand(m, 12, device="cuda") < 0.5
    routed_gemm_k(x, w, planned(mask, 128, k=path), 128)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = routed_gemm_k(x, w, planned(mask, 128, k=path), 128)
    mask.copy_(torch.rand(m, 12, device="cuda") < 0.3)
    graph.replay()
    r = reorder(mask)
    ref32 = routed_gemm_k_ref(x.float(), w.float(), r, 128)
    assert_close_to_ref(y, ref32, routed_gemm_k_ref(x, w, r, 128))
