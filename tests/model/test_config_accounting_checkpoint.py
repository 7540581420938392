"""Config validation, FLOP / sparsity accounting on hand-made masks, checkpoint round trips."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tiny_model
from wide.accounting import FlopModel, SparsityMeter
from wide.config import ModelDims, WideConfig, WideConfigError
from wide.model import CheckpointMismatchError, UnsupportedModelError, WideModel, load_routers

DIMS = ModelDims(n_layers=2, hidden=64, n_q_heads=4, n_kv_heads=2, head_dim=16, intermediate=128, vocab=101)


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(ffn_group_size=24), "power of two"),
        (dict(ffn_group_size=8), "power of two"),
        (dict(sparsity=1.0), "sparsity"),
        (dict(attn_sparsity=0.3), "both"),
        (dict(router_rank=0), "router_rank"),
        (dict(router_input="hidden"), "router_input"),
        (dict(ffn_router_source="previous"), "ffn_router_source must be one of"),
        (dict(ffn_router_source="layer", method="layer-skip"), "layer-skip has none"),
        (dict(tau_end=0), "tau"),
    ],
)
def test_config_errors(kw, msg):
    with pytest.raises(WideConfigError, match=msg):
        WideConfig(**kw)


def test_group_sizes_that_do_not_divide_name_valid_choices():
    with pytest.raises(WideConfigError, match=r"valid choices: \[16, 32, 64, 128\]"):
        WideConfig(ffn_group_size=256).routing_shape(DIMS)
    with pytest.raises(WideConfigError, match=r"valid choices: \[1, 2, 4\]"):
        WideConfig(attn_group_size=3).routing_shape(DIMS)
    with pytest.warns(UserWarning, match="GQA"):
        s = WideConfig(attn_group_size=1).routing_shape(DIMS)
    assert s.attn_groups == 4
    s = WideConfig().routing_shape(DIMS)
    assert (s.attn_heads_per_group, s.attn_groups, s.ffn_groups, s.gqa_aligned) == (2, 2, 1, True)


def test_config_roundtrip_and_tau(tmp_path):
    c = WideConfig(attn_sparsity=0.4, ffn_sparsity=0.6, ffn_group_size=32, seed=3)
    c.save_json(tmp_path / "c.json")
    assert WideConfig.load_json(tmp_path / "c.json") == c
    assert c.tau_at(0, 11) == 5.0 and c.tau_at(10, 11) == 0.5 and c.tau_at(5, 11) == pytest.approx(2.75)
    with pytest.raises(WideConfigError, match="unknown"):
        WideConfig.from_dict({"bogus": 1})
    # configs saved while lookahead routers existed carry the field: false loads, true is refused by name
    assert WideConfig.from_dict({**c.to_dict(), "router_lookahead": False}) == c
    with pytest.raises(WideConfigError, match="router_lookahead routers are no longer supported"):
        WideConfig.from_dict({**c.to_dict(), "router_lookahead": True})
    # configs saved while the router-imitation term existed carry its weight: a training-only field, dropped
    assert WideConfig.from_dict({**c.to_dict(), "router_oracle": 1.0}) == c


def test_unsupported_architecture_is_a_clear_error():
    import transformers as tf

    m = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2, qwen3"):
        WideModel(m, WideConfig(ffn_group_size=16))


def test_meter_on_hand_made_masks():
    shape = WideConfig(ffn_group_size=32).routing_shape(DIMS)  # attn: 2 groups, ffn: 4 groups
    fm = FlopModel(DIMS, shape, router_rank=8)
    meter = SparsityMeter(fm)
    meter.set_token_mask(torch.tensor([[True, True, False]]))
    attn = torch.tensor([[[1, 0], [1, 1], [0, 0]]], dtype=torch.bool)  # token 0 skips 1/2, token 1 none
    ffn = torch.tensor([[[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]], dtype=torch.bool)  # 1/2 and 1
    for layer in range(2):
        meter.record(layer, "attn", attn)
        meter.record(layer, "ffn", ffn)
    s = meter.summary()
    assert s["tokens"] == 2
    assert s["attn_sparsity"] == pytest.approx(0.25)  # (1 + 0) / 4 decisions
    assert s["ffn_sparsity"] == pytest.approx(0.75)  # (2 + 4) / 8
    # FLOPs by hand (per layer, per token t with t + 1 keys)
    D, Hq, Hk, d, Dp, V = 64, 4, 2, 16, 128, 101
    qo, kv, ffn_f = 4 * D * Hq * d, 4 * D * Hk * d, 6 * D * Dp
    score = lambda n: 4 * Hq * d * n  # noqa: E731
    dense = sum(2 * (qo + kv + score(t + 1) + ffn_f) for t in range(2)) + 2 * 2 * D * V
    saved = 2 * (0.5 * (qo + score(1)) + 0 * (qo + score(2)) + 0.5 * ffn_f + 1.0 * ffn_f)
    routers = 2 * (2 * (D * 8 + 8 * 4) + 2 * (D * 8 + 8 * 8))  # per token, both layers
    assert s["flop_saving"] == pytest.approx((saved - 2 * routers) / dense)


def _routed_model(seed=0):
    m = tiny_model("llama", seed=seed)
    wm = WideModel(m, WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.3))
    for r in wm.routers:
        torch.nn.init.normal_(r.ffn.up.weight, std=1.0)
    return m, wm


def test_save_load_identical_outputs(tmp_path):
    m, wm = _routed_model()
    ids = torch.randint(0, 101, (2, 8))
    with torch.no_grad():
        ref = wm(ids).logits
    wm.routers[0].ffn.skip_bias.fill_(0.37)
    with torch.no_grad():
        ref = wm(ids).logits
    wm.save(tmp_path / "r", training={"steps": 1})
    meta = json.loads((tmp_path / "r" / "wide_config.json").read_text())
    assert meta["base_model"] == "tiny-llama" and meta["config"]["sparsity"] == 0.3
    wm.detach()
    m2 = tiny_model("llama", seed=0)
    wm2 = load_routers(m2, tmp_path / "r")
    with torch.no_grad():
        torch.testing.assert_close(wm2(ids).logits, ref, rtol=0, atol=0)
    assert wm2.routers[0].ffn.skip_bias.item() == pytest.approx(0.37)


def test_mismatched_checkpoint_errors(tmp_path):
    _, wm = _routed_model()
    wm.save(tmp_path / "r")
    other = tiny_model("llama", hidden=32, heads=4, kv=2, inter=64)
    with pytest.raises(CheckpointMismatchError, match="hidden"):
        load_routers(other, tmp_path / "r")
    same_dims = tiny_model("llama")
    same_dims.config.wide_model_id = "another-model"
    with pytest.raises(CheckpointMismatchError, match="calibrated on 'tiny-llama'"):
        load_routers(same_dims, tmp_path / "r")
    load_routers(same_dims, tmp_path / "r", strict_base=False).detach()
    meta = json.loads((tmp_path / "r" / "wide_config.json").read_text())
    meta["config"]["ffn_group_size"] = 32
    (tmp_path / "r" / "wide_config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointMismatchError, match="shape"):
        load_routers(tiny_model("llama"), tmp_path / "r")
    with pytest.raises(FileNotFoundError, match="wide_config.json"):
        load_routers(tiny_model("llama"), tmp_path)


def test_broken_checkpoint_files_name_the_file(tmp_path):
    from wide.model.checkpoint import check_checkpoint

    _, wm = _routed_model()
    wm.save(tmp_path / "r")
    wm.detach()
    check_checkpoint(tmp_path / "r")
    cfg = tmp_path / "r" / "wide_config.json"
    good = cfg.read_text()
    cfg.write_text(good[: len(good) // 2])
    for fn in (check_checkpoint, lambda d: load_routers(tiny_model("llama"), d)):
        with pytest.raises(CheckpointMismatchError, match=f"{cfg}: invalid JSON"):
            fn(tmp_path / "r")
    cfg.write_text(good)
    weights = tmp_path / "r" / "routers.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    for fn in (check_checkpoint, lambda d: load_routers(tiny_model("llama"), d)):
        with pytest.raises(CheckpointMismatchError, match=f"{weights} is truncated"):
            fn(tmp_path / "r")
