"""Headline tables and the issue's targets, from the committed kernel and end-to-end benchmarks.

Reads bench/results/kernels/kernels-h200.{json,meta.json}, attn-decode-h200.json (decode attention, when present) and
bench/results/decode/e2e-h200.json; writes
bench/results/kernels/kernels-h200.summary.md (quoted in the README) and prints it.
Usage: python -m bench.kernels.summarize_kernels
"""

from __future__ import annotations

import json
from pathlib import Path

from wide.kernels import plan

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
RES = RESULTS / "kernels"  # this area's records; the end-to-end ones are the decode area's
MS = (1, 16, 64, 256, 1024, 4096, 16384)
OPS = (
    ("gemm_mn", "q", 512),
    ("gemm_mn_swiglu", "gate_up", 128),
    ("gemm_mn_swiglu", "gate_up", 32),
    ("gemm_k", "o", 512),
    ("gemm_k", "down", 128),
    ("gemm_k", "down", 32),
)


def _auto(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["kind"].startswith("gemm") and r.get("variant", "auto") == "auto"]


def _get(rows, **key) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in key.items())), None)


def _cell(r: dict | None, field: str = "speedup") -> str:
    return "–" if r is None or r.get(field) is None else f"{r[field]:.2f}"


def gemm_tables(rows: list[dict]) -> list[str]:
    out = []
    for sp in (0.5, 0.0):
        out += [
            f"GEMMs at {sp:.0%} sparsity: speed-up over cuBLAS `F.linear` (bf16, i.i.d. random masks)",
            "",
            "| op (G) | " + " | ".join(f"M={m}" for m in MS) + " |",
            "|---|" + "---|" * len(MS),
        ]
        for kind, op, g in OPS:
            cells = [_cell(_get(rows, kind=kind, op=op, group_size=g, M=m, sparsity=sp)) for m in MS]
            out.append(f"| {op} ({g}) | " + " | ".join(cells) + " |")
        out.append("")
    return out


def decode_bandwidth(rows: list[dict]) -> list[str]:
    """M = 1, 50%: weight bytes per second beyond the harness's fixed cost (a trivial kernel per call,
    measured by the decode sweep, see docs/history.md): dense = N·K·2 bytes; WIDE = the active fraction of them."""
    floor_ms = json.loads((RESULTS / "decode" / "decode-variants-h200.json").read_text())["records"][0]["wide_ms"]
    out = [
        f"Decode (M = 1, 50%) bandwidth: weight bytes / (time − {1e3 * floor_ms:.1f} µs, the cost per call of a "
        "trivial kernel in this harness, `decode-variants-h200.json`)",
        "",
        "| op (G) | active fraction | dense TB/s | WIDE useful TB/s | speed-up |",
        "|---|---|---|---|---|",
    ]
    for kind, op, g in OPS:
        r = _get(rows, kind=kind, op=op, group_size=g, M=1, sparsity=0.5)
        if r is None:
            continue
        nbytes = r["N"] * r["K"] * 2 * (2 if kind == "gemm_mn_swiglu" else 1)
        dense = nbytes / ((r["dense_ms"] - floor_ms) * 1e-3) / 1e12
        wide = r["active_fraction"] * nbytes / ((r["wide_ms"] - floor_ms) * 1e-3) / 1e12
        out.append(f"| {op} ({g}) | {r['active_fraction']:.3f} | {dense:.2f} | {wide:.2f} | {r['speedup']:.2f} |")
    return out + [""]


def attention_table(rows: list[dict]) -> list[str]:
    att = [r for r in rows if r["kind"].startswith("attn")]
    out = [
        "Attention: speed-up over plain `F.scaled_dot_product_attention(..., enable_gqa=True)` (its own backend "
        "choice), and over the fastest dense backend measured (named)",
        "",
        "| kind | B | T / ctx | vs SDPA 50% | vs SDPA 0% | fastest dense backend | vs it 50% | vs SDPA-flash 50% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    seen = []
    for r in att:
        key = (r["kind"], r["B"], r.get("T") or r.get("ctx"))
        if key in seen:
            continue
        seen.append(key)
        tk = "T" if "T" in r else "ctx"
        r50 = _get(att, kind=r["kind"], B=r["B"], sparsity=0.5, **{tk: key[2]})
        r0 = _get(att, kind=r["kind"], B=r["B"], sparsity=0.0, **{tk: key[2]})
        out.append(
            f"| {r['kind']} | {r['B']} | {key[2]} | {_cell(r50, 'speedup_vs_sdpa_default')} | "
            f"{_cell(r0, 'speedup_vs_sdpa_default')} | {r['baseline']} | {_cell(r50)} | "
            f"{_cell(r50, 'speedup_vs_flash')} |"
        )
    return [*out, ""]


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, each checked against the records (✓ / ✗ with the numbers behind it)."""
    auto = _auto(rows)

    def sp(op, g, m, s):
        r = _get(auto, op=op, group_size=g, M=m, sparsity=s)
        return r["speedup"] if r else float("nan")

    lines = ["| target | measured | met |", "|---|---|---|"]

    def add(name, vals: list[float], ok: bool):
        lines.append(f"| {name} | {min(vals):.2f}–{max(vals):.2f}× | {'✓' if ok else '✗'} |")

    for _kind, op, g in OPS:
        v = [sp(op, g, m, 0.5) for m in (1, 4096, 16384)]
        add(f"{op} (G {g}) ≥ 1.8× at M = 1, 4096, 16384 (50%)", v, min(v) >= 1.8)
    mid = [r["speedup"] for r in auto if 16 <= r["M"] <= 256]
    add("M ∈ [16, 256] ≥ 0.95× (every op, G, sparsity)", mid, min(mid) >= 0.95)
    own = [r["speedup"] for r in auto if 16 <= r["M"] <= 256 and not _same_call(r)]
    if min(mid) < 0.95 <= min(own):  # the target misses only on records whose gap is the harness's
        lines.append(
            f"| (without the records that run their baseline's own cuBLAS call, where a gap is the harness's: "
            f"{min(own):.2f}–{max(own):.2f}×) | | |"
        )
    zero = [r["speedup"] for r in auto if r["M"] >= 1024 and r["sparsity"] == 0.0]
    add("0% sparsity ≥ 0.97× at M ≥ 1024 (every op, G)", zero, min(zero) >= 0.97)
    forced: dict[tuple, list[float]] = {}  # the sorted GEMM-MN timed at the levels the hint sends to cuBLAS
    for r in rows:
        if r.get("variant") == "sorted" and r["M"] >= 1024:  # forced only where 'auto' ran dense
            forced.setdefault((r["op"], r["group_size"], r["sparsity"]), []).append(r["speedup"])
    if forced:
        spans = [f"{op} G {g} {s:.0%}: {min(v):.2f}–{max(v):.2f}×" for (op, g, s), v in sorted(forced.items())]
        lines.append(
            "| (Q and gate/up past M 256 run cuBLAS + the masked epilogue when the expected sparsity is below "
            "`mn_dense_below(G, M)`; the sorted kernel forced there, M ≥ 1024: " + ", ".join(spans) + ") | | |"
        )
    att = [r for r in rows if r["kind"] == "attn_prefill" and r["T"] >= 4096 and r["sparsity"] == 0.5]
    v = [r["speedup_vs_sdpa_default"] for r in att]
    add("prefill attention ≥ 1.8× SDPA at T ≥ 4096 (50%)", v, min(v) >= 1.8)
    # decode attention: its own re-measurement (many mask draws per level) where present
    dec_file = RES / "attn-decode-h200.json"
    dec_rows = json.loads(dec_file.read_text())["records"] if dec_file.is_file() else rows
    dec = [r for r in dec_rows if r["kind"] == "attn_decode" and r["ctx"] >= 4096 and r["sparsity"] == 0.5]
    v = [r["speedup_vs_sdpa_default"] for r in dec]
    src = f" (`{dec_file.name}`)" if dec_file.is_file() else ""
    add(f"decode attention ≥ 1.7× SDPA at ctx ≥ 4096 (50%){src}", v, min(v) >= 1.7)
    reo = [r["reorder_frac_of_served_dense"] * 100 for r in rows if r["kind"] == "reorder" and r["M"] >= 4096]
    # the 'ordered' O projection's row order is timed inside O's own call; shown here for scale
    order = [
        r["pattern_order_ms"] / r["dense_ms"] * 100
        for r in rows
        if r["kind"] == "reorder" and r["M"] >= 16384 and r.get("pattern_order_ms")
    ]
    if order:
        span = f"{min(order):.1f}%" if len(order) == 1 else f"{min(order):.1f}–{max(order):.1f}%"
        lines.append(f"| (O's row order, inside O's timing: {span} of Q + O dense at M ≥ 16384) | | |")
    lines.append(
        f"| reorder ≤ 3% of the served dense ops at M ≥ 4096 | {min(reo):.1f}–{max(reo):.1f}% | "
        f"{'✓' if max(reo) <= 3 else '✗'} |"
    )
    return [*lines, ""]


def e2e_table(name: str = "e2e-h200.json", how: str = "torch.compile'd layer step") -> list[str]:
    """TTFT as issued from Python and, where the file has it, replayed from a CUDA graph of the prompt shape."""
    path = RESULTS / "decode" / name
    if not path.is_file():
        return []
    rows = json.loads(path.read_text())
    graph = all("ttft_graph_ms" in r for r in rows)
    cols = ["B", "model", "real attn / FFN sparsity", "TTFT ms", "TTFT speed-up"]
    cols += ["TTFT graph ms", "TTFT graph speed-up"] if graph else []
    cols += ["TPOT ms", "TPOT speed-up"]
    out = [
        f"End to end (`{name}`, {how}: Llama-3.1-8B shapes, random weights, 4,096-token prompt, decode at "
        "4,096 cached tokens, CUDA-graph decode; dense = the same runtime with cuBLAS / SDPA"
        + ("; TTFT graph: the prefill replayed from a CUDA graph of its prompt shape)" if graph else ")"),
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        name = "dense" if r["variant"] == "dense" else f"WIDE {r['sparsity']:.0%}"
        real = "–" if r["variant"] == "dense" else f"{r['real_attn_sparsity']:.1%} / {r['real_ffn_sparsity']:.1%}"
        cells = [str(r["B"]), name, real, f"{r['ttft_ms']:.1f}", _cell(r, "ttft_speedup")]
        cells += [f"{r['ttft_graph_ms']:.1f}", _cell(r, "ttft_graph_speedup")] if graph else []
        cells += [f"{r['tpot_ms']:.2f}", _cell(r, "tpot_speedup")]
        out.append("| " + " | ".join(cells) + " |")
    return [*out, ""]


def _same_call(r: dict) -> bool:
    """Whether an 'auto' record's WIDE side runs the very cuBLAS call of its dense baseline: O / down on
    cuBLAS over the producer's zeros, Q on the dense path (inactive heads left unspecified)."""
    if r["kind"] == "gemm_k":
        return r["M"] > 16 and plan(r["M"], r["group_size"], r["K"] // r["group_size"], r["sparsity"]).k == "dense"
    return r["kind"] == "gemm_mn" and r.get("path") == "dense"


def harness_spread(rows: list[dict]) -> list[str]:
    """The records whose WIDE side is the dense side's own cuBLAS call (``_same_call``): their spread
    around 1.00x is the timing harness's own."""
    same = [r["speedup"] for r in _auto(rows) if _same_call(r)]  # not the 'ordered' O records
    if not same:
        return []
    return [
        f"Timing spread: O and down at M > 16 (unless 'ordered') and Q on its dense path run the same cuBLAS "
        f"call as their dense baseline ({len(same)} records): {min(same):.2f}–{max(same):.2f}×. Differences of "
        "that size between records are noise.",
        "",
    ]


def main() -> None:
    rows = json.loads((RES / "kernels-h200.json").read_text())
    meta = json.loads((RES / "kernels-h200.meta.json").read_text())
    v = meta["versions"]
    md = [
        f"# Kernel results ({meta['gpu']}, torch {v['torch']}, triton {v['triton']}, Llama-3.1-8B shapes)",
        "",
        "Full sweep in `kernels-h200.md`; timing protocol there. Targets of the kernels issue, checked against "
        "the records:",
        "",
        *targets(rows),
        *gemm_tables(_auto(rows)),
        *harness_spread(rows),
        *decode_bandwidth(_auto(rows)),
        *attention_table(rows),
        *e2e_table(
            how="compiled layer step, commit b69a101: Q and gate/up by cuBLAS where the routers' measured "
            "sparsity is below the GEMM-MN threshold (the 0% rows; 3e6f0a3's per-M thresholds take the same "
            "paths at 0 / 50 / 70%), O by the 'ordered' GEMM-K at M ≥ 16384 / ≥ 40%"
        ),
        "Commands (H200 calls): kernels at commit 55338bb, "
        "`VARIANTS_S=0 BENCH_S=500 TEST_S=0 E2E_S=0 PROFILE_S=0 bash scripts/device/kernels.sh "
        f"$OUT` (step `{meta['command']}`); the dense/sorted GEMM-MN thresholds: `python3 "
        "-m bench.kernels.mn_dense_threshold $OUT` at a53b7c9 (`mn-dense-threshold-h200.json`); e2e at b69a101 "
        "`VARIANTS_S=0 BENCH_S=0 TEST_S=0 E2E_S=480 PROFILE_S=0 E2E_ARGS=--compile bash "
        "scripts/device/kernels.sh $OUT` (step `wide bench e2e --compile`; earlier runs: docs/history.md); "
        "the whole GPU suite (routed GEMMs, routers, PDL, reorder and row order, attention, fused decode, "
        "runtime) at 43f0cf1: `TUNE_S=0 ATTN_S=0 TEST_S=270 bash scripts/device/decode.sh` "
        "(`gpu-tests-h200.log`: 655 passed); "
        'profile at c53ef79 with `WIDE_COMPILE=1 PROFILE_S=150 PROFILE_ARGS="4096 0.7"` (`profile-e2e-h200.txt`); '
        "router kernel: `python3 scripts/decode_variants.py $OUT/bench router` at c53ef79 "
        "(`router-h200.json`); PDL: `python3 scripts/decode_variants.py $OUT/bench pdl` "
        "(`experiments/pdl-h200.json`); ordered GEMM-K variants: `python3 scripts/decode_variants.py $OUT/bench "
        "ordered` at ca06e40 (`experiments/ordered-gemm-k-h200.json`) (that script was removed afterwards: "
        "`git show ca06e40:scripts/decode_variants.py`). Tables: `python -m bench.kernels.summarize_kernels`.",
    ]
    (RES / "kernels-h200.summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
