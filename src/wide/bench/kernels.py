"""``wide bench kernels``: routed GEMM / reorder / gather-scatter sweep + the attention sweep.

Writes ``bench/results/kernels/kernels-h200.json`` (one record per measurement) and ``kernels-h200.md``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import warnings

import torch


def _versions() -> dict:
    import triton

    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def _fmt(v, nd=2):
    return "–" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def _md(rows: list[dict], meta: dict) -> str:
    out = [
        "# Kernel benchmark (WIDE routed kernels vs dense)",
        "",
        f"GPU: {meta['gpu']} · versions: {meta['versions']} · quick={meta['quick']} · wall {meta['wall_s']:.0f} s",
        "",
        f"Command: `{meta['command']}`",
        "",
        "Timing (`wide.bench.timing.time_calls`): a CUDA graph of back-to-back calls (~3 ms of work) "
        "cycling through copies of weights, inputs and masks that together exceed the L2 cache, median "
        "replay per call: an operator as it runs inside a decode step's graph, weights from HBM. GEMMs: "
        "the dense baseline is re-timed with each WIDE variant, their 9 replays interleaved; attention and "
        "reorder: each variant timed on its own, 7 replays. "
        "Each sparsity level is autotuned afresh on its own masks. Dense = "
        "cuBLAS `F.linear` (gate_up: two `F.linear` + `silu*mul`) in the same run, bf16. Masks: i.i.d. "
        "random per (token, group), one per input copy (active_fraction: their mean). "
        "Operators are called as `wide.runtime` calls them: "
        "**route building is included** in the WIDE time of Q and gate_up (first operator of each routing "
        "decision: the graph holds `plan_route` + GEMM; `plan_route` runs the reorder only at M > 256, the "
        "small-M and mid-M paths read the mask); O and down reuse that route, time the GEMM alone and get an "
        "input whose inactive groups are already 0 (`x_zeroed`, as routed attention / SwiGLU write it). "
        "speedup = dense_ms / wide_ms (>1 is faster).",
        "",
    ]
    gemm = [r for r in rows if r["kind"].startswith("gemm") and r.get("variant", "auto") == "auto"]
    keys = sorted({(r["op"], r["group_size"], r["kind"]) for r in gemm}, key=lambda t: (t[2], t[0], -t[1]))
    sps = sorted({r["sparsity"] for r in gemm})
    if gemm:
        out += ["## Routed GEMMs: speedup over dense", ""]
        out.append("| op | G | M | dense ms | " + " | ".join(f"{int(s * 100)}%" for s in sps) + " |")
        out.append("|---|---|---|---|" + "---|" * len(sps))
        for op, g, _kind in keys:
            for m in sorted({r["M"] for r in gemm if r["op"] == op and r["group_size"] == g}):
                sel = {r["sparsity"]: r for r in gemm if r["op"] == op and r["group_size"] == g and r["M"] == m}
                dense = next(iter(sel.values()))["dense_ms"]
                cells = [_fmt(sel[s]["speedup"]) if s in sel else "–" for s in sps]
                out.append(f"| {op} | {g} | {m} | {dense:.4f} | " + " | ".join(cells) + " |")
        out.append("")
    var = [r for r in rows if r["kind"].startswith("gemm") and r.get("variant", "auto") != "auto"]
    if var:
        out += [
            "## Forced paths at 50% (speedup incl. route building for Q / gate_up; GEMM-K variants get an x "
            "that is not pre-zeroed)",
            "",
            "| op | G | M | variant | speedup | auto speedup |",
            "|---|---|---|---|---|---|",
        ]
        auto = {(r["op"], r["group_size"], r["M"], r["sparsity"]): r["speedup"] for r in gemm}
        for r in var:
            a = auto.get((r["op"], r["group_size"], r["M"], r["sparsity"]))
            out.append(
                f"| {r['op']} | {r['group_size']} | {r['M']} | {r['variant']} | {_fmt(r['speedup'])} | {_fmt(a)} |"
            )
        out.append("")
    reo = [r for r in rows if r["kind"] == "reorder"]
    if reo:
        out += ["## Reorder (50% mask) vs the dense time of the operators it serves", ""]
        out += [
            "| decision | N_G | M | reorder ms | served dense ms | fraction |",
            "|---|---|---|---|---|---|",
        ]
        for r in reo:
            out.append(
                f"| {r['op']} ({r['served_ops']}) | {r['n_groups']} | {r['M']} | {r['wide_ms']:.4f} | "
                f"{r['dense_ms']:.4f} | {100 * r['reorder_frac_of_served_dense']:.1f}% |"
            )
        out.append("")
    gs = [r for r in rows if r["kind"] == "gather_scatter"]
    if gs:
        out += ["## Appendix-A naive gather-scatter (S³, G 128, 50%, fixed groups per token)", ""]
        out += ["| axis | S | dense ms | WIDE ms | naive ms | WIDE peak GiB | naive peak GiB |"]
        out.append("|---|---|---|---|---|---|---|")
        for r in gs:
            naive = _fmt(r.get("naive_ms"), 3) if r.get("naive_ms") is not None else r.get("naive_skipped", "–")
            out.append(
                f"| {r['op']} | {r['M']} | {r['dense_ms']:.3f} | {r['wide_ms']:.3f} | {naive} | "
                f"{r['wide_peak_gib']:.3f} | {_fmt(r.get('naive_peak_gib'), 2)} |"
            )
        out.append("")
    att = [r for r in rows if r["kind"].startswith("attn")]
    if att:
        out += ["## Attention (records from `wide.bench.attention_bench`)", ""]
        cols = ("kind", "op", "B", "T", "ctx", "sparsity", "baseline", "dense_ms", "wide_ms", "speedup")
        cols = [*cols, "speedup_vs_sdpa_default", "speedup_vs_flash"]
        cols = [c for c in cols if any(c in r for r in att)]
        out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in att:
            out.append("| " + " | ".join(_fmt(r.get(c), 4) for c in cols) + " |")
        out.append("")
    return "\n".join(out)


def _write(out_dir: str, rows: list[dict], meta: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    # kernels-h200.json: a list of records (one per measurement); the run's metadata goes beside it.
    with open(os.path.join(out_dir, "kernels-h200.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)
    with open(os.path.join(out_dir, "kernels-h200.meta.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)


def run_kernel_bench(out_dir: str, quick: bool = False) -> list[dict]:
    """Run the GEMM / reorder / gather-scatter sweep and the attention sweep; write json + md."""
    if not torch.cuda.is_available():
        raise RuntimeError("run_kernel_bench needs a CUDA GPU")
    from wide.bench import gemm_bench as gb
    from wide.kernels._triton_utils import warn_if_autotune_limited

    warn_if_autotune_limited("wide bench kernels")

    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ms_list = [1, 16, 256, 4096, 16384] if quick else [1, 16, 64, 256, 1024, 4096, 16384]
    sps = [0.5, 0.0] if quick else [0.5, 0.0, 0.25, 0.7]
    rows: list[dict] = []
    for name, kind, n, k, g, with_reorder in gb.OPS:
        rows += gb.bench_op(name, kind, n, k, g, with_reorder, ms_list, sps, gen, extra_variants=not quick)
        print(f"[bench] {name} G{g}: {time.time() - t0:.0f}s", flush=True)
        _write(out_dir, rows, dict(partial=True, wall_s=time.time() - t0))
    rows += gb.bench_reorder([1, 16, 256, 4096, 16384], gen)
    rows += gb.bench_gather_scatter([2048] if quick else [2048, 4096], gen)
    print(f"[bench] gemm part done: {time.time() - t0:.0f}s", flush=True)
    try:
        from wide.bench.attention_bench import run_attention_bench
    except ImportError as e:
        warnings.warn(f"attention bench unavailable ({e}); skipped", stacklevel=2)
    else:
        try:
            rows += run_attention_bench(quick)
        except Exception as e:  # noqa: BLE001 - keep the GEMM results if attention fails
            warnings.warn(f"attention bench failed: {e!r}", stacklevel=2)
    gpu, versions = torch.cuda.get_device_name(), _versions()
    for r in rows:
        r.setdefault("gpu", gpu)
        r.setdefault("versions", versions)
    meta = dict(
        gpu=gpu,
        versions=versions,
        quick=quick,
        wall_s=time.time() - t0,
        command=os.environ.get("WIDE_BENCH_COMMAND", " ".join(sys.argv)),
    )
    _write(out_dir, rows, meta)
    with open(os.path.join(out_dir, "kernels-h200.md"), "w") as f:
        f.write(_md(rows, meta))
    return rows
