"""Routed attention vs dense SDPA on one GPU (Llama-3.1-8B heads: Hq 32, Hk 8, d 128, bf16).

Timing: CUDA-graph replay of R back-to-back calls (R sized to ~3 ms of work), median of replays,
divided by R; inputs rotate over enough copies to exceed the L2 cache. The WIDE time includes the
reorder of the mask (`wide.kernels.route.reorder.reorder`) for prefill; decode needs no reorder.
Dense baseline: the fastest SDPA backend that runs (SDPA's own choice, flash with enable_gqa, flash /
cuDNN / efficient with K/V repeated outside the timed region); its name is in `baseline`;
`speedup_vs_sdpa_default` compares with plain `F.scaled_dot_product_attention(..., enable_gqa=True)`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from wide.bench.gemm_bench import DECODE_MASK_DRAWS
from wide.bench.timing import copies_for as _copies
from wide.bench.timing import time_calls as time_graph

HQ, HK, D = 32, 8, 128
_BASELINE_CACHE: dict = {}  # (kind, B, T) -> (name, ms): sweeps time the dense baseline once


def _versions() -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


def _best(cands: dict) -> tuple[str, float, dict]:
    """Time each candidate (name -> list of fns); return the fastest that runs and all times."""
    times = {}
    for name, fns in cands.items():
        try:
            times[name] = round(time_graph(fns), 5)
        except Exception:  # backend refuses the shape / capture: skip it
            torch.cuda.synchronize()
    name = min(times, key=times.get)
    return name, times[name], times


def _sdpa(backend, q, k, v, causal: bool, gqa: bool):
    from torch.nn.attention import sdpa_kernel

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return run


def _sdpa_cands(qs, ks, vs, causal: bool) -> dict:
    """qs/ks/vs: lists of [B,H,T,d] views; candidates keyed by name."""
    from torch.nn.attention import SDPBackend

    rep = [(k.repeat_interleave(HQ // HK, 1), v.repeat_interleave(HQ // HK, 1)) for k, v in zip(ks, vs, strict=False)]
    default = [
        partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal, enable_gqa=True)
        for q, k, v in zip(qs, ks, vs, strict=False)
    ]
    out = {
        "sdpa-default(enable_gqa)": default,  # what F.scaled_dot_product_attention picks by itself
        "sdpa-flash(enable_gqa)": [
            _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal, True) for q, k, v in zip(qs, ks, vs, strict=False)
        ],
    }
    for name, be in (
        ("sdpa-flash(kv repeated)", SDPBackend.FLASH_ATTENTION),
        ("sdpa-cudnn(kv repeated)", SDPBackend.CUDNN_ATTENTION),
        ("sdpa-efficient(kv repeated)", SDPBackend.EFFICIENT_ATTENTION),
    ):
        out[name] = [_sdpa(be, q, kr, vr, causal, False) for q, (kr, vr) in zip(qs, rep, strict=False)]
    return out


def _vs_flash(times: dict, wide_ms: float) -> float | None:
    """Speed-up over the faster SDPA flash-backend (FA2) variant."""
    flash = [v for k, v in times.items() if k.startswith("sdpa-flash")]
    return round(min(flash) / wide_ms, 3) if flash else None


def _vs_default(times: dict, wide_ms: float) -> float | None:
    """Speed-up over plain ``F.scaled_dot_product_attention(..., enable_gqa=True)`` (its own backend choice)."""
    t = times.get("sdpa-default(enable_gqa)")
    return round(t / wide_ms, 3) if t else None


def _record(kind, b, key, val, sparsity, dense_ms, wide_ms, baseline, **extra) -> dict:
    return {
        "kind": kind,
        "op": "attention",
        "B": b,
        key: val,
        "group_size": HQ // HK * D,
        "sparsity": sparsity,
        "dense_ms": round(dense_ms, 5),
        "wide_ms": round(wide_ms, 5),
        "speedup": round(dense_ms / wide_ms, 3),
        "gpu": torch.cuda.get_device_name(),
        "versions": _versions(),
        "baseline": baseline,
        **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in extra.items()},
    }


def bench_prefill(b: int, t: int, sparsities, dtype=torch.bfloat16, config=None, layout: str = "nhd") -> list[dict]:
    """``config``: a prefill launch configuration (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of the
    kernel's defaults; ``layout``: "hnd" holds the routed kernel's K / V head-major in memory (the same [B, T, Hk, d]
    tensors, as ``WideRuntime(kv_layout="hnd")`` caches them; SDPA, the baseline, reads its own copies)."""
    from wide.kernels.attention import routed_attention_prefill
    from wide.kernels.route.reorder import reorder

    n = _copies(b * t * (2 * HQ + 2 * HK) * D * 2)
    qs = [torch.randn(b, t, HQ, D, device="cuda", dtype=dtype) for _ in range(n)]
    ks = [torch.randn(b, t, HK, D, device="cuda", dtype=dtype) for _ in range(n)]
    vs = [torch.randn(b, t, HK, D, device="cuda", dtype=dtype) for _ in range(n)]
    tr = [x.transpose(1, 2) for x in qs], [x.transpose(1, 2) for x in ks], [x.transpose(1, 2) for x in vs]
    if layout == "hnd":  # [B, T, Hk, d] views of [B, Hk, T, d] storage
        ks, vs = ([x.transpose(1, 2).contiguous().transpose(1, 2) for x in xs] for xs in (ks, vs))
    key = ("prefill", b, t)
    if key not in _BASELINE_CACHE:
        _BASELINE_CACHE[key] = _best(_sdpa_cands(*tr, causal=True))
    baseline, dense_ms, all_dense = _BASELINE_CACHE[key]
    rows = []
    for s in sparsities:
        masks = [torch.rand(b, t, HK, device="cuda") >= s for _ in range(n)]
        routes = [reorder(m) for m in masks]
        wide = [
            partial(routed_attention_prefill, q, k, v, m, config=config)
            for q, k, v, m in zip(qs, ks, vs, masks, strict=False)
        ]
        kern = [
            partial(routed_attention_prefill, q, k, v, m, route=r, config=config)
            for q, k, v, m, r in zip(qs, ks, vs, masks, routes, strict=False)
        ]
        wide_ms = time_graph(wide)
        kern_ms = time_graph(kern)
        reorder_ms = time_graph([partial(reorder, m) for m in masks])
        real = 1.0 - torch.stack(masks).float().mean().item()
        rows.append(
            _record(
                "attn_prefill", b, "T", t, s, dense_ms, wide_ms, baseline,
                wide_kernel_ms=kern_ms, reorder_ms=reorder_ms, real_sparsity=round(real, 4),
                dense_all_ms=all_dense, speedup_vs_flash=_vs_flash(all_dense, wide_ms),
                speedup_vs_sdpa_default=_vs_default(all_dense, wide_ms),
                note="wide_ms includes reorder(mask); causal; random i.i.d. masks",
            )
        )  # fmt: skip
    return rows


def bench_decode(b: int, ctx: int, sparsities, dtype=torch.bfloat16, config=None, waves=None) -> list[dict]:
    """``config``: a decode launch configuration (BLOCK_N, num_warps, num_stages) instead of the kernel's
    defaults; ``waves``: programs per SM the split count aims for (default: the kernel's)."""
    from wide.kernels.attention import decode_num_splits, routed_attention_decode

    n = _copies(b * ctx * 2 * HK * D * 2)
    qs = [torch.randn(b, HQ, D, device="cuda", dtype=dtype) for _ in range(n)]
    ks = [torch.randn(b, ctx, HK, D, device="cuda", dtype=dtype) for _ in range(n)]
    vs = [torch.randn(b, ctx, HK, D, device="cuda", dtype=dtype) for _ in range(n)]
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    q4 = [x[:, :, None, :] for x in qs]  # [B,Hq,1,d]
    tr = q4, [x.transpose(1, 2) for x in ks], [x.transpose(1, 2) for x in vs]
    key = ("decode", b, ctx)
    if key not in _BASELINE_CACHE:
        _BASELINE_CACHE[key] = _best(_sdpa_cands(*tr, causal=False))
    baseline, dense_ms, all_dense = _BASELINE_CACHE[key]
    rows = []
    splits = None if waves is None else decode_num_splits(b, HK, ctx, torch.device("cuda"), waves=waves)
    draws = max(n, DECODE_MASK_DRAWS)  # a [B, Hk] mask of 8 groups strays far from its level: cycle many
    for s in sparsities:
        masks = [torch.rand(b, HK, device="cuda") >= s for _ in range(draws)]
        wide = [
            partial(routed_attention_decode, qs[i % n], ks[i % n], vs[i % n], lens, m, num_splits=splits,
                    config=config)
            for i, m in enumerate(masks)
        ]  # fmt: skip
        wide_ms = time_graph(wide)
        real = 1.0 - torch.stack(masks).float().mean().item()
        rows.append(
            _record(
                "attn_decode", b, "ctx", ctx, s, dense_ms, wide_ms, baseline, real_sparsity=round(real, 4),
                dense_all_ms=all_dense, speedup_vs_flash=_vs_flash(all_dense, wide_ms),
                speedup_vs_sdpa_default=_vs_default(all_dense, wide_ms),
                mask_draws=draws,
                note="SDPA over the full cache (q [B,Hq,1,d]); all cache_lens = ctx; random i.i.d. masks",
            )
        )  # fmt: skip
    return rows


def run_attention_bench(quick: bool = False) -> list[dict]:
    """Sweep Llama-3.1-8B shapes; returns one record per (shape, sparsity). Needs CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("run_attention_bench needs a CUDA GPU")
    torch.manual_seed(0)
    sp = (0.0, 0.5) if quick else (0.0, 0.25, 0.5, 0.7)
    prefill = [(1, 4096), (1, 16384), (8, 4096)]
    if not quick:
        prefill = [(1, 1024), (8, 1024)] + prefill + [(8, 16384)]
    decode = [(b, c) for c in (4096, 32768) for b in (1, 16, 64)]
    rows: list[dict] = []
    for b, t in prefill:
        rows += bench_prefill(b, t, sp)
        torch.cuda.empty_cache()
    for b, c in decode:
        rows += bench_decode(b, c, sp)
        torch.cuda.empty_cache()
    return rows
