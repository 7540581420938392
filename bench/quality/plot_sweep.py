"""Figure-6-style plot of a quality sweep (bench/quality/quality_runs.py records): WikiText-2 word perplexity
and average zero-shot accuracy against the fraction of FLOPs removed, one line per method (and variant:
distillation, FLOP-weighted target, LoRA, group size, a calibration budget other than the series' usual
one), the dense model as a reference line. Every run is a filled marker; the line goes through one hollow
marker per target, the mean of the runs there (geometric for perplexity).

  python -m bench.quality.plot_sweep bench/results/quality/smollm2/quality.json \
      --out bench/results/quality/smollm2/sweep.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

VARIANT_FLAGS = ("--bias-compensation",)  # extra calibrate flags that make a row its own series


def series_label(rec: dict) -> str:
    """The line a record belongs to: its method plus what sets it apart from the plain run."""
    parts = [rec["method"]]
    if rec.get("ffn_group_size") and rec["method"] in ("wide", "static-width") and rec["ffn_group_size"] != 128:
        parts.append(f"G{rec['ffn_group_size']}")
    if rec.get("attn_target") is not None:
        parts.append("uniform")
    if rec.get("sparsity_kind", "groups") != "groups" and not rec.get("match_flops"):  # matched: FLOPs by design
        parts.append(f"{rec['sparsity_kind']} target")
    # `wide calibrate` flags of the row (records before extra_args was kept name them in their command)
    extra = rec.get("extra_args") or [f for f in VARIANT_FLAGS if f in " ".join(rec.get("commands", [])).split()]
    parts += [f.lstrip("-") for f in extra]
    if rec.get("distill", "none") != "none":
        parts.append(rec["distill"])
    if rec.get("lora_steps"):
        parts.append("+LoRA")
    return " ".join(parts)


def _calibration_steps(rec: dict) -> int:
    """Stage-1 steps of a record, a warm start's included (init_steps: the routers it started from)."""
    return (rec.get("init_steps") or 0) + rec["steps"] if rec.get("steps") else 0


def group_series(records: list[dict]) -> tuple[dict[str, list[dict]], dict | None]:
    """({label: records sorted by FLOPs removed}, the dense record or None). A trained row whose step count
    differs from the one most of its series' rows have (the fewer steps on a tie; a warm start counts the steps
    of the routers it started from) is a series of its own."""
    dense = next((r for r in records if r["method"] == "dense" and r.get("status") == "done"), None)
    by_label: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("status") == "done" and r["method"] != "dense":
            by_label[series_label(r)].append(r)
    series: dict[str, list[dict]] = defaultdict(list)
    for label, rs in by_label.items():
        counts = Counter(_calibration_steps(r) for r in rs if r.get("steps"))
        usual = max(counts, key=lambda n: (counts[n], -n)) if counts else None
        for r in rs:
            n = _calibration_steps(r)
            series[label if n in (0, usual) else f"{label} {n} steps"].append(r)
    return {k: sorted(v, key=lambda r: r["flops_removed"]) for k, v in sorted(series.items())}, dense


def level_means(rs: list[dict]) -> list[tuple[float, float | None, float | None]]:
    """One (FLOPs removed, perplexity, accuracy) point per target of a series, sorted by FLOPs: the mean of
    the runs at that target (geometric for perplexity; None where no run has the value)."""
    levels: dict[float, list[dict]] = defaultdict(list)
    for r in rs:
        levels[round(r.get("target") or r["flops_removed"], 4)].append(r)
    points = []
    for runs in levels.values():
        ppl = [r["wikitext_word_ppl"] for r in runs if r.get("wikitext_word_ppl")]
        acc = [r["avg_acc"] for r in runs if r.get("avg_acc") is not None]
        points.append(
            (
                statistics.fmean(r["flops_removed"] for r in runs),
                statistics.geometric_mean(ppl) if ppl else None,
                statistics.fmean(acc) if acc else None,
            )
        )
    return sorted(points)


def plot(records: list[dict], out: Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series, dense = group_series(records)
    if not series:
        raise ValueError("no finished non-dense records to plot")
    fig, (ax_ppl, ax_acc) = plt.subplots(1, 2, figsize=(13, 4.6))
    colors = plt.get_cmap("tab20").colors
    markers = "osD^vP*Xh<>p"
    for n, (label, rs) in enumerate(series.items()):  # a distinct (colour, marker) per series
        color, marker = colors[(2 * n) % 20 + (n // 10) % 2], markers[n % len(markers)]
        x = [100 * r["flops_removed"] for r in rs]
        ppl = [r.get("wikitext_word_ppl") for r in rs]
        acc = [None if r.get("avg_acc") is None else 100 * r["avg_acc"] for r in rs]
        means = level_means(rs)
        mx = [100 * m[0] for m in means]
        mppl = [m[1] for m in means]
        macc = [None if m[2] is None else 100 * m[2] for m in means]
        for ax, runs, mean in ((ax_ppl, ppl, mppl), (ax_acc, acc, macc)):
            if any(v is not None for v in runs):
                ax.plot(*_pairs(x, runs), color=color, marker=marker, ls="none")  # every run, filled
                ax.plot(*_pairs(mx, mean), color=color, marker=marker, mfc="none", ms=9, label=label)  # the means
    if dense is not None:
        if dense.get("wikitext_word_ppl"):
            ax_ppl.axhline(dense["wikitext_word_ppl"], color="k", ls="--", lw=1, label="dense")
        if dense.get("avg_acc") is not None:
            ax_acc.axhline(100 * dense["avg_acc"], color="k", ls="--", lw=1, label="dense")
    ax_ppl.set_yscale("log")
    ax_ppl.set_ylabel("WikiText-2 word perplexity")
    ax_acc.set_ylabel("average zero-shot accuracy (%)")
    for ax in (ax_ppl, ax_acc):
        ax.set_xlabel("FLOPs removed (%), measured on the evaluated tokens")
        ax.grid(alpha=0.3)
    ax_acc.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: no point hidden
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def _pairs(x: list, y: list) -> tuple[list, list]:
    keep = [(a, b) for a, b in zip(x, y) if b is not None]
    return [a for a, _ in keep], [b for _, b in keep]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", type=Path, help="JSON written by bench/quality/quality_runs.py")
    p.add_argument("--out", type=Path, help="PNG path (default: next to the records, .png)")
    p.add_argument("--title")
    a = p.parse_args(argv)
    data = json.loads(a.records.read_text())
    records = data["records"] if isinstance(data, dict) else data
    out = plot(records, a.out or a.records.with_suffix(".png"), a.title)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
