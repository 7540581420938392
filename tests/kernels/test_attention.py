"""Routed flash attention vs the torch references (CPU: Triton interpreter; GPU tests marked)."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are defined: CPU runs Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from wide.kernels.attention import (
    attention_decode_ref,
    attention_prefill_ref,
    routed_attention_decode,
    routed_attention_prefill,
)
from wide.kernels.route.plan import Plan
from wide.kernels.route.reorder import plan_route, reorder, reorder_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _mask(shape, kind: str, gen: torch.Generator, device=DEV) -> torch.Tensor:
    if kind == "all":
        return torch.ones(shape, dtype=torch.bool, device=device)
    if kind == "none":
        return torch.zeros(shape, dtype=torch.bool, device=device)
    p = {"random": 0.5, "sparse": 0.2}[kind]
    return (torch.rand(shape, generator=gen) < p).to(device)


def _check(out: torch.Tensor, ref32: torch.Tensor, ref_same: torch.Tensor, atol: float = 1e-5) -> None:
    """Flash-attention style: kernel error <= 2x plain-PyTorch same-dtype error (+ tiny atol)."""
    assert torch.isfinite(out).all()
    err = (out.float() - ref32.float()).abs().max().item()
    base = (ref_same.float() - ref32.float()).abs().max().item()
    assert err <= 2 * base + atol, f"kernel err {err:.3e} vs torch same-dtype err {base:.3e}"


def _qkv(b, tq, tk, hq, hk, d, dtype, gen, device=DEV):
    q = torch.randn(b, tq, hq, d, generator=gen).to(device, dtype)
    k = torch.randn(b, tk, hk, d, generator=gen).to(device, dtype)
    v = torch.randn(b, tk, hk, d, generator=gen).to(device, dtype)
    return q, k, v


PREFILL_CASES = [
    # B, Tq, Tk, Hq, Hk, d, dtype, mask, causal
    (1, 37, 37, 4, 2, 32, torch.float32, "random", True),  # Tq not a multiple of the tile
    (2, 21, 50, 6, 2, 16, torch.float16, "random", True),  # chunked (Tq < Tk), B > 1, group 3
    (2, 40, 40, 2, 2, 64, torch.float32, "all", True),  # group 1, all active
    (1, 33, 33, 4, 1, 32, torch.float16, "none", True),  # all inactive
    (2, 29, 29, 4, 4, 16, torch.float16, "sparse", True),  # group 1, sparse
    (1, 1, 45, 8, 2, 32, torch.float32, "all", True),  # one query token against a cache
    (2, 19, 27, 4, 2, 32, torch.float32, "random", False),  # full attention, chunked
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"B{c[0]}-Tq{c[1]}-Tk{c[2]}-{c[3]}/{c[4]}-d{c[5]}-{c[7]}")
def test_prefill_matches_reference(case):
    b, tq, tk, hq, hk, d, dtype, kind, causal = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    q, k, v = _qkv(b, tq, tk, hq, hk, d, dtype, gen)
    mask = _mask((b, tq, hk), kind, gen)
    out = routed_attention_prefill(q, k, v, mask, causal=causal)
    ref32 = attention_prefill_ref(q, k, v, mask, causal=causal)
    ref_same = attention_prefill_ref(q, k, v, mask, causal=causal, upcast=False)
    _check(out, ref32, ref_same)
    skipped = ~mask.repeat_interleave(hq // hk, dim=2)  # [B,Tq,Hq]
    assert (out[skipped] == 0).all()


def test_prefill_shared_route_and_scale():
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(2, 24, 30, 4, 2, 32, torch.float32, gen)
    mask = _mask((2, 24, 2), "random", gen)
    # a decision's route as the runtime plans it: with the reorder index (sorted GEMM-MN) or the mask alone
    planned = [plan_route(mask, Plan(mn, "dense", mn == "sorted")) for mn in ("sorted", "dense")]
    ref = attention_prefill_ref(q, k, v, mask, sm_scale=0.3)
    for route in (reorder(mask), reorder_reference(mask), *planned):
        out = routed_attention_prefill(q, k, v, mask, route=route, sm_scale=0.3)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # an explicit launch configuration (benchmark sweeps) instead of the defaults: same result
    out = routed_attention_prefill(q, k, v, mask, sm_scale=0.3, config=(16, 32, 4, 1))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_decode_explicit_config_and_waves():
    from wide.kernels.attention import decode_num_splits

    assert decode_num_splits(1, 8, 1 << 20, waves=2) == 33 and decode_num_splits(1, 8, 1 << 20) == 50
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 32, generator=gen)
    kc, vc = (torch.randn(2, 40, 2, 32, generator=gen) for _ in range(2))
    lens = torch.tensor([40, 9], dtype=torch.int32)
    mask = torch.tensor([[True, False], [True, True]])
    ref = attention_decode_ref(q, kc, vc, lens, mask)
    for ns in (1, 3):
        out = routed_attention_decode(q, kc, vc, lens, mask, num_splits=ns, config=(32, 4, 1))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


DECODE_CASES = [
    # B, S, Hq, Hk, d, dtype, lens, num_splits
    (3, 64, 4, 2, 32, torch.float32, [1, 37, 64], None),
    (3, 64, 4, 2, 32, torch.float16, [1, 37, 64], 3),  # 37 not a multiple of the split size
    (2, 48, 8, 2, 16, torch.float32, [48, 5], 1),  # one split: direct write
    (2, 80, 3, 3, 64, torch.float16, [80, 17], 5),  # group 1
    (1, 33, 6, 2, 32, torch.float32, [33], 8),  # more splits than key blocks
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"B{c[0]}-S{c[1]}-{c[2]}/{c[3]}-d{c[4]}-ns{c[7]}")
def test_decode_matches_reference(case):
    b, s, hq, hk, d, dtype, lens, ns = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    q = torch.randn(b, hq, d, generator=gen).to(DEV, dtype)
    kc = torch.randn(b, s, hk, d, generator=gen).to(DEV, dtype)
    vc = torch.randn(b, s, hk, d, generator=gen).to(DEV, dtype)
    cache_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    mask = _mask((b, hk), "random", gen)
    mask[0] = False  # one sequence fully skipped
    if b > 1:
        mask[1] = True
    out = routed_attention_decode(q, kc, vc, cache_lens, mask, num_splits=ns)
    ref32 = attention_decode_ref(q, kc, vc, cache_lens, mask)
    ref_same = attention_decode_ref(q, kc, vc, cache_lens, mask, upcast=False)
    _check(out, ref32, ref_same)
    assert (out[0] == 0).all()
    assert torch.equal(out, routed_attention_decode(q, kc, vc, cache_lens, mask, num_splits=ns))  # deterministic


def test_a_strided_cache_reads_the_same():
    """A cache [B, S, Hk, d] held as a view of [B, Hk, S, d] storage: decode over the whole cache and prefill
    over its first T keys read it through the strides, bit for bit as the contiguous one."""
    gen = torch.Generator().manual_seed(5)
    b, s, hq, hk, d = 3, 50, 6, 2, 32
    q, kc, vc = _qkv(b, 1, s, hq, hk, d, torch.float32, gen)
    gk, gv = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (kc, vc))
    assert gk.stride(1) == d and gk.stride(2) == s * d
    lens = torch.tensor([50, 17, 1], dtype=torch.int32, device=DEV)
    mask = _mask((b, hk), "random", gen)
    mask[0] = True
    for ns in (None, 3):
        out = routed_attention_decode(q[:, 0], kc, vc, lens, mask, num_splits=ns)
        assert torch.equal(out, routed_attention_decode(q[:, 0], gk, gv, lens, mask, num_splits=ns))
    t = 21
    qp = torch.randn(b, t, hq, d, generator=gen).to(DEV)
    pmask = _mask((b, t, hk), "random", gen)
    out = routed_attention_prefill(qp, kc[:, :t], vc[:, :t], pmask)
    assert torch.equal(out, routed_attention_prefill(qp, gk[:, :t], gv[:, :t], pmask))


def test_decode_ignores_garbage_beyond_length():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 16, generator=gen)
    kc = torch.randn(2, 40, 2, 16, generator=gen)
    vc = torch.randn(2, 40, 2, 16, generator=gen)
    kc[:, 20:] = float("nan")
    vc[:, 20:] = float("inf")
    lens = torch.tensor([20, 7], dtype=torch.int32)
    mask = torch.ones(2, 2, dtype=torch.bool)
    out = routed_attention_decode(q, kc, vc, lens, mask, num_splits=3)
    ref = attention_decode_ref(q, kc[:, :20], vc[:, :20], lens, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_errors():
    q = torch.randn(1, 8, 6, 32)
    k = torch.randn(1, 8, 4, 32)
    m = torch.ones(1, 8, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        routed_attention_prefill(q, k, k, m)
    q = torch.randn(1, 8, 4, 48)
    k = torch.randn(1, 8, 2, 48)
    with pytest.raises(ValueError, match="head dim"):
        routed_attention_prefill(q, k, k, torch.ones(1, 8, 2, dtype=torch.bool))
    q, k = torch.randn(1, 9, 4, 32), torch.randn(1, 8, 2, 32)
    with pytest.raises(ValueError, match="Tq"):
        routed_attention_prefill(q, k, k, torch.ones(1, 9, 2, dtype=torch.bool))
    q, k = torch.randn(1, 8, 4, 32), torch.randn(1, 8, 2, 32)
    with pytest.raises(ValueError, match="mask"):
        routed_attention_prefill(q, k, k, torch.ones(1, 8, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="sm_scale"):
        routed_attention_prefill(q, k, k, torch.ones(1, 8, 2, dtype=torch.bool), sm_scale=0.0)
    with pytest.raises(ValueError, match="fp16/bf16/fp32"):
        routed_attention_prefill(q.double(), k.double(), k.double(), torch.ones(1, 8, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        routed_attention_decode(
            torch.randn(1, 4, 32),
            k,
            k,
            torch.tensor([8], dtype=torch.int32),
            torch.ones(1, 4, dtype=torch.bool),
        )


def test_torch_compile_fullgraph():
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(1, 20, 20, 4, 2, 16, torch.float32, gen)
    mask = _mask((1, 20, 2), "random", gen)
    qd, kc, vc = q[:, -1], k, v
    lens = torch.tensor([20], dtype=torch.int32, device=DEV)

    @torch.compile(fullgraph=True)
    def f(q, k, v, mask, qd, lens):
        o = routed_attention_prefill(q, k, v, mask) * 2.0
        od = routed_attention_decode(qd, k, v, lens, mask[:, -1], num_splits=2) + 1.0
        return o, od

    o, od = f(q, k, v, mask, qd, lens)
    torch.testing.assert_close(o, 2.0 * attention_prefill_ref(q, k, v, mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(od, 1.0 + attention_decode_ref(qd, kc, vc, lens, mask[:, -1]), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------- GPU
GPU_SHAPES = [(32, 8, 128), (9, 3, 64)]  # Llama-3.1-8B, SmolLM2


@gpu
@needs_cuda
@pytest.mark.parametrize("hq,hk,d", GPU_SHAPES)
@pytest.mark.parametrize("b,tq,tk", [(1, 1024, 1024), (2, 300, 777)])
@pytest.mark.parametrize("kind", ["random", "all", "none"])
def test_gpu_prefill_bf16(hq, hk, d, b, tq, tk, kind):
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(b, tq, tk, hq, hk, d, torch.bfloat16, gen, "cuda")
    mask = _mask((b, tq, hk), kind, gen, "cuda")
    out = routed_attention_prefill(q, k, v, mask)
    _check(out, attention_prefill_ref(q, k, v, mask), attention_prefill_ref(q, k, v, mask, upcast=False))


@gpu
@needs_cuda
@pytest.mark.parametrize("hq,hk,d", GPU_SHAPES)
@pytest.mark.parametrize("ns", [None, 1, 7])
def test_gpu_decode_bf16(hq, hk, d, ns):
    gen = torch.Generator().manual_seed(8)
    b, s = 4, 4096
    q = torch.randn(b, hq, d, generator=gen).to("cuda", torch.bfloat16)
    kc = torch.randn(b, s, hk, d, generator=gen).to("cuda", torch.bfloat16)
    vc = torch.randn(b, s, hk, d, generator=gen).to("cuda", torch.bfloat16)
    lens = torch.tensor([1, 4096, 1000, 333], dtype=torch.int32, device="cuda")
    mask = _mask((b, hk), "random", gen, "cuda")
    mask[1] = True
    out = routed_attention_decode(q, kc, vc, lens, mask, num_splits=ns)
    ref32 = attention_decode_ref(q, kc, vc, lens, mask)
    _check(out, ref32, attention_decode_ref(q, kc, vc, lens, mask, upcast=False))
    gk, gv = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (kc, vc))  # [B, Hk, S, d] storage
    assert torch.equal(out, routed_attention_decode(q, gk, gv, lens, mask, num_splits=ns))


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture_replay():
    gen = torch.Generator().manual_seed(9)
    q, k, v = _qkv(2, 512, 512, 32, 8, 128, torch.bfloat16, gen, "cuda")
    mask = _mask((2, 512, 8), "random", gen, "cuda")
    lens = torch.tensor([512, 100], dtype=torch.int32, device="cuda")
    dmask = _mask((2, 8), "random", gen, "cuda")
    qd = q[:, 0].contiguous()
    for _ in range(2):  # warm-up (compiles)
        routed_attention_prefill(q, k, v, mask)
        routed_attention_decode(qd, k, v, lens, dmask)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o = routed_attention_prefill(q, k, v, mask)
        od = routed_attention_decode(qd, k, v, lens, dmask)
    for seed in (10, 11):  # new inputs into the static buffers, replay
        gen.manual_seed(seed)
        q2, k2, v2 = _qkv(2, 512, 512, 32, 8, 128, torch.bfloat16, gen, "cuda")
        q.copy_(q2), k.copy_(k2), v.copy_(v2), qd.copy_(q2[:, 0])
        mask.copy_(_mask((2, 512, 8), "random", gen, "cuda"))
        dmask.copy_(_mask((2, 8), "random", gen, "cuda"))
        g.replay()
        torch.cuda.synchronize()
        _check(o, attention_prefill_ref(q, k, v, mask), attention_prefill_ref(q, k, v, mask, upcast=False))
        _check(
            od,
            attention_decode_ref(qd, k, v, lens, dmask),
            attention_decode_ref(qd, k, v, lens, dmask, upcast=False),
        )


@gpu
@needs_cuda
def test_gpu_torch_compile():
    gen = torch.Generator().manual_seed(12)
    q, k, v = _qkv(1, 256, 256, 32, 8, 128, torch.bfloat16, gen, "cuda")
    mask = _mask((1, 256, 8), "random", gen, "cuda")

    lens = torch.tensor([256], dtype=torch.int32, device="cuda")
    qd = q[:, -1].contiguous()

    @torch.compile(fullgraph=True)
    def f(q, k, v, mask, qd, lens):
        o = routed_attention_prefill(q, k, v, mask) * 2
        return o, routed_attention_decode(qd, k, v, lens, mask[:, -1]) * 2

    out, od = f(q, k, v, mask, qd, lens)
    ref = attention_prefill_ref(q, k, v, mask)
    _check(out / 2, ref, attention_prefill_ref(q, k, v, mask, upcast=False))
    dref = attention_decode_ref(qd, k, v, lens, mask[:, -1])
    _check(od / 2, dref, attention_decode_ref(qd, k, v, lens, mask[:, -1], upcast=False))
