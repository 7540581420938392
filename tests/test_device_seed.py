"""scripts/device/seed_work.sh and restore_work.sh (what a fresh GPU machine's quality run starts from): a row whose
checkpoint is in the tree travels as a name and is restored as that checkpoint's files; a row taken from a run's
returned parts (FROM / KEEP) travels whole; restoring twice changes nothing; the records file comes along."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "src" / "wide" / "checkpoints" / "smollm2-135m-s50"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("git") is None or not (ROOT / ".git").exists(),
    reason="needs bash and the git checkout",
)


def _run(script: str, env: dict) -> str:
    out = subprocess.run(["bash", f"scripts/device/{script}"], cwd=ROOT, env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_seed_and_restore(tmp_path):
    returned = tmp_path / "returned"  # a run's packed parts: one interrupted row
    row = tmp_path / "rows" / "row-x" / "stage1" / "checkpoint-100"
    row.mkdir(parents=True)
    (row / "routers.safetensors").write_bytes(b"\0" * 1000)
    (row.parent / "latest").write_text("checkpoint-100")
    returned.mkdir()
    with tarfile.open(returned / "work.tar.00", "w") as tf:
        tf.add(tmp_path / "rows" / "row-x", arcname="row-x")
    seed = tmp_path / "seed"
    _run("seed_work.sh", {"SEED_OUT": str(seed), "ROWS": "wide-50-long-warm2-kllm", "FROM": str(returned),
                          "KEEP": "row-x"})  # fmt: skip
    assert (seed / "tree-rows.txt").read_text().split() == ["wide-50-long-warm2-kllm", "smollm2-135m-s50"]
    with tarfile.open(seed / "work.tar.00") as tf:  # the returned row only: the tree's travels by name
        assert {Path(n).parts[0] for n in tf.getnames() if Path(n).parts} == {"row-x"}
    work = tmp_path / "work"
    log = _run("restore_work.sh", {"CARRIED": str(seed), "WORK": str(work)})
    assert "row-x: restored" in log and "wide-50-long-warm2-kllm: restored from src/wide/checkpoints" in log
    stage1 = work / "wide-50-long-warm2-kllm" / "stage1"
    for f in ("routers.safetensors", "wide_config.json", "train_log.jsonl"):
        assert filecmp.cmp(stage1 / f, CKPT / f, shallow=False)
    assert (work / "row-x" / "stage1" / "latest").read_text() == "checkpoint-100"
    records = json.loads((work / "quality.json").read_text())["records"]
    assert records and all("name" in r for r in records)
    assert _run("restore_work.sh", {"CARRIED": str(seed), "WORK": str(work)}) == ""  # a warm machine keeps its own


def test_rows_from_history_are_the_routers_shipped_then(tmp_path):
    """wide-50-long-warm-kllm was shipped as smollm2-135m-s50 before the tree's routers: seeded from git history."""
    old_rev = "d827a05:src/wide/checkpoints/smollm2-135m-s50/routers.safetensors"
    old = subprocess.run(["git", "show", old_rev], cwd=ROOT, capture_output=True)
    if old.returncode:
        pytest.skip("a shallow checkout: the history the row is seeded from is not here")
    seed, work = tmp_path / "seed", tmp_path / "work"
    _run("seed_work.sh", {"SEED_OUT": str(seed), "ROWS": "wide-50-long-warm-kllm"})
    assert not (seed / "tree-rows.txt").exists()
    _run("restore_work.sh", {"CARRIED": str(seed), "WORK": str(work)})
    warm = (work / "wide-50-long-warm-kllm" / "stage1" / "routers.safetensors").read_bytes()
    assert warm == old.stdout and warm != (CKPT / "routers.safetensors").read_bytes()
