"""Stage-1 calibration: bit-for-bit resume, atomic checkpoints, reaching the target sparsity."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tiny_model
from wide.config import WideConfig
from wide.model import WideModel, load_routers
from wide.train.calibrate import TrainConfig, calibrate, latest_checkpoint
from wide.train.data import TokenDataset


def _dataset(n=24, seq=16, vocab=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a learnable pattern: repeated short motifs, so the LM loss is informative
    base = torch.randint(0, vocab, (n, 4), generator=g)
    ids = base.repeat(1, seq // 4)
    return TokenDataset(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool))


class Killed(Exception):
    pass


class KillAfter:
    """A dataset that 'kills' the run on its k-th batch request."""

    def __init__(self, ds, k):
        self.ds, self.k, self.calls = ds, k, 0

    def __len__(self):
        return len(self.ds)

    def batch(self, idx):
        self.calls += 1
        if self.calls > self.k:
            raise Killed
        return self.ds.batch(idx)


def _wm(seed=0):
    return WideModel(tiny_model("llama", seed=seed), WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.4))


TC = dict(steps=6, batch_size=4, seq_len=16, save_every=2, log_every=1, fit_batches=2, lr=1e-2)


def test_resume_continues_bit_for_bit(tmp_path):
    torch.manual_seed(123)
    ds = _dataset()
    full = _wm()
    calibrate(full, ds, TrainConfig(**TC), tmp_path / "full", progress=False)

    killed = _wm()
    with pytest.raises(Killed):  # dies during step 5, after the step-4 checkpoint
        calibrate(killed, KillAfter(ds, 4), TrainConfig(**TC), tmp_path / "run", progress=False)
    assert latest_checkpoint(tmp_path / "run").name == "checkpoint-4"
    resumed = _wm()
    calibrate(resumed, ds, TrainConfig(**TC), tmp_path / "run", resume=True, progress=False)
    for (k, a), (_, b) in zip(full.routers.state_dict().items(), resumed.routers.state_dict().items()):
        assert torch.equal(a, b), k
    logs = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    full_logs = [json.loads(x) for x in (tmp_path / "full" / "train_log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logs if r["step"] > 4] == [r["loss"] for r in full_logs if r["step"] > 4]


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    import wide.train.calibrate as cal

    ds = _dataset()
    with pytest.raises(Killed):  # killed in step 3: checkpoint-2 is the latest
        calibrate(_wm(), KillAfter(ds, 2), TrainConfig(**TC), tmp_path, progress=False)
    real_write = cal.write_state

    def dying_write(path, *a, **k):  # killed in the middle of writing checkpoint-4
        real_write(path, *a, **k)
        raise Killed

    monkeypatch.setattr(cal, "write_state", dying_write)
    with pytest.raises(Killed):
        calibrate(_wm(), ds, TrainConfig(**TC), tmp_path, resume=True, progress=False)
    monkeypatch.setattr(cal, "write_state", real_write)
    ck = latest_checkpoint(tmp_path)
    assert ck is not None and ck.name == "checkpoint-2"
    calibrate(_wm(), ds, TrainConfig(**TC), tmp_path, resume=True, progress=False)
    assert (tmp_path / "routers.safetensors").is_file()


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        calibrate(_wm(), _dataset(), TrainConfig(**TC), tmp_path, resume=True, progress=False)


@pytest.mark.parametrize("target", [0.3, 0.6])
def test_short_calibration_reaches_target_at_inference(tmp_path, target):
    torch.manual_seed(0)
    ds = _dataset(n=64, seq=32)
    wm = WideModel(tiny_model("llama"), WideConfig(ffn_group_size=16, router_rank=8, sparsity=target))
    for r in wm.routers:  # start far from the target
        r.attn.up.bias.data.view(-1, 2)[:, 1] = -3.0
        r.ffn.up.bias.data.view(-1, 2)[:, 1] = -3.0
    summary = calibrate(
        wm,
        ds,
        TrainConfig(steps=80, batch_size=8, seq_len=32, lr=2e-2, log_every=10, save_every=1000, fit_batches=4),
        tmp_path,
        progress=False,
    )
    assert summary["steps"] == 80
    # real (argmax) sparsity on the data, through a reloaded checkpoint
    wm.detach()
    wm2 = load_routers(tiny_model("llama"), tmp_path)
    wm2.start_meter()
    with torch.no_grad():
        for i in range(0, 64, 16):
            b = ds.batch(list(range(i, i + 16)))
            wm2(b["input_ids"], attention_mask=b["attention_mask"])
    s = wm2.stop_meter()
    real = 0.5 * (s["attn_sparsity"] + s["ffn_sparsity"])
    assert abs(real - target) < 0.05, s


def test_compiled_layers_train_without_recompiling_per_step(tmp_path):
    import torch._dynamo

    torch._dynamo.reset()
    wm = _wm()
    counts = torch._dynamo.utils.counters
    counts.clear()
    calibrate(wm, _dataset(), TrainConfig(**{**TC, "compile": True}), tmp_path, progress=False)
    # τ changes every step: it is read from a tensor, so the frames do not recompile for it
    assert counts["stats"]["unique_graphs"] <= 6, dict(counts["stats"])
    assert all(torch.isfinite(p).all() for p in wm.routers.parameters())


def test_compiled_layer_is_traced_once_for_every_layer(tmp_path):
    """compile_layers: one trace serves all layers and steps (no per-layer specialisation through
    the hooks or the KV cache, which would hit Dynamo's recompile limit on deep models and leave the
    remaining layers eager); routed outputs equal the eager model's."""
    import torch._dynamo

    layers = 6
    torch._dynamo.reset()
    eager = WideModel(tiny_model("llama", layers=layers), WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.4))
    wm = WideModel(tiny_model("llama", layers=layers), WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.4))
    wm.compile_layers(backend="aot_eager")  # Dynamo's guards do not depend on the backend; this one is fast
    counts = torch._dynamo.utils.counters
    counts.clear()
    calibrate(wm, _dataset(), TrainConfig(**{**TC, "steps": 4}), tmp_path, progress=False)
    # training (first layer's input without grad, the others with) and the no_grad threshold fit
    assert counts["stats"]["unique_graphs"] <= 3 < layers, dict(counts["stats"])
    eager.routers.load_state_dict(wm.routers.state_dict())
    ids = _dataset().input_ids[:2]
    with torch.no_grad():
        want, got = eager(ids).logits, wm(ids).logits  # argmax routing
    assert counts["stats"]["unique_graphs"] <= 4, dict(counts["stats"])
    torch.testing.assert_close(got, want)
    assert [m["attn"].shape for m in wm.last_masks] == [m["attn"].shape for m in eager.last_masks]
