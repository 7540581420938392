from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.conftest import assert_close_to_ref, gpu, make_route, planned
from wide.kernels import Plan, plan
from wide.kernels.gemm.gemm_mn import routed_gemm_mn, routed_swiglu
from wide.kernels.gemm.reference import routed_gemm_mn_ref, routed_swiglu_ref
from wide.kernels.route.reorder import plan_route, reorder

# (B, T, N, K, G): tiles not dividing M / N / K, group sizes 16 / 32 / 128, B > 1, decode-sized M
CPU_SHAPES = [
    (1, 37, 96, 40, 32),
    (2, 10, 64, 72, 16),
    (1, 9, 256, 48, 128),
    (3, 7, 64, 32, 32),
    (1, 1, 64, 72, 16),
    (2, 3, 96, 128, 32),
]
PATHS = ["sorted", "small", "dense", "auto"]
DTYPES = [torch.float32, torch.float16]


def _inputs(m, n, k, dtype, device, seed=0, two=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) / k**0.25
    w = torch.randn(n, k, generator=g) / k**0.25
    w2 = torch.randn(n, k, generator=g) / k**0.25
    return [t.to(device=device, dtype=dtype) for t in (x, w, w2)]


def _check_mn(x, w, w2, route, gs):
    y = routed_gemm_mn(x, w, route, gs)
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype
    ref32 = routed_gemm_mn_ref(x.float(), w.float(), route, gs)
    assert_close_to_ref(y, ref32, routed_gemm_mn_ref(x, w, route, gs))
    h = routed_swiglu(x, w, w2, route, gs)
    h32 = routed_swiglu_ref(x.float(), w.float(), w2.float(), route, gs)
    assert_close_to_ref(h, h32, routed_swiglu_ref(x, w, w2, route, gs))
    return y


@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["random", "all", "none"])
@pytest.mark.parametrize("path", PATHS)
def test_gemm_mn_matches_reference(shape, dtype, mode, path, kernel_device):
    b, t, n, k, gs = shape
    if path == "small" and b * t > 16:
        pytest.skip("the small path serves M <= 16")
    x, w, w2 = _inputs(b * t, n, k, dtype, kernel_device)
    mask, _ = make_route(mode, b, t, n // gs, kernel_device)
    route = planned(mask, gs, mn=path)
    assert route.plan.mn == path or path == "auto"
    y = _check_mn(x, w, w2, route, gs)
    inactive = ~mask.reshape(b * t, -1).repeat_interleave(gs, 1)
    assert (y[inactive] == 0).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [5, 21])
def test_gemm_mn_no_zero_mode_keeps_active_entries(path, m, kernel_device):
    if path == "small" and m > 16:
        pytest.skip("the small path serves M <= 16")
    x, w, w2 = _inputs(m, 64, 40, torch.float32, kernel_device)
    mask, _ = make_route("random", 1, m, 4, kernel_device)
    route = planned(mask[0], 16, mn=path)
    act = mask[0].repeat_interleave(16, 1)
    y = routed_gemm_mn(x, w, route, 16, zero_inactive=False)
    ref = routed_gemm_mn_ref(x, w, route, 16)
    torch.testing.assert_close(y[act], ref[act], rtol=1e-5, atol=1e-5)
    h = routed_swiglu(x, w, w2, route, 16, zero_inactive=False)
    href = routed_swiglu_ref(x, w, w2, route, 16)
    torch.testing.assert_close(h[act], href[act], rtol=1e-5, atol=1e-5)


def test_small_k_split_sum_is_exact_and_deterministic(kernel_device):
    """Decode GEMM-K with several K splits, reduced in-kernel in split order; counters left at 0."""
    from wide.kernels._split_reduce import tile_counters
    from wide.kernels.gemm.small_m import small_gemm_k

    x, w, _ = _inputs(3, 40, 2048, torch.float32, kernel_device)
    mask = (torch.rand(3, 16, generator=torch.Generator().manual_seed(1)) < 0.5).to(kernel_device)
    mask[:, 5] = False  # a group no token runs
    ref = F.linear(x * mask.repeat_interleave(128, 1).to(x.dtype), w)
    cfgs = [{"BLOCK_N": 32, "BLOCK_K": 32, "SPLITS": s, "num_warps": 4} for s in (1, 2, 16)]
    if kernel_device == "cpu":
        cfgs = cfgs[1:2]  # interpreter: slow; one split count beyond 1
    for cfg in cfgs:
        y = small_gemm_k(x, w, mask, 128, config=cfg)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(y, small_gemm_k(x, w, mask, 128, config=cfg))
    assert not tile_counters(x, 1).any()


@pytest.mark.parametrize("splits", [1, 4])
def test_small_m1_matches_reference(splits, kernel_device):
    """M = 1 through both decode kernels (explicit config), with and without a K split."""
    from wide.kernels.gemm.small_m import small_gemm_k, small_gemm_mn

    x, w, w2 = _inputs(1, 64, 256, torch.float32, kernel_device)
    cfg = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLITS": splits, "num_warps": 4}
    mn_mask = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool, device=kernel_device)
    route = reorder(mn_mask)
    h = small_gemm_mn(x, w, w2, mn_mask, 16, True, config=cfg)
    torch.testing.assert_close(h, routed_swiglu_ref(x, w, w2, route, 16), rtol=1e-5, atol=1e-5)
    k_mask = torch.tensor([[1, 0, 0, 1, 1, 0, 1, 0]], dtype=torch.bool, device=kernel_device)
    xk = x.clone()
    xk[0, 32:64] = float("inf")  # an unused group's garbage must not leak in
    ref = F.linear(x * k_mask.repeat_interleave(32, 1).to(x.dtype), w)
    torch.testing.assert_close(small_gemm_k(xk, w, k_mask, 32, config=cfg), ref, rtol=1e-5, atol=1e-5)


def test_small_mn_split_k_matches_unsplit(kernel_device):
    """Decode GEMM-MN / SwiGLU with K split over programs: same result, counters left at 0."""
    from wide.kernels._split_reduce import tile_counters
    from wide.kernels.gemm.small_m import small_gemm_mn

    x, w, w2 = _inputs(2, 64, 200, torch.float32, kernel_device)
    mask = torch.tensor([[1, 0, 1, 0], [1, 0, 0, 1]], dtype=torch.bool, device=kernel_device)
    route = reorder(mask)
    ref, href = routed_gemm_mn_ref(x, w, route, 16), routed_swiglu_ref(x, w, w2, route, 16)
    for splits in (2, 4):
        cfg = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLITS": splits, "num_warps": 4}
        y = small_gemm_mn(x, w, None, mask, 16, True, config=cfg)
        h = small_gemm_mn(x, w, w2, mask, 16, True, config=cfg)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h, href, rtol=1e-5, atol=1e-5)
        assert torch.equal(h, small_gemm_mn(x, w, w2, mask, 16, True, config=cfg))
    assert not tile_counters(x, 1).any()


def test_plan_route_serves_small_and_dense_paths(kernel_device):
    """plan_route skips the reorder at M <= DENSE_M; the small / dense paths read the mask alone."""
    for m, path in ((3, "small"), (40, "dense")):
        x, w, w2 = _inputs(m, 64, 40, torch.float32, kernel_device)
        mask = torch.rand(m, 4, generator=torch.Generator().manual_seed(m)) < 0.5
        p = plan(m, 16, 4)
        assert p == Plan(path, "dense", False)  # G 16: GEMM-K's small path only at M 1
        route = plan_route(mask.to(kernel_device), p)
        assert route.idx.shape == (4, 0) and route.plan == p
        _check_mn(x, w, w2, route, 16)
        with pytest.raises(ValueError, match="reorder index"):  # a plan swapped in after the route was built
            routed_gemm_mn(x, w, route._replace(plan=Plan("sorted", "dense", True)), 16)
    big = plan_route(torch.rand(300, 4) < 0.5, plan(300, 16, 4))
    assert big.idx.shape == (4, 300) and big.plan == Plan("sorted", "dense", True)


def test_plan_mn_paths_follow_m_and_the_expected_sparsity():
    """Past DENSE_M the expected sparsity picks the path (never the mask): below mn_dense_below(G, M)
    cuBLAS, else sorted; the route is reordered exactly for the sorted path."""
    from wide.kernels import mn_dense_below, mn_dense_thresholds

    assert [mn_dense_below(512, m) for m in (300, 4096, 16384)] == [0.55, 0.22, 0.12]  # Q: waves at small M
    assert mn_dense_below(128, 300) == mn_dense_below(128, 65536) == 0.13
    assert mn_dense_below(64, 1024) == mn_dense_below(32, 1024) == 0.55 and mn_dense_below(32, 4096) == 0.45
    assert mn_dense_thresholds(512) == (0.55, 0.22, 0.12) and mn_dense_thresholds(16) == (0.55, 0.45)

    def mn(m, g, s=None):
        p = plan(m, g, 8, s)
        assert p.reorder == (p.mn == "sorted")
        return p.mn

    assert mn(4096, 512) == "sorted"  # no expected sparsity: the sorted kernel
    assert mn(4096, 512, 0.0) == "dense"
    assert mn(4096, 512, 0.25) == "sorted" and mn(1024, 512, 0.25) == "dense"
    assert mn(4096, 32, 0.4) == "dense"
    assert mn(4096, 32, 0.5) == "sorted"
    assert mn(8, 32, 0.0) == "small" and mn(16, 32) == "small" and mn(17, 32) == "dense"
    assert mn(200, 32, 0.9) == "dense" and mn(256, 32, 0.9) == "dense" and mn(257, 32, 0.9) == "sorted"
    assert plan(4096, 32, 8, 0.0, force_mn="sorted") == Plan("sorted", "dense", True)  # forced: the hint is ignored
    assert plan(4096, 32, 8, 0.9, force_mn="dense").reorder is False


@pytest.mark.parametrize("hint", [0.0, 0.3, 0.6])
def test_planned_route_and_gemm_match_reference_past_dense_m(hint, kernel_device):
    """M 300 > DENSE_M, G 32: the plan sends the GEMM-MN dense below 0.55 (no reorder index) and sorted
    above; the output is the routed reference's either way."""
    m, n, k, gs = 300, 64, 40, 32
    x, w, w2 = _inputs(m, n, k, torch.float32, kernel_device)
    mask = (torch.rand(m, n // gs, generator=torch.Generator().manual_seed(1)) < 0.5).to(kernel_device)
    route = plan_route(mask, plan(m, gs, n // gs, hint))
    assert route.idx.shape == ((2, 0) if hint < 0.55 else (2, m))
    assert route.plan.mn == ("dense" if hint < 0.55 else "sorted")
    y = routed_gemm_mn(x, w, route, gs)
    assert_close_to_ref(y, routed_gemm_mn_ref(x, w, route, gs), routed_gemm_mn_ref(x, w, route, gs))
    h = routed_swiglu(x, w, w2, route, gs)  # zeros where inactive, on either path
    assert_close_to_ref(h, routed_swiglu_ref(x, w, w2, route, gs), routed_swiglu_ref(x, w, w2, route, gs))
    with pytest.raises(ValueError, match="sparsity"):
        plan(m, gs, n // gs, 1.5)


def test_gemm_mn_errors():
    x, w, _ = _inputs(8, 64, 32, torch.float32, "cpu")
    mask, unplanned = make_route("random", 1, 8, 4)
    route = planned(mask[0], 16)
    with pytest.raises(ValueError, match="divisible"):
        routed_gemm_mn(x, w[:48], route, 32)
    with pytest.raises(ValueError, match="route"):
        routed_gemm_mn(x, w, route, 32)  # N_G 2 vs route 4
    with pytest.raises(ValueError, match="dtype"):
        routed_gemm_mn(x.double(), w.double(), route, 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        routed_gemm_mn(x, w, route, 8)
    with pytest.raises(ValueError, match="no plan"):
        routed_gemm_mn(x, w, unplanned, 16)  # reorder(mask) alone: the operators do not decide
    with pytest.raises(ValueError, match="unknown force_mn"):
        plan(8, 16, 4, force_mn="fast")
    with pytest.raises(ValueError, match="unknown path"):
        plan_route(mask[0], Plan("fast", "dense", False))
    with pytest.raises(ValueError, match="reorder index"):
        plan_route(mask[0], Plan("sorted", "dense", False))
    with pytest.raises(ValueError, match="M <= 16"):
        plan(40, 16, 4, force_mn="small")
    x40 = torch.randn(40, 32)
    m40, _ = make_route("random", 1, 40, 4)
    with pytest.raises(ValueError, match="M <= 16"):  # a hand-built plan is checked against the route
        routed_gemm_mn(x40, w, plan_route(m40[0], Plan("small", "dense", False)), 16)


def test_custom_op_registered_and_compiles(monkeypatch):
    x, w, w2 = _inputs(12, 64, 32, torch.float32, "cpu")
    mask = torch.rand(12, 4, generator=torch.Generator().manual_seed(3)) < 0.5
    route = reorder(mask)
    torch.library.opcheck(
        torch.ops.wide.routed_gemm_mn.default,
        (x, w, route.idx, route.count, route.mask, 16, True, "sorted"),
        test_utils=("test_schema", "test_faketensor"),
    )
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # reference path under torch.compile

    def f(x, mask):
        r = plan_route(mask, plan(x.shape[0], 16, 4, force_mn="sorted"))
        return routed_gemm_mn(x, w, r, 16) + routed_swiglu(x, w, w2, plan_route(mask, plan(x.shape[0], 16, 4)), 16)

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, mask)
    r = reorder(mask)
    ref = routed_gemm_mn_ref(x, w, r, 16) + routed_swiglu_ref(x, w, w2, r, 16)
    torch.testing.assert_close(out, ref)


# ---------------------------------------------------------------------------------------------- GPU
SMOL = [("q", 576, 576, 192), ("gate_up", 1536, 576, 128), ("gate_up", 1536, 576, 32)]
LLAMA = [("q", 4096, 4096, 512), ("gate_up", 14336, 4096, 128), ("gate_up", 14336, 4096, 32)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("op", SMOL + LLAMA, ids=lambda o: f"{o[0]}-{o[1]}x{o[2]}-G{o[3]}")
@pytest.mark.parametrize("bt", [(1, 1), (4, 1), (16, 1), (1, 77), (2, 2048)], ids=str)
@pytest.mark.parametrize("mode", ["random", "all", "none"])
def test_gemm_mn_gpu(op, bt, mode):
    _, n, k, gs = op
    b, t = bt
    if mode != "random" and n > 1536 and b * t > 1:
        pytest.skip("all/none masks covered at the small shapes")
    x, w, w2 = _inputs(b * t, n, k, torch.bfloat16, "cuda")
    mask, _ = make_route(mode, b, t, n // gs, "cuda")
    for path in ("auto", "sorted", "dense") + (("small",) if b * t <= 16 else ()):
        _check_mn(x, w, w2, planned(mask, gs, mn=path), gs)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 100, 300])
def test_gemm_mn_cuda_graph(m):
    x, w, w2 = _inputs(m, 1536, 576, torch.bfloat16, "cuda")
    mask = torch.rand(m, 12, device="cuda") < 0.5
    f = lambda: (routed_gemm_mn(x, w, planned(mask, 128), 128), routed_swiglu(x, w, w2, planned(mask, 128), 128))
    f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, h = f()
    mask.copy_(torch.rand(m, 12, device="cuda") < 0.3)
    graph.replay()
    r = planned(mask, 128)
    torch.testing.assert_close(y, routed_gemm_mn(x, w, r, 128), rtol=0, atol=0)
    torch.testing.assert_close(h, routed_swiglu(x, w, w2, r, 128), rtol=0, atol=0)
