"""bench.kernels.sweep_prefill_attention: each configuration is checked before it is timed, a failing check is
recorded (not timed), bad --configs are one-line errors; on the CPU the checks run through the interpreter."""

from __future__ import annotations

import json

import pytest
import torch

from bench.kernels import sweep_prefill_attention as SW


def test_parse_configs():
    assert SW.parse_configs("128,64,8,3/64,32,4,1/") == [(128, 64, 8, 3), (64, 32, 4, 1)]
    with pytest.raises(SystemExit, match="is not BLOCK_M"):
        SW.parse_configs("128,64,8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path")
def test_smoke_checks_every_config(tmp_path):
    SW.main(["--smoke", "--out", str(tmp_path), "--configs", "64,32,4,1/32,16,4,1"])
    rec = json.loads((tmp_path / "prefill-sweep-cpu.json").read_text())
    assert [r["config"] for r in rec["records"]] == ["default", [64, 32, 4, 1], [32, 16, 4, 1]]
    assert all(r["check_ok"] for r in rec["records"])
    assert "| 64,32,4,1 | ok" in (tmp_path / "prefill-sweep-cpu.md").read_text()


def test_a_wrong_kernel_fails_its_check(monkeypatch):
    """The check can fail: a kernel with one row off by 1 is caught."""
    from wide.kernels import attention

    real = attention.routed_attention_prefill

    def broken(*a, **k):
        out = real(*a, **k)
        out[0, 3] += 1.0
        return out

    monkeypatch.setattr(attention, "routed_attention_prefill", broken)
    assert not SW.check_config(None, "cpu", interpret=True)["ok"]


def test_unknown_layout_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="--kv-layouts"):
        SW.main(["--smoke", "--out", str(tmp_path), "--kv-layouts", "bhsd"])
