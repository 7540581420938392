"""The runtime's serving slots through the fused decode layer (Triton interpreter on the CPU): per-slot prefill,
a padded decode batch with idle rows, batch-invariant split counts."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model
from wide.config import WideConfig
from wide.kernels._triton_utils import interpret_mode
from wide.model import WideModel
from wide.runtime import WideRuntime
from wide.serve import Engine, SamplingParams

pytestmark = pytest.mark.slow


def _masked_greedy(wm, prompt, n):
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, wm(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[0, len(prompt) :].tolist()


def test_fused_decode_with_idle_rows_serves_the_masked_path_tokens():
    if not (interpret_mode() or torch.cuda.is_available()):
        pytest.skip("the fused layer runs on a GPU or in the Triton interpreter")
    model = tiny_model("llama", layers=2, hidden=128, heads=4, kv=2, inter=64, seed=0)
    wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.5))
    for r in wm.routers:  # mixed decisions
        torch.nn.init.normal_(r.attn.up.weight, std=2.0)
        torch.nn.init.normal_(r.ffn.up.weight, std=2.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 101, (n,), generator=g).tolist() for n in (3, 9, 5)]
    rt = WideRuntime(wm, max_batch=4, max_seq=32, fused_decode=True, batch_invariant=True)
    assert rt.fused_layers is not None and rt.attn_splits is not None
    # 3 requests, finishing at different steps: the padded batch of 4 rows has idle rows from the start
    res = Engine(rt, cuda_graphs=False).run(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 2, 3)])
    for p, r in zip(prompts, res, strict=True):
        assert _masked_greedy(wm, p, len(r.token_ids)) == r.token_ids
        assert 0 < r.attn_sparsity < 1
