"""bench.decode.long_context --smoke: the grid's code path on a tiny model on the CPU (timings there mean nothing),
its records, the summariser's table and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.decode import long_context as LC
from bench.decode import summarize_long_context as S

pytestmark = pytest.mark.slow  # a model build and a subprocess run: tens of seconds
ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("variant", "B", "ctx", "sparsity", "tpot_ms", "tpot_speedup", "byte_limit", "card", "commit", "torch")


def _smoke_grid(out: Path, *args: str) -> list[dict]:
    """One smoke run (B 2, 40 cached keys, 24-token prompts, 50%) in a process of its own on the torch references
    (no interpreter: the kernels' own tests cover them; this covers the driver) -> its rows."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    cmd = [sys.executable, "-m", "bench.decode.long_context", "--smoke", "--out", str(out), "--batches", "2",
           "--contexts", "40", "--prompts", "24", "--sparsities", "0.5", "--budget-s", "3600", *args]  # fmt: skip
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads((out / "long-context-cpu.json").read_text())


@pytest.fixture(scope="module")
def smoke_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("lc")
    return out, _smoke_grid(out, "--shipped", "smollm2-135m-s50")


def test_smoke_grid_records(smoke_rows):
    out, rows = smoke_rows
    tpot = [r for r in rows if r["kind"] == "tpot"]
    assert [r["level"] for r in tpot] == ["dense", "wide 50%", "shipped smollm2-135m-s50"]
    assert all("error" not in r for r in rows), [r.get("error") for r in rows]
    for r in tpot:
        assert all(r.get(k) is not None for k in FIELDS), r
        assert r["byte_limit"] == pytest.approx(r["dense_bytes"] / r["bytes_read"])
        assert r["bytes_weights"] + r["bytes_kv"] == r["bytes_read"]
    dense, wide = tpot[0], tpot[1]
    assert dense["tpot_speedup"] == 1.0 and dense["byte_limit"] == 1.0
    # the K/V a routed step reads: the dense step's times the fraction of (token, group) pairs that ran
    assert wide["bytes_kv"] == pytest.approx(dense["bytes_kv"] * wide["measured_attn_token_run"], rel=1e-6)
    assert wide["tpot_speedup"] == pytest.approx(dense["tpot_ms"] / wide["tpot_ms"])


def test_shipped_rates_are_read_from_the_checkpoint(smoke_rows):
    _, rows = smoke_rows
    cfg = json.loads((LC.CHECKPOINTS / "smollm2-135m-s50" / "wide_config.json").read_text())
    fit = cfg["training"]["skip_bias_fit"]["argmax_skip_after"]
    attn = [v for k, v in fit.items() if k.startswith("attn")]
    row = next(r for r in rows if r["level"] == "shipped smollm2-135m-s50")
    assert row["attn_rate"] == pytest.approx(sum(attn) / len(attn), abs=1e-4)
    assert "smollm2-135m-s50" in row["rates_from"]


def test_smoke_ttft_rows(smoke_rows):
    _, rows = smoke_rows
    ttft = {r["level"]: r for r in rows if r["kind"] == "ttft"}
    assert set(ttft) == {"dense", "wide 50%"}
    assert ttft["wide 50%"]["ttft_speedup"] == pytest.approx(ttft["dense"]["ttft_ms"] / ttft["wide 50%"]["ttft_ms"])
    assert all(r["attention_share"] > 0 for r in ttft.values())


def test_summary_table_and_plot(smoke_rows, tmp_path):
    out, rows = smoke_rows
    md = (out / "long-context-cpu.md").read_text()
    assert "Command: `python -m bench.decode.long_context --smoke" in md
    assert md.count("| 2 | 40 |") == 3  # one line per decode row
    png = tmp_path / "plot.png"
    assert S.main([str(out / "long-context-cpu.json"), "--md", str(tmp_path / "t.md"), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0


def test_summarizer_rejects_another_record(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"records": []}))
    assert S.main([str(bad)]) == 2
    assert "not a bench.decode.long_context record" in capsys.readouterr().err


def test_budget_spent_rows_are_recorded(tmp_path):
    LC.main(["--smoke", "--out", str(tmp_path), "--batches", "1", "--contexts", "16", "--prompts", "",
             "--sparsities", "", "--shipped", "", "--budget-s", "0"])  # fmt: skip
    rows = json.loads((tmp_path / "long-context-cpu.json").read_text())
    assert [r["error"] for r in rows] == ["skipped: time budget spent"]


def test_a_cache_the_card_cannot_hold_is_a_skipped_row(monkeypatch):
    """Llama-3.1-8B, B 16 at 32k: L*B*S*Hk*d*2*2 bytes of cache, more than an 80 GB card holds beside the
    weights: fits() says why."""
    shape = LC.LLAMA_8B
    nbytes = LC.cache_bytes(shape, 16, 32768, 2)
    assert nbytes == 32 * 16 * 32768 * 8 * 128 * 2 * 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (63 << 30, 80 << 30))
    monkeypatch.setattr(LC, "card_tag", lambda: "h100")
    why = LC.fits(nbytes)
    assert why is not None and "68.7 GB" in why and "h100" in why
    assert LC.fits(LC.cache_bytes(shape, 4, 32768, 2)) is None


def test_rules_timed_from_long_context():
    assert LC.rules_for(16384, ["long", "short"]) == ["long", "short"]
    assert LC.rules_for(4096, ["long", "short"]) == ["short"]


def test_unknown_rule_is_a_one_line_error():
    with pytest.raises(SystemExit, match="unknown split rule"):
        LC.parse_config(["--rules", "fast"])


def test_cells_timed_in_both_cache_layouts(tmp_path):
    """--kv-layouts nhd,hnd: every cell's rows in both layouts, each ratio against its own layout's dense row and
    against the library's default (nhd) dense row; the summary marks the head-major rows as not default."""
    rows = _smoke_grid(tmp_path, "--shipped", "", "--kv-layouts", "nhd,hnd")
    tpot = {(r["kv_layout"], r["level"]): r for r in rows if r["kind"] == "tpot"}
    assert set(tpot) == {(lay, lv) for lay in ("nhd", "hnd") for lv in ("dense", "wide 50%")}
    assert [r["default_layout"] for r in tpot.values()] == [True, True, False, False]
    hnd = tpot[("hnd", "wide 50%")]
    assert hnd["tpot_speedup"] == pytest.approx(tpot[("hnd", "dense")]["tpot_ms"] / hnd["tpot_ms"])
    assert hnd["tpot_speedup_vs_default_dense"] == pytest.approx(tpot[("nhd", "dense")]["tpot_ms"] / hnd["tpot_ms"])
    assert hnd["byte_limit"] == pytest.approx(tpot[("nhd", "wide 50%")]["byte_limit"])  # same bytes either way
    assert {(r["kv_layout"], r["level"]) for r in rows if r["kind"] == "ttft"} == set(tpot)
    md = (tmp_path / "long-context-cpu.md").read_text()
    assert md.count("short, hnd cache (not default)") == 2 and "wide 50%, hnd cache" in md


def test_unknown_layout_is_a_one_line_error():
    with pytest.raises(SystemExit, match="--kv-layouts"):
        LC.parse_config(["--kv-layouts", "bhsd"])
