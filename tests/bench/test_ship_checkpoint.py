"""scripts/ship_checkpoint.py: a stage directory becomes a shipped checkpoint folder (bf16 adapter, no local path)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ship_checkpoint.py"


def _ship(stage: Path, dest: Path) -> subprocess.CompletedProcess:
    """The packaging tool as a user runs it (scripts/ holds tools, not modules tests import)."""
    cmd = [sys.executable, str(SCRIPT), str(stage), str(dest), "--base-model", "smollm2-135m"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_ship_lora_stage(tmp_path):
    stage = tmp_path / "lora"
    stage.mkdir()
    routers = {"r.w": torch.randn(3, 5)}
    adapter = {"a.lora_A.weight": torch.randn(4, 7), "a.lora_B.weight": torch.randn(7, 4)}
    save_file(routers, stage / "routers.safetensors")
    save_file(adapter, stage / "adapter_model.safetensors")
    (stage / "wide_config.json").write_text('{"format": "wide-routers"}')
    (stage / "adapter_config.json").write_text(json.dumps({"r": 4, "base_model_name_or_path": "/root/.cache/x"}))
    dest = tmp_path / "ship"
    out = _ship(stage, dest)
    assert out.returncode == 0, out.stderr
    assert {f.name for f in dest.iterdir()} == {
        "routers.safetensors",
        "wide_config.json",
        "adapter_model.safetensors",
        "adapter_config.json",
    }
    got = load_file(dest / "adapter_model.safetensors")
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)) for k, v in adapter.items())
    assert torch.equal(load_file(dest / "routers.safetensors")["r.w"], routers["r.w"])  # routers travel unchanged
    cfg = json.loads((dest / "adapter_config.json").read_text())
    assert cfg == {"r": 4, "base_model_name_or_path": "smollm2-135m"}


def test_ship_refuses_unfinished_stage(tmp_path):
    (tmp_path / "routers.safetensors").write_bytes(b"")
    out = _ship(tmp_path, tmp_path / "out")
    assert out.returncode == 1 and "missing wide_config.json" in out.stderr
