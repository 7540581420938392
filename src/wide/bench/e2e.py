"""End-to-end latency: TTFT (prefill) and TPOT (one decode step at a fixed context), WIDE vs dense
through the same runtime (`wide.runtime`), Llama-3.1-8B shapes with random weights.

Routers get random weights and per-router thresholds fitted so that argmax routing skips the target
fraction of groups on this model's own hidden states: token-dependent masks at the target rate, with
the routers' cost included. Decode steps are timed as CUDA-graph replays; prefill with CUDA events,
both as issued from Python (``ttft_ms``) and replayed from a CUDA graph of that prompt shape
(``ttft_graph_ms``: the GPU's time, free of Python's per-kernel issue cost). Each decode record also
says what one step costs in launches and bytes (``decode_accounting``): kernels per step and per decoder
layer (torch.profiler over an eager step; on a GPU only), the weights and KV the step reads given the
groups its batch runs, and the TB/s that makes of the TPOT.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import torch

from wide.bench.timing import card_tag, median_ms
from wide.config import WideConfig
from wide.kernels import clear_autotune_cache
from wide.kernels._triton_utils import autotune_limit, warn_if_autotune_limited
from wide.kernels.fused_decode import router_overlap
from wide.model import WideModel
from wide.runtime import GraphedDecode, GraphedPrefill, WideRuntime
from wide.train.threshold_fit import collect_margins, fit_offsets

LLAMA_8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=32768,
)
# a tiny Llama for the CPU smoke tests of the GPU scripts
TINY_LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=101,
    max_position_embeddings=256,
)


def build_model(shape: dict, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    finally:
        torch.set_default_dtype(prev)
    model.config.wide_model_id = "random-llama"
    return model


def routers_at(wm: WideModel, rate: float | tuple[float, float], tokens: torch.Tensor) -> None:
    """Random router weights; thresholds fitted so argmax skips ``rate`` of groups on ``tokens`` (one rate, or
    (attention, FFN) rates)."""
    attn, ffn = rate if isinstance(rate, tuple) else (rate, rate)
    for r in wm.routers:
        for router in (r.attn, r.ffn):
            torch.nn.init.normal_(router.up.weight, std=1.0)
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens, dtype=torch.bool)}
    margins, _ = collect_margins(wm, [batch], tokens.device)
    rates = {key: attn if key[1] == "attn" else ffn for key in margins}
    for (i, k), d in fit_offsets(margins, rates, "router").items():
        getattr(wm.routers[i], k).skip_bias.fill_(d)


def measure(
    wm: WideModel,
    routed: bool,
    *,
    batch: int,
    prompt: int,
    context: int,
    device: str,
    reps: int,
    graph: bool,
    compile: bool = False,
    fused_decode: bool | None = None,
    attn_sparsity_hint: float | list[float] | None = None,
    ffn_sparsity_hint: float | list[float] | None = None,
) -> dict:
    """TTFT of a `prompt`-token prefill and TPOT of one decode step at `context` cached tokens."""
    rt = WideRuntime(
        wm,
        max_batch=batch,
        max_seq=max(prompt, context) + 8,
        routed=routed,
        compile=compile,
        fused_decode=fused_decode,
        attn_sparsity_hint=attn_sparsity_hint,
        ffn_sparsity_hint=ffn_sparsity_hint,
    )
    vocab = wm.dims.vocab
    ids = torch.randint(0, vocab, (batch, prompt), device=device)

    def prefill():
        rt.cache.reset()
        rt.prefill(ids)

    prefill()  # warm-up (compile, autotune)
    prefill()
    ttft = median_ms(prefill, reps, device)  # each kernel issued from Python (host-bound when GPU work is short)
    extra = {}
    if graph and device == "cuda":  # the same prefill replayed from a CUDA graph (a server's length buckets)
        try:
            graphed = GraphedPrefill(rt, batch, prompt)

            def prefill_graph():
                rt.cache.reset()
                graphed(ids)

            extra["ttft_graph_ms"] = median_ms(prefill_graph, reps, device)
            del graphed
        except RuntimeError as exc:  # record, keep measuring
            extra["ttft_graph_error"] = repr(exc)[:300]
    rt.cache.reset()
    rt.cache.lens.fill_(context)  # decode against `context` cached tokens (cache contents: random)
    step_ids = torch.randint(0, vocab, (batch, 1), device=device)
    if graph and device == "cuda":
        step = GraphedDecode(rt, batch)
        lens = rt.cache.lens.clone()

        def decode():
            rt.cache.lens.copy_(lens)
            step(step_ids)
    else:
        lens = rt.cache.lens.clone()

        def decode():
            rt.cache.lens.copy_(lens)
            rt.decode(step_ids)

        decode()
    tpot = median_ms(decode, reps * 4, device)
    extra.update(decode_accounting(rt, step_ids, context, tpot))
    return {"ttft_ms": ttft, "tpot_ms": tpot, "fused_decode": rt.fused_layers is not None, **extra}


def count_kernels(fn) -> int | None:
    """CUDA kernels one call of ``fn`` launches (memcpy / memset excluded); None without a GPU."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    skip = ("Memcpy", "Memset")
    return sum(e.device_type == torch.autograd.DeviceType.CUDA and not any(k in e.name for k in skip)
               for e in prof.events())  # fmt: skip


@contextlib.contextmanager
def _first_layers(rt: WideRuntime, n: int):
    """The runtime restricted to its first n decoder layers (kernel counting only)."""
    saved = (rt.weights, dict(rt.step_configs), rt.fused_layers)
    rt.weights = rt.weights[:n]
    rt.step_configs = {k: v[:n] for k, v in rt.step_configs.items()}
    if rt.fused_layers is not None:
        rt.fused_layers = rt.fused_layers[:n]
    try:
        yield
    finally:
        rt.weights, rt.step_configs, rt.fused_layers = saved


def decode_bytes(rt: WideRuntime, batch: int, ctx: int, masks: list | None) -> tuple[int, dict]:
    """Bytes of weights and KV one decode step reads, and the run fractions behind them.

    masks: per layer (attention [B, Hk], FFN [B, G]) bool of the step (``rt.fused_masks``), or None for a
    dense step. Read: Q / O rows and FFN channels of the groups the batch's union runs (Q whole when the fused
    step computes every Q head: ``fused_decode.router_overlap``), K / V projections whole, the K / V cache rows
    of the (token, group) pairs that run, the routers' projections, lm_head (norms and the embedding row are
    negligible). Returns (bytes, mean union / per-token run fractions)."""
    q_whole = masks is not None and router_overlap(rt.hf.lm_head.weight.is_cuda)
    d, el = rt.wm.dims, rt.hf.lm_head.weight.element_size()
    dm, hq, hk, hd = d.hidden, d.n_q_heads, d.n_kv_heads, d.head_dim
    df = rt.layers[0].mlp.down_proj.weight.shape[1]
    total, info = 0, {"attn_union_run": [], "ffn_union_run": [], "attn_token_run": [], "ffn_token_run": []}
    for i in range(d.n_layers):
        if masks is not None:
            ma, mf = masks[i]
            ua, uf = ma.any(0).float().mean().item(), mf.any(0).float().mean().item()
            ta, tf_ = ma.float().mean().item(), mf.float().mean().item()
            router = 2 * rt.heads[i][0][0].numel() * el
        else:
            ua = uf = ta = tf_ = 1.0
            router = 0
        for k, v in (("attn_union_run", ua), ("ffn_union_run", uf), ("attn_token_run", ta), ("ffn_token_run", tf_)):
            info[k].append(v)
        q_o = hq * hd * dm * el * ((1.0 if q_whole else ua) + ua)
        kv_w = 2 * hk * hd * dm * el
        ffn = 3 * df * dm * el * uf
        kv_cache = batch * (ctx + 1) * hk * hd * 2 * el * ta
        total += q_o + kv_w + ffn + kv_cache + router
    total += rt.hf.lm_head.weight.numel() * el
    return int(total), {k: sum(v) / len(v) for k, v in info.items()}


def decode_accounting(rt: WideRuntime, ids: torch.Tensor, ctx: int, tpot_ms: float) -> dict:
    """What one decode step of ``ids`` [B, 1] at ``ctx`` cached tokens costs: kernels per step and per
    decoder layer (eager steps of all, one and two layers), bytes read and TB/s at ``tpot_ms``. Bytes need
    the step's masks: a routed runtime without the fused decode layer (which keeps them) reports None.
    Leaves the cache lengths at ctx."""
    batch = ids.shape[0]

    def eager():
        rt.cache.lens.fill_(ctx)
        rt.decode(ids)

    masks = None
    if rt.routed and rt.fused_layers is not None:
        eager()
        masks = [(a.clone(), f.clone()) for a, f in rt.fused_masks]
    out: dict = {"kernels_per_step": count_kernels(eager)}
    with _first_layers(rt, 1):
        one = count_kernels(eager)
    with _first_layers(rt, 2):
        two = count_kernels(eager)
    rt.cache.lens.fill_(ctx)
    out["kernels_per_layer"] = None if one is None else two - one
    if masks is not None or not rt.routed:
        nbytes, frac = decode_bytes(rt, batch, ctx, masks)
        out.update(bytes_read=nbytes, tb_per_s=nbytes / (tpot_ms * 1e-3) / 1e12)
        if masks is not None:
            out.update({f"measured_{k}": v for k, v in frac.items()})
    else:
        out.update(bytes_read=None, tb_per_s=None)
    return out


def run_e2e_bench(
    out_dir: str | None = None,
    *,
    quick: bool = False,
    shape: dict | None = None,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    sparsities=(0.0, 0.25, 0.5, 0.7),
    batches=(1, 16),
    prompt: int = 4096,
    context: int = 4096,
    reps: int = 10,
    compile: bool = False,
    fused_decode: bool | None = None,
    ffn_group_size: int = 128,
) -> list[dict]:
    """Records (dense and WIDE per sparsity and batch) with ttft_ms, tpot_ms and speed-ups over dense;
    fused_decode: ``WideRuntime``'s flag, dense and WIDE alike (None: its default); each record says whether
    its decode ran fused. ffn_group_size: the routers' FFN channels per decision (G_ffn), in every record."""
    shape = shape or LLAMA_8B
    warn_if_autotune_limited("wide bench e2e")
    if quick:
        sparsities, batches, reps = (0.0, 0.5), (1,), 5
    model = build_model(shape, device, dtype)
    probe = torch.randint(0, shape["vocab_size"], (1, min(prompt, 512)), device=device)
    rows: list[dict] = []
    t0 = time.time()
    for b in batches:
        wm = WideModel(model, WideConfig(ffn_group_size=ffn_group_size))
        kw = dict(batch=b, prompt=prompt, context=context, device=device, reps=reps, graph=True, compile=compile)
        kw["fused_decode"] = fused_decode
        dense = measure(wm, False, **kw)
        rows.append(
            {"kind": "e2e", "variant": "dense", "B": b, "prompt": prompt, "ctx": context, "sparsity": 0.0, **dense}
        )
        _write(out_dir, rows, compile)
        for s in sparsities:
            routers_at(wm, s, probe)
            wm.start_meter()
            with torch.no_grad():
                wm(probe)
            real = wm.stop_meter()
            clear_autotune_cache()  # tune the routed kernels on this level's masks, as a deployment would
            per_layer = real["per_layer"]  # the routers' sparsity as measured on the probe
            r = measure(wm, True, **kw, attn_sparsity_hint=per_layer["attn"], ffn_sparsity_hint=per_layer["ffn"])
            rows.append(
                {
                    "kind": "e2e",
                    "variant": "wide",
                    "B": b,
                    "prompt": prompt,
                    "ctx": context,
                    "sparsity": s,
                    "ffn_group_size": ffn_group_size,
                    "real_attn_sparsity": real["attn_sparsity"],
                    "real_ffn_sparsity": real["ffn_sparsity"],
                    **r,
                    "ttft_speedup": dense["ttft_ms"] / r["ttft_ms"],
                    "tpot_speedup": dense["tpot_ms"] / r["tpot_ms"],
                }
            )
            if "ttft_graph_ms" in r and "ttft_graph_ms" in dense:
                rows[-1]["ttft_graph_speedup"] = dense["ttft_graph_ms"] / r["ttft_graph_ms"]
            _write(out_dir, rows, compile)
        wm.detach()
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "shape": shape,
        "dtype": str(dtype),
        "wall_s": time.time() - t0,
        "compiled": compile,
        "fused_decode": fused_decode,
        "ffn_group_size": ffn_group_size,
        # 0: every config of each autotuned kernel is tried (what users get); N: only the first N
        "autotune_max": autotune_limit(),
    }
    _write(out_dir, rows, compile, meta)
    return rows


def _write(out_dir: str | None, rows: list[dict], compiled: bool, meta: dict | None = None) -> None:
    """Write the rows so far (an interrupted sweep keeps its finished rows)."""
    for r in rows:
        r["compiled"] = compiled
        r.setdefault("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    if rows and meta is None:  # progress: the row just measured
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}), flush=True)
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    card = card_tag()  # the card that ran it: e2e-h100.json, e2e-h200.json, e2e-cpu.json
    with open(os.path.join(out_dir, f"e2e-{card}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if meta is not None:
        with open(os.path.join(out_dir, f"e2e-{card}.meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
