"""The kernel benchmark's code path (variants, routes, records, markdown) on the CPU, timing replaced.

GPU time is scarce: a bug in the sweep should fail here, not on the H200. The kernels run in Triton's
interpreter (fp32, tiny shapes); ``time_graph`` runs each call (one per input copy) once and reports 1 ms.
"""

from __future__ import annotations

import torch

from wide.bench import gemm_bench as gb
from wide.bench.kernels import _md


def test_bench_op_records_every_regime_and_variant(monkeypatch):
    calls = []

    def fake_time(fns):
        calls.extend(f() for f in fns)
        return 1.0

    monkeypatch.setattr(gb, "time_graph", fake_time)
    monkeypatch.setattr(gb, "time_variants", lambda lists: [fake_time(fns) for fns in lists])
    monkeypatch.setattr(gb, "copies_for", lambda nbytes: 2)  # rotation is exercised, interpreter time kept low
    monkeypatch.setattr(gb, "DECODE_MASK_DRAWS", 3)  # decode cycles more mask draws than input copies
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, kind, n, k, g, with_route in (
        ("q", "gemm_mn", 64, 48, 32, True),
        ("gate_up", "gemm_mn_swiglu", 64, 48, 16, True),
        ("down", "gemm_k", 40, 64, 16, False),
    ):
        rows += gb.bench_op(
            name, kind, n, k, g, with_route, [1, 20, 300], [0.5, 0.0], gen, True, device="cpu", dtype=torch.float32
        )
    assert all(isinstance(c, torch.Tensor) for c in calls)
    assert all(r["copies"] == 2 for r in rows)  # (Q leaves inactive heads uninitialised)
    draws = {r["M"]: r["mask_draws"] for r in rows}
    assert draws == {1: 3, 20: 2, 300: 2}
    variants = {(r["kind"], r["M"], r["variant"]) for r in rows}
    assert ("gemm_mn", 1, "dense") in variants and ("gemm_mn", 20, "sorted") in variants
    assert ("gemm_k", 1, "small") in variants and ("gemm_k", 300, "dense") in variants
    # every record names the path its plan took: forced variants take theirs, 'auto' the plan's choice
    assert all(r["path"] == r["variant"] for r in rows if r["variant"] != "auto")
    paths = {(r["kind"], r["M"], r["sparsity"]): r["path"] for r in rows if r["variant"] == "auto"}
    assert paths[("gemm_mn", 1, 0.5)] == "small" and paths[("gemm_mn", 20, 0.5)] == "dense"
    assert paths[("gemm_mn", 300, 0.5)] == "dense" and paths[("gemm_mn", 300, 0.0)] == "dense"  # G 32: < 0.55
    assert paths[("gemm_k", 1, 0.5)] == "small" and paths[("gemm_k", 300, 0.5)] == "dense"
    auto = [r for r in rows if r["variant"] == "auto"]
    assert {r["M"] for r in auto} == {1, 20, 300} and all(r["speedup"] == 1.0 for r in auto)
    # decode and mid-size routes skip the reorder; large M builds it
    assert {r["route_build"] for r in auto if r["M"] <= 256} == {"plan_route"}
    forced = gb.bench_op(  # bench/kernels/mn_dense_threshold.py: both paths forced at every point
        "q",
        "gemm_mn",
        64,
        48,
        32,
        True,
        [300],
        [0.3],
        gen,
        device="cpu",
        dtype=torch.float32,
        variants=["dense", "sorted"],
    )
    assert [(r["variant"], r["path"], r["route_build"]) for r in forced] == [
        ("dense", "dense", "plan_route"),
        ("sorted", "sorted", "reorder"),
    ]
    md = _md(rows, dict(gpu="cpu", versions={}, quick=False, wall_s=0.0, command="test"))
    assert "| q | 32 | 300 |" in md and "Forced paths at 50%" in md
