"""Headline rows of the committed kernel benchmark (bench/results/kernels-h200.json) as markdown.

Usage: python scripts/summarize_kernels.py  (prints the tables quoted in the README)
"""

from __future__ import annotations

import json
from pathlib import Path

RES = Path(__file__).resolve().parents[1] / "bench" / "results"


def speedup(rows, **key) -> str:
    for r in rows:
        if all(r.get(k) == v for k, v in key.items()):
            return f"{r['speedup']:.2f}"
    return "–"


def main() -> None:
    rows = json.loads((RES / "kernels-h200.json").read_text())
    meta = json.loads((RES / "kernels-h200.meta.json").read_text())
    print(
        f"GEMMs (speed-up over cuBLAS `F.linear`, bf16, i.i.d. random masks; {meta['gpu']}, "
        f"torch {meta['versions']['torch']}, triton {meta['versions']['triton']}):\n"
    )
    print("| op (G) | M=1 50% | M=1 0% | M=4096 50% | M=4096 0% | M=16384 50% | M=16384 0% |")
    print("|---|---|---|---|---|---|---|")
    for kind, op, g in (
        ("gemm_mn", "q", 512),
        ("gemm_mn_swiglu", "gate_up", 128),
        ("gemm_mn_swiglu", "gate_up", 32),
        ("gemm_k", "o", 512),
        ("gemm_k", "down", 128),
    ):
        cells = [
            speedup(rows, kind=kind, op=op, group_size=g, M=m, sparsity=s) for m in (1, 4096, 16384) for s in (0.5, 0.0)
        ]
        print(f"| {op} ({g}) | " + " | ".join(cells) + " |")
    # the full attention sweep (bench/results/attention-h200.json) when present, else the quick records
    full = RES / "attention-h200.json"
    att = json.loads(full.read_text()) if full.is_file() else [r for r in rows if r["kind"].startswith("attn")]
    if att:
        src = full.name if full.is_file() else "kernels-h200.json"
        print(f"\nAttention (speed-up over the fastest dense SDPA backend measured, named per row; {src}):\n")
        print("| kind | B | T / ctx | baseline | speed-up 50% | speed-up 0% |")
        print("|---|---|---|---|---|---|")
        seen = set()
        for r in att:
            t = r.get("T") or r.get("ctx") or r.get("context")
            key = (r["kind"], r.get("B"), t)
            if key in seen:
                continue
            seen.add(key)
            tkey = "T" if "T" in r else ("ctx" if "ctx" in r else "context")
            s50 = speedup(att, kind=r["kind"], B=r.get("B"), sparsity=0.5, **{tkey: t})
            s0 = speedup(att, kind=r["kind"], B=r.get("B"), sparsity=0.0, **{tkey: t})
            print(f"| {r['kind']} | {r.get('B')} | {t} | {r.get('baseline', '')} | {s50} | {s0} |")
    print(f"\nCommand: `{meta['command']}` (quick={meta['quick']}).")


if __name__ == "__main__":
    main()
