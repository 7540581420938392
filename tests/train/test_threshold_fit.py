"""Argmax threshold fit: each mode lands the argmax skip rates where it promises."""

from __future__ import annotations

import pytest
import torch

from wide.train.threshold_fit import _overall, _rates, fit_offsets


def _synthetic(layers=3, n=20_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    margins, expected = {}, {}
    for i in range(layers):
        for k, shift in (("attn", -0.5 + 0.3 * i), ("ffn", -1.5 + 0.2 * i)):
            margins[(i, k)] = torch.randn(n, generator=g) + shift
            expected[(i, k)] = 0.2 + 0.1 * i + (0.1 if k == "attn" else 0.0)
    return margins, expected


def test_router_mode_matches_every_router():
    m, e = _synthetic()
    r = _rates(m, fit_offsets(m, e, "router"))
    for key in m:
        assert r[key] == pytest.approx(e[key], abs=2e-3)


def test_kind_mode_matches_each_kind_mean():
    m, e = _synthetic()
    d = fit_offsets(m, e, "kind")
    assert len({d[k] for k in m if k[1] == "attn"}) == 1 and len({d[k] for k in m if k[1] == "ffn"}) == 1
    r = _rates(m, d)
    for kind in ("attn", "ffn"):
        keys = [k for k in m if k[1] == kind]
        assert sum(r[k] for k in keys) / 3 == pytest.approx(sum(e[k] for k in keys) / 3, abs=2e-3)


def test_global_mode_matches_overall_rate_with_one_offset():
    m, e = _synthetic()
    d = fit_offsets(m, e, "global")
    assert len(set(d.values())) == 1
    assert _overall(_rates(m, d)) == pytest.approx(_overall(e), abs=2e-3)


def test_none_mode_and_bad_mode():
    m, e = _synthetic()
    assert set(fit_offsets(m, e, "none").values()) == {0.0}
    with pytest.raises(ValueError, match="fit mode"):
        fit_offsets(m, e, "layer")


def _tiny_wm():
    from tests.conftest import tiny_model
    from wide.config import WideConfig
    from wide.model import WideModel

    return WideModel(tiny_model("llama"), WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.4))


def test_fit_targets_the_rates_under_the_offsets_training_sampled_with():
    """Stage 2 trains routers that carry the stage-1 fit's offsets: the fit's target is the Gumbel-time
    rate with those offsets in the margin, not with the offsets at zero (docs/design.md#threshold-fit)."""
    from wide.train.threshold_fit import collect_margins, fit_thresholds, skip_biases

    torch.manual_seed(0)
    wm = _tiny_wm()
    batches = [{"input_ids": torch.randint(0, 101, (4, 16)), "attention_mask": torch.ones(4, 16, dtype=torch.bool)}]
    for i, r in enumerate(wm.routers):
        r.attn.skip_bias.fill_(1.0 + 0.5 * i)
        r.ffn.skip_bias.fill_(-0.5)
    trained = skip_biases(wm)
    torch.manual_seed(1)  # the same Gumbel routes (they shape later layers' inputs) in both passes
    m0, p0 = collect_margins(wm, batches, torch.device("cpu"))  # margins at offset 0 (this zeroes the offsets)
    for key, d in trained.items():
        getattr(wm.routers[key[0]], key[1]).skip_bias.fill_(d)
    torch.manual_seed(1)
    fit = fit_thresholds(wm, batches, torch.device("cpu"), "router", trained)
    for (i, k), d in trained.items():
        want = torch.sigmoid(m0[(i, k)] + d).mean().item()
        assert fit["expected_gumbel_skip"][f"{k}{i}"] == pytest.approx(want, abs=1e-5)
        assert abs(want - p0[(i, k)]) > 0.05  # the offsets matter: a fit at offset 0 would aim elsewhere
        assert fit["argmax_skip_after"][f"{k}{i}"] == pytest.approx(want, abs=0.05)  # 64 tokens: coarse steps
        assert fit["trained_skip_bias"][f"{k}{i}"] == d


def test_trained_bias_round_trips_through_the_fit_record():
    from wide.train.threshold_fit import trained_bias_of

    assert trained_bias_of(None) is None and trained_bias_of({"mode": "kind"}) is None
    got = trained_bias_of({"trained_skip_bias": {"attn0": 0.5, "ffn0": -1.0, "attn12": 2.0, "ffn12": 0.0}})
    assert got == {(0, "attn"): 0.5, (0, "ffn"): -1.0, (12, "attn"): 2.0, (12, "ffn"): 0.0}
