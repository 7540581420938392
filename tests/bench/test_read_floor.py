"""bench/decode/bench_read_floor.py --smoke: its streaming-read and two-phase kernels return the sums torch computes
(the two-phase launch also leaves its counters zeroed), through the interpreter on a CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
triton = pytest.importorskip("triton")


def test_smoke_checks_pass():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    out = subprocess.run([sys.executable, "-m", "bench.decode.bench_read_floor", "--smoke"], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "smoke ok" in out.stdout
