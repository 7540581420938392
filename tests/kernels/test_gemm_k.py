from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import assert_close_to_ref, gpu, make_route
from wide.kernels.gemm_k import routed_gemm_k
from wide.kernels.reference import routed_gemm_k_ref
from wide.kernels.reorder import RouteIndex, plan_route, reorder, route_mask

# (B, T, N, K, G): K routed; N and M not multiples of the tiles; decode-sized M
CPU_SHAPES = [
    (1, 37, 40, 96, 32),
    (2, 10, 70, 64, 16),
    (1, 9, 48, 256, 128),
    (3, 7, 33, 64, 32),
    (1, 1, 40, 512, 32),
    (4, 1, 33, 96, 16),
]
ALGOS = ["small", "stationary", "atomic", "masked_dense", "ordered", "auto"]
DTYPES = [torch.float32, torch.float16]


def _inputs(m, n, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) / k**0.25
    w = torch.randn(n, k, generator=g) / k**0.25
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def _check_k(x, w, route, gs, algo="auto", x_zeroed=False):
    y = routed_gemm_k(x, w, route, gs, algo=algo, x_zeroed=x_zeroed)
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype
    ref32 = routed_gemm_k_ref(x.float(), w.float(), route, gs)
    assert_close_to_ref(y, ref32, routed_gemm_k_ref(x, w, route, gs))


@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["random", "all", "none"])
@pytest.mark.parametrize("algo", ALGOS)
def test_gemm_k_matches_reference(shape, dtype, mode, algo, kernel_device):
    b, t, n, k, gs = shape
    if algo == "small" and b * t > 16:
        pytest.skip("the small path serves M <= 16")
    x, w = _inputs(b * t, n, k, dtype, kernel_device)
    _, route = make_route(mode, b, t, k // gs, kernel_device)
    _check_k(x, w, route, gs, algo)


@pytest.mark.parametrize("m", [3, 40])
def test_gemm_k_x_zeroed_and_planned_route(m, kernel_device):
    """A pre-zeroed x (what routed SwiGLU / attention produce) gives the same product on the fast path."""
    x, w = _inputs(m, 40, 64, torch.float32, kernel_device)
    mask, route = make_route("random", 1, m, 4, kernel_device)
    xz = x * mask[0].repeat_interleave(16, 1).to(x.dtype)
    planned = plan_route(mask[0])
    ref = routed_gemm_k_ref(x, w, route, 16)
    for r in (route, planned):
        for algo in ("auto", "ordered"):
            torch.testing.assert_close(routed_gemm_k(xz, w, r, 16, x_zeroed=True, algo=algo), ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(routed_gemm_k(x, w, r, 16, algo=algo), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="reorder index"):
        routed_gemm_k(x, w, planned, 16, algo="stationary")


@pytest.mark.parametrize("ng", [3, 16, 20])  # group ids packed in one scalar up to 16 groups, searched beyond
def test_gemm_k_ordered_group_counts(ng, kernel_device):
    x, w = _inputs(45, 24, 16 * ng, torch.float32, kernel_device)
    _, route = make_route("random", 1, 45, ng, kernel_device, p=0.3)
    for zeroed in (False, True):
        xs = x * route_mask(route).repeat_interleave(16, 1).to(x.dtype) if zeroed else x
        _check_k(xs, w, route, 16, "ordered", x_zeroed=zeroed)


def test_gemm_k_deterministic_and_mask_rebuild(kernel_device):
    x, w = _inputs(19, 40, 64, torch.float32, kernel_device)
    _, route = make_route("random", 1, 19, 4, kernel_device)
    for algo in ("stationary", "ordered", "auto", "small"):
        xa, ra = (x[:7], reorder(route_mask(route)[:7])) if algo == "small" else (x, route)
        a = routed_gemm_k(xa, w, ra, 16, deterministic=True, algo=algo)
        b = routed_gemm_k(xa, w, ra, 16, deterministic=True, algo=algo)
        assert torch.equal(a, b)
        no_mask = RouteIndex(*ra[:4])  # mask field absent -> rebuilt from idx / count
        assert torch.equal(routed_gemm_k(xa, w, no_mask, 16, deterministic=True, algo=algo), a)


def test_choose_algo_regimes():
    from wide.kernels.gemm_k import choose_algo

    assert choose_algo(1, 128, False) == "small" and choose_algo(4, 512, True) == "small"
    assert choose_algo(1, 32, False) == "small" and choose_algo(4, 32, False) == "masked_dense"  # narrow groups
    assert choose_algo(16, 128, False) == "masked_dense" and choose_algo(4096, 128, True) == "masked_dense"
    # 'ordered' needs few groups, a large M and the caller's word that enough is skipped
    assert choose_algo(16384, 512, True, n_groups=8, sparsity_hint=0.5) == "ordered"
    assert choose_algo(8192, 512, True, n_groups=8, sparsity_hint=0.7) == "ordered"
    assert choose_algo(16384, 512, True, n_groups=8) == "masked_dense"
    assert choose_algo(16384, 512, True, n_groups=8, sparsity_hint=0.1) == "masked_dense"
    assert choose_algo(8192, 512, True, n_groups=8, sparsity_hint=0.5) == "masked_dense"
    assert choose_algo(4096, 512, True, n_groups=8, sparsity_hint=0.7) == "masked_dense"
    assert choose_algo(16384, 128, True, n_groups=112, sparsity_hint=0.5) == "masked_dense"
    # the runtime specialises on the bucket: it must choose as the raw hint does
    from wide.kernels import gemm_path
    from wide.kernels.gemm_k import sparsity_bucket

    for h in (None, 0.0, 0.05, 0.1, 0.2, 0.39, 0.4, 0.55, 0.6, 0.9):
        for m in (300, 1024, 2048, 4096, 8192, 16384):
            assert choose_algo(m, 512, True, 8, sparsity_bucket(h)) == choose_algo(m, 512, True, 8, h)
            for g in (32, 64, 128, 512):  # and the GEMM-MN path, given the group size
                b = sparsity_bucket(h, g)
                assert gemm_path(m, "auto", g, b if h is not None else None) == gemm_path(m, "auto", g, h)
                assert choose_algo(m, g, True, 8, b) == choose_algo(m, g, True, 8, h)


def test_gemm_k_errors():
    x, w = _inputs(8, 32, 64, torch.float32, "cpu")
    _, route = make_route("random", 1, 8, 4)
    with pytest.raises(ValueError, match="divisible"):
        routed_gemm_k(x[:, :48], w[:, :48], route, 32)
    with pytest.raises(ValueError, match="route"):
        routed_gemm_k(x, w, route, 32)
    with pytest.raises(ValueError, match="K="):
        routed_gemm_k(x, w[:, :32], route, 16)
    with pytest.raises(ValueError, match="algo"):
        routed_gemm_k(x, w, route, 16, algo="fast")
    with pytest.raises(ValueError, match="sparsity_hint"):
        routed_gemm_k(x, w, route, 16, sparsity_hint=1.5)
    with pytest.raises(ValueError, match="route.order"):
        routed_gemm_k(x, w, route._replace(order=torch.arange(5, dtype=torch.int32)), 16, algo="ordered")
    x40 = torch.randn(40, 64)
    _, r40 = make_route("random", 1, 40, 4)
    with pytest.raises(ValueError, match="M <= 16"):
        routed_gemm_k(x40, w, r40, 16, algo="small")


def test_gemm_k_compiles(monkeypatch):
    x, w = _inputs(12, 32, 64, torch.float32, "cpu")
    mask = torch.rand(12, 4, generator=torch.Generator().manual_seed(5)) < 0.5
    r = reorder(mask)
    torch.library.opcheck(
        torch.ops.wide.routed_gemm_k.default,
        (x, w, r.idx, r.count, r.mask, r.idx.new_empty(0), 16, "stationary", False),
        test_utils=("test_schema", "test_faketensor"),
    )
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    f = torch.compile(lambda x, m: routed_gemm_k(x, w, reorder(m), 16), fullgraph=True, backend="aot_eager")
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
    mask, route = make_route(mode, b, t, k // gs, "cuda")
    _check_k(x, w, route, gs)
    _check_k(x, w, route, gs, "stationary")
    _check_k(x, w, route, gs, "ordered")
    xz = x * mask.reshape(b * t, -1).repeat_interleave(gs, 1).to(x.dtype)
    _check_k(xz, w, route, gs, x_zeroed=True)
    _check_k(xz, w, route, gs, "ordered", x_zeroed=True)
    if b * t <= 16:
        _check_k(x, w, route, gs, "small")
    if b * t > 256:
        _check_k(x, w, route, gs, "atomic")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 300, 4096])
def test_gemm_k_deterministic_gpu(m):
    x, w = _inputs(m, 4096, 4096, torch.bfloat16, "cuda")
    _, route = make_route("random", 1, m, 8, "cuda")
    for algo in ("auto", "stationary", "ordered"):
        outs = [routed_gemm_k(x, w, route, 512, deterministic=True, algo=algo) for _ in range(3)]
        assert all(torch.equal(outs[0], o) for o in outs[1:])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "algo,m", [("auto", 600), ("stationary", 600), ("atomic", 600), ("ordered", 600), ("ordered", 5), ("auto", 3)]
)
def test_gemm_k_cuda_graph(algo, m):
    x, w = _inputs(m, 576, 1536, torch.bfloat16, "cuda")
    mask = torch.rand(m, 12, device="cuda") < 0.5
    routed_gemm_k(x, w, reorder(mask), 128, algo=algo)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = routed_gemm_k(x, w, reorder(mask), 128, algo=algo)
    mask.copy_(torch.rand(m, 12, device="cuda") < 0.3)
    graph.replay()
    r = reorder(mask)
    ref32 = routed_gemm_k_ref(x.float(), w.float(), r, 128)
    assert_close_to_ref(y, ref32, routed_gemm_k_ref(x, w, r, 128))
