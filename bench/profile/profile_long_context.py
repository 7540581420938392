"""Where a long-context decode step's time goes, kernel by kernel: the fused decode layer at B sequences of CTX cached
keys, dense and each WIDE level, under torch.profiler (docs/long-context.md#decode-grid).

The grid (`bench.decode.long_context`) says how far each row stays below its byte limit; this says which kernel
loses it: per kernel family (the fused layer's QKV / attention / O / FFN launches, the routers, the rest) the summed
kernel time per step, the same for dense, and the ratio. Eager steps (a graph replay hides its kernels from some
profilers): read the kernel times, not the wall time. Same model, cache and router fitting as the grid.

    PYTHONPATH=src:. python -m bench.profile.profile_long_context --out $OUT --batch 16 --ctx 16384
        -> OUT/profile-long-context-CARD.{json,md}
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.decode.long_context import LLAMA_8B, SHIPPED, SMOKE_SHAPE, Level, filled_runtime, shipped_rates
from wide.bench.e2e import build_model, routers_at
from wide.bench.timing import card_tag, tree_commit
from wide.config import WideConfig
from wide.model import WideModel
from wide.runtime.model import KV_LAYOUTS

# kernel name fragments -> family (first match wins; the fused layer's kernels are named after their work)
FAMILIES = (
    ("attention", ("attn", "decode_split", "decode_reduce", "flash", "sdpa")),
    ("router", ("router", "decision")),
    ("qkv", ("qkv",)),
    ("o_proj", ("_o_kernel", "o_proj")),
    ("ffn", ("ffn", "swiglu", "down", "gate")),
    ("norm", ("norm",)),
    ("lm_head / GEMM", ("gemm", "gemv", "cutlass", "sm90", "nvjet")),
)


def family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in FAMILIES if any(k in low for k in keys)), "other")


def kernel_ms(fn, reps: int) -> dict[str, float]:
    """Kernel name -> summed device ms per call of fn, over reps profiled calls (after one unprofiled call)."""
    cuda = torch.cuda.is_available()
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type == kind and (cuda or e.key.startswith("wide::")):
            t = e.self_device_time_total if cuda else e.self_cpu_time_total
            out[e.key] = out.get(e.key, 0.0) + t / reps / 1e3
    return out


def parse_overrides(text: str) -> list[dict[str, int]]:
    """'attn_programs=264,attn_warps=4;attn_block_n=64' -> one dict of fused-layer launch overrides per ';' part
    (``wide.kernels.fused_decode.rules.LaunchOverrides`` fields); a bad part is a one-line error."""
    from wide.kernels.fused_decode.rules import LaunchOverrides

    out = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        try:
            ov = {k.strip(): int(v) for k, v in (kv.split("=") for kv in part.split(","))}
            LaunchOverrides(**ov)
        except (ValueError, TypeError) as e:
            raise SystemExit(f"--attn-sweep: bad override set '{part}': {e}") from None
        out.append(ov)
    return out


def profile_cell(
    levels: list[Level],
    batch: int,
    ctx: int,
    reps: int,
    smoke: bool,
    overrides: list[dict[str, int]] | None = None,
    layout: str = "nhd",
) -> list[dict]:
    """One record per level: kernel ms per step by family and by kernel; then one per level and launch override set
    (``overrides``: the decode attention's programs, splits, tiles), kernel ms by family."""
    from wide.kernels.fused_decode.rules import launch_overrides

    dev, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    shape = dict(LLAMA_8B, **(SMOKE_SHAPE if smoke else {}))
    model = build_model(shape, dev, dtype)
    wm = WideModel(model, WideConfig(ffn_group_size=32 if smoke else 128))
    probe = torch.randint(0, shape["vocab_size"], (1, 32 if smoke else 512), device=dev)
    ids = torch.randint(0, shape["vocab_size"], (batch, 1), generator=torch.Generator().manual_seed(batch)).to(dev)
    rows = []
    for lv in levels:
        routed = lv.attn is not None
        if routed:
            routers_at(wm, (lv.attn, lv.ffn), probe)
        rt = filled_runtime(wm, batch, ctx, routed, dev, layout)

        def step(rt=rt):
            rt.cache.lens.fill_(ctx)
            rt.decode(ids)

        for ov in [{}, *(overrides or [])]:
            with launch_overrides(**ov):
                per_kernel = kernel_ms(step, reps)
            fams: dict[str, float] = {}
            for name, ms in per_kernel.items():
                fams[family(name)] = fams.get(family(name), 0.0) + ms
            rows.append({"level": lv.name, "attn_rate": lv.attn, "ffn_rate": lv.ffn, "B": batch, "ctx": ctx,
                         "kv_layout": layout, "overrides": ov, "kernel_ms": sum(per_kernel.values()), "families": fams,
                         "kernels": per_kernel})  # fmt: skip
        del rt, step
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def render(all_rows: list[dict], meta: dict) -> str:
    """Markdown: per family, ms per step for each level and its ratio to dense; then the top kernels of each; then
    the attention family and the total under each launch override set."""
    rows = [r for r in all_rows if not r.get("overrides")]
    swept = [r for r in all_rows if r.get("overrides")]
    dense = next((r for r in rows if r["attn_rate"] is None), rows[0])
    fams = sorted({f for r in rows for f in r["families"]}, key=lambda f: -dense["families"].get(f, 0.0))
    head = "| family | " + " | ".join(f"{r['level']} ms" for r in rows) + " | " + " | ".join(
        f"{r['level']} / dense" for r in rows if r is not dense) + " |"  # fmt: skip
    lines = [
        f"# Long-context decode step by kernel ({meta['gpu']}, card {meta['card']}, commit {meta['commit']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"B {dense['B']}, {dense['ctx']} cached keys ({dense.get('kv_layout', 'nhd')} cache), fused decode layer, "
        "eager steps, kernel time per step (torch.profiler; on the CPU the wide:: ops' CPU time).",
        "",
        head,
        "|---|" + "---|" * (2 * len(rows) - 1),
    ]
    for f in [*fams, "total"]:
        get = (lambda r: r["kernel_ms"]) if f == "total" else (lambda r, f=f: r["families"].get(f, 0.0))  # noqa: E731
        d = get(dense)
        cells = [f"{get(r):.3f}" for r in rows]
        ratios = [f"{get(r) / d:.3f}" if d else "–" for r in rows if r is not dense]
        lines.append(f"| {f} | " + " | ".join(cells + ratios) + " |")
    for r in rows:
        lines += ["", f"Top kernels, {r['level']}:", "", "| kernel | family | ms per step |", "|---|---|---|"]
        for name, ms in sorted(r["kernels"].items(), key=lambda kv: -kv[1])[:12]:
            lines.append(f"| `{name[:90]}` | {family(name)} | {ms:.4f} |")
    if swept:
        lines += ["", "Launch overrides (attention family and total kernel ms per step; the rules' row first):", "",
                  "| level | overrides | attention ms | total ms |", "|---|---|---|---|"]  # fmt: skip
        for r in sorted(all_rows, key=lambda r: [x["level"] for x in rows].index(r["level"])):
            ov = ", ".join(f"{k}={v}" for k, v in r.get("overrides", {}).items()) or "(rules)"
            lines.append(f"| {r['level']} | {ov} | {r['families'].get('attention', 0.0):.3f} | {r['kernel_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--sparsities", default="0.5", help="WIDE levels at one rate for both kinds (dense always)")
    ap.add_argument("--shipped", default=SHIPPED[0], help="checkpoints whose per-kind rates are levels")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--attn-sweep",
        default="",
        help="';'-separated launch override sets, e.g. "
        "'attn_programs=264;attn_programs=528,attn_warps=4' (each level is profiled under each)",
    )
    ap.add_argument("--kv-layout", default="nhd", choices=KV_LAYOUTS, help="the cache's memory layout")
    ap.add_argument("--smoke", action="store_true", help="tiny model (CPU check of the code path)")
    a = ap.parse_args(argv)
    sweep = parse_overrides(a.attn_sweep)
    levels = [Level("dense")]
    levels += [Level(f"wide {float(s):.0%}", float(s), float(s)) for s in a.sparsities.split(",") if s]
    levels += [shipped_rates(n) for n in a.shipped.split(",") if n]
    rows = profile_cell(levels, a.batch, a.ctx, a.reps, a.smoke, sweep, a.kv_layout)
    card = card_tag()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    cmd = "python -m bench.profile.profile_long_context " + shlex.join(sys.argv[1:] if argv is None else argv)
    meta = {"card": card, "gpu": gpu, "commit": tree_commit(), "torch": torch.__version__, "command": cmd}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile-long-context-{card}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"profile-long-context-{card}.md").write_text(render(rows, meta))
    print(f"{len(rows)} levels profiled -> {out}", flush=True)


if __name__ == "__main__":
    main()
