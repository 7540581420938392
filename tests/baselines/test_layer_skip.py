"""Token-wise layer skipping: decisions tied per layer, equal to an explicit per-token layer skip,
calibration reaching its target at inference, checkpoints, and its accounting."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import tiny_model
from wide.baselines import build, load
from wide.baselines.layer_skip import LayerSkipModel, TiedMeter
from wide.config import WideConfig


def _cfg(**kw):
    return WideConfig(router_rank=8, method="layer-skip", **kw)


def _randomise(wm, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in wm.routers.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)


def test_masks_are_tied_and_equal_an_explicit_layer_skip():
    base = tiny_model("llama")
    ref = copy.deepcopy(base)
    wm = build(base, _cfg())
    assert isinstance(wm, LayerSkipModel) and isinstance(wm.meter, TiedMeter)
    assert wm.shape.attn_groups == wm.shape.ffn_groups == 1
    _randomise(wm)
    ids = torch.randint(0, 101, (3, 12))
    with torch.no_grad():
        got = wm(ids).logits
    for m in wm.last_masks:
        assert torch.equal(m["attn"], m["ffn"])
    skipped = torch.stack([~m["attn"][..., 0] for m in wm.last_masks])  # [L, B, T]
    assert 0 < skipped.float().mean() < 1  # a mix, or the test proves nothing

    # reference: a decoder layer returns its input for a skipped token, its dense output otherwise
    def layer_hook(i):
        def pre(module, args, kwargs):
            module._x = args[0] if args else kwargs["hidden_states"]

        def post(module, args, kwargs, out):
            x = module._x  # [B, T, D]
            norm = module.input_layernorm(x)
            execute = wm.routers[i].attn.skip_margin(norm)[..., 0] <= 0  # [B, T]
            h = out[0] if isinstance(out, tuple) else out
            h = torch.where(execute[..., None], h, x)
            return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h

        return pre, post

    for i, layer in enumerate(ref.model.layers):
        pre, post = layer_hook(i)
        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.register_forward_hook(post, with_kwargs=True)
    with torch.no_grad():
        want = ref(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gumbel_masks_tied_with_gradient_to_the_attention_router():
    wm = build(tiny_model("llama"), _cfg())
    wm.freeze_base()
    ids = torch.randint(0, 101, (2, 10))
    torch.manual_seed(0)
    with wm.routing("gumbel", tau=1.0):
        out = wm(ids).logits
    a, f = wm.skip_rates()
    torch.testing.assert_close(a, f)
    (out.square().mean() + a.sum()).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in wm.routers[0].attn.parameters())
    assert all(p.grad is None for p in wm.routers[0].ffn.parameters())  # the FFN routers take no part


def test_meter_counts_the_layer_and_one_router():
    wm = build(tiny_model("llama"), _cfg())
    _randomise(wm)
    ids = torch.randint(0, 101, (2, 8))
    wm.start_meter()
    with torch.no_grad():
        wm(ids)
    s = wm.stop_meter()
    skip = torch.stack([(~m["attn"][..., 0]).double() for m in wm.last_masks])  # [L, B, T]
    assert s["attn_sparsity"] == pytest.approx(float(skip.mean()))
    assert s["ffn_sparsity"] == pytest.approx(float(skip.mean()))
    f = wm.meter.flops
    pos = torch.arange(8, dtype=torch.float64) + 1  # keys per position
    dense = saved = 0.0
    for layer in range(2):
        attn = f.attn_prunable_linear + f.attn_scores(pos)  # [T]
        dense += float((f.attn_dense_linear + attn + f.ffn).sum()) * 2
        saved += float((skip[layer] * (attn + f.ffn)).sum())
    dense += f.lm_head * 16
    saved -= f.routers_per_layer / 2 * 2 * 16  # one router per layer, 2 layers, 16 tokens
    assert s["flop_saving"] == pytest.approx(saved / dense)


@pytest.mark.slow
def test_calibration_reaches_target_and_reloads(tmp_path):
    from tests.train.test_calibrate import _dataset
    from wide.train.calibrate import TrainConfig, calibrate

    torch.manual_seed(0)
    ds = _dataset(n=64, seq=32)
    wm = build(tiny_model("llama"), _cfg(sparsity=0.4))
    tc = TrainConfig(steps=30, batch_size=8, seq_len=32, lr=2e-2, log_every=10, save_every=1000, fit_batches=4)
    calibrate(wm, ds, tc, tmp_path, progress=False)
    wm.detach()
    wm2 = load(tiny_model("llama"), tmp_path)
    assert isinstance(wm2, LayerSkipModel)
    for k, v in wm.routers.state_dict().items():
        assert torch.equal(v, wm2.routers.state_dict()[k]), k
    wm2.start_meter()
    with torch.no_grad():
        for i in range(0, 64, 16):
            b = ds.batch(list(range(i, i + 16)))
            wm2(b["input_ids"], attention_mask=b["attention_mask"])
    s = wm2.stop_meter()
    assert s["attn_sparsity"] == s["ffn_sparsity"]
    assert abs(s["attn_sparsity"] - 0.4) < 0.05, s
    wm2.detach()
    assert not wm2._tie_handles
