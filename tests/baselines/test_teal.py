"""TEAL-style thresholding: the requested fraction zeroed per site, its FLOP accounting, equality with
an explicit zeroing, the FLOP-matched target, the checkpoint round trip, and the calibration's quantile
and samples equal to torch.quantile and to the calibration as first written (host-side samples)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import tiny_model
from wide.baselines import build, calibrate_training_free, load
from wide.baselines.teal import HOOKS, SITES, TealModel, quantile, site_flops
from wide.config import WideConfig
from wide.model import CheckpointMismatchError, load_routers
from wide.train.data import TokenDataset


def _data(n=16, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 101, (n, t), generator=g)
    am = torch.ones(n, t, dtype=torch.bool)
    am[2, 9:] = False
    return TokenDataset(input_ids=ids, attention_mask=am)


def _cfg(**kw):
    return WideConfig(router_rank=8, method="teal", **kw)


@pytest.mark.parametrize("target", [0.3, 0.6])
def test_zeroes_the_requested_fraction_per_site(tmp_path, target):
    ds = _data()
    wm = build(tiny_model("llama"), _cfg(sparsity=target))
    assert isinstance(wm, TealModel)
    calibrate_training_free(wm, ds, tmp_path, batches=4, batch_size=4, seq_len=16)
    wm.start_meter()
    with torch.no_grad():
        b = ds.batch(list(range(16)))
        wm(b["input_ids"], attention_mask=b["attention_mask"])
    s = wm.stop_meter()
    assert s["tokens"] == int(ds.attention_mask.sum())
    for site in SITES:
        for frac in s["per_site"][site]:
            assert abs(frac - target) < 0.03, (site, s["per_site"])


def test_flop_accounting_and_explicit_zeroing():
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    wm = build(model, _cfg())
    with torch.no_grad():
        for r in wm.routers:  # nothing zeroed except the whole input of o_proj
            r.thresholds.copy_(torch.tensor([-1.0, float("inf"), -1.0, -1.0]))
        for lyr in ref.model.layers:
            lyr.self_attn.o_proj.weight.zero_()
    ids = torch.randint(0, 101, (2, 9))
    wm.start_meter()
    with torch.no_grad():
        got = wm(ids).logits
    s = wm.stop_meter()
    with torch.no_grad():
        torch.testing.assert_close(got, ref(ids).logits)
    f = wm.meter.flops
    pos = torch.arange(9, dtype=torch.float64) + 1
    per_token = (f.attn_dense_linear + f.attn_prunable_linear + f.attn_scores(pos) + f.ffn) * 2 + f.lm_head  # [T]
    dense = 2 * float(per_token.sum())  # 2 rows
    saved = 2 * 18 * site_flops(wm.dims)["o"]  # 2 layers × 18 tokens
    assert s["flop_saving"] == pytest.approx(saved / dense)
    o, qkv = site_flops(wm.dims)["o"], site_flops(wm.dims)["qkv"]
    assert s["attn_sparsity"] == pytest.approx(o / (o + qkv)) and s["ffn_sparsity"] == 0.0


def test_flops_target_and_checkpoint_round_trip(tmp_path):
    ds = _data()
    wm = build(tiny_model("llama"), _cfg(sparsity=0.4, sparsity_kind="flops"))
    summary = calibrate_training_free(wm, ds, tmp_path, batches=4, batch_size=4, seq_len=16)
    assert summary["fit"]["activation_fraction"] > 0.4  # K/V, lm_head and scores stay: more must be zeroed
    full = ds.batch(list(range(16)))
    full = {k: v[[0, 1, 3, 4, 5]] for k, v in full.items()}  # rows without padding: positions 0..15
    wm.start_meter()
    with torch.no_grad():
        want = wm(full["input_ids"], attention_mask=full["attention_mask"]).logits
    s = wm.stop_meter()
    assert abs(s["flop_saving"] - 0.4) < 0.03, s
    wm.detach()
    wm2 = load(tiny_model("llama"), tmp_path)
    assert isinstance(wm2, TealModel)
    for a, b in zip(wm.routers, wm2.routers):
        assert torch.equal(a.thresholds, b.thresholds)
    with torch.no_grad():
        torch.testing.assert_close(wm2(full["input_ids"], attention_mask=full["attention_mask"]).logits, want)
    with wm2.routing("dense"), torch.no_grad():
        dense = wm2(full["input_ids"]).logits
    assert not torch.allclose(dense, want)
    wm2.detach()
    with pytest.raises(CheckpointMismatchError, match="do not match"):
        load_routers(tiny_model("llama"), tmp_path)  # a TEAL checkpoint is not a router checkpoint


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 65537])
def test_quantile_equals_torch_quantile(n):
    g = torch.Generator().manual_seed(n)
    for v in (
        torch.rand(n, generator=g),
        torch.randn(n, generator=g).abs().bfloat16().float(),  # ties, as |x| of a bf16 model
        torch.randint(0, 3, (n,), generator=g).float(),  # mostly ties
    ):
        for q in (0.0, 0.16, 0.36, 0.5, 2 / 3, 0.999, 1.0, 3 / max(1, n - 1) if n > 3 else 0.25):
            assert torch.equal(quantile(v, q), torch.quantile(v, q)), (n, q)
    v = torch.rand(n, generator=g)
    v[n // 2] = float("nan")
    assert quantile(v, 0.3).isnan() and torch.quantile(v, 0.3).isnan()


def _reference_thresholds(wm: TealModel, batches, s: float, refine: int, max_samples: int, seed: int = 0):
    """The calibration as first written: |x| masked to the real tokens on the host, float32, sampled with the
    CPU generator, thresholds from torch.quantile. [L, 4] per pass."""
    gen = torch.Generator().manual_seed(seed)
    per_batch = max(1, max_samples // len(batches))
    state: dict = {}

    def capture(i, site):
        def pre(module, args):
            x, tm = args[0], state["mask"]
            v = x.abs()[tm].flatten().float()
            if v.numel() > per_batch:
                v = v[torch.randint(0, v.numel(), (per_batch,), generator=gen)]
            state["samples"].setdefault((i, site), []).append(v)

        return pre

    handles = [
        layer.get_submodule(path).register_forward_pre_hook(capture(i, site), prepend=True)
        for i, layer in enumerate(wm.model.model.layers)
        for site, path, records in HOOKS
        if records
    ]
    th = torch.zeros(len(wm.routers), len(SITES))
    for p in range(1 + refine):
        state["samples"] = {}
        with torch.no_grad(), wm.routing("dense" if p == 0 else "argmax"):
            for b in batches:
                state["mask"] = b["attention_mask"].bool()
                wm.hidden_states(b["input_ids"], attention_mask=b["attention_mask"])
        for (i, site), vals in state["samples"].items():
            th[i, SITES.index(site)] = float(torch.quantile(torch.cat(vals), s))
        for r, t in zip(wm.routers, th):
            r.thresholds.copy_(t)
    for h in handles:
        h.remove()
    return th


@pytest.mark.parametrize("max_samples", [1 << 22, 3000])  # every entry; a random sample of each batch
def test_calibrate_equals_reference(max_samples):
    ds = _data()
    batches = [ds.batch(list(range(k, k + 4))) for k in range(0, 16, 4)]  # the first holds the padded row
    wm = build(tiny_model("llama"), _cfg(sparsity=0.4))
    fit = wm.calibrate(batches, torch.device("cpu"), 16, refine=1, max_samples=max_samples, seed=3)
    got = torch.stack([r.thresholds for r in wm.routers])  # [L, 4]
    wm.detach()
    ref = build(tiny_model("llama"), _cfg(sparsity=0.4))
    want = _reference_thresholds(ref, batches, 0.4, refine=1, max_samples=max_samples, seed=3)
    assert torch.equal(got, want)
    assert fit["thresholds"] == {site: want[:, j].tolist() for j, site in enumerate(SITES)}
