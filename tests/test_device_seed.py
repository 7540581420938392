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
CKPTS = ROOT / "src" / "wide" / "checkpoints"
TREE_ROWS = {"wide-25-long-warm-kllm": "smollm2-135m-s25", "wide-50-long-g32-warm-kllm": "smollm2-135m-s50"}

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
    _run("seed_work.sh", {"SEED_OUT": str(seed), "ROWS": " ".join(TREE_ROWS), "FROM": str(returned),
                          "KEEP": "row-x"})  # fmt: skip
    tree_rows = [line.split() for line in (seed / "tree-rows.txt").read_text().splitlines()]
    assert tree_rows == [[n, ck] for n, ck in TREE_ROWS.items()]
    with tarfile.open(seed / "work.tar.00") as tf:  # the returned row only: the tree's travel by name
        assert {Path(n).parts[0] for n in tf.getnames() if Path(n).parts} == {"row-x"}
    work = tmp_path / "work"
    log = _run("restore_work.sh", {"CARRIED": str(seed), "WORK": str(work)})
    assert "row-x: restored" in log
    for name, ck in TREE_ROWS.items():
        assert f"{name}: restored from src/wide/checkpoints/{ck}" in log
        for f in ("routers.safetensors", "wide_config.json", "train_log.jsonl"):
            assert filecmp.cmp(work / name / "stage1" / f, CKPTS / ck / f, shallow=False)
    assert (work / "row-x" / "stage1" / "latest").read_text() == "checkpoint-100"
    records = json.loads((work / "quality.json").read_text())["records"]
    assert records and all("name" in r for r in records)
    assert _run("restore_work.sh", {"CARRIED": str(seed), "WORK": str(work)}) == ""  # a warm machine keeps its own


@pytest.mark.parametrize(
    ("row", "rev", "ckpt"),
    [
        ("wide-25-long", "f043025", "smollm2-135m-s25"),
        ("wide-50-long", "839dbe2", "smollm2-135m-s50"),
        ("wide-50-long-warm-kllm", "d827a05", "smollm2-135m-s50"),
        ("wide-50-long-warm2-kllm", "d52880f", "smollm2-135m-s50"),
    ],
)
def test_rows_from_history_are_the_routers_shipped_then(tmp_path, row, rev, ckpt):
    """A row whose routers were shipped under a checkpoint's name before the tree's ones is seeded from git history:
    the routers, config and training log of that commit, not the tree's."""
    old = {}
    for f in ("routers.safetensors", "wide_config.json", "train_log.jsonl"):
        got = subprocess.run(["git", "show", f"{rev}:src/wide/checkpoints/{ckpt}/{f}"], cwd=ROOT, capture_output=True)
        if got.returncode:
            pytest.skip("a shallow checkout: the history the row is seeded from is not here")
        old[f] = got.stdout
    seed, work = tmp_path / "seed", tmp_path / "work"
    _run("seed_work.sh", {"SEED_OUT": str(seed), "ROWS": row})
    assert not (seed / "tree-rows.txt").exists()
    _run("restore_work.sh", {"CARRIED": str(seed), "WORK": str(work)})
    for f, want in old.items():
        assert (work / row / "stage1" / f).read_bytes() == want
    assert old["routers.safetensors"] != (CKPTS / ckpt / "routers.safetensors").read_bytes()


def test_default_seeds_every_long_row(tmp_path):
    """Without ROWS: the tree's rows by name, the others from history, each once."""
    if subprocess.run(["git", "cat-file", "-e", "f043025"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("a shallow checkout: the history the rows are seeded from is not here")
    seed = tmp_path / "seed"
    _run("seed_work.sh", {"SEED_OUT": str(seed)})
    assert [line.split()[0] for line in (seed / "tree-rows.txt").read_text().splitlines()] == list(TREE_ROWS)
    with tarfile.open(seed / "work.tar.00") as tf:
        rows = {Path(n).parts[0] for n in tf.getnames() if Path(n).parts}
    assert rows == {"wide-25-long", "wide-50-long", "wide-50-long-warm-kllm"}
