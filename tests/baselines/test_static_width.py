"""Static width pruning: the score, exact group counts, equality with explicit weight slicing, the
FLOP-matched target, and the checkpoint round trip."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from tests.conftest import tiny_model
from wide.baselines import build, calibrate_training_free, load
from wide.baselines.static_width import (
    StaticWidthMeter,
    compensation,
    group_scores,
    input_stats,
    select_removed,
    set_constant_routes,
    static_weights,
)
from wide.config import WideConfig
from wide.train.data import TokenDataset

G = 16  # FFN group size of the tiny model (D' 128: 8 groups); attention: 2 GQA groups of 2 heads


def _data(n=16, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 101, (n, t), generator=g)
    am = torch.ones(n, t, dtype=torch.bool)
    am[3, 10:] = False  # padding must not count
    return TokenDataset(input_ids=ids, attention_mask=am)


def _cfg(**kw):
    return WideConfig(ffn_group_size=G, router_rank=8, method="static-width", **kw)


def test_scores_match_a_hand_computation():
    model = tiny_model("llama")
    ds = _data(n=4)
    batch = ds.batch([0, 1, 2, 3])
    # hand: inputs of o_proj / down_proj of the dense model over the real tokens
    acts = {}
    hs = [
        lyr.self_attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: acts.__setitem__(("o", i), a[0].detach()))
        for i, lyr in enumerate(model.model.layers)
    ] + [
        lyr.mlp.down_proj.register_forward_pre_hook(lambda m, a, i=i: acts.__setitem__(("d", i), a[0].detach()))
        for i, lyr in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(batch["input_ids"], attention_mask=batch["attention_mask"])
    for h in hs:
        h.remove()
    wm = build(model, _cfg())
    attn, ffn = group_scores(wm, [batch], torch.device("cpu"))
    keep = batch["attention_mask"]
    for i, lyr in enumerate(model.model.layers):
        for key, proj, width, got in (("o", lyr.self_attn.o_proj, 32, attn), ("d", lyr.mlp.down_proj, G, ffn)):
            mean_abs = acts[(key, i)][keep].abs().double().mean(0)  # [C]
            per_channel = mean_abs * proj.weight.double().norm(dim=0)
            torch.testing.assert_close(got[i], per_channel.view(-1, width).sum(-1))


def test_select_removed_global_and_uniform():
    scores = torch.tensor([[5.0, 1.0, 3.0, 7.0], [0.5, 6.0, 2.0, 4.0]])
    glob = select_removed(scores, 0.5, "global")
    assert glob.tolist() == [[False, True, True, False], [True, False, True, False]]
    uni = select_removed(scores, 0.25, "uniform")
    assert uni.tolist() == [[False, True, False, False], [True, False, False, False]]
    with pytest.raises(ValueError, match="allocation"):
        select_removed(scores, 0.5, "random")


def test_select_removed_standardized_ranks_within_layer_scales():
    """Layer 1's scores are 100x layer 0's: a raw global ranking strips layer 0 whole, the standardised one
    takes each layer's weakest groups (FLAP's per-layer standardisation)."""
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0], [100.0, 400.0, 300.0, 200.0]])
    assert select_removed(scores, 0.5, "global")[0].all()
    std = select_removed(scores, 0.5, "standardized")
    assert std.tolist() == [[True, True, False, False], [True, False, False, True]]
    assert select_removed(scores, 0.5).tolist() == std.tolist()  # the default


def test_constant_routes_hold_in_every_mode():
    wm = build(tiny_model("llama"), _cfg())
    skip = torch.tensor([True, False, True, True, False, False, True, False])
    set_constant_routes(wm.routers[0].ffn, skip)
    x = torch.randn(4, 5, 64) * 10
    assert torch.equal(wm.routers[0].ffn(x, "argmax"), (~skip).expand(4, 5, 8))
    torch.manual_seed(0)
    assert torch.equal(wm.routers[0].ffn(x, "gumbel", tau=0.5).bool(), (~skip).expand(4, 5, 8))


def _slice(model, wm):
    """A copy of model with the removed groups' weights physically cut out."""
    ref = copy.deepcopy(model)
    hd, gqa = wm.dims.head_dim, wm.dims.gqa_group
    for i, lyr in enumerate(ref.model.layers):
        keep_a = wm.routers[i].attn.skip_margin(torch.zeros(1, 64))[0] <= 0  # [N_attn]
        keep_f = wm.routers[i].ffn.skip_margin(torch.zeros(1, 64))[0] <= 0  # [N_ffn]
        q_rows = keep_a.repeat_interleave(gqa * hd)
        kv_rows = keep_a.repeat_interleave(hd)
        f_rows = keep_f.repeat_interleave(G)
        at, mlp = lyr.self_attn, lyr.mlp

        def cut(lin, rows=None, cols=None):
            w = lin.weight.data
            w = w[rows] if rows is not None else w
            w = w[:, cols] if cols is not None else w
            new = nn.Linear(w.shape[1], w.shape[0], bias=False)
            new.weight.data = w.clone()
            return new

        at.q_proj, at.k_proj, at.v_proj = cut(at.q_proj, q_rows), cut(at.k_proj, kv_rows), cut(at.v_proj, kv_rows)
        at.o_proj = cut(at.o_proj, cols=q_rows)
        mlp.gate_proj, mlp.up_proj = cut(mlp.gate_proj, f_rows), cut(mlp.up_proj, f_rows)
        mlp.down_proj = cut(mlp.down_proj, cols=f_rows)
    return ref


def test_static_width_equals_explicit_weight_slicing(tmp_path):
    model = tiny_model("llama")
    original = copy.deepcopy(model)
    wm = build(model, _cfg(sparsity=0.5))
    assert isinstance(wm.meter, StaticWidthMeter)
    summary = calibrate_training_free(wm, _data(), tmp_path, batches=2, batch_size=4, seq_len=16, allocation="uniform")
    fit = summary["fit"]
    assert fit["removed_groups"] == {"attn": 2, "ffn": 8}  # uniform: 1 of 2 and 4 of 8 per layer
    assert fit["bias_compensation"] is False  # the default
    ref = _slice(original, wm)
    ids = torch.randint(0, 101, (2, 12))
    with torch.no_grad():
        got, want = wm(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the reloaded checkpoint routes the same way
    wm.detach()
    wm2 = load(tiny_model("llama"), tmp_path)
    assert isinstance(wm2.meter, StaticWidthMeter) and wm2.config.method == "static-width"
    with torch.no_grad():
        torch.testing.assert_close(wm2(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_compensation_is_the_removed_channels_mean_output():
    model = tiny_model("llama")
    wm = build(model, _cfg())
    batch = _data(n=4).batch([0, 1, 2, 3])
    stats = input_stats(wm, [batch], torch.device("cpu"))
    removed = {"attn": torch.tensor([[True, False], [False, False]]), "ffn": torch.zeros(2, 8, dtype=torch.bool)}
    removed["ffn"][1, [0, 5]] = True
    b = compensation(wm, stats, removed)
    w_o, w_d = model.model.layers[0].self_attn.o_proj.weight.double(), model.model.layers[1].mlp.down_proj.weight
    torch.testing.assert_close(b["attn"][0], w_o[:, :32] @ stats["attn"][1][0, :32])  # group 0: heads 0-1
    assert torch.equal(b["attn"][1], torch.zeros(64, dtype=torch.float64))  # nothing removed there
    cols = torch.cat([torch.arange(0, 16), torch.arange(80, 96)])
    torch.testing.assert_close(b["ffn"][1], w_d.double()[:, cols] @ stats["ffn"][1][1, cols])


def test_bias_compensation_equals_slicing_plus_a_bias_and_is_served(tmp_path, monkeypatch):
    """With FLAP's compensation the pruned model is the sliced model whose O / down projections carry the
    bias; the checkpoint keeps it, and the kernel runtime serves it (CPU torch path: the masked logits)."""
    from wide.runtime import WideRuntime

    model = tiny_model("llama")
    original = copy.deepcopy(model)
    wm = build(model, _cfg(sparsity=0.5))
    summary = calibrate_training_free(
        wm, _data(), tmp_path, batches=2, batch_size=4, seq_len=16, allocation="uniform", compensate=True
    )
    assert summary["fit"]["bias_compensation"] is True
    ref = _slice(original, wm)
    for i, lyr in enumerate(ref.model.layers):
        for proj, router in ((lyr.self_attn.o_proj, wm.routers[i].attn), (lyr.mlp.down_proj, wm.routers[i].ffn)):
            assert router.out_bias.abs().max() > 0
            proj.bias = nn.Parameter(router.out_bias.clone())
    ids = torch.randint(0, 101, (2, 12))
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(wm(ids).logits, want, rtol=1e-5, atol=1e-5)
        with wm.routing("dense"):  # routing off: no bias either
            torch.testing.assert_close(wm(ids).logits, original(ids).logits)
    wm.detach()
    wm2 = load(tiny_model("llama"), tmp_path)
    with torch.no_grad():
        got = wm2(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.testing.assert_close(WideRuntime(wm2, max_batch=2, max_seq=16).score(ids), got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", [0.25, 0.5])
def test_flops_target_is_met_on_the_meter(tmp_path, target):
    wm = build(
        tiny_model("llama", inter=512),
        WideConfig(ffn_group_size=G, router_rank=8, method="static-width", sparsity=target, sparsity_kind="flops"),
    )
    summary = calibrate_training_free(wm, _data(), tmp_path, batches=2, batch_size=4, seq_len=16)
    w = static_weights(wm, 16)
    # granularity: one attention group or one FFN group of the whole model
    tol = max(w.attn + w.kv, w.ffn / 32) + 1e-9
    assert abs(summary["fit"]["flop_saving_at_seq_len"] - target) <= tol
    ids = torch.randint(0, 101, (2, 16))
    wm.start_meter()
    with torch.no_grad():
        wm(ids)
    s = wm.stop_meter()
    assert s["flop_saving"] == pytest.approx(summary["fit"]["flop_saving_at_seq_len"], rel=1e-9)
    assert abs(s["flop_saving"] - target) <= tol
    # attention and FFN remove the same fraction of their groups
    assert abs(s["attn_sparsity"] - s["ffn_sparsity"]) <= 0.5 / 2 + 1e-9


def test_groups_target_hits_exact_counts(tmp_path):
    wm = build(tiny_model("llama"), _cfg(attn_sparsity=0.25, ffn_sparsity=0.5))
    calibrate_training_free(wm, _data(), tmp_path, batches=1, batch_size=4, seq_len=16)
    wm.start_meter()
    with torch.no_grad():
        wm(torch.randint(0, 101, (1, 8)))
    s = wm.stop_meter()
    assert s["attn_sparsity"] == pytest.approx(0.25) and s["ffn_sparsity"] == pytest.approx(0.5)


def test_static_checkpoint_served_by_the_runtime_equals_the_masked_path(tmp_path):
    from wide.runtime import WideRuntime

    wm = build(tiny_model("llama"), _cfg(sparsity=0.5))
    calibrate_training_free(wm, _data(), tmp_path, batches=2, batch_size=4, seq_len=16)
    wm.detach()
    wm = load(tiny_model("llama"), tmp_path)
    ids = torch.randint(0, 101, (2, 12))
    with torch.no_grad():
        want = wm(ids).logits
    got = WideRuntime(wm, max_batch=2, max_seq=16, routed=True).score(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
