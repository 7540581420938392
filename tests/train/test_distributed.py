"""Data-parallel calibration: two CPU ranks (gloo) train identical routers; rank 0 alone writes."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import tiny_model
from tests.train.test_calibrate import _dataset
from wide.config import WideConfig
from wide.model import WideModel
from wide.train.calibrate import TrainConfig, calibrate


def _worker(rank: int, world: int, init_file: str, out: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(100 + rank)  # different router init per rank: calibrate must broadcast rank 0's
        wm = WideModel(tiny_model("llama"), WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.4))
        tc = TrainConfig(steps=4, batch_size=4, seq_len=16, save_every=2, log_every=1, fit_batches=1, lr=1e-2)
        calibrate(wm, _dataset(), tc, out, progress=False)
        results[rank] = {k: v.clone() for k, v in wm.routers.state_dict().items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_two_ranks_train_identical_routers(tmp_path):
    out = tmp_path / "run"
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(2, str(tmp_path / "pg"), str(out), results), nprocs=2, join=True)
        r0, r1 = dict(results[0]), dict(results[1])
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
    logs = (out / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in logs] == [1, 2, 3, 4]  # one writer
    meta = json.loads((out / "wide_config.json").read_text())
    assert meta["training"]["world_size"] == 2
    assert (out / "checkpoint-2" / "rng_rank1.pt").is_file()
    assert os.path.isfile(out / "routers.safetensors")


def test_batch_must_split_evenly(monkeypatch):
    import wide.train.calibrate as cal

    monkeypatch.setattr(cal, "dist_world", lambda: (0, 3))
    wm = WideModel(tiny_model("llama"), WideConfig(ffn_group_size=16, router_rank=8))
    with pytest.raises(ValueError, match="divisible by the 3 data-parallel ranks"):
        calibrate(wm, _dataset(), TrainConfig(steps=1, batch_size=4, seq_len=16), "/tmp/unused", progress=False)
