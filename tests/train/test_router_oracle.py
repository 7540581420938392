"""The router-imitation term (WideConfig.router_oracle): its oracle, its gradient, and calibration with it."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import tiny_model
from wide.config import WideConfig, WideConfigError
from wide.model import WideModel
from wide.routing import oracle_imitation_loss


def _brute_force(h, weight, margin, execute, token_mask, width):
    """The oracle by hand: every real (token, group) pair's ||W[:, g] h_g||, the k smallest skipped."""
    b, t, ng = margin.shape
    real = [(i, j) for i in range(b) for j in range(t) if token_mask[i, j]]
    contrib = {
        (i, j, g): float((weight[:, g * width : (g + 1) * width] @ h[i, j, g * width : (g + 1) * width]).norm())
        for i, j in real
        for g in range(ng)
    }
    rate = 1 - sum(float(execute[i, j].float().mean()) for i, j in real) / len(real)
    k = round(rate * len(contrib))
    skipped = set(sorted(contrib, key=contrib.get)[:k])
    labels = torch.tensor([[float((i, j, g) in skipped) for g in range(ng)] for i, j in real])
    logits = torch.stack([margin[i, j] for i, j in real])
    return F.binary_cross_entropy_with_logits(logits, labels), k


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_imitation_loss_matches_a_brute_force_oracle(seed):
    torch.manual_seed(seed)
    b, t, ng, width, d = 2, 5, 3, 4, 6
    h = torch.randn(b, t, ng * width, requires_grad=True)
    weight = torch.randn(d, ng * width, requires_grad=True)
    margin = torch.randn(b, t, ng, requires_grad=True)
    execute = torch.rand(b, t, ng) < 0.6
    token_mask = torch.ones(b, t, dtype=torch.bool)
    token_mask[1, -2:] = False  # padding: neither ranked nor counted
    got = oracle_imitation_loss(h, weight, margin, execute, token_mask)
    want, k = _brute_force(h.detach(), weight.detach(), margin.detach(), execute, token_mask, width)
    assert 0 < k < (b * t - 2) * ng
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.backward()
    assert margin.grad is not None and margin.grad.abs().sum() > 0
    assert h.grad is None and weight.grad is None  # the oracle is a target, not a path for gradients
    assert margin.grad[1, -2:].abs().sum() == 0


def test_oracle_skips_nothing_when_the_router_runs_everything():
    torch.manual_seed(3)
    margin = torch.randn(1, 4, 2)
    loss = oracle_imitation_loss(torch.randn(1, 4, 8), torch.randn(5, 8), margin, torch.ones(1, 4, 2), None)
    torch.testing.assert_close(loss, F.binary_cross_entropy_with_logits(margin, torch.zeros_like(margin)))


def test_router_oracle_term_moves_the_routers_towards_the_oracle():
    """Trained on the term alone, the routers' argmax decisions agree with the oracle's more than at the start."""
    torch.manual_seed(0)
    cfg = WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.5, router_oracle=1.0)
    wm = WideModel(tiny_model("llama"), cfg)
    ids = torch.randint(0, 101, (4, 24))
    opt = torch.optim.Adam(wm.router_parameters(), lr=3e-2)

    def term() -> torch.Tensor:
        wm.mode = "gumbel"
        wm(ids)
        return wm.oracle_loss()

    with torch.no_grad():
        before = float(term())
    for _ in range(60):
        opt.zero_grad()
        term().backward()
        opt.step()
    with torch.no_grad():
        after = float(term())
    assert after < 0.7 * before, (before, after)


def test_calibration_with_the_router_oracle_logs_and_saves_it(tmp_path):
    from tests.train.test_calibrate import _dataset
    from wide.train.calibrate import TrainConfig, calibrate

    torch.manual_seed(0)
    cfg = WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.3, router_oracle=0.5)
    wm = WideModel(tiny_model("llama"), cfg)
    tc = TrainConfig(steps=3, batch_size=4, seq_len=16, log_every=1, save_every=100, fit_batches=1, lr=1e-2)
    calibrate(wm, _dataset(), tc, tmp_path, progress=False)
    logs = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["router_oracle_loss"]) and r["router_oracle_loss"] > 0 for r in logs)
    assert json.loads((tmp_path / "wide_config.json").read_text())["config"]["router_oracle"] == 0.5


def test_router_oracle_validation():
    with pytest.raises(WideConfigError, match="router_oracle must be >= 0"):
        WideConfig(router_oracle=-1.0)
    with pytest.raises(WideConfigError, match="needs method 'wide'"):
        WideConfig(router_oracle=1.0, method="module-skip")
    assert WideModel(tiny_model("llama"), WideConfig(ffn_group_size=16, router_rank=8)).oracle_loss() is None
