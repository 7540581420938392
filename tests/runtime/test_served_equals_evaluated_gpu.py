"""Served = evaluated on the GPU: the routed runtime (Triton kernels, bf16) against the masked path.

The routers decide through one op in both paths (docs/routing.md#the-decision-rule), so on the same
input they decide the same; the backbones differ by the kernels' bf16 rounding (gathered GEMMs, flash
attention vs cuBLAS / SDPA), so whole-model logits agree within bf16 noise, not bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model
from wide.config import WideConfig
from wide.model import WideModel
from wide.runtime import WideRuntime, generate

pytestmark = pytest.mark.gpu

# (family, hidden, heads, kv heads, FFN width, group size): GQA 4 / 7 / 3 / 4, head_dim 64 / 64 / 128 / 128,
# FFN widths that are not powers of two
SHAPES = [
    ("llama", 1024, 16, 4, 2816, 64),
    ("qwen2", 896, 14, 2, 4864, 128),
    ("qwen3", 1536, 12, 4, 3072, 96),
    ("mistral", 2048, 16, 4, 5632, 128),
]


def _model(family, hidden, heads, kv, inter, g, seed=0):
    model = tiny_model(family, layers=4, hidden=hidden, heads=heads, kv=kv, inter=inter, vocab=512, seed=seed)
    model = model.to("cuda", torch.bfloat16)
    wm = WideModel(model, WideConfig(ffn_group_size=g, router_rank=32, sparsity=0.5))
    torch.manual_seed(seed)
    for r in wm.routers:  # decisions near 50%: many tokens close to the threshold
        torch.nn.init.normal_(r.attn.up.weight, std=0.5)
        torch.nn.init.normal_(r.ffn.up.weight, std=0.5)
    return model, wm


def _capture(rt):
    seen: list = []
    step = rt.step
    rt.step = lambda *a: (lambda out: (seen.append(out), out)[1])(step(*a))
    return seen


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_same_inputs_same_decisions_at_every_layer(shape, monkeypatch):
    """Every router input the runtime decides on (B 3, T 300: past the sorted-kernel threshold), given to
    the masked path's routers: 0 differing decisions; and the runtime's RMSNorm is the HF module's, bit
    for bit, so equal layer inputs give equal router inputs."""
    import wide.kernels as K

    model, wm = _model(*shape)
    ids = torch.randint(0, 512, (3, 300), device="cuda")
    rt = WideRuntime(wm, max_batch=3, max_seq=320, attn_sparsity_hint=0.5, ffn_sparsity_hint=0.5)
    calls: list = []
    decide = K.router_decisions
    monkeypatch.setattr(K, "router_decisions", lambda h, *a: (calls.append((h, decide(h, *a))), calls[-1][1])[1])
    ins: list = []
    step = rt.step
    rt.step = lambda x, *a: (ins.append(x.clone()), step(x, *a))[1]
    rt.score(ids)
    assert len(calls) == 2 * len(wm.routers)
    n = 0
    for i, r in enumerate(wm.routers):
        for (h, mask), router in zip(calls[2 * i : 2 * i + 2], (r.attn, r.ffn), strict=True):
            assert torch.equal(router.skip_margin(h) <= 0, mask), f"layer {i}"
            n += mask.numel()
        hf_norm = model.model.layers[i].input_layernorm(ins[i])
        assert torch.equal(hf_norm, calls[2 * i][0]), f"layer {i}: RMSNorm differs from the HF module"
    assert n > 0


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_prefill_logits_within_bf16_noise_of_the_masked_path(shape):
    """Whole-model logits of every position (B 3, T 300) vs the masked path: the routed runtime is as close
    to it as the dense runtime is to the dense model (same noise source: the backbone's bf16 rounding),
    and few decisions differ (a flip needs backbone noise to cross a threshold)."""
    model, wm = _model(*shape)
    ids = torch.randint(0, 512, (3, 300), device="cuda")
    with torch.no_grad():
        ref = wm(ids).logits.float()
        with wm.routing("dense"):
            ref_dense = wm(ids).logits.float()
    with torch.no_grad():
        wm(ids)
    masks = [(m["attn"].clone(), m["ffn"].clone()) for m in wm.last_masks]
    rt = WideRuntime(wm, max_batch=3, max_seq=320, attn_sparsity_hint=0.5, ffn_sparsity_hint=0.5)
    outs = _capture(rt)
    got = rt.score(ids).float()
    dense_rt = WideRuntime(wm, max_batch=3, max_seq=320, routed=False)
    got_dense = dense_rt.score(ids).float()
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    routed_err, dense_err = rel(got, ref), rel(got_dense, ref_dense)
    flips = sum(int((o[1] != m[0]).sum() + (o[2] != m[1]).sum()) for o, m in zip(outs, masks, strict=True))
    n = sum(m[0].numel() + m[1].numel() for m in masks)
    print(f"{shape[0]}: routed rel err {routed_err:.2e}, dense {dense_err:.2e}, flips {flips}/{n}")
    assert routed_err <= max(4 * dense_err, 1e-2), (routed_err, dense_err)
    assert flips <= 1e-3 * n


@pytest.mark.parametrize("shape", SHAPES[:2], ids=[s[0] for s in SHAPES[:2]])
def test_greedy_tokens_equal_the_masked_path_for_32_steps(shape):
    """CUDA-graph decode through the routed runtime vs re-scoring the whole sequence on the masked path at
    every step (B 2)."""
    model, wm = _model(*shape, seed=1)
    ids = torch.randint(0, 512, (2, 40), device="cuda")
    rt = WideRuntime(wm, max_batch=2, max_seq=96)
    out = generate(rt, ids, 32)
    seq = ids
    with torch.no_grad():
        for _ in range(32):
            seq = torch.cat([seq, wm(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    agree = (out[:, 40:] == seq[:, 40:]).float().mean().item()
    assert torch.equal(out, seq), f"greedy tokens agree on {agree:.0%}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_runtime_refuses_head_dim_128_outside_bf16(dtype):
    model = tiny_model("llama", layers=1, hidden=256, heads=2, kv=1, inter=256).to("cuda", dtype)
    wm = WideModel(model, WideConfig(ffn_group_size=64, router_rank=8))
    with pytest.raises(ValueError, match="load it in bf16"):
        WideRuntime(wm, max_batch=1, max_seq=8)
