"""The decision rule's ops (``wide.kernels.router``): kernel vs fp64 reference, batch invariance, autograd."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import gpu
from wide.kernels.router.ops import (
    router_decisions,
    router_decisions_pair,
    router_margin,
    router_margin_kernel,
    router_margin_ref,
)


def _router(d, r, ng, dtype, device, seed=0, bias_shift=0.0):
    g = torch.Generator().manual_seed(seed)
    w_down = (torch.randn(r, d, generator=g) / d**0.5).to(device=device, dtype=dtype)
    w_margin = (torch.randn(ng, r, generator=g) / r**0.5).to(device)
    b_margin = (0.1 * torch.randn(ng, generator=g) + bias_shift).to(device)
    return w_down, w_margin, b_margin


def _hidden(m, d, dtype, device, seed=1):
    return torch.randn(m, d, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _skip_bf16_in_interpreter(dtype, device):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("Triton's CPU interpreter computes bf16 dots wrongly; bf16 runs in the GPU tests")


def _exact_margin(h, w_down, w_margin, b_margin):
    """The rule in fp64 throughout (no rounding of r): what every implementation approximates."""
    r = h.double() @ w_down.to(h.dtype).double().t()
    return r @ w_margin.double().t() + b_margin.double()


# (M, D, r, N_G): D not a multiple of the tile, r below / at / above the 16-wide MMA, N_G over 64 groups,
# M across several 16-row blocks
SHAPES = [(1, 64, 16, 3), (3, 200, 8, 70), (16, 96, 32, 130), (37, 576, 32, 12)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_margin_matches_reference(shape, dtype, splits, kernel_device):
    m, d, r, ng = shape
    _skip_bf16_in_interpreter(dtype, kernel_device)
    w_down, w_margin, b_margin = _router(d, r, ng, dtype, kernel_device)
    h = _hidden(m, d, dtype, kernel_device)
    exact = _exact_margin(h, w_down, w_margin, b_margin)
    conf = {"BLOCK_D": 32, "SPLITS": splits, "num_warps": 4}
    out = router_margin_kernel(h, w_down, w_margin, b_margin, config=conf)
    ref = router_margin_ref(h, w_down, w_margin, b_margin)
    assert out.dtype == ref.dtype == torch.float32 and out.shape == (m, ng)
    scale = exact.abs().max().item()
    assert (ref.double() - exact).abs().max().item() <= 1e-6 * scale  # fp64 sums: only the final rounding
    assert (out.double() - exact).abs().max().item() <= 1e-4 * scale  # fp32 accumulation of exact products
    dec = router_decisions(h, w_down, w_margin, b_margin, config=conf)
    assert torch.equal(dec, out <= 0)  # the mask is the margin's sign, bit for bit


@pytest.mark.parametrize("splits", [1, 4])
def test_head_blocks_are_independent(splits, kernel_device):
    """300 groups: three head blocks of 128 (the last partial), multiplied in turn; a group's margin is the same
    bits whichever block of the same width holds it (the head of those 128 groups alone, or of the last 128 groups,
    whose block straddles the whole head's last two): a block's offset or order does not enter its arithmetic."""
    w_down, w_margin, b_margin = _router(200, 32, 300, torch.float32, kernel_device)
    h = _hidden(19, 200, torch.float32, kernel_device)
    conf = {"BLOCK_D": 32, "SPLITS": splits, "num_warps": 4, "BLOCK_G": 128}
    whole = router_margin_kernel(h, w_down, w_margin, b_margin, config=conf)
    for lo, hi in [(0, 128), (128, 256), (172, 300)]:
        part = router_margin_kernel(h, w_down, w_margin[lo:hi], b_margin[lo:hi], config=conf)
        assert torch.equal(part, whole[:, lo:hi]), (lo, hi)


@pytest.mark.parametrize("launch", [{"BLOCK_G": 256}, {"BLOCK_G": 512}, {"num_warps": 8}, {"num_warps": 2},
                                    {"BLOCK_G": 512, "num_warps": 8, "HEAD_FIRST": 0}])  # fmt: skip
def test_head_step_and_warps_are_bit_identical(launch, kernel_device):
    """The head's groups per step (BLOCK_G) and the warps per program partition the outputs, not a dot's K
    order: 448 groups (Llama-3.1-8B's FFN at G 32) give the same margins bit for bit under any of them as in four
    steps of 128 (the rule before it took up to 512 groups a step)."""
    w_down, w_margin, b_margin = _router(200, 32, 448, torch.float32, kernel_device)
    h = _hidden(19, 200, torch.float32, kernel_device)
    conf = {"BLOCK_D": 32, "SPLITS": 4, "num_warps": 4, "BLOCK_G": 128}
    base = router_margin_kernel(h, w_down, w_margin, b_margin, config=conf)
    assert torch.equal(router_margin_kernel(h, w_down, w_margin, b_margin, config={**conf, **launch}), base)


def test_forced_head_step_reaches_the_pair_and_is_checked(kernel_device):
    """A config's BLOCK_G reaches both launches (single and pair) and changes no bit; a step that is not a power of
    two >= 16 is a one-line error."""
    a = _router(200, 32, 448, torch.float32, kernel_device)
    b = _router(200, 16, 8, torch.float32, kernel_device, seed=4)
    h = _hidden(19, 200, torch.float32, kernel_device)
    conf = {"BLOCK_D": 32, "SPLITS": 4, "num_warps": 4}
    pair = router_decisions_pair(h, a, b, config={**conf, "BLOCK_G": 128})
    assert torch.equal(pair[0], router_decisions(h, *a, config=conf))
    assert torch.equal(pair[1], router_decisions(h, *b, config=conf))
    with pytest.raises(ValueError, match="BLOCK_G must be a power of two"):
        router_margin_kernel(h, *a, config={**conf, "BLOCK_G": 100})


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("ng", [12, 130])
def test_head_loaded_first_is_bit_identical(splits, ng, kernel_device):
    """HEAD_FIRST (the head's first block loaded before the D loop) changes where a load sits, not one bit;
    130 groups: the second head block is loaded in the reduction as before."""
    w_down, w_margin, b_margin = _router(200, 32, ng, torch.float32, kernel_device)
    h = _hidden(19, 200, torch.float32, kernel_device)
    conf = {"BLOCK_D": 32, "SPLITS": splits, "num_warps": 4, "BLOCK_G": 128}
    first = router_margin_kernel(h, w_down, w_margin, b_margin, config={**conf, "HEAD_FIRST": 1})
    late = router_margin_kernel(h, w_down, w_margin, b_margin, config={**conf, "HEAD_FIRST": 0})
    assert torch.equal(first, late)
    assert torch.equal(router_decisions(h, w_down, w_margin, b_margin, config={**conf, "HEAD_FIRST": 1}), late <= 0)


@pytest.mark.parametrize("splits", [1, 4])
def test_serial_schedule_is_bit_identical(splits, kernel_device):
    """SERIAL (one program per row block runs its splits in turn, the schedule for many rows) sums the same
    partials with the same code as one program per split: the margins, and so the decisions, bit for bit; the
    pair launch too. 37 rows: a partial last row block. 130 groups: the split schedule shares the head."""
    w_down, w_margin, b_margin = _router(200, 32, 130, torch.float32, kernel_device)
    other = _router(200, 16, 8, torch.float32, kernel_device, seed=4)
    h = _hidden(37, 200, torch.float32, kernel_device)
    conf = {"BLOCK_D": 32, "SPLITS": splits, "num_warps": 4}
    split = router_margin_kernel(h, w_down, w_margin, b_margin, config={**conf, "SERIAL": 0})
    serial = router_margin_kernel(h, w_down, w_margin, b_margin, config={**conf, "SERIAL": 1})
    assert torch.equal(split, serial)
    pair = router_decisions_pair(h, (w_down, w_margin, b_margin), other, config={**conf, "SERIAL": 1})
    assert torch.equal(pair[0], split <= 0)
    assert torch.equal(pair[1], router_decisions(h, *other, config={**conf, "SERIAL": 0}))


@pytest.mark.parametrize("shape", [(1, 130), (37, 448)])
@pytest.mark.parametrize("heads", [1, 3, None])
def test_shared_head_is_bit_identical(shape, heads, kernel_device):
    """The shared head (HEAD_PROGS programs, each every HEAD_PROGS-th block of the head, after waiting for the
    splits) gives the margins of the head run by the last split alone, bit for bit; single and pair launch; a
    second call after the first (the counters are back at 0: no ticket left over)."""
    from wide.kernels._split_reduce import tile_counters
    from wide.kernels.router.ops import head_schedule

    m, ng = shape
    w_down, w_margin, b_margin = _router(200, 32, ng, torch.float32, kernel_device)
    other = _router(200, 16, 8, torch.float32, kernel_device, seed=4)
    h = _hidden(m, 200, torch.float32, kernel_device)
    conf = {"BLOCK_D": 32, "SPLITS": 4, "num_warps": 4}
    alone = router_margin_kernel(h, w_down, w_margin, b_margin, config={**conf, "HEAD_PROGS": 0})
    for step in [{}, {"BLOCK_G": 16}, {"BLOCK_G": 64}, {"BLOCK_G": 128}]:
        shared = {**conf, **step} if heads is None else {**conf, **step, "HEAD_PROGS": heads}
        assert head_schedule(ng, shared)[1] == (heads or -(-ng // head_schedule(ng, shared)[0]))
        for _ in range(2):
            assert torch.equal(router_margin_kernel(h, w_down, w_margin, b_margin, config=shared), alone), step
            assert not tile_counters(h, 1)[: 3 * 64].any()
        pair = router_decisions_pair(h, other, (w_down, w_margin, b_margin), config=shared)
        assert torch.equal(pair[1], alone <= 0), step
        assert torch.equal(pair[0], router_decisions(h, *other, config={**conf, "HEAD_PROGS": 0})), step


def test_shared_head_rule_and_bad_settings(kernel_device):
    """The split schedule shares a head of SHARED_HEAD_MIN_GROUPS groups or more, one program per
    SHARED_HEAD_BLOCK_G groups; fewer groups, one split or the serial schedule run it alone; a config that asks to
    share where no split is summed is a one-line error."""
    from wide.kernels.router.ops import SHARED_HEAD_BLOCK_G, SHARED_HEAD_MIN_GROUPS, default_config, head_schedule

    split = default_config(4096, 1)
    few, many = SHARED_HEAD_MIN_GROUPS - 1, SHARED_HEAD_MIN_GROUPS
    assert head_schedule(many, split) == (SHARED_HEAD_BLOCK_G, -(-many // SHARED_HEAD_BLOCK_G))
    assert head_schedule(few, split)[1] == 0
    assert head_schedule(448, default_config(4096, 4096))[1] == 0  # serial schedule
    assert head_schedule(448, default_config(256, 1))[1] == 0  # one split: no partials to wait for
    assert head_schedule(448, {**split, "HEAD_PROGS": 0}) == (512, 0)
    w = _router(64, 16, 130, torch.float32, kernel_device)
    h = _hidden(3, 64, torch.float32, kernel_device)
    for bad in ({"SPLITS": 1, "HEAD_PROGS": 2}, {"SPLITS": 4, "SERIAL": 1, "HEAD_PROGS": 2}):
        with pytest.raises(ValueError, match="HEAD_PROGS 2: the head is shared only in the split schedule"):
            router_margin_kernel(h, *w, config=bad)


def test_serial_schedule_is_the_rule_for_many_rows():
    from wide.kernels.router.ops import ROUTER_BLOCK_M, SERIAL_MIN_BLOCKS, default_config

    many = ROUTER_BLOCK_M * SERIAL_MIN_BLOCKS
    assert default_config(4096, 1)["SERIAL"] == 0 and default_config(4096, many - ROUTER_BLOCK_M)["SERIAL"] == 0
    assert default_config(4096, many)["SERIAL"] == 1
    assert default_config(256, many)["SERIAL"] == 0  # one split: nothing to run in turn
    arithmetic = ("BLOCK_D", "SPLITS", "num_warps")
    assert {k: default_config(4096, many)[k] for k in arithmetic} == {k: default_config(4096)[k] for k in arithmetic}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kernel_rows_do_not_depend_on_the_batch(dtype, kernel_device):
    """A row's margin is bit-identical whether it runs alone, in a sub-batch, or in the whole batch. The
    interpreter's numpy dot may depend on a row's place in its 16-row block, so on the CPU the sub-batches
    start on block boundaries; the GPU test below takes arbitrary offsets."""
    _skip_bf16_in_interpreter(dtype, kernel_device)
    w_down, w_margin, b_margin = _router(320, 16, 20, dtype, kernel_device)
    h = _hidden(35, 320, dtype, kernel_device)
    conf = {"BLOCK_D": 32, "SPLITS": 4, "num_warps": 4}
    whole = router_margin_kernel(h, w_down, w_margin, b_margin, config=conf)
    cuts = [(0, 1), (7, 8), (34, 35), (3, 20), (16, 35)] if kernel_device == "cuda" else [(0, 1), (16, 17), (16, 35)]
    for lo, hi in cuts:
        part = router_margin_kernel(h[lo:hi], w_down, w_margin, b_margin, config=conf)
        assert torch.equal(part, whole[lo:hi]), (lo, hi)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_reference_rows_do_not_depend_on_the_batch(dtype):
    w_down, w_margin, b_margin = _router(576, 32, 64, dtype, "cpu")
    h = _hidden(300, 576, dtype, "cpu")
    whole = router_margin(h, w_down, w_margin, b_margin)
    assert torch.equal(router_margin(h[:1], w_down, w_margin, b_margin), whole[:1])
    assert torch.equal(router_margin(h[123:190], w_down, w_margin, b_margin), whole[123:190])
    assert torch.equal(router_margin(h.view(3, 100, 576), w_down, w_margin, b_margin).view(300, -1), whole)


def test_fp32_master_weight_is_rounded_to_the_input_dtype():
    """Training passes the fp32 parameter; the runtime the folded bf16 copy: the same margins."""
    w_down, w_margin, b_margin = _router(128, 16, 10, torch.float32, "cpu")
    h = _hidden(9, 128, torch.bfloat16, "cpu")
    assert torch.equal(
        router_margin(h, w_down, w_margin, b_margin), router_margin(h, w_down.bfloat16(), w_margin, b_margin)
    )


def test_router_margin_gradients_match_autograd():
    torch.manual_seed(0)
    h = torch.randn(6, 40, dtype=torch.float64).float().requires_grad_()
    w_down = torch.randn(8, 40).requires_grad_()
    w_margin = torch.randn(5, 8).requires_grad_()
    b_margin = torch.randn(5).requires_grad_()
    g = torch.randn(6, 5)
    (router_margin(h, w_down, w_margin, b_margin) * g).sum().backward()
    got = [t.grad.clone() for t in (h, w_down, w_margin, b_margin)]
    for t in (h, w_down, w_margin, b_margin):
        t.grad = None
    ((h @ w_down.t() @ w_margin.t() + b_margin) * g).sum().backward()
    for a, t in zip(got, (h, w_down, w_margin, b_margin), strict=True):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shift", [-10.0, 10.0])
def test_router_all_run_and_all_skip(shift, kernel_device):
    w_down, w_margin, b_margin = _router(64, 16, 20, torch.float32, kernel_device, bias_shift=shift)
    h = _hidden(4, 64, torch.float32, kernel_device)
    for out in (
        router_decisions(h, w_down, w_margin, b_margin),
        router_decisions(h, w_down, w_margin, b_margin, config={"BLOCK_D": 32, "SPLITS": 2, "num_warps": 4}),
    ):
        assert bool(out.all()) is (shift < 0)  # margin <= 0 runs the group
        assert bool((~out).all()) is (shift > 0)


def test_router_repeats_identical(kernel_device):
    w_down, w_margin, b_margin = _router(256, 32, 40, torch.float16, kernel_device)
    h = _hidden(7, 256, torch.float16, kernel_device)
    conf = {"BLOCK_D": 32, "SPLITS": 8, "num_warps": 4}
    first = router_decisions(h, w_down, w_margin, b_margin, config=conf)
    for _ in range(3):
        assert torch.equal(router_decisions(h, w_down, w_margin, b_margin, config=conf), first)


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
    with pytest.raises(ValueError, match="not supported"):
        router_margin(h.to(torch.float64), w_down, w_margin, b_margin)


# (M, D, rank a, N_G a, rank b, N_G b): the two routers of a pair differ in rank (BLOCK_R) and in groups
# (BLOCK_G: the attention router's few KV groups, the FFN router's many), M over several row blocks
PAIR_SHAPES = [(1, 200, 16, 3, 32, 70), (37, 96, 8, 130, 16, 7), (16, 576, 32, 4, 32, 12)]


@pytest.mark.parametrize("shape", PAIR_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 4])
def test_pair_equals_two_single_launches(shape, dtype, splits, kernel_device):
    """Each mask of the one-launch pair is its router's own decision, bit for bit, whatever the other router."""
    m, d, ra, nga, rb, ngb = shape
    a = _router(d, ra, nga, dtype, kernel_device, seed=2)
    b = _router(d, rb, ngb, dtype, kernel_device, seed=3)
    h = _hidden(m, d, dtype, kernel_device)
    conf = {"BLOCK_D": 32, "SPLITS": splits, "num_warps": 4}
    got_a, got_b = router_decisions_pair(h, a, b, config=conf)
    assert got_a.shape == (m, nga) and got_b.shape == (m, ngb) and got_a.dtype == got_b.dtype == torch.bool
    assert torch.equal(got_a, router_decisions(h, *a, config=conf))
    assert torch.equal(got_b, router_decisions(h, *b, config=conf))
    assert torch.equal(got_a, router_margin_kernel(h, *a, config=conf) <= 0)
    assert 0 < int(got_b.sum()) < got_b.numel()  # the comparison saw both decisions


def test_pair_op_keeps_leading_dims_and_matches_the_rule():
    """The op users call (no config): [B, T, D] in, [B, T, N_G] masks out, each the reference rule's."""
    a = _router(64, 16, 5, torch.float32, "cpu", seed=4)
    b = _router(64, 8, 20, torch.float32, "cpu", seed=5)
    h = _hidden(6, 64, torch.float32, "cpu").view(2, 3, 64)
    got_a, got_b = router_decisions_pair(h, a, b)
    assert got_a.shape == (2, 3, 5) and got_b.shape == (2, 3, 20)
    assert torch.equal(got_a, router_decisions(h, *a)) and torch.equal(got_b, router_decisions(h, *b))
    empty_a, empty_b = router_decisions_pair(h[:, :0], a, b)
    assert empty_a.shape == (2, 0, 5) and empty_b.shape == (2, 0, 20)
    with pytest.raises(ValueError, match="hidden size"):
        router_decisions_pair(h, a, _router(32, 8, 20, torch.float32, "cpu"))


# ------------------------------------------------------------------------------------------------ GPU
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ng", [8, 112, 448])
def test_gpu_rows_do_not_depend_on_m(dtype, ng):
    """Llama-3.1-8B routers (D 4096, r 32): decode (M 1..16) and prefill (M up to 4096) compute each
    row's margin bit-identically, so a token decided at decode is decided the same when scored."""
    w_down, w_margin, b_margin = _router(4096, 32, ng, dtype, "cuda")
    h = _hidden(4099, 4096, dtype, "cuda")
    whole = router_margin(h, w_down, w_margin, b_margin)
    exact = _exact_margin(h, w_down, w_margin, b_margin)
    assert (whole.double() - exact).abs().max().item() <= 1e-4 * exact.abs().max().item()
    # up to 16 rows: parallel splits; (17, 1041) (64 row blocks), (0, 4096), (1, 4099) and the whole: the serial
    # schedule (default_config)
    for lo, hi in [(0, 1), (4098, 4099), (5, 8), (100, 116), (17, 1041), (0, 4096), (1, 4099)]:
        assert torch.equal(router_margin(h[lo:hi], w_down, w_margin, b_margin), whole[lo:hi]), (lo, hi)
        assert torch.equal(router_decisions(h[lo:hi], w_down, w_margin, b_margin), whole[lo:hi] <= 0), (lo, hi)


@gpu
@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("ng", [112, 448])
def test_router_cuda_graph(m, ng):
    w_down, w_margin, b_margin = _router(4096, 32, ng, torch.bfloat16, "cuda")
    static_h = _hidden(m, 4096, torch.bfloat16, "cuda")
    router_decisions(static_h, w_down, w_margin, b_margin)  # warm (compile) outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = router_decisions(static_h, w_down, w_margin, b_margin)
    h2 = _hidden(m, 4096, torch.bfloat16, "cuda", seed=5)
    static_h.copy_(h2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, router_decisions(h2, w_down, w_margin, b_margin))


@gpu
def test_gpu_margin_gradients_flow_under_autocast():
    """Training: bf16 model activations, fp32 router parameters, bf16 autocast."""
    from wide.routing import Router

    r = Router(4096, 112, 32).cuda()
    x = _hidden(64, 4096, torch.bfloat16, "cuda").requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        m = r.skip_margin(x)
    assert m.dtype == torch.float32
    m.square().mean().backward()
    assert x.grad is not None and r.down.weight.grad.dtype == torch.float32
    assert torch.isfinite(r.up.weight.grad).all()


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16, 300])
@pytest.mark.parametrize("ng", [112, 448])
def test_gpu_pair_equals_single_launches(dtype, m, ng):
    """Llama-3.1-8B attention (8 KV groups) and FFN (G 128: 112 groups; G 32: 448, a shared head) routers on one
    input: the pair's default launch decides each exactly as its own launch does; and it replays under a CUDA
    graph."""
    a = _router(4096, 32, 8, dtype, "cuda", seed=2)
    b = _router(4096, 32, ng, dtype, "cuda", seed=3)
    h = _hidden(m, 4096, dtype, "cuda")
    got_a, got_b = router_decisions_pair(h, a, b)
    assert torch.equal(got_a, router_decisions(h, *a)) and torch.equal(got_b, router_decisions(h, *b))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_a, static_b = router_decisions_pair(h, a, b)
    h2 = _hidden(m, 4096, dtype, "cuda", seed=7)
    h.copy_(h2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_a, router_decisions(h2, *a)) and torch.equal(static_b, router_decisions(h2, *b))
