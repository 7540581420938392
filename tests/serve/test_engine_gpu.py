"""The engine on a GPU: CUDA-graph decode steps equal eager ones, and batch-invariant mode makes a request's greedy
tokens independent of its batch-mates (fused decode layer, bf16)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model
from wide.config import WideConfig
from wide.model import WideModel
from wide.runtime import WideRuntime
from wide.serve import Engine, SamplingParams

pytestmark = pytest.mark.gpu


def _wm():
    model = tiny_model("llama", layers=2, hidden=256, heads=8, kv=4, inter=512, vocab=512, seed=0)
    wm = WideModel(model, WideConfig(ffn_group_size=32, router_rank=8, sparsity=0.5))
    for r in wm.routers:
        torch.nn.init.normal_(r.attn.up.weight, std=2.0)
        torch.nn.init.normal_(r.ffn.up.weight, std=2.0)
    model.to("cuda", torch.bfloat16)
    wm.routers.to("cuda")
    return wm


def _prompts(n: int):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 200, (n,), generator=g)  # prompt + output within the tiny model's 256 positions
    return [torch.randint(0, 512, (int(k),), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("routed", [True, False])
def test_graphed_engine_equals_eager(routed):
    wm = _wm()
    prompts, sp = _prompts(6), SamplingParams(max_tokens=12, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        rt = WideRuntime(wm, max_batch=4, max_seq=512, routed=routed, batch_invariant=True)
        eng = Engine(rt, cuda_graphs=graphs)
        assert bool(eng._graphs) == graphs
        runs.append([(r.token_ids, r.attn_sparsity, r.ffn_sparsity) for r in eng.run(prompts, sp)])
        assert eng.load() == (0, 0)
    assert runs[0] == runs[1]  # tokens, and the sparsity the graph counted inside the step equal the eager count


def test_batch_invariant_mode_greedy_tokens_do_not_depend_on_the_batch():
    wm = _wm()
    eng = Engine(WideRuntime(wm, max_batch=8, max_seq=512, batch_invariant=True))
    prompts, sp = _prompts(8), SamplingParams(max_tokens=16, ignore_eos=True)
    together = [r.token_ids for r in eng.run(prompts, sp)]
    alone = [eng.run([p], sp)[0].token_ids for p in prompts]
    assert together == alone
