"""Issue 61's probes, each with its one-line error (or correct behaviour) and the files it leaves: non-finite
flags and losses, NaN routers, one writer per run folder (two real processes), resume provenance, the CLI's
error boundary, context limits, file modes, `wide refit --out`."""

# ruff: noqa: F811 (the fixtures tiny_dir and text_file, imported from tests.test_cli, are test arguments)
from __future__ import annotations

import errno
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import wide
from tests.test_cli import calibrate_tiny, cli, text_file, tiny_dir  # noqa: F401 (fixtures)
from tests.train.test_calibrate import TC, _dataset, _wm
from wide.config import WideConfig, WideConfigError
from wide.model.checkpoint import CheckpointMismatchError, check_checkpoint, save_routers
from wide.paths import PACKAGE_DIR
from wide.train import calibrate as cal
from wide.train.calibrate import MANIFEST_NAME, NonFiniteError, TrainConfig, calibrate
from wide.train.run_lock import LOCK_NAME


def _one_line_error(capsys, *words: str) -> str:
    """The stderr of the last command: no traceback, its last line an `error:` naming every word."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error:") or "error:" in last, err
    for w in words:
        assert w in last, (w, last)
    return last


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


@pytest.fixture
def resumable(tiny_dir, text_file, tmp_path):
    """A finished 4-step CLI run whose checkpoint-2 can be resumed."""
    out = tmp_path / "run"
    assert calibrate_tiny(tiny_dir, text_file, out, "--save-every", 2, steps=4) == 0
    assert (out / "checkpoint-2").is_dir()
    return out


# ------------------------------------------------------------------ 1. non-finite numbers
@pytest.mark.parametrize("flag,value", [("--alpha", "nan"), ("--alpha", "inf"), ("--tau-end", "inf"), ("--lr", "nan")])
def test_non_finite_flags_are_refused_before_anything(tiny_dir, text_file, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        calibrate_tiny(tiny_dir, text_file, tmp_path / "run", flag, value)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "finite" in err and flag in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "kw",
    [{"alpha": math.nan}, {"alpha": math.inf}, {"tau_end": math.inf}, {"tau_start": math.nan}, {"sparsity": math.nan}],
)
def test_configs_refuse_non_finite_numbers(kw):
    with pytest.raises(WideConfigError, match="must be"):
        WideConfig(**kw)


def test_train_config_refuses_infinite_clipping():
    with pytest.raises(ValueError, match="max_grad_norm"):
        TrainConfig(max_grad_norm=math.inf)


def test_nan_loss_stops_at_its_step_and_no_checkpoint_holds_it(tmp_path, monkeypatch):
    real = cal.routing_sparsity_loss
    calls = []

    def nan_from_step_3(*a, **k):  # steps 1 and 2 are finite (checkpoint-2 is written), step 3 is NaN
        calls.append(1)
        loss = real(*a, **k)
        return loss * math.nan if len(calls) >= 3 else loss

    monkeypatch.setattr(cal, "routing_sparsity_loss", nan_from_step_3)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError) as e:
        calibrate(_wm(), _dataset(), TrainConfig(**TC), out, progress=False)
    msg = str(e.value)
    assert "step 3" in msg and "checkpoint-2" in msg and "\n" not in msg
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "checkpoint-2" / "routers.safetensors")).values())
    assert not (out / "routers.safetensors").exists() and not list(out.glob(".tmp-*"))
    assert not (out / LOCK_NAME).exists()
    steps = [json.loads(x)["step"] for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the NaN step is never logged


def test_nan_routers_are_never_written_nor_loaded(resumable, tiny_dir, tmp_path, capsys):
    wm = _wm()
    with torch.no_grad():
        next(wm.routers.parameters()).fill_(math.nan)
    with pytest.raises(CheckpointMismatchError, match="NaN or inf.*not written"):
        save_routers(wm, tmp_path / "nan")
    assert not (tmp_path / "nan" / "routers.safetensors").exists()
    bad = tmp_path / "bad"
    shutil.copytree(resumable, bad)
    state = load_file(str(bad / "routers.safetensors"))
    key = next(iter(state))
    state[key] = torch.full_like(state[key], math.inf)
    save_file(state, str(bad / "routers.safetensors"), metadata={"format": "wide-routers"})
    with pytest.raises(CheckpointMismatchError, match=f"{key} holds NaN or inf"):
        check_checkpoint(bad)
    assert cli("generate", "--model", tiny_dir, "--routers", bad, "--max-new-tokens", 2) == 2
    _one_line_error(capsys, "NaN or inf")


# ------------------------------------------------------------------- 2. one writer per run
def test_two_processes_on_one_out(tiny_dir, text_file, tmp_path, capsys):
    """A second `wide calibrate` on the --out a running one writes is refused naming it; once the first is
    killed (-9), its lock is stale and a new run takes the folder over."""
    out = tmp_path / "run"
    args = ["--model", tiny_dir, "--data", text_file, "--seq-len", 32, "--batch-size", 2, "--ffn-group-size", 16]
    args += ["--router-rank", 8, "--log-every", 1, "--save-every", 10**6, "--device", "cpu", "--out", out]
    cmd = [sys.executable, "-m", "wide.cli", "calibrate", *map(str, args)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(wide.__file__).parents[1]), os.getcwd()])}
    err = open(tmp_path / "first.err", "w")  # noqa: SIM115 (closed below; a pipe would fill and block it)
    first = subprocess.Popen([*cmd, "--steps", str(10**6)], env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        log = out / "train_log.jsonl"
        deadline = time.time() + 240
        while not (log.is_file() and log.read_text().count("\n") >= 1):  # it holds the lock and trains
            assert first.poll() is None, (tmp_path / "first.err").read_text()
            assert time.time() < deadline, "the first run did not start training"
            time.sleep(0.2)
        second = subprocess.run([*cmd, "--steps", "2", "--overwrite"], env=env, capture_output=True, text=True)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith("error:") and "in use by another wide run" in last and f"pid {first.pid}" in last
        assert first.poll() is None  # the first run goes on, alone
        steps = [json.loads(x)["step"] for x in log.read_text().splitlines() if x.strip()]
        assert steps == list(range(1, len(steps) + 1))  # one writer's log
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
        err.close()
    assert (out / LOCK_NAME).is_file()  # left by the killed run: stale, the kernel dropped its lock
    assert calibrate_tiny(tiny_dir, text_file, out, "--overwrite", "--log-every", 1, steps=2) == 0
    assert [json.loads(x)["step"] for x in (out / "train_log.jsonl").read_text().splitlines()] == [1, 2]
    assert not (out / LOCK_NAME).exists()


def test_temporary_checkpoint_names_are_unique_per_writer(tmp_path, monkeypatch):
    seen = []
    real = cal.save_trainable

    def record(wm, where, *a, **k):
        seen.append(Path(where).name)
        return real(wm, where, *a, **k)

    monkeypatch.setattr(cal, "save_trainable", record)
    for run in ("a", "b"):
        calibrate(_wm(), _dataset(), TrainConfig(**{**TC, "steps": 3}), tmp_path / run, progress=False)
    tmps = [n for n in seen if n.startswith(".tmp-")]
    assert len(tmps) == 2 and tmps[0] != tmps[1] and all(n.startswith(".tmp-checkpoint-2.") for n in tmps)


# -------------------------------------------------------------------- 3. resume provenance
def test_resume_refuses_another_dtype_before_loading(resumable, tiny_dir, text_file, capsys, monkeypatch):
    import wide.model

    before = _snapshot(resumable)
    monkeypatch.setattr(wide.model, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    rc = calibrate_tiny(tiny_dir, text_file, resumable, "--save-every", 2, "--resume", "--dtype", "bf16", steps=4)
    assert rc == 2
    _one_line_error(capsys, "dtype 'float32' then, 'bfloat16' now", "--resume-anyway")
    assert _snapshot(resumable) == before


def test_resume_refuses_changed_data_content_unless_anyway(resumable, tiny_dir, text_file, capsys):
    sentences = text_file.read_text().split(". ")
    text_file.write_text(". ".join(reversed(sentences)))  # the same sentences, so as many sequences
    before = _snapshot(resumable)
    assert calibrate_tiny(tiny_dir, text_file, resumable, "--save-every", 2, "--resume", steps=4) == 2
    _one_line_error(capsys, "data_sha256")
    assert _snapshot(resumable) == before
    rc = calibrate_tiny(tiny_dir, text_file, resumable, "--save-every", 2, "--resume", "--resume-anyway", steps=4)
    assert rc == 0
    assert "--resume-anyway: data_sha256 was" in capsys.readouterr().err
    run = json.loads((resumable / MANIFEST_NAME).read_text())["run"]
    assert run["resumed_anyway"][0]["from"] == "checkpoint-2" and "data_sha256" in run["resumed_anyway"][0]["changed"]


# ---------------------------------------------------------- 4. the CLI's one-line errors
def test_disk_full_during_a_checkpoint_is_one_line_and_leaves_no_tmp(
    tiny_dir, text_file, tmp_path, capsys, monkeypatch
):
    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(cal, "write_state", full)
    out = tmp_path / "run"
    assert calibrate_tiny(tiny_dir, text_file, out, "--save-every", 2, steps=4) == 2
    _one_line_error(capsys, "no space left", "trainer_state.safetensors")
    assert not list(out.glob(".tmp-*")) and not (out / "latest").exists() and not (out / LOCK_NAME).exists()


def test_a_temporary_checkpoint_is_never_loaded(resumable, tiny_dir, capsys):
    tmp = resumable / ".tmp-checkpoint-4.123-abc"
    shutil.copytree(resumable / "checkpoint-2", tmp)
    with pytest.raises(CheckpointMismatchError, match="unfinished checkpoint"):
        check_checkpoint(tmp)
    assert cli("generate", "--model", tiny_dir, "--routers", tmp, "--max-new-tokens", 2) == 2
    _one_line_error(capsys, "unfinished checkpoint")


def test_a_checkpoint_replaced_by_a_symlink_is_removed_not_followed(resumable, tiny_dir, text_file, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not wide's")
    shutil.rmtree(resumable / "checkpoint-2")
    (resumable / "checkpoint-2").symlink_to(elsewhere, target_is_directory=True)
    assert calibrate_tiny(tiny_dir, text_file, resumable, "--save-every", 2, "--overwrite", steps=4) == 0
    assert (elsewhere / "keep.txt").read_text() == "not wide's" and sorted(p.name for p in elsewhere.iterdir()) == [
        "keep.txt"
    ]
    ckpt = resumable / "checkpoint-2"
    assert ckpt.is_dir() and not ckpt.is_symlink() and (ckpt / "trainer_state.safetensors").is_file()


def test_non_utf8_prompt_is_one_line(tiny_dir, capsys):
    prompt = os.fsdecode(b"caf\xe9 au lait")  # what Python makes of non-UTF-8 bytes in argv
    assert cli("generate", "--model", tiny_dir, "--prompt", prompt, "--max-new-tokens", 2) == 2
    _one_line_error(capsys, "--prompt", "UTF-8")


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickled_model_is_one_line_and_never_run(tiny_dir, tmp_path, capsys):
    model = tmp_path / "pickled"
    shutil.copytree(tiny_dir, model)
    for p in model.glob("*.safetensors"):
        p.unlink()
    marker = tmp_path / "pwned"
    with open(model / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Payload(marker)}, f)
    assert cli("generate", "--model", model, "--max-new-tokens", 2) == 2
    _one_line_error(capsys, "pickle", "safetensors")
    assert not marker.exists()


def test_debug_escape_shows_the_traceback(tiny_dir, monkeypatch):
    monkeypatch.setenv("WIDE_DEBUG", "1")
    with pytest.raises(ValueError, match="UTF-8"):
        cli("generate", "--model", tiny_dir, "--prompt", os.fsdecode(b"\xff"), "--max-new-tokens", 2)


# ------------------------------------------------------------------- 5. context limits
def test_context_limits_are_checked(tiny_dir, text_file, tmp_path, capsys):
    limit = json.loads((tiny_dir / "config.json").read_text())["max_position_embeddings"]
    assert calibrate_tiny(tiny_dir, text_file, tmp_path / "run", "--seq-len", limit + 1) == 2
    _one_line_error(capsys, "--seq-len", f"{limit} positions")
    assert not (tmp_path / "run").exists()
    assert cli("generate", "--model", tiny_dir, "--max-new-tokens", limit) == 2
    _one_line_error(capsys, "--max-new-tokens", f"{limit} positions")
    args = (
        "--tasks",
        "wikitext",
        "--limit",
        1,
        "--max-length",
        limit + 1,
        "--no-lm-eval-check",
        "--out",
        tmp_path / "e",
    )
    assert cli("eval", "--model", tiny_dir, *args) == 2
    _one_line_error(capsys, "--max-length", f"{limit} positions")


def test_check_context_names_the_runtime_limit():
    from wide.model import check_context

    cfg = type("Cfg", (), {"max_position_embeddings": 64})()
    check_context(cfg, 64, what="x")
    with pytest.raises(ValueError, match="model's 64 positions"):
        check_context(cfg, 65, what="x")
    with pytest.raises(ValueError, match="runtime's max_seq of 32"):
        check_context(cfg, 33, what="x", max_seq=32)


# ------------------------------------------------------------------ 6. modes, refit --out
def test_files_get_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "run"
        calibrate(_wm(), _dataset(), TrainConfig(**{**TC, "steps": 4}), out, progress=False)
    finally:
        os.umask(old)
    ckpt = out / "checkpoint-2"
    assert ckpt.stat().st_mode & 0o777 == 0o755
    for p in (out / "routers.safetensors", out / "wide_config.json", out / MANIFEST_NAME, out / "latest"):
        assert p.stat().st_mode & 0o777 == 0o644, p
    for p in (ckpt / "routers.safetensors", ckpt / "trainer_state.safetensors"):
        assert p.stat().st_mode & 0o777 == 0o644, p


def test_refit_needs_out_and_never_writes_into_the_package(resumable, tiny_dir, text_file, capsys):
    refit = ("refit", "--model", tiny_dir, "--routers", resumable, "--data", text_file, "--seq-len", 32)
    with pytest.raises(SystemExit) as e:
        cli(*refit)
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
    inside = PACKAGE_DIR / "checkpoints" / "refit-probe"
    assert cli(*refit, "--out", inside) == 2
    _one_line_error(capsys, "inside the installed wide package")
    assert not inside.exists()


def test_refit_without_text_refuses_before_the_model_loads(resumable, tmp_path, monkeypatch, capsys):
    """No --data and no data root: one line about the text, before the (here nonexistent) model is read."""
    monkeypatch.delenv("WIDE_DATA", raising=False)
    monkeypatch.setenv("WIDE_DATA_SEARCH", "0")
    refit = ("refit", "--model", tmp_path / "no-such-model", "--routers", resumable, "--out", tmp_path / "o")
    assert cli(*refit) == 2
    _one_line_error(capsys, "no training text")
