"""bench/decode/plot_decode.py on the committed decode record: the series it draws and the figure file."""

from __future__ import annotations

import json
from pathlib import Path

from bench.decode import plot_decode

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "bench" / "results" / "decode" / "decode-h200.json"


def _plot_decode():
    return plot_decode


def test_series_pair_each_wide_line_with_its_dense_run(tmp_path):
    pd = _plot_decode()
    records = json.loads(RECORD.read_text())["records"]
    lines, dense = pd.series(records)
    assert {k[:2] for k in lines} == set(dense)  # every WIDE line has the same step's dense TPOT
    for pts in lines.values():
        levels = [s for s, _ in pts]
        # one point per level: rows of the other FFN router input are a line of their own, not a zigzag
        assert levels == sorted(set(levels)) and all(0 <= s < 1 for s in levels)
    assert {k[2] for k in lines} == {r.get("ffn_router_source", "block") for r in records if r.get("variant") == "wide"}
    # the per-kind row (attn / ffn rates differ) is not a point of the shared-level lines
    assert sum(len(v) for v in lines.values()) < sum(1 for r in records if r.get("variant") == "wide")
    assert pd.main([str(RECORD), "--out", str(tmp_path / "d.png")]) == 0
    assert (tmp_path / "d.png").stat().st_size > 10_000


def test_group_sizes_are_lines_of_their_own(tmp_path):
    """Rows of another FFN group size (bench_decode.py --ffn-group-sizes 128,32) are a line of their own."""
    pd = _plot_decode()
    records = [{"kind": "tpot", "variant": "dense", "fused": True, "B": 1, "sparsity": 0.0, "tpot_ms": 4.0}]
    for g, ms in ((128, 3.0), (32, 3.5)):
        records += [{"kind": "tpot", "variant": "wide", "fused": True, "B": 1, "sparsity": s, "tpot_ms": ms - s,
                     "ffn_group_size": g} for s in (0.25, 0.5)]  # fmt: skip
    lines, _ = pd.series(records)
    assert set(lines) == {(True, 1, "block", 128), (True, 1, "block", 32)}
    assert lines[(True, 1, "block", 32)] == [(0.25, 3.25), (0.5, 3.0)]
    rec = tmp_path / "d.json"
    rec.write_text(json.dumps({"records": records}))
    assert pd.main([str(rec), "--out", str(tmp_path / "g.png")]) == 0


def test_no_rows_is_a_clear_error(tmp_path, capsys):
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"records": [{"kind": "tpot", "variant": "dense", "tpot_ms": 1.0, "B": 1}]}))
    assert _plot_decode().main([str(empty), "--out", str(tmp_path / "e.png")]) == 2
    assert "no WIDE TPOT rows" in capsys.readouterr().err
