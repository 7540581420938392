"""WIDE's quality against its training budget, from a quality sweep's records (bench/quality/quality_runs.py):
WikiText-2 word perplexity as a multiple of the dense model's, against the tokens each row trained on
(stage 1, warm starts and LoRA all counted), one panel per target that has rows at more than one budget.
Calibration-only rows are circles, + LoRA rows squares, distilled rows (`--distill`) filled; each row is
labelled with its steps and joined to the row it started from (stage1_from / init_from). Only the plain
WIDE series enter (groups target, no extra calibrate flags), one per FFN group size named in --group-sizes
(default 128; other sizes drawn as triangles / diamonds), so what moves is the budget, the objective and the
group size. Dashed lines: the goals of the quality issue, when given (--goal).

  python -m bench.quality.plot_budget bench/results/quality/smollm2/quality-h200.json --out docs/plots/budget-h200.png \
      --goal 0.25:1.25 --goal 0.5:3.0 --goal 0.5:2.2:LoRA --group-sizes 128,32
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def plain_wide(rec: dict, group_sizes: tuple[int, ...] = (128,)) -> bool:
    """The rows of the plain WIDE series: what differs between them is the budget, the objective and the FFN
    group size (one of `group_sizes`)."""
    return (
        rec.get("method") == "wide"
        and rec.get("status", "done") == "done"
        and rec.get("sparsity_kind", "groups") == "groups"
        and rec.get("ffn_group_size", 128) in group_sizes
        and rec.get("attn_target") is None
        and not rec.get("extra_args")
        and rec.get("wikitext_word_ppl")
        and rec.get("tokens")
    )


def steps_label(rec: dict) -> str:
    """e.g. "300", "4000 + 3000 kl+lm", "4000 + LoRA 1000": the row's steps, warm start and stage 2."""
    parts = [str(rec["init_steps"]), str(rec["steps"])] if rec.get("init_steps") else [str(rec["steps"])]
    if rec.get("lora_steps"):
        parts.append(f"LoRA {rec['lora_steps']}")
    label = " + ".join(parts)
    return label + (f" {rec['distill']}" if rec.get("distill", "none") != "none" else "")


def points(records: list[dict], group_sizes: tuple[int, ...] = (128,)) -> tuple[float, dict[float, list[dict]]]:
    """(dense word perplexity, target -> plain WIDE rows of those FFN group sizes sorted by tokens)."""
    dense = next((r for r in records if r.get("method") == "dense" and r.get("wikitext_word_ppl")), None)
    if dense is None:
        raise SystemExit("no dense record with a WikiText-2 perplexity: nothing to divide by")
    by_target: dict[float, list[dict]] = {}
    for r in (r for r in records if plain_wide(r, group_sizes)):
        by_target.setdefault(r["target"], []).append(r)
    # a target trained at one budget only says nothing about the budget
    by_target = {t: rows for t, rows in by_target.items() if len({r["tokens"] for r in rows}) > 1}
    for rows in by_target.values():
        rows.sort(key=lambda r: r["tokens"])
    return dense["wikitext_word_ppl"], dict(sorted(by_target.items()))


def parse_goal(text: str) -> tuple[float, float, str]:
    """Parse TARGET:RATIO[:LABEL] into (target, ratio, label)."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"--goal {text!r}: expected TARGET:RATIO[:LABEL], e.g. 0.5:3.0")
    try:
        return float(parts[0]), float(parts[1]), (parts[2] if len(parts) == 3 else "calibration only")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--goal {text!r}: {e}") from None


def plot(
    records: list[dict], out: Path, goals: list[tuple[float, float, str]], group_sizes: tuple[int, ...] = (128,)
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    dense, by_target = points(records, group_sizes)
    if not by_target:
        sizes = "/".join(map(str, group_sizes))
        raise SystemExit(f"no target with plain WIDE rows (groups target, G {sizes}, no extra flags) at two budgets")
    # (group size, LoRA) -> marker, colour: the first size keeps circles / squares, the others triangles / diamonds
    styles = {}
    for i, g in enumerate(group_sizes):
        styles[(g, False)] = ("o" if i == 0 else "^", ("tab:blue", "tab:green", "tab:purple")[min(i, 2)])
        styles[(g, True)] = ("s" if i == 0 else "D", ("tab:orange", "tab:red", "tab:brown")[min(i, 2)])
    fig, axes = plt.subplots(1, len(by_target), figsize=(6.2 * len(by_target), 4.6), squeeze=False)
    for ax, (target, rows) in zip(axes[0], by_target.items()):
        xy = {r["name"]: (r["tokens"] / 1e6, r["wikitext_word_ppl"] / dense) for r in rows}
        for r in rows:  # the row each one started from
            src = r.get("stage1_from") or r.get("init_from")
            if src in xy:
                (x0, y0), (x1, y1) = xy[src], xy[r["name"]]
                ax.plot([x0, x1], [y0, y1], color="grey", lw=0.7, alpha=0.6)
        placed: list[tuple[float, float]] = []  # labelled points: a label near one goes below its point
        for (g, lora), (marker, colour) in styles.items():
            sel = [r for r in rows if bool(r.get("lora_steps")) == lora and r.get("ffn_group_size", 128) == g]
            if not sel:
                continue
            for r in sel:
                x, y = xy[r["name"]]
                distilled = r.get("distill", "none") != "none"
                ax.plot(x, y, marker, color=colour, mfc=colour if distilled else "white", ms=7)
                near = any(abs(math.log(x / px)) < 0.5 and abs(math.log(y / py)) < 0.06 for px, py in placed)
                ax.annotate(steps_label(r), (x, y), textcoords="offset points", xytext=(6, -11 if near else 4),
                            fontsize=7)  # fmt: skip
                placed.append((x, y))
            kind = "+ LoRA" if lora else "calibration only"
            kind = f"G {g}, {kind}" if len(group_sizes) > 1 else kind
            ax.plot([], [], marker, color=colour, mfc="white", label=kind)
        for g_target, ratio, label in goals:
            if g_target == target:
                ax.axhline(ratio, ls="--", lw=0.8, color="grey")
                ax.annotate(f"goal {ratio:g}× ({label})", (0.01, ratio), xycoords=("axes fraction", "data"),
                            xytext=(0, 3), textcoords="offset points", fontsize=7, color="grey")  # fmt: skip
        ax.plot([], [], "o", color="grey", label="filled: distilled (KL to dense + LM)")
        ax.set(xscale="log", yscale="log", xlabel="training tokens (M)", ylabel="word perplexity / dense")
        xs, ys = [x for x, _ in xy.values()], [y for _, y in xy.values()]
        ys += [ratio for g_target, ratio, _ in goals if g_target == target]
        # room inside the frame for the labels right of the last points and below the lowest one
        ax.set_xlim(min(xs) / 1.3, max(xs) * 3.6)
        lo, hi = math.log(min(ys)), math.log(max(ys))
        ax.set_ylim(bottom=math.exp(lo - 0.1 * (hi - lo)))
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        sparse = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else "")  # 2, 5, 20, 50, ...
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(sparse)
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.set_title(f"WIDE, target {target:.0%} of the groups")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", type=Path, help="a quality sweep's JSON (bench/quality/quality_runs.py --out)")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--goal", type=parse_goal, action="append", default=[], help="TARGET:RATIO[:LABEL], repeatable")
    p.add_argument("--group-sizes", default="128", help="FFN group sizes, comma list: one series each (first: circles)")
    a = p.parse_args(argv)
    try:
        sizes = tuple(int(s) for s in a.group_sizes.split(","))
    except ValueError:
        p.error(f"--group-sizes {a.group_sizes!r}: expected a comma list of integers, e.g. 128,32")
    if not a.records.is_file():
        p.error(f"{a.records}: no such file")
    print(plot(json.loads(a.records.read_text())["records"], a.out, a.goal, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
