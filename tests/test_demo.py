"""`wide demo` on the embedded SmolLM2-135M with the shipped routers (slow: real weights on the CPU)."""

from __future__ import annotations

import pytest

from wide.demo import run_demo, shipped_routers
from wide.model.checkpoint import has_adapter
from wide.paths import SHIPPED_ROUTERS

pytestmark = pytest.mark.slow


def test_demo_runs_with_shipped_routers(capsys):
    assert [p.name for p in shipped_routers()] == list(SHIPPED_ROUTERS)
    assert [has_adapter(p) for p in shipped_routers()] == [False, True, False, True]
    res = run_demo(max_tokens=512, prompt="Hello")
    out = capsys.readouterr().out
    assert "real sparsity" in out and "dense" in out
    for name in SHIPPED_ROUTERS:
        sp = res[name]["sparsity"]
        # the shipped routers reach their targets at inference (within 0.08 on a short slice)
        assert abs(0.5 * (sp["attn_sparsity"] + sp["ffn_sparsity"]) - res[name]["target"]) < 0.08
        assert res[name]["ppl"]["token_perplexity"] > res["dense"]["ppl"]["token_perplexity"]
    # the LoRA checkpoint runs on its merged weights, the others on the base weights: the 50% row scored
    # after it equals the 50% checkpoint scored alone
    alone = run_demo(routers="smollm2-135m-s50", max_tokens=512, prompt="Hello")
    assert alone["smollm2-135m-s50"]["ppl"] == res["smollm2-135m-s50"]["ppl"]
    assert res["smollm2-135m-s25-lora"]["ppl"] != res["smollm2-135m-s25"]["ppl"]
    assert res["smollm2-135m-s50-lora"]["ppl"] != res["smollm2-135m-s50"]["ppl"]
