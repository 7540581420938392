"""Decode and prefill attention at long context against the torch references (docs/long-context.md): caches of
16k-32k keys, ragged per-sequence lengths differing by thousands, sequences fully skipped for a step, GQA 3 / 4
/ 7, head_dim 64 / 128, the bf16 rule on a GPU (error <= 2x plain PyTorch's bf16 error, both vs fp32). The K/V
of skipped (sequence, group) pairs and of positions past each length are NaN: a kernel that read them into a
result would fail. CPU: Triton's interpreter, fp32, one case per kernel at >= 16k keys."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import assert_close_to_ref, gpu
from wide.kernels import fused_decode as FD
from wide.kernels.attention import (
    attention_decode_ref,
    attention_prefill_ref,
    routed_attention_decode,
    routed_attention_prefill,
)


def _decode_case(
    b: int, hq: int, hk: int, d: int, s: int, lens: list[int], skip_rows: list[int], seed: int, device: str = "cpu"
):
    """q [B, Hq, d], caches [B, S, Hk, d] with NaN past each length and in every skipped pair, lens [B], mask
    [B, Hk] (random, the rows in skip_rows all False: those sequences skip attention this step); drawn on
    ``device`` (a GPU draws its gigabyte of cache in milliseconds)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g, device=device)
    kc = torch.randn(b, s, hk, d, generator=g, device=device)
    vc = torch.randn(b, s, hk, d, generator=g, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    mask = torch.rand(b, hk, generator=g, device=device) < 0.5
    mask[0, 0] = True  # at least one pair runs
    mask[skip_rows] = False
    past = torch.arange(s, device=device)[None, :] >= lens_t[:, None]  # [B, S]
    for c in (kc, vc):
        c[past] = float("nan")
        c.permute(0, 2, 1, 3)[~mask] = float("nan")  # [B, Hk, S, d] view: the skipped pairs' whole cache
    return q, kc, vc, lens_t, mask


def _ref(q, kc, vc, lens, mask, upcast=True):
    """The reference on NaN-free caches (it zeroes positions past each length itself)."""
    return attention_decode_ref(q, kc.nan_to_num(0.0), vc.nan_to_num(0.0), lens, mask, upcast=upcast)


def _refs(q, kc, vc, lens, mask):
    """(fp32 reference of the bf16 inputs, plain PyTorch in bf16): the bf16 rule's two references."""
    return _ref(q.float(), kc.float(), vc.float(), lens, mask), _ref(q, kc, vc, lens, mask, upcast=False)


@pytest.mark.slow
def test_fused_decode_attention_long_ragged_cpu(kernel_device):
    """16,400 keys, B 3 with lengths 16,400 / 9,000 / 2,500, GQA 4, the third sequence skipped: the fused
    attention at the long-context rule's split count for its running pairs (passed explicitly: the interpreter
    caps the rule's own count at 2), the rule's count itself, and the reference."""
    s = 16400
    q, kc, vc, lens, mask = _decode_case(3, 4, 1, 64, s, [s, 9000, 2500], [2], seed=1)
    ref = _ref(q, kc, vc, lens, mask)
    with FD.launch_overrides(long_context=1):
        ns = FD.attn_num_splits(int(mask.sum()), s, FD.attn_programs(s, 132))
    assert ns > 16  # beyond the short rule's cap
    q, kc, vc, lens, mask = (t.to(kernel_device) for t in (q, kc, vc, lens, mask))
    # few key steps under the interpreter (its cost is per step); a GPU keeps its own block (shared memory)
    block = {"attn_block_n": 512} if kernel_device == "cpu" else {}
    with FD.launch_overrides(long_context=1, **block):
        fixed = FD.attention_decode_merged(q, kc, vc, lens, mask, num_splits=ns)
        rule = FD.attention_decode_merged(q, kc, vc, lens, mask)
    for out in (fixed, rule):
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_routed_prefill_long_keys_cpu():
    """A chunk of 9 queries against 16,400 keys (the cache's tail), GQA 3, one sequence's group skipped for every
    query: the routed prefill kernel vs the reference."""
    g = torch.Generator().manual_seed(2)
    b, tq, tk, hq, hk, d = 2, 9, 16400, 6, 2, 64
    q = torch.randn(b, tq, hq, d, generator=g)
    k, v = torch.randn(b, tk, hk, d, generator=g), torch.randn(b, tk, hk, d, generator=g)
    mask = torch.rand(b, tq, hk, generator=g) < 0.5
    mask[1, :, 0] = False
    k[1, :, 0] = float("nan")  # the skipped (sequence, group): never read
    v[1, :, 0] = float("nan")
    out = routed_attention_prefill(q, k, v, mask, config=(32, 512, 4, 1))  # one query tile, few key steps
    ref = attention_prefill_ref(q, k.nan_to_num(0.0), v.nan_to_num(0.0), mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------- GPU
LONG_SHAPES = [(24, 8, 64), (32, 8, 128), (28, 4, 128), (21, 3, 64)]  # GQA 3, 4 (Llama-3.1-8B), 7, 7


def _ragged(b: int, s: int, seed: int) -> list[int]:
    """b lengths in [1, s], spread over the cache (differing by thousands), the first the full cache."""
    g = torch.Generator().manual_seed(seed)
    return [s] + torch.randint(1, s, (b - 1,), generator=g).tolist()


@gpu
@pytest.mark.parametrize("hq,hk,d", LONG_SHAPES)
@pytest.mark.parametrize("b,s", [(3, 32768), (16, 16400)])
@pytest.mark.parametrize("long_rule", [1, 0])
def test_gpu_fused_decode_attention_long_bf16(hq, hk, d, b, s, long_rule):
    """The fused decode attention in bf16 at 16k-32k keys, ragged lengths, two sequences skipped, under the
    long-context and the short split rule: within the bf16 rule."""
    lens = _ragged(b, s, seed=b)
    q, kc, vc, lens_t, mask = _decode_case(b, hq, hk, d, s, lens, [1, b - 1], seed=hq + b, device="cuda")
    q, kc, vc = (t.to(torch.bfloat16) for t in (q, kc, vc))
    with FD.launch_overrides(long_context=long_rule):
        out = FD.attention_decode_merged(q, kc, vc, lens_t, mask)
    assert torch.isfinite(out).all()
    assert_close_to_ref(out, *_refs(q, kc, vc, lens_t, mask))


@gpu
@pytest.mark.parametrize("hq,hk,d", LONG_SHAPES)
def test_gpu_unfused_decode_attention_long_bf16(hq, hk, d):
    """The unfused split-KV decode (``routed_attention_decode``) at 32k keys, ragged, one sequence skipped."""
    b, s = 4, 32768
    q, kc, vc, lens_t, mask = _decode_case(b, hq, hk, d, s, _ragged(b, s, seed=5), [2], seed=hq, device="cuda")
    q, kc, vc = (t.to(torch.bfloat16) for t in (q, kc, vc))
    out = routed_attention_decode(q, kc, vc, lens_t, mask)
    assert torch.isfinite(out).all()
    assert_close_to_ref(out, *_refs(q, kc, vc, lens_t, mask))


@gpu
@pytest.mark.parametrize(
    "b,tq,tk,hq,hk,d",
    [(3, 256, 16384, 28, 4, 128), (1, 16384, 16384, 3, 1, 64), (2, 1024, 32768, 32, 8, 128)],
    ids=["chunk-gqa7-d128", "full-16k-gqa3-d64", "chunk-32k-gqa4-d128"],
)
def test_gpu_routed_prefill_long_bf16(b, tq, tk, hq, hk, d):
    """The routed prefill in bf16 at 16k-32k keys, one sequence's first group skipped for every query (its K/V
    NaN): within the bf16 rule."""
    g = torch.Generator(device="cuda").manual_seed(tq + hq)
    q = torch.randn(b, tq, hq, d, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(b, tk, hk, d, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(b, tk, hk, d, generator=g, device="cuda").to(torch.bfloat16)
    mask = torch.rand(b, tq, hk, generator=g, device="cuda") < 0.5
    mask[b - 1, :, 0] = False
    k[b - 1, :, 0], v[b - 1, :, 0] = float("nan"), float("nan")
    out = routed_attention_prefill(q, k, v, mask)
    kz, vz = k.nan_to_num(0.0), v.nan_to_num(0.0)
    assert torch.isfinite(out).all()
    assert_close_to_ref(
        out, attention_prefill_ref(q, kz, vz, mask), attention_prefill_ref(q, kz, vz, mask, upcast=False)
    )


@gpu
def test_gpu_one_graph_serves_every_cache_length():
    """The fused attention captured once in a CUDA graph over a 32,784-key cache serves lengths from 1 to the
    whole cache, ragged within the batch, and new masks, on replay: within the bf16 rule each time."""
    b, hq, hk, d, s = 4, 32, 8, 128, 32784
    q, kc, vc, lens_t, mask = _decode_case(b, hq, hk, d, s, [s, 1, 20000, 4096], [1], seed=3, device="cuda")
    kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    q, kc, vc = (t.to(torch.bfloat16) for t in (q, kc, vc))
    for _ in range(2):
        FD.attention_decode_merged(q, kc, vc, lens_t, mask)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = FD.attention_decode_merged(q, kc, vc, lens_t, mask)
    g = torch.Generator().manual_seed(4)
    for lens in ([1, 2, 3, 4], [s, s, s, s], [30000, 17, 8192, 12345]):
        lens_t.copy_(torch.tensor(lens, dtype=torch.int32))
        mask.copy_(torch.rand(b, hk, generator=g) < 0.5)
        graph.replay()
        torch.cuda.synchronize()
        ref32 = attention_decode_ref(q.float(), kc.float(), vc.float(), lens_t, mask)
        assert_close_to_ref(out, ref32, attention_decode_ref(q, kc, vc, lens_t, mask, upcast=False))
