"""The fused decode layer's targets, checked against committed decode tables.

Reads one or more ``bench/decode/bench_decode.py`` records (``bench/results/decode/decode-<card>.json``) and
writes, per record
and FFN router input, each target of the fused decode issue with the measured value: TPOT against the same call's
fused dense step, the dense step's absolute TPOT and read rate, launches per layer, B 16 against the limit the
union of its masks implies. The absolute targets (ms, TB/s) are the H200's; on another card they are printed
and marked "other card". Usage:

    python -m bench.decode.summarize_decode bench/results/decode/decode-h200.json \
        bench/results/decode/decode-h100.json \
        --out bench/results/decode/decode-targets.md
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Target:
    label: str
    B: int
    level: float | None  # WIDE sparsity label; None: the dense step
    at_least: float | None = None  # speed-up vs the call's fused dense step
    at_most_ms: float | None = None  # absolute TPOT (H200)


TARGETS = (
    Target("dense TPOT ≤ 4.0 ms (≥ 3.9 TB/s)", 1, None, at_most_ms=4.0),
    Target("WIDE 50% ≥ 1.6× dense, ≤ 2.4 ms", 1, 0.5, at_least=1.6, at_most_ms=2.4),
    Target("WIDE 70% ≥ 2.0×", 1, 0.7, at_least=2.0),
    Target("WIDE 0% ≥ 0.98×", 1, 0.0, at_least=0.98),
    Target("B 16, WIDE 50% ≥ 1.0× (limit: the union's groups)", 16, 0.5, at_least=1.0),
)
DENSE_TB_S = 3.9
MAX_LAUNCHES = 6


def _load(path: Path) -> tuple[dict, list[dict]]:
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or "records" not in doc:
        raise SystemExit(f"{path}: not a bench_decode.py record (no 'records')")
    return doc.get("meta", {}), [r for r in doc["records"] if r.get("kind") == "tpot"]


def _setting(r: dict) -> str:
    """A WIDE row's FFN router input, and its FFN group size where it is not the default 128."""
    g = r.get("ffn_group_size", 128)
    return r.get("ffn_router_source", "block") + ("" if g == 128 else f", G {g}")


def _row(rows: list[dict], variant: str, B: int, level: float | None, setting: str | None) -> dict | None:
    for r in rows:
        if r["variant"] != variant or r["B"] != B or not r.get("fused"):
            continue
        if variant == "wide" and (r.get("sparsity") != level or _setting(r) != setting):
            continue
        return r
    return None


def _mark(ok: bool | None) -> str:
    return "–" if ok is None else ("✓" if ok else "✗")


def summarize(path: Path) -> list[str]:
    meta, rows = _load(path)
    device = meta.get("device", "?")
    h200 = "H200" in device
    sources = sorted({_setting(r) for r in rows if r["variant"] == "wide"})
    out = [f"### `{path.name}` ({device})", "", f"Command: `{meta.get('command', '?')}`", ""]
    out += ["| target | FFN router input | measured | met |", "|---|---|---|---|"]
    for t in TARGETS:
        for source in [None] if t.level is None else sources:
            variant = "dense" if t.level is None else "wide"
            r = _row(rows, variant, t.B, t.level, source)
            if r is None:
                out.append(f"| {t.label} | {source or '–'} | not in the record | – |")
                continue
            parts, oks = [f"{r['tpot_ms']:.3f} ms"], []
            if t.level is None:
                parts.append(f"{r['tb_per_s']:.2f} TB/s")
                if h200:
                    oks += [r["tpot_ms"] <= t.at_most_ms, r["tb_per_s"] >= DENSE_TB_S]
            else:
                parts.append(f"{r['tpot_speedup_vs_dense_fused']:.3f}×")
                oks.append(r["tpot_speedup_vs_dense_fused"] >= t.at_least)
                if t.at_most_ms is not None and h200:
                    oks.append(r["tpot_ms"] <= t.at_most_ms)
                ran = (r.get("measured_attn_union_run"), r.get("measured_ffn_union_run"))
                if None not in ran:
                    parts.append(f"union runs attn {ran[0]:.2f} / FFN {ran[1]:.2f} of the groups")
            note = "" if h200 or t.at_most_ms is None else " (ms: other card)"
            out.append(
                f"| {t.label} | {source or '–'} | {', '.join(parts)}{note} | {_mark(all(oks) if oks else None)} |"
            )
    for B in sorted({r["B"] for r in rows}):
        f, u = (
            next((r for r in rows if r["variant"] == "dense" and r["B"] == B and bool(r.get("fused")) == k), None)
            for k in (True, False)
        )
        if f and u:
            ratio = u["tpot_ms"] / f["tpot_ms"]
            out.append(
                f"| B {B}: fused dense at least as fast as the compiled unfused (cuBLAS) step | – | "
                f"{f['tpot_ms']:.3f} against {u['tpot_ms']:.3f} ms, {ratio:.3f}× | {_mark(ratio >= 1.0)} |"
            )
    fused = [r for r in rows if r.get("fused")]
    worst = max((r["kernels_per_layer"] for r in fused), default=None)
    if worst is not None:
        out.append(
            f"| ≤ {MAX_LAUNCHES} launches per decoder layer | all | at most {worst} | {_mark(worst <= MAX_LAUNCHES)} |"
        )
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+", type=Path, help="bench_decode.py JSON records")
    ap.add_argument("--out", type=Path, help="write the tables here (Markdown) as well as printing them")
    args = ap.parse_args(argv)
    for p in args.records:
        if not p.is_file():
            ap.error(f"no such record: {p}")
    lines = ["# Fused decode layer: the issue's targets against the committed tables", ""]
    lines += [
        "Generated by `python -m bench.decode.summarize_decode "
        + " ".join(f"bench/results/decode/{p.name}" for p in args.records)
        + "`. TPOT ratios are against the same call's fused dense step; absolute targets are the H200's.",
        "",
    ]
    for p in args.records:
        lines += summarize(p)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
