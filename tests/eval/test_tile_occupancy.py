from __future__ import annotations

import pytest
import torch

from wide.eval.tile_occupancy import occupancy_report, shuffled_like, tile_occupancy


def test_tile_occupancy_counts_tiles_with_an_active_row():
    mask = torch.zeros(10, 2, dtype=torch.bool)
    mask[0, 0] = True  # tile 0 (rows 0-3) runs group 0 only
    mask[9, 1] = True  # tile 2 (rows 8-9, padded) runs group 1 only
    assert tile_occupancy(mask, rows=4) == pytest.approx(2 / 6)
    order = torch.tensor([9, 1, 2, 3, 4, 5, 6, 7, 8, 0])  # rows 9 and 0 swapped: same tiles, other groups
    assert tile_occupancy(mask, rows=4, order=order) == pytest.approx(2 / 6)
    assert tile_occupancy(torch.ones(5, 3, dtype=torch.bool), rows=2) == 1.0
    with pytest.raises(ValueError):
        tile_occupancy(torch.ones(2, 2, 2, dtype=torch.bool))


def test_correlated_rows_leave_whole_tiles_idle():
    # runs of 64 equal rows (what correlated routing looks like): natural-order tiles already skip
    g = torch.Generator().manual_seed(0)
    runs = torch.rand(32, 8, generator=g) < 0.5
    mask = runs.repeat_interleave(64, dim=0)  # [2048, 8]
    r = occupancy_report(mask, rows=64, generator=g)
    assert r["natural"] == pytest.approx(r["active"])
    assert r["ordered"] <= r["natural"] + 1e-6
    assert r["iid_natural"] > 0.99  # shuffled: every tile has every group
    assert r["active"] < r["iid_ordered"] < r["iid_natural"]


def test_shuffled_like_keeps_group_rates():
    mask = torch.rand(500, 6, generator=torch.Generator().manual_seed(1)) < torch.linspace(0.1, 0.9, 6)
    s = shuffled_like(mask, torch.Generator().manual_seed(2))
    assert torch.equal(s.sum(0), mask.sum(0)) and not torch.equal(s, mask)
