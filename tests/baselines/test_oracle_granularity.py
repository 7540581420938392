"""bench/quality/oracle_granularity.py: the magnitude oracle and TEAL-style FFN forwards skip what they say."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.quality import oracle_granularity as og
from tests.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _mlp():
    return tiny_model("llama", layers=1, hidden=64, heads=4, kv=2, inter=96, seed=0).model.layers[0].mlp


def test_oracle_skips_the_smallest_group_contributions():
    torch.manual_seed(0)
    mlp, x = _mlp(), torch.randn(2, 5, 64)
    with torch.no_grad():
        dense = mlp(x)
        torch.testing.assert_close(og.oracle_mlp(mlp, 0.0, 16)(x), dense)  # rate 0: nothing skipped
        torch.testing.assert_close(og.teal_mlp(mlp, 0.0)(x), dense)
        a = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)  # [2, 5, 96]
        contrib = torch.einsum("btgc,dgc->btgd", a.view(2, 5, 6, 16), mlp.down_proj.weight.view(64, 6, 16)).norm(dim=-1)
        out = og.oracle_mlp(mlp, 0.5, 16)(x)
        keep = contrib > contrib.flatten().kthvalue(30).values  # 60 (token, group) pairs, half skipped
        want = mlp.down_proj(a * keep.repeat_interleave(16, dim=-1))
        torch.testing.assert_close(out, want)
        assert keep.float().mean() == 0.5
        # G = 1: a channel's contribution is |a_c| ||W_down[:, c]||
        score = a.abs() * mlp.down_proj.weight.norm(dim=0)
        keep1 = score > score.flatten().kthvalue(round(0.25 * score.numel())).values
        torch.testing.assert_close(og.oracle_mlp(mlp, 0.25, 1)(x), mlp.down_proj(a * keep1))


def test_teal_zeroes_the_smallest_inputs_of_each_projection():
    torch.manual_seed(1)
    mlp, x = _mlp(), torch.randn(1, 7, 64)
    with torch.no_grad():
        out = og.teal_mlp(mlp, 0.5)(x)
        xs = x * (x.abs() > x.abs().flatten().kthvalue(round(0.5 * x.numel())).values)
        assert (xs == 0).float().mean() == 0.5
        a = mlp.act_fn(mlp.gate_proj(xs)) * mlp.up_proj(xs)
        a = a * (a.abs() > a.abs().flatten().kthvalue(round(0.5 * a.numel())).values)
        torch.testing.assert_close(out, mlp.down_proj(a))


def test_attention_oracle_zeroes_the_smallest_head_groups():
    torch.manual_seed(2)
    attn = tiny_model("llama", layers=1, hidden=64, heads=4, kv=2, inter=96, seed=0).model.layers[0].self_attn
    o = torch.randn(1, 6, 64)  # [B, T, Hq * d], d = 16, 2 heads per KV group
    w = attn.o_proj.weight
    (got,) = og.oracle_o_hook(attn, 0.5, 2)(attn.o_proj, (o,))
    y = torch.einsum("bthc,Dhc->bthD", o.view(1, 6, 4, 16), w.view(64, 4, 16)).view(1, 6, 2, 2, 64).sum(3)
    score = y.norm(dim=-1)  # [1, 6, 2]: 12 (token, group) pairs, 6 skipped
    keep = score > score.flatten().kthvalue(6).values
    torch.testing.assert_close(got, o * keep.repeat_interleave(32, dim=-1))
    (full,) = og.oracle_o_hook(attn, 0.0, 1)(attn.o_proj, (o,))
    assert torch.equal(full, o)
    (t,) = og.teal_hook(0.25)(None, (o,))
    assert (t == 0).float().mean() == 0.25


def test_plot_reads_a_result_file(tmp_path):
    rows = [{"method": "dense", "ffn_skip": 0.0, "word_ppl": 10.0},
            {"method": "learned", "routers": "r", "group": 128, "ffn_skip": 0.4, "word_ppl": 40.0}]  # fmt: skip
    for alloc in ("learned", "uniform"):
        rows += [{"method": "oracle", "allocation": alloc, "group": g, "ffn_skip": 0.4, "word_ppl": 10.0 + g}
                 for g in og.GROUPS]  # fmt: skip
        rows.append({"method": "teal", "allocation": alloc, "ffn_skip": 0.4, "word_ppl": 12.0})
    result = {"command": "c", "docs": 1, "max_length": 64, "wall_s": 1.0, "rows": rows}
    og.write(result, tmp_path / "g.json")
    assert json.loads((tmp_path / "g.json").read_text()) == result
    assert "magnitude oracle, G 1 (per channel) | uniform" in (tmp_path / "g.md").read_text()
    og.plot(result, tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 0


def test_attention_result_file(tmp_path):
    rows = [{"method": "dense", "attn_skip": 0.0, "word_ppl": 10.0},
            {"method": "learned", "routers": "r", "heads": 3, "attn_skip": 0.6, "word_ppl": 20.0},
            {"method": "oracle", "allocation": "uniform", "heads": 3, "attn_skip": 0.6, "word_ppl": 30.0},
            {"method": "oracle", "allocation": "uniform", "heads": 1, "attn_skip": 0.6, "word_ppl": 15.0},
            {"method": "teal", "allocation": "uniform", "attn_skip": 0.6, "word_ppl": 12.0}]  # fmt: skip
    og.write({"command": "c", "kind": "attn", "docs": 1, "max_length": 64, "wall_s": 1.0, "rows": rows},
             tmp_path / "a.json")  # fmt: skip
    md = (tmp_path / "a.md").read_text()
    assert "attention at the routers' skip rates (CPU, FFN dense)" in md
    assert "| magnitude oracle, per 3 query heads (a KV group) | uniform | 0.600 | 30.00 | 3.00 |" in md
    assert "| learned WIDE routers (`r`, 3 heads) | learned | 0.600 | 20.00 | 2.00 |" in md
