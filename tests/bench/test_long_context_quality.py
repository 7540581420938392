"""bench.quality.long_context_quality on a tiny model: the windows' per-token losses and the record's table."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bench.quality import long_context_quality as Q
from tests.conftest import tiny_model


def test_window_nll_scores_every_token_of_disjoint_windows():
    """Window w's input is [prefix] + its first L - 1 tokens, its targets all L tokens: the loss of each token
    is the model's, computed here on the window alone; tokens past the last whole window are not scored."""
    model = tiny_model()
    stream = torch.randint(1, 101, (2 * 16 + 5,), generator=torch.Generator().manual_seed(0)).tolist()
    nll = Q.window_nll(model, stream, 16, prefix=0)
    assert nll.shape == (2, 16)
    tgt = torch.tensor(stream[16:32])
    ids = torch.cat([torch.tensor([0]), tgt[:-1]])[None]
    with torch.no_grad():
        ref = -F.log_softmax(model(ids).logits[0].float(), -1).gather(-1, tgt[:, None])[:, 0]
    torch.testing.assert_close(nll[1].float(), ref, rtol=1e-5, atol=1e-5)


def test_measure_meters_a_routed_model_and_buckets_positions(monkeypatch):
    """Buckets are perplexities over those positions of every window (a bucket past the window is left out); the
    token perplexity is their token-weighted mean; a routed model's real skip rates are recorded."""
    from wide.config import WideConfig
    from wide.model import WideModel

    model = tiny_model()
    wm = WideModel(model, WideConfig(sparsity=0.5, ffn_group_size=32))
    stream = torch.randint(1, 101, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    monkeypatch.setattr(Q, "BUCKETS", ((0, 16), (16, 64), (64, 128)))
    row = Q.measure(model, wm, "tiny", "masked", stream, 32, prefix=0)
    assert row.tokens == 64 and row.windows == 2
    assert set(row.bucket_perplexity) == {"0-16"}  # 16-64 and 64-128 reach past a 32-token window
    nll = Q.window_nll(model, stream, 32, prefix=0)
    assert row.bucket_perplexity["0-16"] == pytest.approx(math.exp(float(nll[:, :16].mean())))
    assert row.token_perplexity == pytest.approx(math.exp(float(nll.mean())))
    assert 0.0 <= row.attn_sparsity <= 1.0 and 0.0 <= row.ffn_sparsity <= 1.0
    dense = Q.measure(model, None, "dense", "hf", stream, 64, prefix=0)
    assert dense.attn_sparsity is None


def test_markdown_ratios_are_against_dense_on_the_same_window():
    def row(name, window, ppl):
        return {"row": name, "path": "masked", "window": window, "token_perplexity": ppl,
                "bucket_perplexity": {"0-2048": ppl}, "attn_sparsity": None, "ffn_sparsity": None}  # fmt: skip

    rec = {"command": "c", "commit": "x", "tokens": 8, "source": "s",
           "rows": [row("dense", 8, 10.0), row("r", 8, 15.0), row("dense", 4, 20.0), row("r", 4, 25.0)]}  # fmt: skip
    md = Q.to_markdown(rec)
    assert "| r | masked | 8 | 15.000 | 1.500 |" in md
    assert "| r | masked | 4 | 25.000 | 1.250 |" in md


def test_pool_weights_slices_by_their_tokens():
    """Pooled token perplexity is exp(summed NLL / summed tokens); × dense on the pooled tokens; skip rates weighted
    by tokens; a (row, path, window) missing from one slice is left out."""

    def row(name, window, ppl, tokens, attn=None):
        return {"row": name, "path": "hf" if name == "dense" else "masked", "window": window, "tokens": tokens,
                "token_perplexity": ppl, "attn_sparsity": attn, "ffn_sparsity": attn}  # fmt: skip

    a = {"rows": [row("dense", 2048, 10.0, 100), row("s50", 2048, 20.0, 100, 0.5), row("s25", 2048, 12.0, 100, 0.2)]}
    b = {"rows": [row("dense", 2048, 40.0, 300), row("s50", 2048, 60.0, 300, 0.7)]}
    got = {r["row"]: r for r in Q.pool([a, b])}
    assert set(got) == {"dense", "s50"}
    d = math.exp((100 * math.log(10.0) + 300 * math.log(40.0)) / 400)
    w = math.exp((100 * math.log(20.0) + 300 * math.log(60.0)) / 400)
    assert math.isclose(got["dense"]["token_perplexity"], d) and math.isclose(got["s50"]["x_dense"], w / d)
    assert math.isclose(got["s50"]["attn_sparsity"], 0.65) and got["dense"]["attn_sparsity"] is None
    assert got["s50"]["tokens"] == 400 and got["s50"]["slices"] == 2
