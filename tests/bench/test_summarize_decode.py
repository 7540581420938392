"""bench/decode/summarize_decode.py: the fused decode issue's targets checked against decode records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.decode import summarize_decode

ROOT = Path(__file__).resolve().parents[2]
RECORDS = [ROOT / "bench" / "results" / "decode" / f"decode-{card}.json" for card in ("h200", "h100")]


def _row(variant, B, ms, sparsity=0.0, fused=True, dense_fused_ms=None, **extra):
    r = {"kind": "tpot", "variant": variant, "B": B, "sparsity": sparsity, "fused": fused, "tpot_ms": ms,
         "kernels_per_layer": 4 if variant == "dense" else 6, "tb_per_s": 15.5 / ms}  # fmt: skip
    r["tpot_speedup_vs_dense_fused"] = (dense_fused_ms or ms) / ms
    return r | extra


def _record(tmp_path: Path, device: str, rows: list[dict]) -> Path:
    p = tmp_path / "decode.json"
    p.write_text(json.dumps({"meta": {"device": device, "command": "bench"}, "records": rows}))
    return p


def _lines(sd, path: Path) -> dict[str, str]:
    """target label + setting -> the row's 'met' cell."""
    out = {}
    for line in sd.summarize(path):
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] != "target":
            out[f"{cells[0]} [{cells[1]}]"] = cells[3]
    return out


def test_met_and_missed_follow_the_numbers(tmp_path):
    sd = summarize_decode
    rows = [_row("dense", 1, 3.9), _row("dense", 1, 4.2, fused=False, dense_fused_ms=3.9)]
    rows += [_row("wide", 1, 2.3, 0.5, dense_fused_ms=3.9, measured_attn_union_run=0.5, measured_ffn_union_run=0.5)]
    rows += [_row("wide", 1, 2.0, 0.7, dense_fused_ms=3.9), _row("wide", 1, 4.1, 0.0, dense_fused_ms=3.9)]
    rows += [_row("wide", 1, 2.0, 0.5, dense_fused_ms=3.9, ffn_group_size=32)]  # another setting: its own rows
    cells = _lines(sd, _record(tmp_path, "NVIDIA H200", rows))
    assert cells["dense TPOT ≤ 4.0 ms (≥ 3.9 TB/s) [–]"] == "✓"
    assert cells["WIDE 50% ≥ 1.6× dense, ≤ 2.4 ms [block]"] == "✓"  # 3.9 / 2.3 = 1.70×, 2.3 ms
    assert cells["WIDE 70% ≥ 2.0× [block]"] == "✗"  # 1.95×
    assert cells["WIDE 0% ≥ 0.98× [block]"] == "✗"  # 0.951×
    assert cells["WIDE 50% ≥ 1.6× dense, ≤ 2.4 ms [block, G 32]"] == "✓"
    assert cells["WIDE 70% ≥ 2.0× [block, G 32]"] == "–"  # not in the record
    assert cells["B 1: fused dense at least as fast as the compiled unfused (cuBLAS) step [–]"] == "✓"
    assert cells["≤ 6 launches per decoder layer [all]"] == "✓"
    # another card: the absolute targets are not judged, the ratios are
    cells = _lines(sd, _record(tmp_path, "NVIDIA H100 80GB HBM3", rows))
    assert cells["dense TPOT ≤ 4.0 ms (≥ 3.9 TB/s) [–]"] == "–"
    assert cells["WIDE 0% ≥ 0.98× [block]"] == "✗"


def test_committed_records_and_bad_input(tmp_path, capsys):
    sd = summarize_decode
    out = tmp_path / "t.md"
    assert sd.main([*map(str, RECORDS), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.count("### ") == len(RECORDS) and "≤ 6 launches per decoder layer | all | at most 6 | ✓" in text
    bad = tmp_path / "x.json"
    bad.write_text("[]")
    with pytest.raises(SystemExit, match="not a bench_decode.py record"):
        sd.main([str(bad)])
    with pytest.raises(SystemExit):
        sd.main([str(tmp_path / "missing.json")])
