"""`wide demo` on the embedded SmolLM2-135M with the shipped routers (slow: real weights on the CPU)."""

from __future__ import annotations

import pytest

from wide.demo import run_demo, shipped_routers

pytestmark = pytest.mark.slow


def test_demo_runs_with_shipped_routers(capsys):
    assert [p.name for p in shipped_routers()] == ["smollm2-135m-s25", "smollm2-135m-s50"]
    res = run_demo(max_tokens=512, prompt="Hello")
    out = capsys.readouterr().out
    assert "real sparsity" in out and "dense" in out
    for name in ("smollm2-135m-s25", "smollm2-135m-s50"):
        sp = res[name]["sparsity"]
        # the shipped routers reach their targets at inference (within 0.08 on a short slice)
        assert abs(0.5 * (sp["attn_sparsity"] + sp["ffn_sparsity"]) - res[name]["target"]) < 0.08
        assert res[name]["ppl"]["token_perplexity"] > res["dense"]["ppl"]["token_perplexity"]
