"""bench/kernels/tune_fused_decode.py --smoke: every case checks its kernel against the fp32 reference through the
interpreter on a CPU; with --once a configuration is checked and not timed (the run a profiler wraps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
triton = pytest.importorskip("triton")


def _run(tmp_path: Path, *args: str) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    cmd = [sys.executable, "-m", "bench.kernels.tune_fused_decode", "--smoke", "--batches", "2", "--out",
           str(tmp_path), *args]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads((tmp_path / "fused-tune-cpu.json").read_text())["records"]


def test_down_and_ffn_checked_once_not_timed(tmp_path):
    recs = _run(tmp_path, "--once", "--kernels", "ffn,down", "--grid", "[{}]")
    assert [(r["kernel"], r["routed"]) for r in recs] == [("ffn", False), ("ffn", True), ("down", False),
                                                          ("down", True)]  # fmt: skip
    assert all(r["err_ok"] and "ms" not in r and r["cublas_ms"] is None for r in recs)
    down = {r["routed"]: r for r in recs if r["kernel"] == "down"}
    assert down[True]["bytes"] < down[False]["bytes"]  # groups no token runs are not read


def test_timed_run_records_times(tmp_path):
    recs = _run(tmp_path, "--kernels", "down", "--grid", '[{"o_splits": 2}]')
    assert len(recs) == 2 and all(r["err_ok"] and r["ms"] > 0 and r["cublas_ms"] > 0 for r in recs)


def test_unfused_halves_and_predicated_loops_are_checked(tmp_path):
    """The FFN's halves through the unfused kernels, and the predicated K loops (``compact_k=0``; the rule
    compacts), pass the check."""
    recs = _run(tmp_path, "--once", "--kernels", "gateup-unfused,down-unfused,ffn", "--grid",
                '[{}, {"compact_k": 0, "down_block_k": 16, "down_stages": 2}]')  # fmt: skip
    assert len(recs) == 12 and all(r["err_ok"] for r in recs), [r for r in recs if not r.get("err_ok")]
    half = {(r["kernel"], r["routed"]): r["bytes"] for r in recs}
    assert half["gateup-unfused", True] < half["gateup-unfused", False]  # groups no token runs are not read
    assert half["gateup-unfused", False] == 2 * half["down-unfused", False]  # gate and up: two D' x D matrices


@pytest.mark.parametrize("skip", ["0", "1"])
def test_skip_sets_the_routed_draw(tmp_path, skip):
    """--skip: every group runs (0: the routed case reads the dense bytes) or none does (1: no weight bytes),
    and both pass the check (QKV with no Q head running: its K/V rows); the records carry the rate. Out of [0, 1]: a
    one-line error."""
    recs = _run(tmp_path, "--once", "--kernels", "ffn,o,qkv", "--grid", "[{}]", "--skip", skip)
    assert all(r.get("err_ok") for r in recs), [r for r in recs if not r.get("err_ok")]
    assert {r["skip"] for r in recs if r["routed"]} == {float(skip)}
    by = {(r["kernel"], r["routed"]): r["bytes"] for r in recs}
    for k in ("ffn", "o"):
        assert by[k, True] == (by[k, False] if skip == "0" else 0)
    kv = 2 * 2 * 32 * 128 * 2  # K and V of the smoke shapes (HK 2, head_dim 32, D 128), bf16 bytes
    assert by["qkv", True] == (by["qkv", False] if skip == "0" else kv)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    bad = subprocess.run([sys.executable, "-m", "bench.kernels.tune_fused_decode", "--smoke", "--skip", "1.5"],
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert bad.returncode == 2 and "--skip must be in [0, 1]" in bad.stderr


def test_ffn_group_size_sets_the_groups(tmp_path):
    """--ffn-group-size: the FFN and its router over groups of that many channels (16 where the smoke default is
    32) pass the check against the reference; a size that does not divide the FFN width is a one-line error."""
    recs = _run(tmp_path, "--once", "--kernels", "ffn,router", "--grid", "[{}]", "--ffn-group-size", "16")
    assert recs and all(r["err_ok"] for r in recs), [r for r in recs if not r.get("err_ok")]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    bad = subprocess.run([sys.executable, "-m", "bench.kernels.tune_fused_decode", "--smoke",
                          "--ffn-group-size", "100"], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert bad.returncode == 2 and "--ffn-group-size must divide the FFN width 256" in bad.stderr


def test_skip_run_decides_adjacent_groups_together():
    """--skip-run N: a token skips or runs each run of N adjacent groups as one (a wider group's pattern at the same
    group size; the last run may be shorter); below 1 it is a one-line error."""
    import torch

    from bench.kernels import tune_fused_decode as mod

    mod.SKIP, mod.SKIP_RUN, mod.DEV = 0.5, 4, "cpu"  # as --smoke sets them on a CPU
    m = mod.rand_mask(3, 10, True, torch.Generator().manual_seed(0)).cpu()
    assert m.shape == (3, 10) and m.dtype == torch.bool
    runs = m[:, :8].reshape(3, 2, 4)
    assert (runs == runs[..., :1]).all() and (m[:, 8:] == m[:, 8:9]).all()
    assert m.any() and not m.all()  # seed 0 draws both outcomes
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    bad = subprocess.run([sys.executable, "-m", "bench.kernels.tune_fused_decode", "--smoke", "--skip-run", "0"],
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert bad.returncode == 2 and "--skip-run must be >= 1" in bad.stderr
