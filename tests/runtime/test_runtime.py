"""The kernel-path runtime equals the masked-dense path of WideModel (same routers, same decisions)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model
from wide.config import WideConfig
from wide.kernels import router_decisions
from wide.model import WideModel, load_routers, save_routers
from wide.paths import SHIPPED_ROUTERS
from wide.runtime import GraphedPrefill, WideRuntime, generate
from wide.runtime.model import fuse_linears
from wide.target import FittedRates


def _routed(family: str, sparsity=0.5, seed=0, router_input="normed", source="block"):
    model = tiny_model(family, layers=2, hidden=64, heads=4, kv=2, inter=64, seed=seed)
    cfg = WideConfig(
        ffn_group_size=16,
        router_rank=8,
        sparsity=sparsity,
        router_input=router_input,
        ffn_router_source=source,
    )
    wm = WideModel(model, cfg)
    for r in wm.routers:  # mixed decisions
        torch.nn.init.normal_(r.attn.up.weight, std=2.0)
        torch.nn.init.normal_(r.ffn.up.weight, std=2.0)
    return model, wm


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_prefill_matches_masked_path(family):
    model, wm = _routed(family)
    ids = torch.randint(0, 101, (2, 7))
    with torch.no_grad():
        ref = wm(ids).logits[:, -1]
    rt = WideRuntime(wm, max_batch=2, max_seq=16)
    torch.testing.assert_close(rt.prefill(ids), ref, rtol=1e-4, atol=1e-4)
    # K/V in the cache equal the dense projections (routing never touches K/V)
    assert rt.cache.lens.tolist() == [7, 7]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_decode_matches_masked_path(family):
    model, wm = _routed(family, seed=1)
    ids = torch.randint(0, 101, (2, 5))
    rt = WideRuntime(wm, max_batch=2, max_seq=16)
    out = generate(rt, ids, 6)
    # reference: re-run the whole sequence through the masked path at every step
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = wm(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


def test_folded_router_heads_decide_like_the_routers():
    """The runtime folds each router once (Router.fold); its decisions are the routers' own, bit for bit."""
    model, wm = _routed("llama")
    for r in wm.routers:
        r.attn.skip_bias.fill_(0.3)
        r.ffn.skip_bias.fill_(-0.2)
    rt = WideRuntime(wm, max_batch=1, max_seq=8)
    h = torch.randn(2, 5, 64)
    for i, r in enumerate(wm.routers):
        for j, router in enumerate((r.attn, r.ffn)):
            assert torch.equal(router_decisions(h, *rt.heads[i][j]), router.skip_margin(h) <= 0)
            hb = h.bfloat16()
            assert torch.equal(router_decisions(hb, *router.fold(torch.bfloat16)), router.skip_margin(hb) <= 0)


def test_fuse_linears_shares_storage_and_keeps_the_modules():
    """One buffer for linears reading one input: module outputs unchanged, weights now views of it."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 4, bias=True), torch.nn.Linear(6, 3, bias=False)
    x = torch.randn(5, 6)
    ya, yb = a(x), b(x)
    w, bias = fuse_linears([a, b])
    assert w.shape == (7, 6) and bias.shape == (7,)
    assert torch.equal(bias[4:], torch.zeros(3))  # b has no bias
    assert a.weight.data_ptr() == w.data_ptr() and b.weight.data_ptr() == w[4:].data_ptr()
    torch.testing.assert_close(a(x), ya)
    torch.testing.assert_close(b(x), yb)
    assert fuse_linears([b])[1] is None


@pytest.mark.parametrize("routed", [True, False])
def test_runtime_shares_the_model_weights(routed):
    """Building a runtime adds no second copy of the projection weights: the HF modules read the fused buffers."""
    model, wm = _routed("qwen2")
    rt = WideRuntime(wm, max_batch=1, max_seq=8, routed=routed)
    at, w = model.model.layers[0].self_attn, rt.weights[0]
    fused = w.wq if routed else w.w_qkv
    assert at.q_proj.weight.data_ptr() == fused.data_ptr()
    ids = torch.randint(0, 101, (1, 5))
    with torch.no_grad(), wm.routing("argmax" if routed else "dense"):  # the HF modules over the shared weights
        ref = wm(ids).logits[:, -1]
    torch.testing.assert_close(rt.prefill(ids), ref, rtol=1e-4, atol=1e-4)


def test_model_saves_and_reloads_after_a_runtime_shared_its_weights(tmp_path):
    model, wm = _routed("llama")
    WideRuntime(wm, max_batch=1, max_seq=8)
    ids = torch.randint(0, 101, (1, 6))
    with torch.no_grad(), wm.routing("dense"):
        ref = model(ids).logits
    wm.detach()
    model.save_pretrained(tmp_path)  # safetensors: the fused views are saved as separate tensors
    again = type(model).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ref)


def test_dense_runtime_matches_hf():
    model, wm = _routed("llama")
    ids = torch.randint(0, 101, (1, 6))
    with torch.no_grad(), wm.routing("dense"):
        ref = model(ids).logits[:, -1]
    rt = WideRuntime(wm, max_batch=1, max_seq=8, routed=False)
    torch.testing.assert_close(rt.prefill(ids), ref, rtol=1e-4, atol=1e-4)
    nxt = torch.tensor([[3]])
    with torch.no_grad(), wm.routing("dense"):
        ref2 = model(torch.cat([ids, nxt], 1)).logits[:, -1]
    torch.testing.assert_close(rt.decode(nxt), ref2, rtol=1e-4, atol=1e-4)


def test_runtime_rejects_non_gqa_routers_and_oversized_prompts():
    model = tiny_model("llama")
    with pytest.warns(UserWarning):
        wm = WideModel(model, WideConfig(attn_group_size=1, ffn_group_size=16, router_rank=8))
    with pytest.raises(ValueError, match="one attention decision per KV group"):
        WideRuntime(wm, max_batch=1, max_seq=8)
    wm.detach()
    # layer skipping ties the FFN's decision to the attention's, TEAL has no routers: neither is served, even
    # where their one-group shape would pass the KV-group check (one KV head)
    from wide.baselines import build

    mqa = tiny_model("llama", kv=1)
    for method in ("layer-skip", "teal"):
        routed = build(mqa, WideConfig(method=method, router_rank=8))
        with pytest.raises(ValueError, match=f"these are {method}'s"):
            WideRuntime(routed, max_batch=1, max_seq=8)
        routed.detach()
    _, wm = _routed("llama")
    rt = WideRuntime(wm, max_batch=2, max_seq=4)
    for bad in (torch.zeros(1, 5, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long)):
        for call in (rt.prefill, rt.score):
            with pytest.raises(ValueError, match="outside the cache"):
                call(bad)
    with pytest.raises(ValueError, match=r"token ids \[B, T\]"):
        rt.prefill(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="decode takes ids"):
        rt.decode(torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="exceed the runtime's max_seq"):
        generate(rt, torch.zeros(1, 3, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_batch and max_seq"):
        WideRuntime(wm, max_batch=0, max_seq=4)


def test_runtime_refuses_what_its_step_would_compute_otherwise():
    """A sliding attention window shorter than the cache (the step attends to every cached key) and MLP biases
    (the step reads the projections' weights): a one-line error, where a window the cache never exceeds is
    served."""
    ids = torch.randint(0, 101, (1, 16))
    windowed = tiny_model("mistral", sliding_window=8)
    with torch.no_grad():  # the window matters to the Hugging Face model at 16 tokens
        windowed.config.sliding_window = None
        full = windowed(ids).logits
        windowed.config.sliding_window = 8
        assert not torch.allclose(windowed(ids).logits, full)
    wm = WideModel(windowed, WideConfig(ffn_group_size=16, router_rank=8))
    with pytest.raises(ValueError, match="looks back 8 keys at most, the cache holds max_seq=16"):
        WideRuntime(wm, max_batch=1, max_seq=16)
    WideRuntime(wm, max_batch=1, max_seq=8)  # never more keys than the window
    wm.detach()
    WideRuntime(
        WideModel(tiny_model("qwen2", sliding_window=8), WideConfig(ffn_group_size=16)), max_batch=1, max_seq=16
    )
    qwen = tiny_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    wm = WideModel(qwen, WideConfig(ffn_group_size=16, router_rank=8))
    with pytest.raises(ValueError, match="looks back 8 keys"):
        WideRuntime(wm, max_batch=1, max_seq=16, routed=False)
    wm.detach()
    wm = WideModel(tiny_model("llama", mlp_bias=True), WideConfig(ffn_group_size=16, router_rank=8))
    with pytest.raises(ValueError, match="layer 0's MLP projections have biases"):
        WideRuntime(wm, max_batch=1, max_seq=8)
    wm.detach()
    wm = WideModel(tiny_model("llama", hidden_act="gelu"), WideConfig(ffn_group_size=16, router_rank=8))
    with pytest.raises(ValueError, match="activation is 'gelu', the runtime's is SiLU"):
        WideRuntime(wm, max_batch=1, max_seq=8, routed=False)


def test_runtime_names_unsupported_families():
    import transformers as tf

    from wide.model.wide_model import UnsupportedModelError

    cfg = tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    with pytest.raises(UnsupportedModelError, match="WIDE routes llama, mistral, qwen2, qwen3"):
        WideModel(tf.GPT2LMHeadModel(cfg), WideConfig())


# --------------------------------------------------------------------------- served = evaluated (CPU)
@pytest.mark.parametrize(
    ("family", "router_input", "source"),
    [
        *((f, "normed", "block") for f in ("llama", "qwen2", "qwen3", "mistral")),
        ("llama", "residual", "block"),
        ("qwen3", "normed", "layer"),
        ("llama", "residual", "layer"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scores_and_decisions_equal_the_masked_path_in_low_precision(family, router_input, source, dtype, monkeypatch):
    """In bf16 / fp16 the runtime makes the masked path's decisions (0 differing, every layer and kind)
    and its logits at every position are the masked path's, bit for bit: one decision rule, and on the CPU
    the same torch arithmetic for the backbone (docs/routing.md#the-decision-rule). Runs the torch path a
    CPU user runs (the interpreter's kernels compute the GEMMs in their own order). Routers that read the
    residual stream (``router_input="residual"``) and an FFN router that reads the layer input
    (``ffn_router_source="layer"``) read the same in the runtime."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model, wm = _routed(family, seed=2, router_input=router_input, source=source)
    model.to(dtype)
    ids = torch.randint(0, 101, (3, 41))
    with torch.no_grad():
        ref = wm(ids).logits
    ref_masks = [{k: m[k].clone() for k in ("attn", "ffn")} for m in wm.last_masks]
    rt = WideRuntime(wm, max_batch=3, max_seq=48)
    seen: list = []
    step = rt.step
    rt.step = lambda *a: (lambda out: (seen.append(out[1]), out)[1])(step(*a))
    out = rt.score(ids)
    assert out.dtype == dtype and out.shape == ref.shape
    n_dec = 0
    for i, (a, f) in enumerate(seen):
        assert torch.equal(a, ref_masks[i]["attn"]) and torch.equal(f, ref_masks[i]["ffn"]), f"layer {i}"
        n_dec += a.numel() + f.numel()
    assert n_dec > 0 and 0 < sum(float(a.float().mean()) for a, _ in seen) / len(seen) < 1  # mixed decisions
    assert torch.equal(out, ref)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_generation_equals_the_masked_path_in_low_precision(family, dtype, monkeypatch):
    """What a CPU user is served, token for token: 32 greedy tokens through the runtime's cached decode equal
    the masked path re-scoring the whole sequence at every step, in bf16 / fp16. A decode step computes one
    query where the re-scoring computes the whole sequence (GEMMs and SDPA over other shapes), so a token may
    differ only where the masked path's own logits of the two tokens are within 4 units in the last place
    (a near-tie); the sequences are compared up to there."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model, wm = _routed(family, seed=1)
    model.to(dtype)
    ids = torch.randint(0, 101, (2, 9))
    out = generate(WideRuntime(wm, max_batch=2, max_seq=48), ids, 32)
    mantissa = 7 if dtype == torch.bfloat16 else 10
    with torch.no_grad():
        for i in range(ids.shape[1], out.shape[1]):
            ref = wm(out[:, :i]).logits[:, -1].float()  # [B, V]
            best, got = ref.argmax(-1), out[:, i]
            for b in torch.nonzero(best != got).flatten().tolist():
                top = ref[b, best[b]]
                ulp = 2.0 ** (torch.floor(torch.log2(top.abs().clamp_min(1e-30))) - mantissa)
                margin = top - ref[b, got[b]]
                assert margin <= 4 * ulp, f"step {i}, row {b}: not a near-tie ({margin:.3g} > 4 ulp {ulp:.3g})"
                return  # past a near-tie the two sequences continue from different tokens


def test_runtime_meters_its_own_decisions():
    model, wm = _routed("llama", seed=3)
    ids = torch.randint(0, 101, (2, 9))
    wm.start_meter()
    with torch.no_grad():
        wm(ids)
    want = wm.stop_meter()
    rt = WideRuntime(wm, max_batch=2, max_seq=16)
    wm.start_meter()
    rt.score(ids)
    got = wm.stop_meter()
    assert got["tokens"] == want["tokens"] == 18
    for k in ("attn_sparsity", "ffn_sparsity", "flop_saving"):
        assert got[k] == pytest.approx(want[k], abs=1e-12)


def test_attention_sparsity_hint_defaults_to_the_target_and_is_checked():
    _, wm = _routed("llama", sparsity=0.7)
    rt = WideRuntime(wm, max_batch=1, max_seq=8)
    assert rt.attn_sparsity_hints == [0.7, 0.7]
    assert [st.attn_sparsity_hint for st in rt.step_configs[False]] == [0.6, 0.6]  # the threshold it reaches
    wm.detach()
    _, wm = _routed("llama")
    rt = WideRuntime(wm, max_batch=1, max_seq=8, attn_sparsity_hint=[0.2, 0.45])  # per layer
    # the largest threshold each reaches: ORDERED_WHEN's 0.4 / 0.6, the G 32 GEMM-MN's 0.45 / 0.55
    assert [st.attn_sparsity_hint for st in rt.step_configs[True]] == [0.0, 0.45]
    ids = torch.randint(0, 101, (1, 5))
    with torch.no_grad():
        ref = wm(ids).logits[:, -1]
    torch.testing.assert_close(rt.prefill(ids), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="attn_sparsity_hint"):
        WideRuntime(wm, max_batch=1, max_seq=8, attn_sparsity_hint=1.5)
    with pytest.raises(ValueError, match="2 layers"):
        WideRuntime(wm, max_batch=1, max_seq=8, attn_sparsity_hint=[0.5])
    # a calibrated checkpoint's recorded per-layer rates are the default
    fit = {"attn0": 0.65, "ffn0": 0.1, "attn1": 0.1}
    wm.record_training({"skip_bias_fit": {"argmax_skip_after": fit}})
    assert wm.fitted_rates == FittedRates(attn=[0.65, 0.1], ffn=None)  # ffn1 missing: no FFN rates
    assert WideRuntime(wm, max_batch=1, max_seq=8).attn_sparsity_hints == [0.65, 0.1]
    assert WideRuntime(wm, max_batch=1, max_seq=8).ffn_sparsity_hints == [0.5, 0.5]  # the target
    wm.record_training({"skip_bias_fit": {"argmax_skip_after": {**fit, "ffn0": 0.1, "ffn1": 0.3}}})
    assert WideRuntime(wm, max_batch=1, max_seq=8).ffn_sparsity_hints == [0.1, 0.3]
    assert FittedRates.from_training({}, 2) is None and FittedRates.from_training({"skip_bias_fit": {}}, 2) is None


def test_fitted_rates_come_from_the_checkpoint(tmp_path):
    """load_routers reads the threshold fit's per-layer rates into the typed WideModel.fitted_rates."""
    model, wm = _routed("llama")
    after = {"attn0": 0.6, "attn1": 0.2, "ffn0": 0.3, "ffn1": 0.4}
    save_routers(wm, tmp_path, training={"skip_bias_fit": {"argmax_skip_after": after}})
    wm.detach()
    loaded = load_routers(model, tmp_path)
    assert loaded.fitted_rates == FittedRates(attn=[0.6, 0.2], ffn=[0.3, 0.4])
    rt = WideRuntime(loaded, max_batch=1, max_seq=8)
    assert rt.attn_sparsity_hints == [0.6, 0.2] and rt.ffn_sparsity_hints == [0.3, 0.4]
    loaded.detach()
    save_routers(loaded, tmp_path)  # no fit recorded: no rates, the runtime falls back to the targets
    assert load_routers(model, tmp_path).fitted_rates is None


def test_hints_pick_the_dense_path_at_low_sparsity_and_keep_the_output():
    """FFN / attention hints reach the step configs bucketed (gate/up, Q: dense below mn_dense_below(G, M));
    a prompt past DENSE_M runs through the dense or the sorted GEMM-MN and matches the model either way."""
    from wide.kernels import mn_dense_below, plan

    _, wm = _routed("llama")
    ids = torch.randint(0, 101, (1, 300))  # M 300 > DENSE_M
    with torch.no_grad():
        ref = wm(ids).logits[:, -1]
    for ffn_hint in (0.0, 0.9):
        rt = WideRuntime(wm, max_batch=1, max_seq=304, attn_sparsity_hint=0.0, ffn_sparsity_hint=ffn_hint)
        assert rt.ffn_sparsity_hints == [ffn_hint, ffn_hint]
        st = rt.step_configs[False][0]
        assert st.attn_sparsity_hint == 0.0
        assert (st.ffn_sparsity_hint < mn_dense_below(rt.g_ffn, 300)) == (ffn_hint == 0.0)
        n_groups = wm.dims.intermediate // rt.g_ffn
        assert plan(300, rt.g_ffn, n_groups, st.ffn_sparsity_hint).mn == ("dense" if ffn_hint == 0.0 else "sorted")
        torch.testing.assert_close(rt.prefill(ids), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="ffn_sparsity_hint"):
        WideRuntime(wm, max_batch=1, max_seq=8, ffn_sparsity_hint=[0.1, 0.2, 0.3])


@pytest.mark.gpu
@pytest.mark.parametrize("routed", [True, False])
def test_cuda_graph_decode_equals_eager_on_gpu(routed):
    model, wm = _routed("llama", seed=2)
    model.to("cuda", torch.bfloat16)
    wm.routers.to("cuda")
    ids = torch.randint(0, 101, (3, 9), device="cuda")
    rt = WideRuntime(wm, max_batch=3, max_seq=32, routed=routed)
    eager = generate(rt, ids, 8, cuda_graph=False)
    graphed = generate(rt, ids, 8, cuda_graph=True)
    assert torch.equal(eager, graphed)


@pytest.mark.parametrize(("routed", "source"), [(True, "block"), (False, "block"), (True, "layer")])
def test_compiled_layer_step_equals_eager(routed, source):
    """compile=True runs the same layer step through torch.compile: same logits, one graph for all layers
    (the FFN router on the layer input: both routers in the pair op)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, wm = _routed("qwen3", seed=3, source=source)
    ids = torch.randint(0, 101, (2, 6))
    eager = WideRuntime(wm, max_batch=2, max_seq=16, routed=routed)
    comp = WideRuntime(wm, max_batch=2, max_seq=16, routed=routed, compile=True)
    torch.testing.assert_close(comp.prefill(ids), eager.prefill(ids), rtol=1e-4, atol=1e-4)
    nxt = torch.tensor([[5], [7]])
    for _ in range(2):
        a, b = comp.decode(nxt), eager.decode(nxt)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        nxt = a.argmax(-1, keepdim=True)
    torch.testing.assert_close(comp.cache.k, eager.cache.k)
    # the two layers share their compiled code: one frame per (prefill, decode) static config
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4


@pytest.mark.gpu
@pytest.mark.parametrize("routed", [True, False])
def test_compiled_cuda_graph_decode_on_gpu(routed):
    """The compiled layer step replayed from a CUDA graph equals the compiled step run eagerly (bitwise),
    and the compiled dense runtime matches the eager one to bf16 rounding (fused norms round once)."""
    model, wm = _routed("llama", seed=4)
    model.to("cuda", torch.bfloat16)
    wm.routers.to("cuda")
    ids = torch.randint(0, 101, (3, 9), device="cuda")
    comp = WideRuntime(wm, max_batch=3, max_seq=32, routed=routed, compile=True)
    assert torch.equal(generate(comp, ids, 6, cuda_graph=True), generate(comp, ids, 6, cuda_graph=False))
    if not routed:  # (routed: a decision within bf16 rounding of its threshold may flip between the two)
        eager = WideRuntime(wm, max_batch=3, max_seq=32, routed=False)
        torch.testing.assert_close(comp.prefill(ids), eager.prefill(ids), rtol=0.05, atol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("routed", [True, False])
def test_graphed_prefill_equals_eager_on_gpu(routed, compile):
    """A prefill replayed from its CUDA graph gives the eager prefill's logits and cache (same kernels; the
    tolerance only covers a cuBLAS algorithm picked differently under capture); M = 320 tokens takes the
    sorted (reorder) path of the routed kernels. Other prompt shapes are refused."""
    model, wm = _routed("llama", seed=5)
    model.to("cuda", torch.bfloat16)
    wm.routers.to("cuda")
    ids = torch.randint(0, 101, (2, 160), device="cuda")
    rt = WideRuntime(wm, max_batch=2, max_seq=192, routed=routed, compile=compile)
    rt.cache.reset()
    eager = rt.prefill(ids).clone()
    k_eager, lens_eager = rt.cache.k.clone(), rt.cache.lens.clone()
    graphed = GraphedPrefill(rt, 2, 160)
    rt.cache.reset()
    rt.cache.k.zero_()
    out = graphed(ids)
    torch.testing.assert_close(out, eager, rtol=1e-2, atol=1e-2)
    assert torch.equal(out.argmax(-1), eager.argmax(-1))
    torch.testing.assert_close(rt.cache.k, k_eager, rtol=1e-2, atol=1e-2)
    assert torch.equal(rt.cache.lens, lens_eager)
    with pytest.raises(ValueError, match="serves prompts"):
        graphed(ids[:, :100])


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED_ROUTERS)
def test_shipped_routers_serve_what_was_evaluated(name, monkeypatch):
    """The shipped routers on SmolLM2-135M in bf16 (CPU torch path): the runtime scores two WikiText-2
    windows with the masked path's decisions (0 of ~100k differing) and its logits, bit for bit."""
    import gzip

    from wide.model import load_model, load_routers
    from wide.paths import packaged_wikitext_slice, resolve_routers

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model, tok = load_model("smollm2-135m", dtype=torch.bfloat16, device="cpu")
    wm = load_routers(model, str(resolve_routers(name))).eval()
    with gzip.open(packaged_wikitext_slice(), "rt", encoding="utf-8") as f:  # wiki.test.raw's first bytes
        toks = tok.encode(f.read()[:20000])
    ids = torch.tensor([toks[:192], toks[500:692]])
    with torch.no_grad():
        ref = wm(ids).logits
    ref_masks = [(m["attn"].clone(), m["ffn"].clone()) for m in wm.last_masks]
    rt = WideRuntime(wm, max_batch=2, max_seq=192)
    seen: list = []
    step = rt.step
    rt.step = lambda *a: (lambda out: (seen.append(out[1]), out)[1])(step(*a))
    out = rt.score(ids)
    n = sum(a.numel() + f.numel() for a, f in ref_masks)
    differ = sum(int((a != ra).sum() + (f != rf).sum()) for (a, f), (ra, rf) in zip(seen, ref_masks, strict=True))
    assert n > 100_000 and differ == 0
    assert torch.equal(out, ref)


def test_compiled_step_without_the_interpreter_has_no_graph_breaks():
    """The ops' torch paths run inside traced ``triton_op`` bodies when Triton is not interpreted (as on a
    GPU machine): no host reads there. Runs the compiled-step test in a fresh process without the
    interpreter (the flag is read when the kernels are imported)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    test = "tests/runtime/test_runtime.py::test_compiled_layer_step_equals_eager"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:]
