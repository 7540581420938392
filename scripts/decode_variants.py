# ruff: noqa: B023  (closures are timed inside the loop iteration that defines them)
"""Decode-kernel tuning sweep on the GPU: explicit configs of the small-M routed GEMMs and split
counts of routed decode attention, each checked for bf16 error before it is timed.

GEMMs are timed as in ``wide.bench.gemm_bench`` (one call per CUDA graph, L2 flushed); attention as in
``wide.bench.attention_bench`` (many calls per graph on rotated inputs). Writes OUT/decode_variants.json
(one record per variant) and a short markdown table.
Usage: python3 scripts/decode_variants.py OUT_DIR [PARTS]   (PARTS: comma list of gemm1,gemm4,attn; all)
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

from wide.bench import attention_bench as AB
from wide.bench.gemm_bench import time_graph
from wide.kernels import attention as A
from wide.kernels.attention_reference import attention_decode_ref
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
    "o": [cfg(bn, bk, s, st) for bn, bk, st in ((32, 128, 4), (64, 128, 4), (64, 64, 5), (32, 256, 3)) for s in (4, 8)],
    "down": [cfg(bn, bk, s, st) for bn, bk, st in ((32, 128, 4), (64, 128, 4), (64, 64, 5)) for s in (8, 16, 32)],
}


SHAPES = {"q": (4096, 4096, 512), "gate_up": (14336, 4096, 128), "o": (4096, 4096, 512), "down": (4096, 14336, 128)}


def err_ok(out, ref32, low) -> tuple[bool, float, float]:
    e = (out.float() - ref32).abs().max().item()
    b = (low.float() - ref32).abs().max().item()
    return e <= 2 * b + 1e-5 * max(1.0, ref32.abs().max().item()), e, b


def gemm_variants(recs: list, m: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m)
    for op, (n, k, g) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
        w2 = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
        x = torch.randn(m, k, device="cuda", generator=gen)
        ng = (k if op in ("o", "down") else n) // g
        mask = torch.rand(m, ng, device="cuda", generator=gen) < 0.5
        r = plan_route(mask)
        xb, wb, w2b = x.bfloat16(), w.bfloat16(), w2.bfloat16()
        if op in ("o", "down"):
            xz = xb * mask.repeat_interleave(g, 1)
            ref, low = routed_gemm_k_ref(x, w, r, g), routed_gemm_k_ref(xb, wb, r, g)
            dense = time_graph(lambda: F.linear(xz, wb))
            cands = [(c, partial(small_gemm_k, xz, wb, mask, g, config=c)) for c in K_CFGS[op]]
            cands.append(("autotuned", partial(small_gemm_k, xz, wb, mask, g)))
        else:
            sw = op == "gate_up"
            if sw:
                ref, low = routed_swiglu_ref(x, w, w2, r, g), routed_swiglu_ref(xb, wb, w2b, r, g)
                dense = time_graph(lambda: F.silu(F.linear(xb, wb)) * F.linear(xb, w2b))
            else:
                ref, low = routed_gemm_mn_ref(x, w, r, g), routed_gemm_mn_ref(xb, wb, r, g)
                dense = time_graph(lambda: F.linear(xb, wb))
            w2_arg = w2b if sw else None
            cands = [(c, partial(small_gemm_mn, xb, wb, w2_arg, mask, g, True, config=c)) for c in MN_CFGS[op]]
            cands.append(("autotuned", partial(small_gemm_mn, xb, wb, w2_arg, mask, g, True)))
        for c, fn in cands:
            rec = {"kind": "gemm", "op": op, "M": m, "group_size": g, "sparsity": 0.5, "config": c, "dense_ms": dense}
            try:
                out = fn()
                ok, e, b = err_ok(out, ref, low)
                same = torch.equal(out, fn())
                rec.update(err=e, torch_err=b, err_ok=ok, repeat_identical=same)
                if ok:
                    rec["wide_ms"] = time_graph(fn)
                    rec["speedup"] = dense / rec["wide_ms"]
            except Exception as exc:  # noqa: BLE001 - record the failure, go on
                rec["error"] = repr(exc)[:300]
            recs.append(rec)
            print(json.dumps(rec), flush=True)


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
                A.DECODE_CONFIG_OVERRIDE = conf
                rec = {"kind": "attn_decode", "B": b, "ctx": ctx, "sparsity": 0.5, "config": conf,
                       "num_splits": ns, "default_splits": default_ns, "sdpa_default_ms": sdpa_ms}  # fmt: skip
                try:
                    out = A.routed_attention_decode(qs[0], ks[0], vs[0], lens, masks[0], num_splits=ns)
                    ok, e, bb = err_ok(out, ref, low)
                    rec.update(err=e, torch_err=bb, err_ok=ok)
                    fns = [
                        partial(A.routed_attention_decode, q, k, v, lens, mk, num_splits=ns)
                        for q, k, v, mk in zip(qs, ks, vs, masks, strict=True)
                    ]
                    rec["wide_ms"] = AB.time_graph(fns)
                    rec["speedup_vs_sdpa_default"] = sdpa_ms / rec["wide_ms"]
                except Exception as exc:  # noqa: BLE001
                    rec["error"] = repr(exc)[:300]
                A.DECODE_CONFIG_OVERRIDE = None
                recs.append(rec)
                print(json.dumps(rec), flush=True)


def floor(recs: list) -> None:
    """Time of a graph holding one trivial kernel, with the GEMM harness (its fixed cost)."""
    t = torch.zeros(1, device="cuda")
    recs.append({"kind": "floor", "what": "one 1-element add per graph", "wide_ms": time_graph(lambda: t.add_(1))})
    print(json.dumps(recs[-1]), flush=True)


def main(out_dir: str) -> None:
    t0 = time.time()
    recs: list = []
    parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["gemm1", "gemm4", "attn"]
    floor(recs)
    for m in (1, 4):
        if f"gemm{m}" in parts:
            gemm_variants(recs, m)
    if "attn" in parts:
        attn_variants(recs)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "wall_s": time.time() - t0}
    with open(f"{out_dir}/decode_variants.json", "w") as f:
        json.dump({"meta": meta, "records": recs}, f, indent=1)
    best: dict = {}
    for r in recs:
        if "wide_ms" not in r or r["kind"] == "floor":
            continue
        key = (r["kind"], r.get("op"), r.get("M"), r.get("B"), r.get("ctx"))
        if key not in best or r["wide_ms"] < best[key]["wide_ms"]:
            best[key] = r
    lines = ["| kind | op / B,ctx | M | best config | wide ms | speed-up |", "|---|---|---|---|---|---|"]
    for (kind, op, m, b, ctx), r in best.items():
        sp = r.get("speedup") or r.get("speedup_vs_sdpa_default")
        conf = r.get("config"), r.get("num_splits")
        lines.append(f"| {kind} | {op or (b, ctx)} | {m} | {conf} | {r['wide_ms']:.4f} | {sp:.2f} |")
    with open(f"{out_dir}/decode_variants.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
