# ruff: noqa: B023  (closures are timed inside the loop iteration that defines them)
"""Decode-kernel tuning sweep on the GPU: explicit configs of the small-M routed GEMMs and split
counts of routed decode attention, each checked for bf16 error before it is timed.

Timed as the benchmarks time (``wide.bench.timing.time_calls``: back-to-back calls on rotated input
copies in one CUDA graph). Also sweeps the sorted GEMM-MN tile configs at M = 4096 ('large') and the
routed prefill attention launch configs ('prefill'). Writes OUT/decode_variants.json (one record per
variant) and a short markdown table.
Usage: python3 scripts/decode_variants.py OUT_DIR [PARTS]   (PARTS: comma list of
gemm1,gemm4,gemmk,attn,large,pick,prefill,down32,router,pdl,ordered; default gemm1,gemm4,attn)
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

from wide.bench import attention_bench as AB
from wide.bench.gemm_bench import time_graph, time_variants
from wide.bench.timing import copies_for
from wide.kernels import attention as A
from wide.kernels.attention_reference import attention_decode_ref
from wide.kernels.plan import plan
from wide.kernels.reference import routed_gemm_k_ref, routed_gemm_mn_ref, routed_swiglu_ref
from wide.kernels.reorder import plan_route
from wide.kernels.small_m import small_gemm_k, small_gemm_mn


def cfg(bn, bk, splits, stages=4, warps=4):
    return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLITS": splits, "num_stages": stages, "num_warps": warps}


MN_CFGS = {
    "q": [cfg(bn, bk, s) for bn, bk in ((16, 256), (32, 256), (32, 128), (64, 128)) for s in (1, 2, 4, 8)],
    "gate_up": [cfg(bn, bk, s) for bn, bk in ((16, 256), (32, 128), (32, 256), (64, 128)) for s in (1, 2, 4)],
}
K_CFGS = {
    "o": [
        cfg(bn, bk, s, st) for bn, bk, st in ((32, 128, 4), (64, 128, 4), (64, 64, 5), (32, 256, 3)) for s in (4, 8, 16)
    ],
    "down": [cfg(bn, bk, s, st) for bn, bk, st in ((32, 128, 4), (64, 128, 4), (64, 64, 5)) for s in (8, 16, 32)],
    "down32": [cfg(bn, 32, s, st) for bn, st in ((64, 5), (64, 8), (32, 6)) for s in (4, 8, 16)],
}


SHAPES = {
    "q": (4096, 4096, 512),
    "gate_up": (14336, 4096, 128),
    "o": (4096, 4096, 512),
    "down": (4096, 14336, 128),
    "down32": (4096, 14336, 32),  # part 'down32' only
}


def _time_vs_sdpa(rec: dict, fns: list, sdpa_ms: float) -> None:
    rec["wide_ms"] = AB.time_graph(fns)
    rec["speedup_vs_sdpa_default"] = sdpa_ms / rec["wide_ms"]


def _keep(recs: list, rec: dict) -> None:
    recs.append(rec)
    print(json.dumps(rec), flush=True)


def err_ok(out, ref32, low) -> tuple[bool, float, float]:
    e = (out.float() - ref32).abs().max().item()
    b = (low.float() - ref32).abs().max().item()
    return e <= 2 * b + 1e-5 * max(1.0, ref32.abs().max().item()), e, b


def gemm_variants(recs: list, m: int, ops: tuple[str, ...] = ("q", "gate_up", "o", "down")) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m)
    for op, (n, k, g) in SHAPES.items():
        if op not in ops:
            continue
        nc = copies_for(n * k * 2 * (2 if op == "gate_up" else 1))
        w = [torch.randn(n, k, device="cuda", generator=gen) / k**0.5 for _ in range(nc)]
        w2 = [torch.randn(n, k, device="cuda", generator=gen) / k**0.5 if op == "gate_up" else None for _ in range(nc)]
        x = [torch.randn(m, k, device="cuda", generator=gen) for _ in range(nc)]
        ng = (k if op in ("o", "down", "down32") else n) // g
        mask = [torch.rand(m, ng, device="cuda", generator=gen) < 0.5 for _ in range(nc)]
        r = plan_route(mask[0], plan(m, g, ng))
        xb, wb = [t.bfloat16() for t in x], [t.bfloat16() for t in w]
        w2b = [t.bfloat16() if t is not None else None for t in w2]
        if op in ("o", "down", "down32"):
            xz = [a * mk.repeat_interleave(g, 1) for a, mk in zip(xb, mask, strict=True)]
            ref, low = routed_gemm_k_ref(x[0], w[0], r, g), routed_gemm_k_ref(xb[0], wb[0], r, g)
            dense = time_graph([partial(F.linear, a, b) for a, b in zip(xz, wb, strict=True)])

            def make(c, xz=xz, wb=wb, mask=mask):
                kw = {} if c is None else {"config": c}
                return [partial(small_gemm_k, a, b, mk, g, **kw) for a, b, mk in zip(xz, wb, mask, strict=True)]

            cfgs = K_CFGS[op]
        else:
            sw = op == "gate_up"
            if sw:
                ref, low = routed_swiglu_ref(x[0], w[0], w2[0], r, g), routed_swiglu_ref(xb[0], wb[0], w2b[0], r, g)
                dense = time_graph(
                    [lambda a=a, b=b, c=c: F.silu(F.linear(a, b)) * F.linear(a, c) for a, b, c in zip(xb, wb, w2b)]
                )
            else:
                ref, low = routed_gemm_mn_ref(x[0], w[0], r, g), routed_gemm_mn_ref(xb[0], wb[0], r, g)
                dense = time_graph([partial(F.linear, a, b) for a, b in zip(xb, wb, strict=True)])

            def make(c, xb=xb, wb=wb, w2b=w2b, mask=mask):
                kw = {} if c is None else {"config": c}
                return [
                    partial(small_gemm_mn, a, b, c2, mk, g, True, **kw)
                    for a, b, c2, mk in zip(xb, wb, w2b, mask, strict=True)
                ]

            cfgs = MN_CFGS[op]
        for c in [*cfgs, None]:
            fns = make(c)
            rec = {"kind": "gemm", "op": op, "M": m, "group_size": g, "sparsity": 0.5, "config": c or "autotuned",
                   "dense_ms": dense, "copies": nc,
                   "active_fraction": torch.stack(mask).float().mean().item()}  # fmt: skip
            try:
                out = fns[0]()
                ok, e, b = err_ok(out, ref, low)
                same = torch.equal(out, fns[0]())
                rec.update(err=e, torch_err=b, err_ok=ok, repeat_identical=same)
                if ok:
                    rec["wide_ms"] = time_graph(fns)
                    rec["speedup"] = dense / rec["wide_ms"]
            except Exception as exc:  # noqa: BLE001 - record the failure, go on
                rec["error"] = repr(exc)[:300]
            recs.append(rec)
            print(json.dumps(rec), flush=True)


def _large_inputs(op: str, m: int, gen: torch.Generator):
    """(SwiGLU?, copies, weights, up weights, inputs): bf16 copies of one large-M GEMM-MN case, together > L2."""
    n, k, _ = SHAPES[op]
    sw = op == "gate_up"
    nc = copies_for(n * k * 2 * (2 if sw else 1) + m * k * 2)
    w = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5 for _ in range(nc)]
    w2 = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5 for _ in range(nc)]
    x = [torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(nc)]
    return sw, nc, w, w2, x


def large_mn_variants(recs: list, m: int = 4096) -> None:
    """Sorted GEMM-MN tile configs at large M, 50% and 0%: each forced as the only autotune candidate."""
    from wide.kernels import clear_autotune_cache
    from wide.kernels import gemm_mn as GM

    gen = torch.Generator(device="cuda").manual_seed(7)
    saved = list(GM._LARGE)
    cands = saved + [GM._cfg(64, 256, 64, 4, 8, tma=True), GM._cfg(128, 128, 64, 5, 8, tma=True),
                     GM._cfg(256, 128, 64, 3, 8, tma=True), GM._cfg(128, 256, 64, 4, 8, tma=True)]  # fmt: skip
    for op, (n, _, g) in (("q", SHAPES["q"]), ("gate_up", SHAPES["gate_up"])):
        sw, nc, w, w2, x = _large_inputs(op, m, gen)
        if sw:
            dense = time_graph(
                [lambda a=a, b=b, c=c: F.silu(F.linear(a, b)) * F.linear(a, c) for a, b, c in zip(x, w, w2)]
            )
        else:
            dense = time_graph([partial(F.linear, a, b) for a, b in zip(x, w, strict=True)])
        for sp in (0.5, 0.0):
            masks = [torch.rand(m, n // g, device="cuda", generator=gen) >= sp for _ in range(nc)]
            routes = [plan_route(mk, plan(m, g, n // g, force_mn="sorted")) for mk in masks]
            for c in cands:
                if g % c.kwargs["BLOCK_N"]:
                    continue
                GM._LARGE[:] = [c]
                GM._gemm_mn_tuned.configs = [c]
                clear_autotune_cache()
                if sw:
                    fns = [partial(GM.routed_swiglu, a, b, c2, r, g) for a, b, c2, r in zip(x, w, w2, routes)]
                else:
                    fns = [partial(GM.routed_gemm_mn, a, b, r, g, zero_inactive=False) for a, b, r in zip(x, w, routes)]
                rec = {"kind": "gemm_large", "op": op, "M": m, "group_size": g, "sparsity": sp, "config": str(c),
                       "dense_ms": dense, "copies": nc}  # fmt: skip
                try:
                    rec["wide_ms"] = time_graph(fns)
                    rec["speedup"] = dense / rec["wide_ms"]
                except Exception as exc:  # noqa: BLE001
                    rec["error"] = repr(exc)[:300]
                recs.append(rec)
                print(json.dumps(rec), flush=True)
    GM._LARGE[:] = saved
    GM._gemm_mn_tuned.configs = GM._ALL
    clear_autotune_cache()


def prefill_variants(recs: list) -> None:
    """Routed prefill attention launch configs (BLOCK_M, BLOCK_N, warps, stages) at 50% and 0%."""
    from wide.kernels.reorder import reorder

    hq, hk, d = 32, 8, 128
    for b, t in ((1, 4096), (8, 4096)):
        n = AB._copies(b * t * (2 * hq + 2 * hk) * d * 2)
        qs = [torch.randn(b, t, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        ks = [torch.randn(b, t, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        vs = [torch.randn(b, t, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        tr = [x.transpose(1, 2) for x in qs], [x.transpose(1, 2) for x in ks], [x.transpose(1, 2) for x in vs]
        sdpa_ms = AB.time_graph(AB._sdpa_cands(*tr, causal=True)["sdpa-default(enable_gqa)"])
        for sp in (0.5, 0.0):
            masks = [torch.rand(b, t, hk, device="cuda") >= sp for _ in range(n)]
            routes = [reorder(mk) for mk in masks]
            for conf in (None, (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2),
                         (128, 64, 8, 4), (64, 64, 4, 3), (256, 64, 8, 3), (64, 128, 4, 3)):  # fmt: skip
                rec = {
                    "kind": "attn_prefill",
                    "B": b,
                    "T": t,
                    "sparsity": sp,
                    "config": conf,
                    "sdpa_default_ms": sdpa_ms,
                }
                try:
                    fns = [
                        partial(A.routed_attention_prefill, q, k, v, mk, route=r, config=conf)
                        for q, k, v, mk, r in zip(qs, ks, vs, masks, routes, strict=True)
                    ]
                    out = fns[0]().float()
                    ref = A.attention_prefill_ref(qs[0][:, -256:].float(), ks[0].float(), vs[0].float(),
                                                  masks[0][:, -256:], 1 / d**0.5, True)  # fmt: skip
                    rec["max_err_last256"] = (out[:, -256:] - ref).abs().max().item()
                    _time_vs_sdpa(rec, fns, sdpa_ms)
                except Exception as exc:  # noqa: BLE001
                    rec["error"] = repr(exc)[:300]
                _keep(recs, rec)


def attn_variants(recs: list) -> None:
    hq, hk, d = 32, 8, 128
    for b, ctx in ((1, 4096), (16, 4096), (1, 32768), (64, 4096)):
        n = AB._copies(b * ctx * 2 * hk * d * 2)
        qs = [torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        ks = [torch.randn(b, ctx, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        vs = [torch.randn(b, ctx, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        masks = [torch.rand(b, hk, device="cuda") >= 0.5 for _ in range(n)]
        q4 = [x[:, :, None, :] for x in qs]
        tr = q4, [x.transpose(1, 2) for x in ks], [x.transpose(1, 2) for x in vs]
        sdpa_ms = AB.time_graph(AB._sdpa_cands(*tr, causal=False)["sdpa-default(enable_gqa)"])
        ref = attention_decode_ref(qs[0], ks[0], vs[0], lens, masks[0])
        low = attention_decode_ref(qs[0], ks[0], vs[0], lens, masks[0], upcast=False)
        default_ns = A.decode_num_splits(b, hk, ctx, qs[0].device)
        for conf in ((128, 8, 3), (64, 4, 3), (64, 4, 4), (128, 4, 2)):
            for ns in sorted({4, 8, 16, 32, 64, default_ns}):
                if ctx // ns < conf[0]:
                    continue
                rec = {"kind": "attn_decode", "B": b, "ctx": ctx, "sparsity": 0.5, "config": conf,
                       "num_splits": ns, "default_splits": default_ns, "sdpa_default_ms": sdpa_ms}  # fmt: skip
                try:
                    out = A.routed_attention_decode(qs[0], ks[0], vs[0], lens, masks[0], num_splits=ns, config=conf)
                    ok, e, bb = err_ok(out, ref, low)
                    rec.update(err=e, torch_err=bb, err_ok=ok)
                    fns = [
                        partial(A.routed_attention_decode, q, k, v, lens, mk, num_splits=ns, config=conf)
                        for q, k, v, mk in zip(qs, ks, vs, masks, strict=True)
                    ]
                    _time_vs_sdpa(rec, fns, sdpa_ms)
                except Exception as exc:  # noqa: BLE001
                    rec["error"] = repr(exc)[:300]
                _keep(recs, rec)


def autotune_pick(recs: list, m: int = 4096) -> None:
    """What the sorted GEMM-MN autotuner picks at large M (its own per-config times, with Triton's
    default do_bench and with its CUDA-graph one) against this harness's time of the picked config."""
    from wide.kernels import clear_autotune_cache
    from wide.kernels import gemm_mn as GM

    gen = torch.Generator(device="cuda").manual_seed(9)
    tuner = GM._gemm_mn_tuned
    for op, (n, _, g) in (("gate_up", SHAPES["gate_up"]), ("q", SHAPES["q"])):
        sw, nc, w, w2, x = _large_inputs(op, m, gen)
        for sp in (0.5, 0.0):
            masks = [torch.rand(m, n // g, device="cuda", generator=gen) >= sp for _ in range(nc)]
            routes = [plan_route(mk, plan(m, g, n // g, force_mn="sorted")) for mk in masks]
            if sw:
                fns = [partial(GM.routed_swiglu, a, b, c2, r, g) for a, b, c2, r in zip(x, w, w2, routes)]
            else:
                fns = [partial(GM.routed_gemm_mn, a, b, r, g, zero_inactive=False) for a, b, r in zip(x, w, routes)]
            for graph_bench in (False, True):
                from triton.testing import do_bench_cudagraph

                def graph_bench_fn(fn, quantiles):
                    return do_bench_cudagraph(fn, rep=20, quantiles=quantiles)

                tuner._do_bench = graph_bench_fn if graph_bench else None  # None: Triton's default
                clear_autotune_cache()
                fns[0]()
                timings = {str(c): t for c, t in (getattr(tuner, "configs_timings", None) or {}).items()}
                rec = {"kind": "autotune_pick", "op": op, "M": m, "group_size": g, "sparsity": sp,
                       "tuner_bench": "cudagraph" if graph_bench else "default", "picked": str(tuner.best_config),
                       "tuner_timings": {c: (t[0] if isinstance(t, list) else t) for c, t in timings.items()},
                       "wide_ms": time_graph(fns)}  # fmt: skip
                recs.append(rec)
                print(json.dumps(rec), flush=True)
    tuner._do_bench = None
    clear_autotune_cache()


def router_variants(recs: list) -> None:
    """Router decisions at decode (Llama-3.1-8B: D 4096, r 32; FFN 112 groups (G 128), attention 8):
    the torch path the runtime ran (cuBLAS projection + fp32 head + compare) against the one-launch
    kernel at several configs; decisions checked equal away from the threshold."""
    from wide.kernels.router import margin_decisions, margin_decisions_ref, router_decisions, router_decisions_ref

    gen = torch.Generator(device="cuda").manual_seed(11)
    d, r = 4096, 32
    for ng in (112, 8):
        w_down = torch.randn(r, d, device="cuda", generator=gen).div_(d**0.5).bfloat16()
        w_margin = torch.randn(ng, r, device="cuda", generator=gen) / r**0.5
        b_margin = 0.1 * torch.randn(ng, device="cuda", generator=gen)
        for m in (1, 16):
            hs = [torch.randn(m, d, device="cuda", generator=gen).bfloat16() for _ in range(8)]
            torch_ms = time_graph([partial(router_decisions_ref, h, w_down, w_margin, b_margin) for h in hs])
            ref = router_decisions_ref(hs[0], w_down, w_margin, b_margin)
            margin = (hs[0].float() @ w_down.float().t()).bfloat16().float() @ w_margin.t() + b_margin
            confs = [None] + [
                {"BLOCK_D": bd, "SPLITS": sp, "num_warps": 4} for bd in (64, 128, 256) for sp in (4, 8, 16, 32)
            ]
            for conf in confs:
                if conf is not None and d // conf["SPLITS"] < conf["BLOCK_D"]:
                    continue
                rec = {"kind": "router", "op": f"router N_G {ng}", "M": m, "config": conf, "torch_ms": torch_ms}
                out = router_decisions(hs[0], w_down, w_margin, b_margin, config=conf)
                rec["decisions_differ"] = int((out != ref).sum())
                rec["differ_away_from_threshold"] = int(((out != ref) & (margin.abs() > 2e-2)).sum())
                fns = [partial(router_decisions, h, w_down, w_margin, b_margin, config=conf) for h in hs]
                rec["wide_ms"] = time_graph(fns)
                rec["speedup"] = torch_ms / rec["wide_ms"]
                _keep(recs, rec)
            rs = [torch.randn(m, 2 * 1024 + r, device="cuda", generator=gen).bfloat16()[:, 2048:] for _ in range(8)]
            rec = {"kind": "router", "op": f"margin N_G {ng}", "M": m, "config": None}
            rec["torch_ms"] = time_graph([partial(margin_decisions_ref, x, w_margin, b_margin) for x in rs])
            rec["decisions_differ"] = int(
                (margin_decisions(rs[0], w_margin, b_margin) != margin_decisions_ref(rs[0], w_margin, b_margin)).sum()
            )
            rec["wide_ms"] = time_graph([partial(margin_decisions, x, w_margin, b_margin) for x in rs])
            rec["speedup"] = rec["torch_ms"] / rec["wide_ms"]
            _keep(recs, rec)


def pdl_variants(recs: list) -> None:
    """Programmatic dependent launch: the decode kernels (autotuned, so one config for both variants)
    launched plainly (WIDE_PDL=0) and with PDL, against cuBLAS; M 1 and 4, 50% and all-active masks."""
    import os

    from wide.kernels.router import margin_decisions, margin_decisions_ref, router_decisions, router_decisions_ref

    gen = torch.Generator(device="cuda").manual_seed(5)
    variants = (("plain", "0"), ("pdl", "1"))
    for op in ("q", "gate_up", "o", "down"):
        n, k, g = SHAPES[op]
        sw, k_routed = op == "gate_up", op in ("o", "down")
        nc = copies_for(n * k * 2 * (2 if sw else 1))
        wb = [(torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16() for _ in range(nc)]
        w2b = [(torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16() if sw else None for _ in range(nc)]
        ng = (k if k_routed else n) // g
        for m in (1, 4):
            xb = [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for _ in range(nc)]
            for sp in (0.5, 0.0):
                mask = [torch.rand(m, ng, device="cuda", generator=gen) >= sp for _ in range(nc)]
                r0 = plan_route(mask[0], plan(m, g, ng))
                if k_routed:
                    xs = [a * mk.repeat_interleave(g, 1) for a, mk in zip(xb, mask, strict=True)]
                    dense = time_graph([partial(F.linear, a, b) for a, b in zip(xs, wb, strict=True)])
                    ref32, low = routed_gemm_k_ref(xs[0].float(), wb[0].float(), r0, g), F.linear(xs[0], wb[0])
                elif sw:
                    xs = xb
                    dense = time_graph(
                        [lambda a=a, b=b, c=c: F.silu(F.linear(a, b)) * F.linear(a, c) for a, b, c in zip(xb, wb, w2b)]
                    )
                    ref32 = routed_swiglu_ref(xb[0].float(), wb[0].float(), w2b[0].float(), r0, g)
                    low = routed_swiglu_ref(xb[0], wb[0], w2b[0], r0, g)
                else:
                    xs = xb
                    dense = time_graph([partial(F.linear, a, b) for a, b in zip(xb, wb, strict=True)])
                    ref32, low = (
                        routed_gemm_mn_ref(xb[0].float(), wb[0].float(), r0, g),
                        routed_gemm_mn_ref(xb[0], wb[0], r0, g),
                    )
                for name, env in variants:
                    os.environ["WIDE_PDL"] = env
                    if k_routed:
                        fns = [partial(small_gemm_k, a, b, mk, g) for a, b, mk in zip(xs, wb, mask, strict=True)]
                    else:
                        fns = [
                            partial(small_gemm_mn, a, b, c2, mk, g, True)
                            for a, b, c2, mk in zip(xs, wb, w2b, mask, strict=True)
                        ]
                    out = fns[0]()
                    ok, e, b = err_ok(out, ref32, low)
                    rec = {"kind": "pdl", "op": op, "M": m, "group_size": g, "sparsity": sp, "variant": name,
                           "dense_ms": dense, "err_ok": ok, "err": e, "torch_err": b,
                           "repeat_identical": torch.equal(out, fns[0]())}  # fmt: skip
                    rec["wide_ms"] = time_graph(fns)
                    rec["speedup"] = dense / rec["wide_ms"]
                    _keep(recs, rec)
    d, r = 4096, 32
    for ng in (112, 8):
        w_down = torch.randn(r, d, device="cuda", generator=gen).div_(d**0.5).bfloat16()
        w_margin = torch.randn(ng, r, device="cuda", generator=gen) / r**0.5
        b_margin = 0.1 * torch.randn(ng, device="cuda", generator=gen)
        hs = [torch.randn(1, d, device="cuda", generator=gen).bfloat16() for _ in range(8)]
        rs = [torch.randn(1, 2 * 1024 + r, device="cuda", generator=gen).bfloat16()[:, 2048:] for _ in range(8)]
        ref = router_decisions_ref(hs[0], w_down, w_margin, b_margin)
        mref = margin_decisions_ref(rs[0], w_margin, b_margin)
        for name, env in variants:
            os.environ["WIDE_PDL"] = env
            out = router_decisions(hs[0], w_down, w_margin, b_margin)
            rec = {"kind": "pdl", "op": f"router N_G {ng}", "M": 1, "variant": name,
                   "decisions_differ": int((out != ref).sum())}  # fmt: skip
            rec["wide_ms"] = time_graph([partial(router_decisions, h, w_down, w_margin, b_margin) for h in hs])
            _keep(recs, rec)
            rec = {"kind": "pdl", "op": f"margin N_G {ng}", "M": 1, "variant": name,
                   "decisions_differ": int((margin_decisions(rs[0], w_margin, b_margin) != mref).sum())}  # fmt: skip
            rec["wide_ms"] = time_graph([partial(margin_decisions, x, w_margin, b_margin) for x in rs])
            _keep(recs, rec)
    os.environ["WIDE_PDL"] = "1"


def ordered_variants(recs: list) -> None:
    """GEMM-K 'ordered' (rows in the shared Gray pattern order, a tile skips the groups none of its
    rows runs) against cuBLAS on the pre-zeroed input ('dense', what the plan runs at large M):
    O (G 512) at M 4096 / 8192 / 16384 and sparsity 0-70%, down (G 128) at M 4096, 50%. 'ordered'
    computes its order in the call; '_pre' variants get it precomputed (Gray / binary order)."""
    from wide.kernels import clear_autotune_cache
    from wide.kernels import gemm_k as GK
    from wide.kernels.gemm_k import routed_gemm_k
    from wide.kernels.reorder import pattern_order, pattern_order_reference

    gen = torch.Generator(device="cuda").manual_seed(11)
    all_cfgs = list(GK._ordered.configs)
    sweep = {("o", 4096, 0.5), ("o", 16384, 0.5)}
    for op, m, sps in (("o", 4096, (0.0, 0.5, 0.7)), ("o", 8192, (0.5, 0.7)),
                       ("o", 16384, (0.0, 0.25, 0.5, 0.7)), ("down", 4096, (0.5,))):  # fmt: skip
        n, k, g = SHAPES[op]
        nc = copies_for(n * k * 2 + m * k * 2)
        w = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5 for _ in range(nc)]
        x = [torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(nc)]
        for sp in sps:
            masks = [torch.rand(m, k // g, device="cuda", generator=gen) >= sp for _ in range(nc)]
            xz = [a * mk.repeat_interleave(g, 1).to(a.dtype) for a, mk in zip(x, masks, strict=True)]
            routes = [plan_route(mk, plan(m, g, k // g, sp, force_k="ordered")) for mk in masks]
            dense_routes = [r._replace(plan=plan(m, g, k // g, sp, force_k="dense")) for r in routes]
            pre = [r._replace(order=pattern_order(r.mask)) for r in routes]
            lex = [r._replace(order=pattern_order(r.mask, gray=False)) for r in routes]
            base = {"kind": "gemm_k_ordered", "op": op, "M": m, "group_size": g, "sparsity": sp, "copies": nc}
            ref32 = routed_gemm_k_ref(xz[0].float(), w[0].float(), routes[0], g)
            low = F.linear(xz[0], w[0])
            clear_autotune_cache()
            checks = {}
            for name, zeroed, rs, xs in (("ordered", True, routes, xz), ("ordered_masked_x", False, routes, x)):
                ok, e, b = err_ok(routed_gemm_k(xs[0], w[0], rs[0], g, x_zeroed=zeroed), ref32, low)
                checks[name] = {"ok": ok, "err": e, "torch_bf16_err": b}

            def calls(xs, rs, ws=w, **kw):
                return [partial(routed_gemm_k, a, b, r, g, **kw) for a, b, r in zip(xs, ws, rs, strict=True)]

            variants = {
                "cublas_dense": [partial(F.linear, a, b) for a, b in zip(xz, w, strict=True)],
                "masked_dense": calls(xz, dense_routes, x_zeroed=True),
                "ordered": calls(xz, routes, x_zeroed=True),
                "ordered_pre": calls(xz, pre, x_zeroed=True),
                "ordered_pre_binary": calls(xz, lex, x_zeroed=True),
                "ordered_masked_x": calls(x, pre),
            }
            for f in variants["ordered"][:1]:
                f()  # autotune on these masks before timing
            best = str(GK._ordered.best_config)
            times = time_variants(list(variants.values()))
            t = dict(zip(variants, times, strict=True))
            rec = dict(base, checks=checks, best_config=best, times_ms=t,
                       order_ms=time_graph([partial(pattern_order, mk) for mk in masks]),
                       order_torch_ms=time_graph([partial(pattern_order_reference, mk) for mk in masks]),
                       speedup_vs_cublas={kk: t["cublas_dense"] / v for kk, v in t.items()})  # fmt: skip
            rec["wide_ms"], rec["speedup"] = t["ordered"], t["cublas_dense"] / t["ordered"]
            _keep(recs, rec)
            if (op, m, sp) in sweep:  # each config forced alone
                for c in all_cfgs:
                    GK._ordered.configs = [c]
                    clear_autotune_cache()
                    try:
                        ms = time_graph(variants["ordered_pre"])
                        _keep(recs, dict(base, kind="gemm_k_ordered_cfg", config=str(c), wide_ms=ms,
                                         speedup=t["cublas_dense"] / ms))  # fmt: skip
                    except Exception as exc:  # noqa: BLE001
                        _keep(recs, dict(base, kind="gemm_k_ordered_cfg", config=str(c), error=repr(exc)[:300]))
                GK._ordered.configs = all_cfgs
                clear_autotune_cache()
        del w, x
        torch.cuda.empty_cache()


def floor(recs: list) -> None:
    """Time per call of a trivial kernel in the harness (back-to-back in one graph): its fixed cost."""
    t = torch.zeros(1, device="cuda")
    recs.append({"kind": "floor", "what": "one 1-element add per call", "wide_ms": time_graph([lambda: t.add_(1)])})
    print(json.dumps(recs[-1]), flush=True)


def main(out_dir: str) -> None:
    t0 = time.time()
    recs: list = []
    parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["gemm1", "gemm4", "attn"]
    floor(recs)
    for m in (1, 4):
        if f"gemm{m}" in parts:
            gemm_variants(recs, m)
    other_parts = {
        "attn": attn_variants,
        "down32": lambda r: gemm_variants(r, 1, ("down32",)),
        "gemmk": lambda r: [gemm_variants(r, m, ("o", "down")) for m in (1, 4)],  # GEMM-K small path, M 1 / 4
        "large": large_mn_variants,
        "pick": autotune_pick,
        "prefill": prefill_variants,
        "router": router_variants,
        "pdl": pdl_variants,
        "ordered": ordered_variants,
    }
    for name, run in other_parts.items():  # in this order, whatever the order of PARTS
        if name in parts:
            run(recs)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "wall_s": time.time() - t0}
    with open(f"{out_dir}/decode_variants.json", "w") as f:
        json.dump({"meta": meta, "records": recs}, f, indent=1)
    best: dict = {}
    for r in recs:
        if "wide_ms" not in r or r["kind"] == "floor":
            continue
        key = (r["kind"], r.get("op"), r.get("M"), r.get("B"), r.get("ctx") or r.get("T"), r.get("sparsity"))
        if key not in best or r["wide_ms"] < best[key]["wide_ms"]:
            best[key] = r
    lines = ["| kind | op / B,T | M | sparsity | best config | wide ms | speed-up |", "|---|---|---|---|---|---|---|"]
    for (kind, op, m, b, ctx, spars), r in best.items():
        sp = r.get("speedup") or r.get("speedup_vs_sdpa_default")
        conf = r.get("config"), r.get("num_splits")
        sp = float("nan") if sp is None else sp  # autotune_pick records carry no speed-up
        lines.append(f"| {kind} | {op or (b, ctx)} | {m} | {spars} | {conf} | {r['wide_ms']:.4f} | {sp:.2f} |")
    with open(f"{out_dir}/decode_variants.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
