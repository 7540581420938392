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
