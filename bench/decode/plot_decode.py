"""Decode time per token against sparsity from a `bench/decode/bench_decode.py` record: one line per (step, B),
fused and unfused, the same run's dense TPOT as a dashed line of the same colour.

  python -m bench.decode.plot_decode bench/results/decode/decode-h200.json --out docs/plots/decode-h200.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def series(records: list[dict]) -> tuple[dict[tuple, list[tuple[float, float]]], dict[tuple, float]]:
    """({(fused, B, FFN router source, FFN group size): [(sparsity, TPOT ms)] sorted}, {(fused, B): dense TPOT
    ms}); rows at one shared sparsity level only (per-kind rows and failed rows left out)."""
    lines: dict[tuple, list[tuple[float, float]]] = {}
    dense: dict[tuple, float] = {}
    for r in records:
        if r.get("kind") != "tpot" or not r.get("tpot_ms") or not isinstance(r.get("sparsity"), (int, float)):
            continue
        key = (bool(r.get("fused")), r["B"])
        if r["variant"] == "dense":
            dense[key] = r["tpot_ms"]
        elif r["variant"] == "wide":
            line = (*key, r.get("ffn_router_source", "block"), r.get("ffn_group_size", 128))
            lines.setdefault(line, []).append((float(r["sparsity"]), r["tpot_ms"]))
    return {k: sorted(v) for k, v in sorted(lines.items())}, dense


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("record", type=Path, help="decode-h200.json (bench/decode/bench_decode.py)")
    ap.add_argument("--out", type=Path, required=True, help="the .png to write")
    a = ap.parse_args(argv)
    data = json.loads(a.record.read_text())
    lines, dense = series(data["records"] if isinstance(data, dict) else data)
    if not lines:
        print(f"{a.record}: no WIDE TPOT rows to plot", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({k[1] for k in lines})
    sources = sorted({k[2] for k in lines})  # "block" before "layer"
    sizes = sorted({k[3] for k in lines}, reverse=True)  # 128 first: the record's default
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.8), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        for fused, colour in ((False, "tab:gray"), (True, "tab:blue")):
            name = "fused" if fused else "unfused (compiled)"
            styles = ("o-", "s--", "^-.", "D:")
            for (source, g), style in zip(((s, g) for g in sizes for s in sources), styles, strict=False):
                pts = lines.get((fused, b, source, g))
                if pts:
                    label = f"WIDE, {name}" + (f", FFN router on the {source} input" if len(sources) > 1 else "")
                    label += f", G {g}" if len(sizes) > 1 else ""
                    ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], style, color=colour, label=label)
            if (fused, b) in dense:
                ax.axhline(dense[(fused, b)], color=colour, ls=":", lw=1, label=f"dense, {name}")
        ax.set(title=f"B = {b}", xlabel="groups skipped per token (%)", ylabel="TPOT (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    fig.suptitle(f"Decode, Llama-3.1-8B shapes, ctx {meta.get('ctx', '?')} ({meta.get('device', '?')})", fontsize=10)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
