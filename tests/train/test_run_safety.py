"""Run directories and trainer state: no pickle is ever loaded, foreign files are never touched,
--resume refuses changed settings and truncates the log, the seed fixes the routers' initialisation."""

from __future__ import annotations

import errno
import json
import pickle
import random

import numpy as np
import pytest
import torch

from tests.conftest import tiny_model
from tests.train.test_calibrate import TC, KillAfter, Killed, _dataset, _wm
from wide.config import WideConfig
from wide.model import WideModel
from wide.train import calibrate as cal
from wide.train.calibrate import (
    MANIFEST_NAME,
    STATE_NAME,
    TrainConfig,
    calibrate,
    check_out_dir,
    latest_checkpoint,
    read_state,
    rng_from_portable,
    rng_state,
    rng_to_portable,
    seeded_wide_model,
    set_rng_state,
    write_state,
)


class Payload:
    """Unpickling this creates `marker`: proof that loading ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _killed_run(out, k=2):
    """A run killed while fetching batch k+1; with TC's save_every=2, checkpoint-2 is the latest."""
    with pytest.raises(Killed):
        calibrate(_wm(), KillAfter(_dataset(), k), TrainConfig(**TC), out, progress=False)
    assert latest_checkpoint(out).name == "checkpoint-2"
    return out / "checkpoint-2"


@pytest.mark.parametrize("name", [STATE_NAME, "trainer_state.pt"])
def test_crafted_trainer_state_cannot_run_code(tmp_path, name):
    ckpt = _killed_run(tmp_path / "run")
    marker = tmp_path / "pwned"
    (ckpt / STATE_NAME).unlink()
    with open(ckpt / name, "wb") as f:  # what torch.save(..., pickle) of a hostile object writes
        pickle.dump({"step": 2, "optimizer": Payload(marker)}, f)
    with pytest.raises(ValueError) as e:
        calibrate(_wm(), _dataset(), TrainConfig(**TC), tmp_path / "run", resume=True, progress=False)
    assert not marker.exists()
    assert name in str(e.value) and "\n" not in str(e.value)


def test_truncated_checkpoint_files_are_one_line_errors(tmp_path):
    ckpt = _killed_run(tmp_path / "run")
    state = (ckpt / STATE_NAME).read_bytes()
    (ckpt / STATE_NAME).write_bytes(state[: len(state) // 2])
    with pytest.raises(ValueError, match="trainer_state.safetensors is unreadable"):
        calibrate(_wm(), _dataset(), TrainConfig(**TC), tmp_path / "run", resume=True, progress=False)
    (ckpt / STATE_NAME).write_bytes(state)
    routers = (ckpt / "routers.safetensors").read_bytes()
    (ckpt / "routers.safetensors").write_bytes(routers[:100])
    with pytest.raises(ValueError, match="routers.safetensors is truncated"):
        calibrate(_wm(), _dataset(), TrainConfig(**TC), tmp_path / "run", resume=True, progress=False)


def test_portable_rng_state_round_trips_through_a_file(tmp_path):
    random.random(), np.random.standard_normal()  # numpy then holds a cached Gaussian
    saved = rng_state()
    tensors, js = rng_to_portable(saved)
    write_state(tmp_path / "s.safetensors", tensors, {"rng": js})
    want = (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(3))
    t2, meta = read_state(tmp_path / "s.safetensors")
    set_rng_state(rng_from_portable(t2, meta["rng"]))
    got = (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(3))
    assert want[:3] == got[:3] and torch.equal(want[3], got[3])


def test_foreign_out_dir_is_refused_and_never_pruned(tmp_path):
    out = tmp_path / "mine"
    for name in ("checkpoint-500", "checkpoint-1000", "checkpoint-best"):
        (out / name).mkdir(parents=True)
        (out / name / "model.bin").write_text(name)
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty .* not a WIDE run"):
        calibrate(_wm(), _dataset(), TrainConfig(**TC), out, progress=False)
    assert not (out / MANIFEST_NAME).exists() and not (out / "routers.safetensors").exists()

    calibrate(_wm(), _dataset(), TrainConfig(**TC), out, overwrite=True, progress=False)  # saves at 2 and 4
    for name in ("checkpoint-500", "checkpoint-1000", "checkpoint-best"):
        assert (out / name / "model.bin").read_text() == name
    assert (out / "notes.txt").read_text() == "keep me"
    assert not (out / "checkpoint-2").exists() and (out / "checkpoint-4" / STATE_NAME).is_file()  # ours pruned
    assert json.loads((out / MANIFEST_NAME).read_text())["checkpoints"] == ["checkpoint-4"]


def test_foreign_checkpoint_this_run_would_write_is_refused(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    with pytest.raises(ValueError, match="holds checkpoint-2/"):
        check_out_dir(tmp_path, TrainConfig(**TC), overwrite=True)
    check_out_dir(tmp_path, TrainConfig(**{**TC, "save_every": 5}), overwrite=True)  # never writes step 2


def test_existing_run_needs_resume_or_overwrite(tmp_path):
    calibrate(_wm(), _dataset(), TrainConfig(**TC), tmp_path, progress=False)
    with pytest.raises(ValueError, match="already holds a WIDE run: pass --resume"):
        calibrate(_wm(), _dataset(), TrainConfig(**TC), tmp_path, progress=False)
    calibrate(_wm(), _dataset(), TrainConfig(**{**TC, "steps": 3}), tmp_path, overwrite=True, progress=False)
    steps = [json.loads(x)["step"] for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # the earlier run's log was replaced, not appended to
    assert not (tmp_path / "checkpoint-4").exists()


@pytest.mark.parametrize(
    "change, flag",
    [
        ({"lr": 0.1}, "--lr"),
        ({"seq_len": 8}, "--seq-len"),
        ({"batch_size": 2}, "--batch-size"),
        ({"steps": 8}, "--steps"),
        ({"seed": 3}, "--seed"),
        ({"extra": {"data": "other.txt"}}, "--data"),
    ],
)
def test_resume_refuses_changed_training_settings(tmp_path, change, flag):
    _killed_run(tmp_path)
    with pytest.raises(ValueError, match=f"--resume: {flag} "):
        check_out_dir(tmp_path, TrainConfig(**{**TC, **change}), resume=True)


@pytest.mark.parametrize(
    "change, flag",
    [
        ({"sparsity": 0.25}, "--sparsity"),
        ({"ffn_group_size": 32}, "--ffn-group-size"),
        ({"router_rank": 4}, "--router-rank"),
    ],
)
def test_resume_refuses_changed_routing_config(tmp_path, change, flag):
    _killed_run(tmp_path)
    cfg = WideConfig(**{"ffn_group_size": 16, "router_rank": 8, "sparsity": 0.4, **change})
    wm = WideModel(tiny_model("llama"), cfg)
    with pytest.raises(ValueError, match=f"--resume: {flag} "):
        calibrate(wm, _dataset(), TrainConfig(**TC), tmp_path, resume=True, progress=False)


def test_resume_truncates_the_log_and_allows_logging_changes(tmp_path):
    with pytest.raises(Killed):  # steps 1-3 logged, checkpoint-2 the latest
        calibrate(_wm(), KillAfter(_dataset(), 3), TrainConfig(**TC), tmp_path, progress=False)
    calibrate(
        _wm(), _dataset(), TrainConfig(**{**TC, "log_every": 1, "save_every": 3}), tmp_path, resume=True, progress=False
    )
    steps = [json.loads(x)["step"] for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_resume_refuses_changed_data_size(tmp_path):
    _killed_run(tmp_path)
    with pytest.raises(ValueError, match="--data now gives 20 training sequences"):
        calibrate(_wm(), _dataset(n=20), TrainConfig(**TC), tmp_path, resume=True, progress=False)


def test_seed_fixes_router_initialisation():
    cfg = WideConfig(ffn_group_size=16, router_rank=8, seed=7)
    a = seeded_wide_model(tiny_model("llama"), cfg).routers.state_dict()
    torch.rand(5)  # global generator state in between must not matter
    b = seeded_wide_model(tiny_model("llama"), cfg).routers.state_dict()
    c = seeded_wide_model(tiny_model("llama"), WideConfig(ffn_group_size=16, router_rank=8, seed=8)).routers
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["0.attn.down.weight"], c.state_dict()["0.attn.down.weight"])


@pytest.mark.parametrize(
    "kw, msg", [({"lr": -1.0}, "lr"), ({"lr": float("nan")}, "lr"), ({"warmup_frac": 2.0}, "warmup_frac")]
)
def test_bad_numbers_fail_at_config_time(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TrainConfig(**{**TC, **kw})


def test_unwritable_out_is_found_before_training(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cal.tempfile, "TemporaryFile", refuse)
    out = tmp_path / "ro" / "run"
    with pytest.raises(ValueError, match="is not writable \\(Read-only file system\\)"):
        calibrate(_wm(), _dataset(), TrainConfig(**TC), out, progress=False)
    assert not out.exists()
