"""Decode TPOT of the fused decode layer against today's decode, dense and WIDE (one H200, ~5 minutes).

    python -m bench.decode.bench_decode --out $OUT            # -> $OUT/decode-CARD.json and .md

CARD names the GPU (h100, h200, ...: ``wide.bench.timing.card_tag``).

Llama-3.1-8B shapes with random weights (bf16, 32 layers), B 1 and 16, 4,096 cached tokens, each decode
step replayed from a CUDA graph. Variants: dense unfused (today's runtime), dense fused
(``WideRuntime(fused_decode=True)``), WIDE unfused and fused at 0 / 25 / 50 / 70% (random routers whose
thresholds are fitted so that argmax skips that fraction on a probe: ``wide.bench.e2e.routers_at``), and
Hugging Face's compiled StaticCache decode of the same model when the time budget allows. Per record:
TPOT, speed-ups over the same run's dense unfused and dense fused, kernels per step and per layer
(torch.profiler over one eager step; per layer = 2-layer step - 1-layer step), bytes of weights and KV
the step reads (from the step's own masks) and the TB/s that makes. A correctness block compares the
fused and unfused runtimes (logits of one step, 32 greedy tokens). Every variant runs in try/except and
the whole run stops starting new variants past ``--budget-s``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback

import torch

from wide.bench.e2e import LLAMA_8B, build_model, decode_accounting, routers_at
from wide.bench.timing import card_tag, median_ms
from wide.config import WideConfig
from wide.kernels import fused_decode
from wide.model import WideModel
from wide.runtime import GraphedDecode, WideRuntime, generate


def measure(
    wm: WideModel,
    routed: bool,
    fused: bool,
    batch: int,
    ctx: int,
    reps: int,
    hints: tuple | None = None,
    compile: bool = False,
) -> dict:
    """TPOT of one CUDA-graph decode step at ``ctx`` cached tokens, kernels, bytes and TB/s. ``compile``:
    the unfused layer step through torch.compile (the strong unfused baseline of ``wide bench e2e``)."""
    attn_hint, ffn_hint = hints if hints is not None else (None, None)
    rt = WideRuntime(
        wm, max_batch=batch, max_seq=ctx + 16, routed=routed, fused_decode=fused,
        attn_sparsity_hint=attn_hint, ffn_sparsity_hint=ffn_hint, compile=compile and not fused,
    )  # fmt: skip
    dev = rt.cache.k.device
    # the same tokens for every row of a batch size, so rows with the same routers take the same decisions (paired
    # comparisons: fused vs unfused, one launch override vs another)
    ids = torch.randint(0, wm.dims.vocab, (batch, 1), generator=torch.Generator().manual_seed(batch)).to(dev)
    rt.cache.lens.fill_(ctx)  # decode against ctx cached tokens (contents: zeros)
    lens = rt.cache.lens.clone()
    step = GraphedDecode(rt, batch) if dev.type == "cuda" else rt.decode

    def decode():
        rt.cache.lens.copy_(lens)
        step(ids)

    decode()
    tpot = median_ms(decode, reps, dev)
    return {"tpot_ms": tpot, **decode_accounting(rt, ids, ctx, tpot)}


def correctness(wm: WideModel, routed: bool, batch: int, steps: int = 32) -> dict:
    """Fused vs unfused: relative logits error of one decode step, and greedy tokens over ``steps``."""
    dev = next(wm.model.parameters()).device
    torch.manual_seed(1)
    ids = torch.randint(0, wm.dims.vocab, (batch, 64), device=dev)
    res = {}
    outs, logits = {}, {}
    for fused in (False, True):
        rt = WideRuntime(wm, max_batch=batch, max_seq=64 + steps + 8, routed=routed, fused_decode=fused)
        nxt = rt.prefill(ids).argmax(-1, keepdim=True)
        logits[fused] = rt.decode(nxt).float()
        outs[fused] = generate(rt, ids, steps)
        del rt
    a, b = logits[True], logits[False]
    res["logits_rel_err"] = ((a - b).norm() / b.norm()).item()
    res["greedy_equal"] = bool(torch.equal(outs[True], outs[False]))
    res["greedy_token_agreement"] = (outs[True][:, 64:] == outs[False][:, 64:]).float().mean().item()
    return res


def hf_static_decode(model, batch: int, ctx: int, reps: int) -> dict:
    """Hugging Face's StaticCache decode, forward compiled with mode='reduce-overhead' (CUDA graphs)."""
    from transformers import StaticCache

    dev = next(model.parameters()).device
    cache = StaticCache(config=model.config, max_cache_len=ctx + 16)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=dev)
    warm_pos = torch.arange(1, device=dev)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, cache_position=warm_pos, use_cache=True)  # initialises the cache
        fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
        pos = torch.tensor([ctx], device=dev)

        def decode():
            fwd(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True)

        t0 = time.time()
        for _ in range(3):
            decode()
        torch.cuda.synchronize()
        compile_s = time.time() - t0
        return {
            "tpot_ms": median_ms(decode, reps, "cuda" if torch.cuda.is_available() else "cpu"),
            "compile_s": compile_s,
        }


def _write(out: str, rows: list[dict], meta: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"decode-{card_tag()}.json"), "w") as f:
        json.dump({"meta": meta, "records": rows}, f, indent=1)
    lines = [
        f"# Fused decode layer: TPOT ({meta['device']}, Llama-3.1-8B shapes unless --smoke, random weights)",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| variant | fused | B | sparsity | measured attn/ffn run (union) | TPOT ms | vs dense | vs dense fused "
        "| kernels/layer | TB/s | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, p=3):
        return "" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))

    for r in rows:
        if r.get("kind") != "tpot":
            continue
        run = ""
        if "measured_attn_union_run" in r:
            run = f"{r['measured_attn_union_run']:.2f} / {r['measured_ffn_union_run']:.2f}"
        variant = r["variant"] + (" (FFN router on the layer input)" if r.get("ffn_router_source") == "layer" else "")
        if len(meta.get("ffn_group_sizes", [])) > 1 and r.get("ffn_group_size"):
            variant += f", G {r['ffn_group_size']}"
        if r.get("fused_tune"):
            variant += ", " + ",".join(f"{k}={v}" for k, v in r["fused_tune"].items())
        lines.append(
            f"| {variant} | {r.get('fused', '')} | {r['B']} | {f(r.get('sparsity'), 2)} | {run} "
            f"| {f(r.get('tpot_ms'))} | {f(r.get('tpot_speedup'))} | {f(r.get('tpot_speedup_vs_dense_fused'))} "
            f"| {f(r.get('kernels_per_layer'))} | {f(r.get('tb_per_s'), 2)} | {(r.get('error') or '')[:60]} |"
        )
    lines += ["", "Correctness (fused vs unfused runtime):", ""]
    for r in rows:
        if r.get("kind") == "correctness":
            lines.append(f"- {json.dumps(r)}")
    with open(os.path.join(out, f"decode-{card_tag()}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--sparsities", default="0,0.25,0.5,0.7")
    ap.add_argument(
        "--kind-rates",
        default="0.6:0.41",
        help="extra level attn:ffn skip rates (default: the shipped SmolLM2 routers' '50%%' per-kind rates)",
    )
    ap.add_argument(
        "--ffn-router-sources",
        default="block",
        help="WIDE rows per FFN router input (WideConfig.ffn_router_source), comma-separated: block, layer",
    )
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=LLAMA_8B["num_hidden_layers"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=280.0)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument(
        "--eager-unfused", action="store_true", help="unfused variants without torch.compile (default: compiled)"
    )
    ap.add_argument(
        "--ffn-group-sizes",
        default="",
        help="WIDE rows per FFN group size G_ffn, comma-separated (default 128; --smoke: 32)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny model (CPU interpreter / quick GPU check)")
    ap.add_argument("--fused-only", action="store_true", help="only the fused step (no unfused baselines)")
    ap.add_argument("--tune", default="", help="fused launch overrides, e.g. ffn_block_n=64,num_stages=4")
    ap.add_argument(
        "--fused-tunes",
        default="",
        help="override sets, '/'-separated (e.g. router_overlap=0/router_overlap=1): each fused row (dense and "
        "WIDE) is measured under each in turn, on top of --tune, and compared with the dense row of the same set",
    )
    ap.add_argument("--no-check", action="store_true", help="no fused-vs-unfused correctness rows")
    args = ap.parse_args()
    tune = _overrides(args.tune)
    with fused_decode.launch_overrides(**tune):
        run_all(args, tune)


def _overrides(text: str) -> dict[str, int]:
    """'a=1,b=2' -> {'a': 1, 'b': 2}."""
    return {k: int(v) for k, v in (kv.split("=") for kv in filter(None, text.split(",")))}


def run_all(args: argparse.Namespace, tune: dict[str, int]) -> None:
    """Every variant of the benchmark (under the caller's launch overrides)."""
    t0 = time.time()
    meta = {
        "command": "python -m bench.decode.bench_decode " + " ".join(f"{k}={v}" for k, v in vars(args).items()),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "ctx": args.ctx,
        "tune": tune,
    }
    shape = dict(LLAMA_8B, num_hidden_layers=args.layers)
    dev, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    if args.smoke:
        shape = dict(shape, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                     vocab_size=101, num_hidden_layers=min(args.layers, 3))  # fmt: skip
    meta["shape"] = shape
    batches = [int(b) for b in args.batches.split(",")]
    levels: list[tuple] = [(float(s), float(s)) for s in args.sparsities.split(",")]
    if args.kind_rates:
        a_rate, f_rate = (float(v) for v in args.kind_rates.split(":"))
        levels.append((a_rate, f_rate))
    sources = args.ffn_router_sources.split(",")
    sizes = [int(g) for g in args.ffn_group_sizes.split(",")] if args.ffn_group_sizes else [32 if args.smoke else 128]
    meta["ffn_group_sizes"] = sizes
    levels = [(g, a, f, src) for g in sizes for a, f in levels for src in sources]
    tunes = [_overrides(t) for t in args.fused_tunes.split("/")] if args.fused_tunes else [None]
    meta["fused_tunes"] = tunes
    rows: list[dict] = []

    def left() -> float:
        return args.budget_s - (time.time() - t0)

    def run(rec: dict, fn) -> dict:
        if left() <= 0:
            rec["error"] = "skipped: time budget spent"
        else:
            try:
                rec.update(fn())
            except Exception as exc:  # noqa: BLE001 - record and keep going
                rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
                rec["traceback"] = traceback.format_exc()[-1500:]
        rec["elapsed_s"] = time.time() - t0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        rows.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
        _write(args.out, rows, meta)
        return rec

    def comp(fused: bool) -> bool:  # the unfused step compiled on a GPU (the e2e benchmark's baseline)
        return not fused and str(dev).startswith("cuda") and not args.eager_unfused

    model = build_model(shape, dev, dtype)
    wm = WideModel(model, WideConfig(ffn_group_size=sizes[0]))  # the dense rows do not route: any G
    probe = torch.randint(0, shape["vocab_size"], (1, 512 if not args.smoke else 32), device=dev)
    modes = (True,) if args.fused_only else (False, True)
    dense = {}  # (B, fused, the fused row's extra overrides) -> TPOT ms
    for b in batches:
        for fused, extra in ((f, t) for f in modes for t in (tunes if f else [None])):
            rec = {"kind": "tpot", "variant": "dense", "fused": fused, "B": b, "sparsity": 0.0, "compiled": comp(fused)}
            if extra is not None:
                rec["fused_tune"] = extra
            with fused_decode.launch_overrides(**{**tune, **(extra or {})}):
                r = run(rec, lambda b=b, fused=fused: measure(wm, False, fused, b, args.ctx, args.reps,
                                                              compile=comp(fused)))  # fmt: skip
            dense[(b, fused, json.dumps(extra))] = r.get("tpot_ms")
    for g, a_rate, f_rate, src in levels:
        if g != wm.config.ffn_group_size:  # another G: new routers on the same weights
            wm.detach()
            wm = WideModel(model, WideConfig(ffn_group_size=g))
        s = a_rate if a_rate == f_rate else f"attn {a_rate} / ffn {f_rate}"
        wm.config.ffn_router_source = src  # read where routers are fitted and where a runtime is built
        try:
            routers_at(wm, (a_rate, f_rate), probe)
        except Exception as exc:  # noqa: BLE001
            rows.append({"kind": "tpot", "variant": "wide", "sparsity": s, "B": None, "ffn_router_source": src,
                         "ffn_group_size": g, "error": f"routers: {exc}"})  # fmt: skip
            continue
        for b in batches:
            for fused, extra in ((f, t) for f in modes for t in (tunes if f else [None])):
                rec = {"kind": "tpot", "variant": "wide", "fused": fused, "B": b, "sparsity": s, "ffn_group_size": g}
                if extra is not None:
                    rec["fused_tune"] = extra
                with fused_decode.launch_overrides(**{**tune, **(extra or {})}):
                    r = run(
                        {**rec, "compiled": comp(fused), "ffn_router_source": src},
                        lambda b=b, fused=fused, h=(a_rate, f_rate), wm=wm: measure(
                            wm, True, fused, b, args.ctx, args.reps, h, compile=comp(fused)
                        ),
                    )
                for key, ref in (
                    ("tpot_speedup", dense.get((b, False, "null"))),
                    ("tpot_speedup_vs_dense_fused", dense.get((b, True, json.dumps(extra)))),
                ):
                    if r.get("tpot_ms") and ref:
                        r[key] = ref / r["tpot_ms"]
        for b in batches:  # unfused WIDE takes the same decisions: its bytes are the fused step's
            recs = {r["fused"]: r for r in rows if r.get("kind") == "tpot" and r["variant"] == "wide"
                    and r.get("B") == b and r.get("sparsity") == s and r.get("ffn_router_source") == src
                    and r.get("ffn_group_size") == g}  # fmt: skip
            uf, fu = recs.get(False), recs.get(True)
            if uf and fu and uf.get("tpot_ms") and fu.get("bytes_read"):
                uf["bytes_read"] = fu["bytes_read"]
                uf["bytes_from"] = "the fused step's masks (same routers, same inputs up to rounding)"
                uf["tb_per_s"] = fu["bytes_read"] / (uf["tpot_ms"] * 1e-3) / 1e12
                uf.update({k: v for k, v in fu.items() if k.startswith("measured_")})
        _write(args.out, rows, meta)
        if s == 0.5 and not args.no_check:
            for b in (1,):
                run(
                    {
                        "kind": "correctness",
                        "variant": "wide",
                        "B": b,
                        "sparsity": s,
                        "ffn_router_source": src,
                        "ffn_group_size": g,
                    },
                    lambda b=b, wm=wm: correctness(wm, True, b),
                )
    if not args.no_check:
        run({"kind": "correctness", "variant": "dense", "B": 1, "sparsity": 0.0}, lambda: correctness(wm, False, 1))
    for b in batches:  # dense speed-ups of the fused dense rows
        for r in rows:
            if r.get("kind") == "tpot" and r["variant"] == "dense" and r.get("B") == b and r.get("tpot_ms"):
                if dense.get((b, False, "null")):
                    r["tpot_speedup"] = dense[(b, False, "null")] / r["tpot_ms"]
                ref = dense.get((b, True, json.dumps(r.get("fused_tune") if r["fused"] else tunes[0])))
                if ref:
                    r["tpot_speedup_vs_dense_fused"] = ref / r["tpot_ms"]
    wm.config.ffn_router_source = "block"
    wm.detach()
    if not args.no_hf and dev == "cuda":
        for b in batches:
            rec = {"kind": "tpot", "variant": "hf_static_compiled", "B": b, "sparsity": 0.0}
            if left() < 120:
                rec["error"] = "skipped: less than 120 s of the time budget left for torch.compile"
                rows.append(rec)
                continue
            r = run(rec, lambda b=b: hf_static_decode(model, b, args.ctx, args.reps))
            if r.get("tpot_ms") and dense.get((b, False, "null")):
                r["tpot_speedup"] = dense[(b, False, "null")] / r["tpot_ms"]
    meta["wall_s"] = time.time() - t0
    _write(args.out, rows, meta)


if __name__ == "__main__":
    main()
