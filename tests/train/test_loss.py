"""Chunked LM loss equals the Hugging Face loss, value and router gradients."""

from __future__ import annotations

import torch

from tests.conftest import tiny_model
from wide.config import WideConfig
from wide.model import WideModel
from wide.train.loss import chunked_lm_loss


def test_chunked_loss_equals_hf_loss_and_gradients():
    model = tiny_model("llama")
    wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8))
    wm.freeze_base()
    ids = torch.randint(0, 101, (3, 11))
    am = torch.ones_like(ids)
    am[1, 8:] = 0
    labels = ids.masked_fill(am == 0, -100)
    grads = []
    for chunked in (False, True):
        torch.manual_seed(0)  # same Gumbel noise in both runs
        with wm.routing("gumbel", tau=1.0):
            if chunked:
                loss = chunked_lm_loss(wm.hidden_states(ids, attention_mask=am), labels, model.lm_head, 7)
            else:
                loss = wm(ids, attention_mask=am, labels=labels).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in wm.routers.parameters()]))
        wm.routers.zero_grad()
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
