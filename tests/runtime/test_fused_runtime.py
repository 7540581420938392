"""The fused decode runtime (``fused_decode=True``) equals the unfused runtime and the masked path."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model
from wide.config import WideConfig
from wide.model import WideModel
from wide.runtime import WideRuntime, generate


def _routed(family: str, seed: int = 0, router_input: str = "normed", source: str = "block"):
    # head_dim 32 (the fused QKV kernel pairs RoPE halves of >= 16 columns), FFN groups of 16
    model = tiny_model(family, layers=2, hidden=128, heads=4, kv=2, inter=96, seed=seed)
    cfg = WideConfig(
        ffn_group_size=16, router_rank=8, sparsity=0.5, router_input=router_input, ffn_router_source=source
    )
    wm = WideModel(model, cfg)
    for r in wm.routers:  # mixed decisions
        torch.nn.init.normal_(r.attn.up.weight, std=2.0)
        torch.nn.init.normal_(r.ffn.up.weight, std=2.0)
    return model, wm


def _masked_greedy(wm: WideModel, ids: torch.Tensor, n: int) -> torch.Tensor:
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, wm(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq


@pytest.mark.parametrize(
    "family",
    ["llama", "qwen3", pytest.param("mistral", marks=pytest.mark.slow), pytest.param("qwen2", marks=pytest.mark.slow)],
)
def test_fused_greedy_decode_equals_unfused_and_masked_path(family):
    _, wm = _routed(family, seed=1)
    ids = torch.randint(0, 101, (3, 4))
    fused = generate(WideRuntime(wm, max_batch=3, max_seq=16, fused_decode=True), ids, 5)
    unfused = generate(WideRuntime(wm, max_batch=3, max_seq=16, fused_decode=False), ids, 5)
    assert torch.equal(fused, unfused)
    assert torch.equal(fused, _masked_greedy(wm, ids, 5))


@pytest.mark.parametrize(("router_input", "source"), [("residual", "block"), ("normed", "layer")])
def test_fused_decode_routers_read_what_the_masked_path_reads(router_input, source):
    """router_input="residual": the fused step's routers read the residual entering attention / the FFN;
    ffn_router_source="layer": the FFN router reads the layer's input. As the masked path's and the unfused
    runtime's do (their decisions differ from the default's: the normed input of each block)."""
    model, wm = _routed("llama", seed=1, router_input=router_input, source=source)
    for layer, r in zip(model.model.layers, wm.routers, strict=True):  # norm and margin offsets: the two differ
        layer.input_layernorm.weight.data.uniform_(0.2, 2.0)
        layer.post_attention_layernorm.weight.data.uniform_(0.2, 2.0)
        r.attn.skip_bias.fill_(0.3)
        r.ffn.skip_bias.fill_(-0.2)
    ids = torch.randint(0, 101, (3, 4))
    fused = generate(WideRuntime(wm, max_batch=3, max_seq=16, fused_decode=True), ids, 5)
    assert torch.equal(fused, generate(WideRuntime(wm, max_batch=3, max_seq=16, fused_decode=False), ids, 5))
    assert torch.equal(fused, _masked_greedy(wm, ids, 5))
    rt = WideRuntime(wm, max_batch=3, max_seq=16, fused_decode=True)
    rt.prefill(ids)
    rt.decode(fused[:, 4:5])
    residual = [m for pair in rt.fused_masks for m in pair]
    wm.config.router_input, wm.config.ffn_router_source = "normed", "block"  # the default reads otherwise
    rt = WideRuntime(wm, max_batch=3, max_seq=16, fused_decode=True)
    rt.prefill(ids)
    rt.decode(fused[:, 4:5])
    assert any(not torch.equal(a, b) for a, b in zip(residual, [m for pair in rt.fused_masks for m in pair]))


@pytest.mark.parametrize("source", ["block", "layer"])
def test_router_overlap_gives_the_same_tokens_bit_for_bit(source):
    """router_overlap=1 (the GPU's rule: the routers beside a QKV launch that computes every Q head) and 0 (the
    CPU's: QKV after the routers, skipping Q heads) give the same logits: a Q head's GEMV does not depend on its
    neighbours, and attention and O ignore the heads of groups no token runs."""
    from wide.kernels.fused_decode import launch_overrides

    _, wm = _routed("llama", seed=5, source=source)
    ids = torch.randint(0, 101, (3, 4))
    runs = {}
    for overlap in (0, 1):
        with launch_overrides(router_overlap=overlap):
            rt = WideRuntime(wm, max_batch=3, max_seq=16, fused_decode=True)
            rt.prefill(ids)
            runs[overlap] = [rt.decode(ids[:, -1:] + k) for k in range(3)], rt.fused_masks
    (la, ma), (lb, mb) = runs[0], runs[1]
    assert all(torch.equal(a, b) for a, b in zip(la, lb, strict=True))
    assert all(torch.equal(a, b) for pa, pb in zip(ma, mb, strict=True) for a, b in zip(pa, pb, strict=True))
    assert any(not bool(m.all()) for m, _ in ma)  # some group skipped, so the two QKV launches differed


@pytest.mark.parametrize("routed", [True, False])
def test_fused_decode_logits_match_unfused(routed):
    _, wm = _routed("llama", seed=2)
    ids = torch.randint(0, 101, (2, 5))
    a = WideRuntime(wm, max_batch=2, max_seq=12, routed=routed, fused_decode=True)
    b = WideRuntime(wm, max_batch=2, max_seq=12, routed=routed, fused_decode=False)
    torch.testing.assert_close(a.prefill(ids), b.prefill(ids))
    nxt = torch.randint(0, 101, (2, 1))
    la, lb = a.decode(nxt), b.decode(nxt)
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.cache.k, b.cache.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.cache.v, b.cache.v, rtol=1e-5, atol=1e-5)
    assert a.cache.lens.tolist() == b.cache.lens.tolist() == [6, 6]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("routed", [True, False])
def test_head_major_cache_serves_what_the_token_major_one_does(routed, fused):
    """kv_layout "hnd" (docs/long-context.md#cache-layout): the same [L, B, S, Hk, d] tensors over head-major
    storage; prefill and decode steps (ragged lengths through slots) give the logits and cache contents of "nhd"."""
    _, wm = _routed("llama", seed=4)
    rts = {lay: WideRuntime(wm, max_batch=2, max_seq=16, routed=routed, fused_decode=fused, kv_layout=lay)
           for lay in ("nhd", "hnd")}  # fmt: skip
    s, hk, d = rts["hnd"].cache.k.shape[2:]
    assert rts["hnd"].cache.k[0].stride() == (hk * s * d, d, s * d, 1) and rts["hnd"].cache.layout == "hnd"
    assert rts["nhd"].cache.k.is_contiguous()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 101, (1, n), generator=g) for n in (5, 9)]
    logits = {}
    for lay, rt in rts.items():
        out = [rt.prefill(p, slot=i) for i, p in enumerate(prompts)]
        for _ in range(3):
            out.append(rt.decode(torch.randint(0, 101, (2, 1), generator=torch.Generator().manual_seed(len(out)))))
        logits[lay] = out
    for a, b in zip(logits["nhd"], logits["hnd"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for name in ("k", "v"):
        torch.testing.assert_close(getattr(rts["nhd"].cache, name), getattr(rts["hnd"].cache, name))
    assert rts["nhd"].cache.lens.tolist() == rts["hnd"].cache.lens.tolist() == [8, 12]
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        WideRuntime(wm, max_batch=1, max_seq=8, kv_layout="bhsd")


def test_fused_decode_serves_the_routers_out_bias():
    """Static width's bias compensation (a router's out_bias after O and down) reaches both decode paths."""
    _, wm = _routed("llama", seed=3)
    g = torch.Generator().manual_seed(0)
    for i in range(len(wm.routers)):
        wm.set_out_bias(i, "attn", torch.randn(128, generator=g))
        wm.set_out_bias(i, "ffn", torch.randn(128, generator=g))
    ids = torch.randint(0, 101, (2, 5))
    a = WideRuntime(wm, max_batch=2, max_seq=12, fused_decode=True)
    b = WideRuntime(wm, max_batch=2, max_seq=12, fused_decode=False)
    with torch.no_grad():
        torch.testing.assert_close(b.prefill(ids), wm(ids).logits[:, -1], rtol=1e-4, atol=1e-4)
    a.prefill(ids)
    nxt = torch.randint(0, 101, (2, 1))
    la, lb = a.decode(nxt), b.decode(nxt)
    with torch.no_grad():
        ref = wm(torch.cat([ids, nxt], 1)).logits[:, -1]  # the masked path, biases by its hooks
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(la, ref, rtol=1e-4, atol=1e-4)
    wm.detach()


def test_fused_decode_rejects_large_batches():
    _, wm = _routed("llama")
    with pytest.raises(ValueError, match="fused_decode serves batches of at most 16"):
        WideRuntime(wm, max_batch=17, max_seq=8, fused_decode=True)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)
def test_default_decodes_fused_on_a_gpu_wherever_it_serves(device):
    """fused_decode=None: the fused layer on a GPU when it serves the runtime, the unfused step otherwise
    (the CPU, more than 16 tokens, head_dim not a multiple of 32), never an error."""
    _, wm = _routed("llama")
    wm = wm.to(device)
    on_gpu = device == "cuda"
    assert (WideRuntime(wm, max_batch=2, max_seq=8).fused_layers is not None) == on_gpu
    assert (WideRuntime(wm, max_batch=2, max_seq=8, routed=False).fused_layers is not None) == on_gpu
    assert WideRuntime(wm, max_batch=17, max_seq=8).fused_layers is None
    assert WideRuntime(wm, max_batch=2, max_seq=8, fused_decode=False).fused_layers is None
    small = WideModel(tiny_model("llama", layers=1, hidden=64, heads=4, kv=2, inter=64), WideConfig(ffn_group_size=16))
    assert WideRuntime(small.to(device), max_batch=1, max_seq=8).fused_layers is None  # head_dim 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_layout", ["nhd", "hnd"])
@pytest.mark.parametrize("routed", [True, False])
def test_fused_cuda_graph_decode_equals_unfused_on_gpu(routed, kv_layout):
    """The graphed fused step, in either cache layout, gives the unfused (token-major) step's greedy tokens."""
    _, wm = _routed("llama", seed=3)
    wm = wm.cuda()
    ids = torch.randint(0, 101, (2, 6), device="cuda")
    rt = WideRuntime(wm, max_batch=2, max_seq=32, routed=routed, fused_decode=True, kv_layout=kv_layout)
    fused = generate(rt, ids, 8)
    unfused = generate(
        WideRuntime(wm, max_batch=2, max_seq=32, routed=routed, fused_decode=False), ids, 8, cuda_graph=False
    )
    assert torch.equal(fused, unfused)
    if routed:
        assert torch.equal(fused, _masked_greedy(wm, ids, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("source", ["block", "layer"])
def test_router_overlap_in_a_cuda_graph_gives_the_same_tokens(source):
    """The routers on the side stream, captured with the rest of the step (fork and join in the graph): the same
    greedy tokens as the routers before QKV on one stream, and as the masked path."""
    from wide.kernels.fused_decode import launch_overrides

    _, wm = _routed("llama", seed=6, source=source)
    wm = wm.cuda()
    ids = torch.randint(0, 101, (2, 6), device="cuda")
    out = {}
    for overlap in (0, 1):
        with launch_overrides(router_overlap=overlap):
            out[overlap] = generate(WideRuntime(wm, max_batch=2, max_seq=32, fused_decode=True), ids, 8)
    assert torch.equal(out[0], out[1])
    assert torch.equal(out[1], _masked_greedy(wm, ids, 8))


_NO_KERNEL = {"view", "empty", "empty_strided", "_unsafe_view", "reshape", "select", "slice", "alias", "as_strided",
              "detach", "t", "unsqueeze", "squeeze", "expand", "lift_fresh", "split", "split_with_sizes"}  # fmt: skip


def _ops_of_step(rt, n_layers: int) -> list[str]:
    """Top-level ops of one fused decode step over the first n layers (a ``wide::`` op is one launch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from wide.runtime.fused import fused_decode_step

    class Rec(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ns, name = func.namespace, func.overloadpacket.__name__
            if ns != "aten" or name not in _NO_KERNEL:
                self.ops.append(f"{ns}::{name}")
            return func(*args, **(kwargs or {}))

    saved = rt.fused_layers
    rt.fused_layers = saved[:n_layers]
    ids = torch.randint(0, 101, (2, 1))
    try:
        with Rec() as rec:
            fused_decode_step(rt, ids, rt.cache.lens[:2].long()[:, None])
    finally:
        rt.fused_layers = saved
    return rec.ops


@pytest.mark.parametrize(
    ("routed", "source", "launches"), [(True, "block", 6), (True, "layer", 5), (False, "block", 4)]
)
def test_fused_layer_launches_six_kernels_or_fewer(routed, source, launches):
    """Per decoder layer the fused step issues only the fused ops (+ the routers): 6 routed, 4 dense; 5 when
    the FFN router reads the layer input (both routers in one launch)."""
    _, wm = _routed("llama", seed=4, source=source)
    rt = WideRuntime(wm, max_batch=2, max_seq=8, routed=routed, fused_decode=True)
    rt.prefill(torch.randint(0, 101, (2, 3)))
    one, two = _ops_of_step(rt, 1), _ops_of_step(rt, 2)
    assert len(two) - len(one) == launches, (one, two)
    layer_ops = [op for op in two if op.startswith("wide::")]
    assert len(layer_ops) == 1 + 2 * launches  # the first layer's norm + two layers
