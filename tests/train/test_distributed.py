"""Data-parallel calibration: two CPU ranks (gloo) train identical routers; rank 0 alone writes."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import tiny_model
from tests.train.test_calibrate import KillAfter, Killed, _dataset
from wide.config import WideConfig
from wide.model import WideModel
from wide.train.calibrate import TrainConfig, calibrate


def _worker(
    rank: int,
    world: int,
    init_file: str,
    out: str,
    results: dict,
    steps: int = 4,
    kill_after: int | None = None,
    resume: bool = False,
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(100 + rank)  # different router init per rank: calibrate must broadcast rank 0's
        wm = WideModel(tiny_model("llama"), WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.4))
        tc = TrainConfig(steps=steps, batch_size=4, seq_len=16, save_every=2, log_every=1, fit_batches=1, lr=1e-2)
        ds = _dataset() if kill_after is None else KillAfter(_dataset(), kill_after)
        try:
            calibrate(wm, ds, tc, out, progress=False, resume=resume)
        except Killed:
            results[rank] = "killed"
            return
        results[rank] = {k: v.clone() for k, v in wm.routers.state_dict().items()}
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, name: str, **kw) -> dict:
    with mp.Manager() as manager:
        results = manager.dict()
        args = (
            2,
            str(tmp_path / f"pg-{name}"),
            str(tmp_path / kw.pop("out")),
            results,
            kw.pop("steps", 4),
            kw.pop("kill_after", None),
            kw.pop("resume", False),
        )
        mp.spawn(_worker, args=args, nprocs=2, join=True)
        return {r: results[r] if isinstance(results[r], str) else dict(results[r]) for r in (0, 1)}


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_two_ranks_train_identical_routers(tmp_path):
    out = tmp_path / "run"
    res = _spawn(tmp_path, "a", out="run")
    r0, r1 = res[0], res[1]
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
    logs = (out / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in logs] == [1, 2, 3, 4]  # one writer
    meta = json.loads((out / "wide_config.json").read_text())
    assert meta["training"]["world_size"] == 2
    assert (out / "checkpoint-2" / "rng_rank1.safetensors").is_file()
    assert os.path.isfile(out / "routers.safetensors")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_two_rank_resume_equals_uninterrupted(tmp_path):
    full = _spawn(tmp_path, "full", out="full", steps=6)
    killed = _spawn(tmp_path, "kill", out="run", steps=6, kill_after=5)  # dies in step 6, after checkpoint-4
    assert killed == {0: "killed", 1: "killed"}
    resumed = _spawn(tmp_path, "resume", out="run", steps=6, resume=True)
    for k in full[0]:
        assert torch.equal(full[0][k], resumed[0][k]), k


def test_batch_must_split_evenly(monkeypatch):
    import wide.train.calibrate as cal

    monkeypatch.setattr(cal, "dist_world", lambda: (0, 3))
    wm = WideModel(tiny_model("llama"), WideConfig(ffn_group_size=16, router_rank=8))
    with pytest.raises(ValueError, match="divisible by the 3 data-parallel ranks"):
        calibrate(wm, _dataset(), TrainConfig(steps=1, batch_size=4, seq_len=16), "/tmp/unused", progress=False)
