"""Routers, masks, the masked path vs an explicit per-token weight-slicing reference, gradients, losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tests.conftest import tiny_model
from wide.config import WideConfig
from wide.model import WideModel
from wide.routing import Router, fit_skip_bias, hard_gumbel_execute, split_router_groups
from wide.target import sparsity_loss


def test_router_shapes_and_modes():
    r = Router(d_in=32, n_groups=6, rank=8)
    x = torch.randn(2, 5, 32)
    assert r.skip_margin(x).shape == (2, 5, 6)
    m = r(x, "argmax")
    assert m.shape == (2, 5, 6) and m.dtype == torch.bool
    g = r(x, "gumbel", tau=1.0)
    assert g.shape == (2, 5, 6) and set(g.unique().tolist()) <= {0.0, 1.0}
    assert all(p.dtype == torch.float32 for p in r.parameters())


def test_router_initial_skip_rate_follows_init():
    r = Router(d_in=16, n_groups=4, rank=4, init_skip=0.25)
    p = torch.sigmoid(r.skip_margin(torch.zeros(1, 16)))  # the two-class softmax's P(skip)
    assert torch.allclose(p, torch.full_like(p, 0.25), atol=1e-5)


def test_split_groups_keep_the_coarse_decisions():
    """Each coarse group split k ways: every narrower group's margin is its coarse group's, on any input."""
    coarse, fine = Router(d_in=16, n_groups=3, rank=4), Router(d_in=16, n_groups=12, rank=4)
    with torch.no_grad():
        coarse.up.weight.normal_()
        coarse.up.bias.normal_()
        coarse.skip_bias.fill_(0.3)
    state = {f"2.ffn.{k}": v for k, v in coarse.state_dict().items()}
    split = split_router_groups(state, "ffn", 4)
    assert split["2.ffn.down.weight"] is state["2.ffn.down.weight"]  # only the output rows change
    fine.load_state_dict({k.removeprefix("2.ffn."): v for k, v in split.items()})
    x = torch.randn(5, 16)
    assert torch.equal(fine.skip_margin(x), coarse.skip_margin(x).repeat_interleave(4, dim=-1))
    assert split_router_groups(state, "attn", 4) == state  # another kind's routers: untouched
    with pytest.raises(ValueError, match="factor"):
        split_router_groups(state, "ffn", 0)


def test_router_stays_fp32_under_bf16_input():
    r = Router(d_in=16, n_groups=4, rank=4)
    assert r.skip_margin(torch.randn(3, 16, dtype=torch.bfloat16)).dtype == torch.float32


def test_margin_is_the_difference_of_the_two_logits():
    torch.manual_seed(0)
    r = Router(d_in=16, n_groups=4, rank=4)
    torch.nn.init.normal_(r.up.weight)
    r.skip_bias.fill_(0.25)
    x = torch.randn(7, 16)
    logits = r.up(r.down(x)).view(7, 4, 2)  # [.., execute, skip]
    torch.testing.assert_close(r.skip_margin(x), logits[..., 1] - logits[..., 0] + 0.25, rtol=1e-5, atol=1e-6)
    w_down, w_margin, b_margin = r.fold(torch.bfloat16)
    assert w_down.dtype == torch.bfloat16 and w_margin.dtype == b_margin.dtype == torch.float32


def test_autocast_reads_the_router_input_in_the_autocast_dtype():
    """An fp32 model under bf16 autocast routes as a bf16 model would (the served dtype)."""
    torch.manual_seed(0)
    r = Router(d_in=64, n_groups=4, rank=8)
    x = torch.randn(5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = r.skip_margin(x)
    assert torch.equal(under, r.skip_margin(x.bfloat16()))


def test_hard_gumbel_straight_through():
    margin = torch.randn(4, 3, requires_grad=True)
    y = hard_gumbel_execute(margin, tau=0.7)
    assert set(y.unique().tolist()) <= {0.0, 1.0}
    y.sum().backward()
    assert margin.grad is not None and margin.grad.abs().sum() > 0


def test_gumbel_rate_matches_softmax_probability():
    torch.manual_seed(0)
    margin = torch.full((200_000,), math.log(0.3 / 0.7))
    y = hard_gumbel_execute(margin, tau=5.0)
    assert abs((1 - y.mean()).item() - 0.3) < 0.01


def test_sparsity_loss_formulas():
    a, f = torch.tensor([0.2, 0.4]), torch.tensor([0.6, 0.8])
    cfg = WideConfig(sparsity=0.5, alpha=20)
    # eq. 6: 20 * |0.5 - mean(0.5 * (a + f))| = 20 * |0.5 - 0.5| = 0
    assert sparsity_loss(a, f, cfg).item() == pytest.approx(0.0, abs=1e-6)
    cfg = WideConfig(sparsity=0.25, alpha=20)
    assert sparsity_loss(a, f, cfg).item() == pytest.approx(20 * 0.25)
    cfg = WideConfig(attn_sparsity=0.5, ffn_sparsity=0.5, alpha=20)
    # eq. 22: 10 * (|0.5 - 0.3| + |0.5 - 0.7|) = 4
    assert sparsity_loss(a, f, cfg).item() == pytest.approx(4.0)


def test_fit_skip_bias_hits_rate():
    m = torch.randn(10_000)
    for rate in (0.0, 0.1, 0.5, 0.93, 1.0):
        d = fit_skip_bias(m, rate)
        assert abs(((m + d) > 0).float().mean().item() - rate) < 1e-3


# ------------------------------------------------------------------ the masked path is exact
def reference_layer(layer, x, cos, sin, attn_exec, ffn_exec, heads_per_group, ffn_group):
    """Decoder layer computed per token with only the active groups' weight slices.
    x: [B, T, D]; attn_exec: [B, T, N_attn] bool; ffn_exec: [B, T, N_ffn] bool."""
    at, mlp = layer.self_attn, layer.mlp
    b, t, _ = x.shape
    d = at.head_dim
    hq = at.config.num_attention_heads
    hk = at.config.num_key_value_heads
    h = layer.input_layernorm(x)
    q = at.q_proj(h).view(b, t, hq, d).transpose(1, 2)
    k = at.k_proj(h).view(b, t, hk, d).transpose(1, 2)
    v = at.v_proj(h).view(b, t, hk, d).transpose(1, 2)
    if hasattr(at, "q_norm"):  # qwen3
        q, k = at.q_norm(q), at.k_norm(k)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out = torch.zeros_like(x)
    for bi in range(b):
        for ti in range(t):
            acc = torch.zeros(x.shape[-1])
            for g in torch.nonzero(attn_exec[bi, ti]).flatten().tolist():
                for head in range(g * heads_per_group, (g + 1) * heads_per_group):
                    kvh = head // (hq // hk)
                    s = (k[bi, kvh, : ti + 1] @ q[bi, head, ti]) / math.sqrt(d)
                    o = s.softmax(0) @ v[bi, kvh, : ti + 1]  # [d]
                    acc += at.o_proj.weight[:, head * d : (head + 1) * d] @ o
            out[bi, ti] = acc
    x2 = x + out
    h2 = layer.post_attention_layernorm(x2)
    y = torch.zeros_like(x)
    for bi in range(b):
        for ti in range(t):
            groups = torch.nonzero(ffn_exec[bi, ti]).flatten().tolist()
            idx = (
                torch.cat([torch.arange(g * ffn_group, (g + 1) * ffn_group) for g in groups])
                if groups
                else torch.zeros(0, dtype=torch.long)
            )
            a = F.silu(mlp.gate_proj.weight[idx] @ h2[bi, ti]) * (mlp.up_proj.weight[idx] @ h2[bi, ti])
            y[bi, ti] = mlp.down_proj.weight[:, idx] @ a
    return x2 + y


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("attn_heads", [None, 1])
def test_masked_path_equals_weight_slicing_reference(family, attn_heads):
    model = tiny_model(family, layers=2, hidden=64, heads=4, kv=2, inter=64)
    if attn_heads == 1:
        with pytest.warns(UserWarning, match="GQA"):
            wm = WideModel(model, WideConfig(attn_group_size=attn_heads, ffn_group_size=16, router_rank=8))
    else:
        wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8))
    for r in wm.routers:  # make decisions mixed, not all-or-nothing
        torch.nn.init.normal_(r.attn.up.weight, std=2.0)
        torch.nn.init.normal_(r.ffn.up.weight, std=2.0)
    captured = {}
    layer1 = model.model.layers[1]

    def grab_in(module, args, kwargs):
        captured.update(x=kwargs.get("hidden_states", args[0] if args else None), pe=kwargs["position_embeddings"])

    h_in = layer1.register_forward_pre_hook(grab_in, with_kwargs=True)
    h_out = layer1.register_forward_hook(lambda m, a, o: captured.update(y=o[0] if isinstance(o, tuple) else o))
    ids = torch.randint(0, 101, (2, 6))
    with torch.no_grad():
        wm(ids)
    h_in.remove()
    h_out.remove()
    am, fm = wm.last_masks[1]["attn"], wm.last_masks[1]["ffn"]
    assert 0 < am.float().mean() < 1 and 0 < fm.float().mean() < 1
    cos, sin = captured["pe"]
    with torch.no_grad():
        ref = reference_layer(layer1, captured["x"], cos, sin, am, fm, wm.shape.attn_heads_per_group, 16)
    torch.testing.assert_close(captured["y"], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("source", ["block", "layer"])
@pytest.mark.parametrize("router_input", ["normed", "residual"])
def test_ffn_router_source_sets_what_the_ffn_router_reads(source, router_input):
    """ffn_router_source="block": the FFN router reads the FFN block's input (post-attention norm / residual);
    "layer": the layer's input, as the attention router does. The masks applied are those decisions."""
    model = tiny_model("llama", layers=2, hidden=64, heads=4, kv=2, inter=64)
    cfg = WideConfig(ffn_group_size=16, router_rank=8, router_input=router_input, ffn_router_source=source)
    wm = WideModel(model, cfg)
    for r in wm.routers:
        torch.nn.init.normal_(r.attn.up.weight, std=2.0)
        torch.nn.init.normal_(r.ffn.up.weight, std=2.0)
    layer = model.model.layers[1]
    seen = {}
    hooks = [
        layer.input_layernorm.register_forward_hook(lambda m, a, o: seen.update(x=a[0], h=o)),
        layer.post_attention_layernorm.register_forward_hook(lambda m, a, o: seen.update(x2=a[0], h2=o)),
    ]
    with torch.no_grad():
        wm(torch.randint(0, 101, (2, 7)))
    for h in hooks:
        h.remove()
    layer_in = seen["h"] if router_input == "normed" else seen["x"]
    block_in = seen["h2"] if router_input == "normed" else seen["x2"]
    r = wm.routers[1]
    with torch.no_grad():
        assert torch.equal(wm.last_masks[1]["attn"], r.attn.skip_margin(layer_in) <= 0)
        want = r.ffn.skip_margin(layer_in if source == "layer" else block_in) <= 0
        other = r.ffn.skip_margin(block_in if source == "layer" else layer_in) <= 0
    assert torch.equal(wm.last_masks[1]["ffn"], want) and not torch.equal(want, other)
    wm.detach()
    assert not any(n.startswith("_wide_slot") for m in model.modules() for n in vars(m))


def test_all_execute_equals_dense_and_dense_mode_bypasses():
    model = tiny_model("llama")
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        dense = model(ids).logits
        wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8))
        for r in wm.routers:
            r.attn.skip_bias.fill_(-1e4)
            r.ffn.skip_bias.fill_(-1e4)
        torch.testing.assert_close(wm(ids).logits, dense, rtol=0, atol=0)
        for r in wm.routers:
            r.attn.skip_bias.fill_(1e4)
        assert not torch.allclose(wm(ids).logits, dense)
        with wm.routing("dense"):
            torch.testing.assert_close(wm(ids).logits, dense, rtol=0, atol=0)
        wm.detach()
        torch.testing.assert_close(model(ids).logits, dense, rtol=0, atol=0)


def test_gradients_reach_routers_not_frozen_weights():
    model = tiny_model("llama")
    wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8))
    wm.freeze_base()
    ids = torch.randint(0, 101, (2, 7))
    with wm.routing("gumbel", tau=1.0):
        out = wm(ids, labels=ids)
        a, f = wm.skip_rates()
        (out.loss + sparsity_loss(a, f, wm.config)).backward()
    for name, p in wm.routers.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in model.parameters())


def test_lm_loss_alone_sends_gradient_to_routers():
    """The straight-through mask carries the LM loss gradient (not only the sparsity loss)."""
    model = tiny_model("llama")
    wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8))
    wm.freeze_base()
    ids = torch.randint(0, 101, (2, 7))
    with wm.routing("gumbel"):
        wm(ids, labels=ids).loss.backward()
    assert wm.routers[0].ffn.up.weight.grad.abs().sum() > 0
    assert wm.routers[0].attn.down.weight.grad.abs().sum() > 0


def test_skip_rates_exclude_padding():
    model = tiny_model("llama")
    wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8))
    ids = torch.randint(0, 101, (1, 4))
    am = torch.tensor([[1, 1, 0, 0]])
    with torch.no_grad():
        wm(ids, attention_mask=am)
    a, _ = wm.skip_rates()
    m = wm.last_masks[0]["attn"][0, :2].float()
    assert a[0].item() == pytest.approx(1 - m.mean().item())


def test_module_skipping_baseline_routes_whole_blocks():
    model = tiny_model("llama")
    wm = WideModel(model, WideConfig(module_skipping=True, router_rank=8))
    assert (wm.shape.attn_groups, wm.shape.ffn_groups) == (1, 1)
    for r in wm.routers:
        torch.nn.init.normal_(r.ffn.up.weight, std=3.0)
    ids = torch.randint(0, 101, (2, 8))
    captured = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: captured.append(o))
    with torch.no_grad():
        wm(ids)
    skip = ~wm.last_masks[0]["ffn"][..., 0]  # [B, T]
    assert skip.any() and (~skip).any()
    out = captured[-1]  # a skipped token's FFN output is exactly zero, an executed one is not
    assert torch.count_nonzero(out[skip]) == 0 and (out[~skip].abs().sum(-1) > 0).all()
