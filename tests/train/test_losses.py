"""Levers beyond the paper: distillation KL against a torch reference, the dense teacher, FLOP weights
and the FLOP-weighted sparsity target, and the calibration loop running with them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import tiny_model
from wide.accounting import FlopModel
from wide.config import ModelDims, WideConfig, WideConfigError
from wide.model import WideModel
from wide.target import flop_weights, model_flop_weights, routing_sparsity_loss
from wide.train.losses import chunked_kl_loss, task_loss, teacher_hidden


def _batch(b=3, t=11, pad_row=1, pad_from=8):
    ids = torch.randint(0, 101, (b, t))
    am = torch.ones_like(ids)
    am[pad_row, pad_from:] = 0
    return ids, am, ids.masked_fill(am == 0, -100)


def test_chunked_kl_equals_torch_reference_value_and_gradient():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    h = torch.randn(2, 9, 16, requires_grad=True)
    ht = torch.randn(2, 9, 16)
    labels = torch.randint(0, 50, (2, 9))
    labels[1, 6:] = -100
    got = chunked_kl_loss(h, ht, labels, head, chunk_tokens=5)
    got.backward()
    g_got = h.grad.clone()
    h.grad = None
    # reference: full logits, torch's KL(teacher || student) per scored position, mean over them
    s = F.log_softmax(head(h[:, :-1]), -1)
    t = F.log_softmax(head(ht[:, :-1]), -1)
    keep = labels[:, 1:] != -100
    want = F.kl_div(s[keep], t[keep], log_target=True, reduction="batchmean")
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_got, h.grad, rtol=1e-4, atol=1e-7)
    # a student equal to the teacher has zero KL
    with torch.no_grad():
        assert float(chunked_kl_loss(ht, ht, labels, head, 4)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("with_teacher", [False, True])
def test_chunked_task_losses_compiled_equals_eager(with_teacher):
    """One pass gives the plain LM loss (and the KL, 0 without a teacher); the torch.compile'd chunk
    (what `--compile` trains with) gives the same values and gradients up to fp32 rounding."""
    from wide.train.loss import chunked_lm_loss, chunked_task_losses

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    h = torch.randn(2, 9, 16, requires_grad=True)
    ht = torch.randn(2, 9, 16) if with_teacher else None
    labels = torch.randint(0, 50, (2, 9))
    labels[1, 6:] = -100
    out = {}
    for compiled in (False, True):
        lm, kl = chunked_task_losses(h, ht, labels, head, chunk_tokens=5, compiled=compiled)
        (lm + 0.5 * kl).backward()
        out[compiled] = (lm.detach(), kl.detach(), h.grad.clone())
        h.grad = None
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[False][0], chunked_lm_loss(h, labels, head, 5).detach())
    assert (float(out[False][1]) > 0) == with_teacher  # the KL's value: test_chunked_kl_equals_torch_reference...


def test_teacher_is_the_dense_model_and_keeps_the_student_masks():
    model = tiny_model("llama")
    ids, am, _ = _batch()
    with torch.no_grad():  # before the routers are attached
        dense = model.model(input_ids=ids, attention_mask=am).last_hidden_state
    wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8, distill="kl"))
    teacher = teacher_hidden(wm, ids, am)
    torch.testing.assert_close(teacher, dense)
    assert wm.mode == "argmax"  # routing restored
    routed = wm.hidden_states(ids, attention_mask=am)
    assert not torch.allclose(routed, dense)
    assert wm.last_masks[0]["attn"].shape == (3, 11, 2)
    wm.config.distill = "none"
    assert teacher_hidden(wm, ids, am) is None


@pytest.mark.parametrize("mode", ["none", "kl", "kl+lm"])
def test_task_loss_modes(mode):
    from wide.train.loss import chunked_lm_loss

    model = tiny_model("llama")
    wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8, distill=mode))
    wm.freeze_base()
    ids, am, labels = _batch()
    teacher = teacher_hidden(wm, ids, am)
    torch.manual_seed(0)
    with wm.routing("gumbel", tau=1.0):
        hidden = wm.hidden_states(ids, attention_mask=am)
    obj, lm = task_loss(wm, hidden, labels, teacher, 7)
    lm_ref = chunked_lm_loss(hidden, labels, model.lm_head, 7)
    torch.testing.assert_close(lm, lm_ref)
    if mode == "none":
        assert obj is lm
    else:
        kl = chunked_kl_loss(hidden, teacher, labels, model.lm_head, 7)
        torch.testing.assert_close(obj, kl if mode == "kl" else lm_ref + kl)
        assert kl.item() > 0
    obj.backward()  # the routers get a gradient through the straight-through masks
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in wm.routers.parameters())


def test_flop_weights_match_a_hand_count():
    dims = ModelDims(n_layers=3, hidden=64, n_q_heads=4, n_kv_heads=2, head_dim=16, intermediate=128, vocab=101)
    cfg = WideConfig(ffn_group_size=16, router_rank=8)
    fm = FlopModel(dims, cfg.routing_shape(dims), 8)
    w = flop_weights(fm, seq_len=9)
    q_o = 2 * 2 * 64 * 64
    kv = 2 * 2 * 64 * 32
    scores = 2 * 2 * 4 * 16 * 5.0  # mean key count of 9 packed tokens: (9 + 1) / 2
    ffn = 3 * 2 * 64 * 128
    routers = fm.routers_per_layer  # wide.accounting's count (tested in tests/model)
    dense = 3 * (q_o + kv + scores + ffn) + 2 * 64 * 101
    assert w.dense == pytest.approx(dense)
    assert w.attn == pytest.approx((q_o + scores) / dense)
    assert w.kv == pytest.approx(kv / dense)
    assert w.ffn == pytest.approx(ffn / dense)
    assert w.routers == pytest.approx(3 * routers / dense)
    # every layer skipping all of attention and FFN removes everything but K/V, lm_head and the routers
    full = w.removed(torch.ones(3), torch.ones(3))
    assert float(full) == pytest.approx(1 - (3 * kv + 2 * 64 * 101 + 3 * routers) / dense)


def test_flops_target_loss_and_validation():
    wm = WideModel(
        tiny_model("llama"), WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.3, sparsity_kind="flops")
    )
    w = model_flop_weights(wm, 16)
    a = torch.tensor([0.2, 0.6])
    f = torch.tensor([0.4, 0.1])
    got = routing_sparsity_loss(a, f, wm.config, w)
    want = 20.0 * abs(0.3 - (w.attn * 0.8 + w.ffn * 0.5 - w.routers))
    assert float(got) == pytest.approx(want)
    groups = WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.3)
    assert float(routing_sparsity_loss(a, f, groups)) == pytest.approx(20.0 * abs(0.3 - 0.5 * (0.4 + 0.25)))
    with pytest.raises(ValueError, match="FlopWeights"):
        routing_sparsity_loss(a, f, wm.config)
    with pytest.raises(WideConfigError, match="shared target"):
        WideConfig(attn_sparsity=0.3, ffn_sparsity=0.3, sparsity_kind="flops")
    with pytest.raises(WideConfigError, match="distill"):
        WideConfig(distill="mse")


def test_layer_skip_flop_weights_count_one_router():
    from wide.baselines import build

    cfg = WideConfig(router_rank=8, method="layer-skip", sparsity_kind="flops")
    wm = build(tiny_model("llama"), cfg)
    w = model_flop_weights(wm, 16)
    one = wm.meter.flops.routers_per_layer / 2  # the two routers of a layer are the same size
    assert w.routers * w.dense == pytest.approx(2 * one)  # 2 layers, one router each


@pytest.mark.parametrize("distill", ["kl", "kl+lm"])
def test_calibration_runs_with_distillation_and_flops_target(tmp_path, distill):
    import json

    from tests.train.test_calibrate import _dataset
    from wide.train.calibrate import TrainConfig, calibrate

    torch.manual_seed(0)
    cfg = WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.3, sparsity_kind="flops", distill=distill)
    wm = WideModel(tiny_model("llama"), cfg)
    tc = TrainConfig(steps=3, batch_size=4, seq_len=16, log_every=1, save_every=100, fit_batches=1, lr=1e-2)
    summary = calibrate(wm, _dataset(), tc, tmp_path, progress=False)
    assert summary["steps"] == 3
    logs = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["lm_loss"]) for r in logs)
    saved = json.loads((tmp_path / "wide_config.json").read_text())["config"]
    assert saved["distill"] == distill and saved["sparsity_kind"] == "flops"


def test_unreachable_flops_target_is_a_clear_error():
    wm = WideModel(
        tiny_model("llama"), WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.9, sparsity_kind="flops")
    )
    with pytest.raises(ValueError, match="cannot be removed by this routing"):
        model_flop_weights(wm, 16)


def test_stage2_teacher_is_the_base_model_without_lora():
    from wide.train.lora import apply_lora

    model = tiny_model("llama")
    ids, am, _ = _batch()
    with torch.no_grad():
        base = model.model(input_ids=ids, attention_mask=am).last_hidden_state
    adapter = apply_lora(model, r=4, alpha=8, dropout=0.0)
    for n, p in model.named_parameters():  # non-zero adapters: their path changes the output
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8, distill="kl"))
    torch.testing.assert_close(teacher_hidden(wm, ids, am, adapter), base)
    with wm.routing("dense"), torch.no_grad():
        with_lora = wm.hidden_states(ids, attention_mask=am)
    assert not torch.allclose(with_lora, base)  # the adapter is back on after the teacher forward
