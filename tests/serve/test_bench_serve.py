"""`wide bench serve`'s harness on the CPU at tiny shapes (the GPU run's smoke test)."""

from __future__ import annotations

import json

import pytest
import torch

from wide.bench.serve import WORKLOADS, run_serve_bench, shipped_rates


def test_workloads_are_seeded_and_within_their_bounds():
    for wl in WORKLOADS.values():
        a, b = wl.draw(64, seed=3), wl.draw(64, seed=3)
        assert a == b and a != wl.draw(64, seed=4)
        assert all(wl.prompt[2] <= p <= wl.prompt[3] and wl.output[2] <= o <= wl.output[3] for p, o in a)


def test_shipped_rates_come_from_the_checkpoint():
    attn, ffn = shipped_rates()
    assert 0.2 < attn < 0.9 and 0.2 < ffn < 0.9 and attn != ffn


@pytest.mark.slow
def test_smoke_run_writes_every_kind_of_row(tmp_path):
    rows = run_serve_bench(
        str(tmp_path), smoke=True, device="cpu", dtype=torch.float32, workloads=("chat",), concurrency=(1, 2)
    )
    kinds = {r["kind"] for r in rows}
    assert kinds == {"engine", "bare_step", "hf", "batch_dependence"}
    engine = [r for r in rows if r["kind"] == "engine"]
    assert {(r["variant"], r["concurrency"]) for r in engine} == {
        (v, c) for v in ("dense", "wide50", "shipped_rates") for c in (1, 2)
    }
    for r in engine:
        assert r["requests"] >= 4 and r["output_tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0
        if r["variant"] == "dense":
            assert r["bytes_dense_over_own"] == 1.0 and r["attn_sparsity"] is None
        else:  # WIDE reads fewer bytes than dense: its limit is above 1, and it ran sparse
            assert r["byte_limit"] > 1.0 and 0 < r["attn_sparsity"] < 1 and r["speedup_vs_dense"] > 0
    assert "error" not in next(r for r in rows if r["kind"] == "hf")
    dep = [r for r in rows if r["kind"] == "batch_dependence"]
    assert [r["batch_invariant"] for r in dep] == [False, True] and all(0 <= r["changed"] <= r["requests"] for r in dep)
    saved = json.loads((tmp_path / "serve-chat-cpu.json").read_text())
    assert saved["records"] == rows and (tmp_path / "serve-chat-cpu.md").read_text().startswith("# Serving engine")
