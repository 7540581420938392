"""Per-kernel sweep of the fused decode layer's GEMV kernels against cuBLAS (one H200, a few minutes).

    python -m bench.kernels.tune_fused_decode --out $OUT        # -> $OUT/fused-tune-CARD.json and .md

Llama-3.1-8B layer shapes (D 4,096, Hq 32, Hk 8, d 128, D' 14,336, FFN groups of 128 or ``--ffn-group-size``), bf16,
random weights. For each kernel (QKV + RoPE + cache write, decode attention over CTX cached keys, O + residual + norm,
the FFN, its down projection alone through O's kernel (``down``); the FFN's two halves through the unfused decode
path's kernels (``gateup-unfused``, ``down-unfused``: ``routed_swiglu`` / ``routed_gemm_k`` on the 'small' path,
autotuned, which launch overrides do not change: run them with ``--grid '[{}]'``); the router of rank 32 over the FFN's
groups) and each launch configuration (``wide.kernels.fused_decode.launch_overrides``; the router:
``router_decisions(config=...)``), B 1 and 16, dense (no mask) and routed (each token skips each group with
probability ``--skip``, 0.5 by default): the time per call (``wide.bench.timing.time_calls``: a CUDA graph of
back-to-back calls on rotated weight copies larger than L2), the bytes of weights the call reads (groups no token runs
are not read) and the TB/s that makes; cuBLAS's ``F.linear`` of the same matrices (dense; attention: SDPA on the same
cache, transposed; the router: its projection alone) as the yardstick. Every configuration's output is checked against
the fp32 reference before it is timed (bf16 rule: error <= 2x the bf16 torch path's, + 1e-5 of the scale); a failing
one is recorded with ``err_ok: false`` and not timed. The fastest passing configuration per (kernel, B, routed) is
listed in the .md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F

from wide.bench.checks import within_bf16_rule
from wide.bench.timing import card_tag, copies_for, median_ms
from wide.bench.timing import time_calls as _time_calls
from wide.kernels import fused_decode as FD
from wide.kernels import plan, plan_route, routed_gemm_k, routed_swiglu
from wide.kernels.attention.reference import attention_decode_ref
from wide.kernels.router.ops import default_config, router_margin_kernel, router_margin_ref

D, HQ, HK, HD, DF, G, CTX, RANK = 4096, 32, 8, 128, 14336, 128, 4096, 32
DEV, DTYPE = "cuda", torch.bfloat16
SKIP = 0.5  # --skip: the probability that a token skips a group in the routed cases
SKIP_RUN = 1  # --skip-run: adjacent groups skipped or kept together (1: each group on its own)
# --smoke: the interpreter on a CPU, in fp32 (the interpreter's bf16 arithmetic is not the GPU's)
SMOKE = dict(D=128, HQ=4, HK=2, HD=32, DF=256, G=32, CTX=96, RANK=8, DEV="cpu", DTYPE=torch.float32)

# (name, overrides): the shape rules (empty dict) first, then the variants
QKV = [{}, *({"qkv_slices": s, "qkv_splits": k} for s, k in ((4, 1), (4, 2), (4, 4), (2, 2), (2, 4), (1, 4)))]
O_PROJ = [{}, *({"o_block_n": n, "o_splits": k} for n, k in ((32, 1), (32, 2), (32, 4), (32, 8), (16, 4), (64, 4),
                                                              (64, 8)))]  # fmt: skip
FFN = [
    {},
    *(
        {"ffn_chunk": c, "ffn_splits": k, "ffn_block_n": n}
        for c, k, n in (
            (32, 1, 32),
            (32, 2, 32),
            (32, 4, 32),
            (32, 8, 32),
            (16, 4, 32),
            (64, 4, 32),
            (32, 4, 16),
            (32, 4, 64),
            (32, 8, 64),
        )  # fmt: skip
    ),
]
ATTN = [{}, *({"attn_splits": s, "attn_block_n": n} for s, n in
                ((8, 128), (16, 64), (32, 128), (32, 64), (48, 64), (64, 64), (64, 32), (128, 32)))]  # fmt: skip
ATTN_WARPS = [{"attn_warps": w} for w in (2, 4, 8)]
# router configs (BLOCK_D, SPLITS, num_warps, num_stages, BLOCK_G: the head's groups a step, HEAD_PROGS: programs
# sharing the head, 0: the last split alone); the first:
# default_config(D, M), the rule
ROUTER = [{}, *({"BLOCK_D": bd, "SPLITS": sp, "num_warps": nw} for bd, sp, nw in
                ((128, 8, 4), (64, 16, 2), (128, 16, 4), (64, 32, 2), (128, 32, 4), (256, 16, 4),
                 (64, 64, 1)))]  # fmt: skip
STREAM = [{"block_k": bk, "num_warps": nw, "num_stages": ns} for bk, nw, ns in
          ((128, 4, 4), (256, 4, 4), (256, 8, 3), (512, 8, 3), (128, 4, 6), (256, 4, 2), (64, 4, 5),
           (64, 4, 8))]  # fmt: skip


def time_calls(fns) -> float:
    if DEV == "cpu":
        return sum(median_ms(fn, 1, "cpu") for fn in fns) / len(fns)
    return _time_calls(fns)


def err_ok(out: torch.Tensor, ref32: torch.Tensor, ref_bf16: torch.Tensor) -> tuple[bool, float, float]:
    if ref_bf16.dtype == torch.float32:  # smoke (fp32): the reference rounded to bf16 sets the bar
        ref_bf16 = ref_bf16.bfloat16()
    return within_bf16_rule(out, ref32, ref_bf16)


def rand_mask(b: int, ng: int, routed: bool, gen: torch.Generator) -> torch.Tensor | None:
    if not routed:
        return None
    run = torch.rand(b, -(-ng // SKIP_RUN), generator=gen) >= SKIP  # [B, runs of SKIP_RUN groups]
    return run.repeat_interleave(SKIP_RUN, dim=1)[:, :ng].contiguous().to(DEV)


def qkv_case(b: int, routed: bool, gen: torch.Generator):
    n = (HQ + 2 * HK) * HD
    w = [torch.randn(n, D, device=DEV, dtype=DTYPE) * D**-0.5 for _ in range(copies_for(n * D * 2))]
    h = torch.randn(b, D, device=DEV, dtype=DTYPE)
    pos = torch.arange(b, device=DEV)
    ang = pos.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, HD, 2, device=DEV).float() / HD))[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    kc = torch.zeros(b, 64, HK, HD, device=DEV, dtype=DTYPE)
    vc = torch.zeros_like(kc)
    mask = rand_mask(b, HK, routed, gen)

    def call(i: int):
        return FD.qkv_rope_cache(h, w[i], None, mask, cos, sin, pos, kc, vc, HQ)

    def check(out):
        kr32, vr32 = kc.float().clone(), vc.float().clone()
        ref32 = FD.qkv_rope_cache_ref(h.float(), w[0].float(), None, cos, sin, pos, kr32, vr32, HQ)
        kr, vr = kc.clone(), vc.clone()
        ref = FD.qkv_rope_cache_ref(h, w[0], None, cos, sin, pos, kr, vr, HQ)
        run = torch.ones(HQ, dtype=torch.bool, device=DEV) if mask is None else mask.any(0).repeat_interleave(HQ // HK)
        # the running Q heads and every K/V row written (a routed case may skip every Q head)
        return err_ok(*(torch.cat([q[:, run].flatten(), k.flatten(), v.flatten()]) for q, k, v in
                        ((out, kc, vc), (ref32, kr32, vr32), (ref, kr, vr))))  # fmt: skip

    active = 1.0 if mask is None else mask.any(0).float().mean().item()
    nbytes = (HQ * active + 2 * HK) * HD * D * 2
    dense = [[lambda i=i: F.linear(h, w[i]) for i in range(len(w))]]
    return call, len(w), check, nbytes, dense, (HQ + 2 * HK) * HD * D * 2


def o_case(b: int, routed: bool, gen: torch.Generator, down: bool = False):
    """O + residual + norm; ``down``: the same kernel on the FFN's down projection (K = D', the FFN's groups),
    the second half of the FFN timed alone."""
    k, ng = (DF, DF // G) if down else (HQ * HD, HK)
    w = [torch.randn(D, k, device=DEV, dtype=DTYPE) * k**-0.5 for _ in range(copies_for(D * k * 2))]
    mask = rand_mask(b, ng, routed, gen)
    o = torch.randn(b, k, device=DEV, dtype=DTYPE)
    if mask is not None:
        o = o * mask.repeat_interleave(k // ng, dim=1)
    x = torch.randn(b, D, device=DEV, dtype=DTYPE)
    nw = torch.rand(D, device=DEV, dtype=DTYPE) + 0.5

    def call(i: int):
        return FD.o_proj_residual_norm(o, w[i], None, mask, x, nw, 1e-5)

    def check(out):
        ref32 = FD.o_proj_residual_norm_ref(o.float(), w[0].float(), None, x.float(), nw.float(), 1e-5)[0]
        ref = FD.o_proj_residual_norm_ref(o, w[0], None, x, nw, 1e-5)[0]
        return err_ok(out[0], ref32, ref)

    active = 1.0 if mask is None else mask.any(0).float().mean().item()
    dense = [[lambda i=i: F.linear(o, w[i]) for i in range(len(w))]]
    return call, len(w), check, D * k * 2 * active, dense, D * k * 2


def ffn_case(b: int, routed: bool, gen: torch.Generator):
    wg = torch.randn(DF, D, device=DEV, dtype=DTYPE) * D**-0.5
    wu = torch.randn(DF, D, device=DEV, dtype=DTYPE) * D**-0.5
    wd = torch.randn(D, DF, device=DEV, dtype=DTYPE) * DF**-0.5
    wgu = torch.cat([wg, wu])
    mask = rand_mask(b, DF // G, routed, gen)
    h = torch.randn(b, D, device=DEV, dtype=DTYPE)
    x = torch.randn(b, D, device=DEV, dtype=DTYPE)
    nw = torch.rand(D, device=DEV, dtype=DTYPE) + 0.5
    a = torch.randn(b, DF, device=DEV, dtype=DTYPE)

    def call(i: int):
        return FD.ffn_residual_norm(h, wg, wu, wd, mask, x, nw, 1e-5, G)

    def check(out):
        f32 = [t.float() for t in (h, wg, wu, wd)]
        m = None if mask is None else mask
        ref32 = FD.ffn_residual_norm_ref(*f32, m, x.float(), nw.float(), 1e-5)[0]
        ref = FD.ffn_residual_norm_ref(h, wg, wu, wd, m, x, nw, 1e-5)[0]
        return err_ok(out[0], ref32, ref)

    active = 1.0 if mask is None else mask.any(0).float().mean().item()
    dense = [[lambda: F.linear(h, wgu)], [lambda: F.linear(a, wd)]]  # cuBLAS: the sum of both GEMVs
    return call, 1, check, 3 * DF * D * 2 * active, dense, 3 * DF * D * 2


def unfused_case(b: int, routed: bool, gen: torch.Generator, down: bool):
    """The FFN's halves through the unfused decode path (``wide.kernels``: ``routed_swiglu`` and ``routed_gemm_k``
    on the 'small' path, autotuned, as ``WideRuntime(fused_decode=False)`` runs them at decode), each timed alone
    on the FFN case's shapes and mask draw: gate/up -> SwiGLU (``gateup-unfused``) or down (``down-unfused``),
    so that each half of the fused FFN has a yardstick. Dense: every group (the same kernels)."""
    mask = rand_mask(b, DF // G, routed, gen)
    run = torch.ones(b, DF // G, dtype=torch.bool, device=DEV) if mask is None else mask
    route = plan_route(run, plan(b, G, DF // G, SKIP, force_mn="small", force_k="small"))
    h = torch.randn(b, D, device=DEV, dtype=DTYPE)
    active = run.any(0).float().mean().item()
    if down:
        w = [torch.randn(D, DF, device=DEV, dtype=DTYPE) * DF**-0.5 for _ in range(copies_for(D * DF * 2))]
        a = torch.randn(b, DF, device=DEV, dtype=DTYPE) * run.repeat_interleave(G, dim=1)

        def call(i: int):
            return routed_gemm_k(a, w[i], route, G, x_zeroed=True)

        def check(out):
            return err_ok(out, a.float() @ w[0].float().t(), F.linear(a, w[0]))

        dense = [[lambda i=i: F.linear(a, w[i]) for i in range(len(w))]]
        return call, len(w), check, D * DF * 2 * active, dense, D * DF * 2
    wg = torch.randn(DF, D, device=DEV, dtype=DTYPE) * D**-0.5
    wu = torch.randn(DF, D, device=DEV, dtype=DTYPE) * D**-0.5
    wgu = torch.cat([wg, wu])
    on = run.repeat_interleave(G, dim=1)

    def call(i: int):
        return routed_swiglu(h, wg, wu, route, G)

    def check(out):
        ref32 = F.silu(h.float() @ wg.float().t()) * (h.float() @ wu.float().t()) * on
        ref = F.silu(F.linear(h, wg)) * F.linear(h, wu) * on
        return err_ok(out, ref32, ref)

    return call, 1, check, 2 * DF * D * 2 * active, [[lambda: F.linear(h, wgu)]], 2 * DF * D * 2


def attn_case(b: int, routed: bool, gen: torch.Generator):
    s_max = CTX + 8
    n_copies = copies_for(2 * b * s_max * HK * HD * 2)
    caches = [(torch.randn(b, s_max, HK, HD, device=DEV, dtype=DTYPE), torch.randn(b, s_max, HK, HD, device=DEV,
               dtype=DTYPE)) for _ in range(n_copies)]  # fmt: skip
    q = torch.randn(b, HQ, HD, device=DEV, dtype=DTYPE)
    lens = torch.full((b,), CTX, device=DEV, dtype=torch.int32)
    mask = rand_mask(b, HK, routed, gen)
    run = torch.ones(b, HK, dtype=torch.bool, device=DEV) if mask is None else mask

    def call(i: int):
        return FD.attention_decode_merged(q, *caches[i], lens, mask, len_add=1)  # mask None: dense

    def check(out):
        kc, vc = caches[0]
        ref32 = attention_decode_ref(q.float(), kc.float(), vc.float(), lens + 1, run)
        ref = attention_decode_ref(q, kc, vc, lens + 1, run, upcast=False)
        return err_ok(out, ref32, ref)

    nbytes = 2 * run.float().sum().item() * (CTX + 1) * HD * 2
    qs = q[:, :, None]  # SDPA on the same cache, transposed to [B, Hk, S, d] (outside the timing)
    kv_t = [tuple(t[:, : CTX + 1].transpose(1, 2).contiguous() for t in kv) for kv in caches]
    dense = [[lambda i=i: F.scaled_dot_product_attention(qs, *kv_t[i], enable_gqa=True) for i in range(n_copies)]]
    return call, n_copies, check, nbytes, dense, 2 * b * HK * (CTX + 1) * HD * 2


_ROUTER_CONFIG: dict = {}  # the router configuration ``measure`` sets (the router is not a launch override)


def router_case(b: int, routed: bool, gen: torch.Generator):
    ng = DF // G
    n_copies = copies_for(RANK * D * 2)
    wd = [torch.randn(RANK, D, device=DEV, dtype=DTYPE) * D**-0.5 for _ in range(n_copies)]
    wm = torch.randn(ng, RANK, device=DEV)
    bm = torch.randn(ng, device=DEV)
    h = torch.randn(b, D, device=DEV, dtype=DTYPE)

    def call(i: int):
        return router_margin_kernel(h, wd[i], wm, bm, config={**default_config(D, b), **_ROUTER_CONFIG})

    def check(out):  # the fp64 reference; plain PyTorch: the projection in the model dtype
        ref = router_margin_ref(h, wd[0], wm, bm)
        low = (h @ wd[0].t()).float() @ wm.t() + bm
        return err_ok(out, ref, low)

    # the yardstick: the projection alone through cuBLAS in the model dtype (no fixed per-row order)
    dense = [[lambda i=i: h @ wd[i].t() for i in range(n_copies)]]
    return call, n_copies, check, RANK * D * 2, dense, RANK * D * 2


CASES = {
    "qkv": (qkv_case, QKV),
    "attn": (attn_case, ATTN),
    "o": (o_case, O_PROJ),
    "ffn": (ffn_case, FFN),
    "down": (lambda b, routed, gen: o_case(b, routed, gen, down=True), O_PROJ),
    "gateup-unfused": (lambda b, routed, gen: unfused_case(b, routed, gen, down=False), [{}]),
    "down-unfused": (lambda b, routed, gen: unfused_case(b, routed, gen, down=True), [{}]),
    "router": (router_case, ROUTER),
}
# the second pass, on the best configuration (default: STREAM)
STREAMS = {"attn": ATTN_WARPS, "router": [{"num_stages": n} for n in (1, 2, 4)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--kernels", default="qkv,attn,o,ffn,router")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--skip", type=float, default=SKIP, help="routed cases: the probability a token skips a group")
    ap.add_argument("--skip-run", type=int, default=SKIP_RUN, help="routed cases: adjacent groups a token skips or "
                    "runs together (the skip pattern of wider groups at the same group size)")  # fmt: skip
    ap.add_argument("--ffn-group-size", type=int, default=None, help=f"FFN channels per group (default {G}; "
                    "--smoke: its own)")  # fmt: skip
    ap.add_argument("--once", action="store_true", help="each configuration runs once, checked, not timed (for a "
                    "profiler such as ncu, scripts/device/decode.sh NCU_S)")  # fmt: skip
    ap.add_argument("--grid", default=None, help="a JSON list of overrides that replaces every kernel's grid "
                    "(then no second pass), e.g. '[{}, {\"attn_splits\": 32}]'")  # fmt: skip
    args = ap.parse_args()
    if not 0.0 <= args.skip <= 1.0:
        ap.error(f"--skip must be in [0, 1], got {args.skip}")
    if args.skip_run < 1:
        ap.error(f"--skip-run must be >= 1, got {args.skip_run}")
    globals().update(SKIP=args.skip, SKIP_RUN=args.skip_run, **(SMOKE if args.smoke else {}))
    if args.ffn_group_size is not None:
        if args.ffn_group_size <= 0 or DF % args.ffn_group_size:
            ap.error(f"--ffn-group-size must divide the FFN width {DF}, got {args.ffn_group_size}")
        globals().update(G=args.ffn_group_size)
    t0 = time.time()
    rows: list[dict] = []
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    meta = {"command": "python -m bench.kernels.tune_fused_decode " + flags,
            "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__}  # fmt: skip

    def write() -> None:
        meta["wall_s"] = time.time() - t0
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"fused-tune-{card_tag(DEV)}.json"), "w") as fh:
            json.dump({"meta": meta, "records": rows}, fh, indent=1)
        best: dict[tuple, dict] = {}
        for r in rows:
            if r.get("ms") and r.get("err_ok"):
                key = (r["kernel"], r["B"], r["routed"])
                if key not in best or r["ms"] < best[key]["ms"]:
                    best[key] = r
        lines = [f"# Fused decode GEMV sweep ({meta['device']})", "", f"Command: `{meta['command']}`", "",
                 "| kernel | B | routed | best overrides | ms | TB/s | shape rules ms "
                 "| cuBLAS / SDPA dense ms (TB/s) |",
                 "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for key, r in sorted(best.items(), key=lambda kv: str(kv[0])):
            default = next((x for x in rows if (x["kernel"], x["B"], x["routed"]) == key and not x["tune"]), {})
            lines.append(
                f"| {key[0]} | {key[1]} | {key[2]} | {r['tune']} | {r['ms']:.4f} | {r['tb_per_s']:.2f} "
                f"| {default.get('ms', float('nan')):.4f} | {r.get('cublas_ms') or float('nan'):.4f} "
                f"({r.get('cublas_tb_per_s') or float('nan'):.2f}) |"
            )
        with open(os.path.join(args.out, f"fused-tune-{card_tag(DEV)}.md"), "w") as fh:
            fh.write("\n".join(lines) + "\n")

    def measure(name: str, b: int, routed: bool, cfg: dict, case, cublas_ms: float) -> dict | None:
        """One configuration: checked, then timed; None once the time budget is spent."""
        call, n_copies, check, nbytes, _, dense_bytes = case
        if time.time() - t0 > args.budget_s:
            return None
        rec = {"kernel": name, "B": b, "routed": routed, "skip": SKIP if routed else 0.0, "skip_run": SKIP_RUN,
               "tune": cfg, "bytes": nbytes, "cublas_ms": cublas_ms,
               "cublas_tb_per_s": dense_bytes / (cublas_ms * 1e-3) / 1e12 if cublas_ms else None}  # fmt: skip
        _ROUTER_CONFIG.clear()
        if name == "router":
            _ROUTER_CONFIG.update(cfg)
        try:
            with FD.launch_overrides(**({} if name == "router" else cfg)):
                ok, err, base = check(call(0))
                rec.update(err_ok=ok, err=err, torch_err=base)
                if ok and not args.once:
                    ms = time_calls([lambda i=i: call(i) for i in range(n_copies)])
                    rec.update(ms=ms, tb_per_s=nbytes / (ms * 1e-3) / 1e12)
        except Exception as exc:  # noqa: BLE001 - record and keep going
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rec["traceback"] = traceback.format_exc()[-1200:]
        rows.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
        return rec

    gen = torch.Generator().manual_seed(0)
    for name in args.kernels.split(","):
        make, grid = CASES[name]
        grid = grid if args.grid is None else json.loads(args.grid)
        for b in (int(x) for x in args.batches.split(",")):
            for routed in (True,) if name == "router" else (False, True):
                case = make(b, routed, gen)
                cublas_ms = sum(time_calls(fns) for fns in case[4]) if case[4] and not args.once else None
                recs = [measure(name, b, routed, cfg, case, cublas_ms) for cfg in grid]
                done = [r for r in recs if r and r.get("ms")]
                if done and args.grid is None:  # the streaming loop's tile and pipeline depth, on the best config
                    top = min(done, key=lambda r: r["ms"])["tune"]
                    for st in STREAMS.get(name, STREAM):
                        measure(name, b, routed, dict(top, **st), case, cublas_ms)
                del case
                torch.cuda.empty_cache()
                write()
    write()


if __name__ == "__main__":
    main()
