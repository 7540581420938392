"""The embedded SmolLM2-135M loads, routes and generates (real weights; ~25 s on two CPU cores)."""

from __future__ import annotations

import pytest
import torch

from wide.config import WideConfig
from wide.model import SMOLLM2, WideModel, load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_model(SMOLLM2)


def test_smollm2_loads_with_expected_shape(smollm2):
    model, tok = smollm2
    c = model.config
    assert (
        c.model_type,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.num_hidden_layers,
    ) == ("llama", 576, 9, 3, 1536, 30)
    assert model.config.wide_model_id == SMOLLM2 and tok.pad_token_id is not None


def test_smollm2_routes_and_generates(smollm2):
    model, tok = smollm2
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        dense = model(ids).logits
        wm = WideModel(model, WideConfig(sparsity=0.5))
        assert (wm.shape.attn_groups, wm.shape.ffn_groups) == (3, 12)
        wm.start_meter()
        routed = wm(ids).logits
        s = wm.stop_meter()
        out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    wm.detach()
    assert torch.isfinite(routed).all() and not torch.allclose(routed, dense)
    assert 0.2 < s["attn_sparsity"] < 0.8 and 0.2 < s["ffn_sparsity"] < 0.8
    assert out.shape[1] == ids.shape[1] + 5
