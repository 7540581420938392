"""Stage 2: LoRA recovery trains adapters + routers, masks cover the adapter path, save -> merge -> load."""

from __future__ import annotations

import torch

from tests.conftest import tiny_model
from tests.train.test_calibrate import _dataset
from wide.config import WideConfig
from wide.model import WideModel, load_routers
from wide.train.calibrate import TrainConfig, calibrate
from wide.train.lora import apply_lora


def _stage1(tmp_path):
    wm = WideModel(tiny_model("llama"), WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.4))
    calibrate(
        wm, _dataset(), TrainConfig(steps=3, batch_size=4, seq_len=16, fit_batches=1), tmp_path / "s1", progress=False
    )
    wm.detach()
    return tmp_path / "s1"


def test_lora_stage_trains_adapters_and_merges_back(tmp_path):
    s1 = _stage1(tmp_path)
    model = tiny_model("llama")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = apply_lora(model, r=4, alpha=8, dropout=0.0)
    wm = load_routers(model, s1)
    for n, p in model.named_parameters():  # make the adapters non-zero so their path matters
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    stage1_bias = {f"{k}{i}": float(getattr(r, k).skip_bias) for i, r in enumerate(wm.routers) for k in ("attn", "ffn")}
    assert any(v != 0 for v in stage1_bias.values())  # stage 1's fit moved the offsets
    summary = calibrate(
        wm,
        _dataset(),
        TrainConfig(steps=3, batch_size=4, seq_len=16, fit_batches=1, lr=1e-2),
        tmp_path / "s2",
        progress=False,
        adapter=adapter,
    )
    # stage 2 sampled under stage 1's offsets, and its fit aims at the rates it trained at (with them)
    assert summary["skip_bias_fit"]["trained_skip_bias"] == stage1_bias
    assert (tmp_path / "s2" / "adapter_config.json").is_file()
    assert (tmp_path / "s2" / "adapter_model.safetensors").is_file()
    # base weights untouched, LoRA + routers trained
    for k, v in adapter.base_model.model.state_dict().items():
        if "lora_" not in k and k.replace("base_layer.", "") in base:
            assert torch.equal(v, base[k.replace("base_layer.", "")]), k
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        ref = wm(ids).logits
    # every inference path: load_routers merges the checkpoint's adapter into the base, then attaches the routers
    wm2 = load_routers(tiny_model("llama"), tmp_path / "s2")
    with torch.no_grad():
        torch.testing.assert_close(wm2(ids).logits, ref, rtol=1e-4, atol=1e-4)


def test_masks_cover_the_lora_path(tmp_path):
    """With every group skipped, a LoRA-wrapped o_proj/down_proj contributes nothing at all."""
    model = tiny_model("llama")
    apply_lora(model, r=4, alpha=8, dropout=0.0)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8))
    captured = []
    layer = model.model.layers[0]
    layer.mlp.down_proj.register_forward_hook(lambda m, a, o: captured.append(o))
    for r in wm.routers:
        r.ffn.skip_bias.fill_(1e4)
    with torch.no_grad():
        wm(torch.randint(0, 101, (1, 5)))
    assert torch.count_nonzero(captured[-1]) == 0
