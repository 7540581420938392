"""Tables and plot of a ``bench.decode.long_context`` record: each speed-up beside its byte limit.

    python -m bench.decode.summarize_long_context bench/results/decode/long-context-h100.json \
        --md bench/results/decode/long-context-h100.md --plot docs/plots/long-context-h100.png

The decode table: per (B, context) the fused dense row and each WIDE level, under the split rule the library
takes at that length (the default rule) and, where a row was also timed under the other rule, that row too.
The TTFT table: B 1 prompts, dense (SDPA) vs routed, with attention's share of the prefill. The plot: speed-up
over the fused dense step against context length, one panel per B, each level's byte limit dashed in its
colour.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _f(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def _gb(v) -> str:
    return "–" if v is None else f"{v / 1e9:.2f}"


def is_default(r: dict) -> bool:
    """Whether a row ran what the library runs by default: its split rule and its cache layout (rows of records
    from before the layout was a choice ran the default one)."""
    return r.get("default_rule", True) and r.get("default_layout", True)


def tpot_table(rows: list[dict]) -> list[str]:
    lines = [
        "| B | context | variant | split rule | TPOT ms | × fused dense | byte limit | share of limit | TB/s "
        "| pairs run | union run attn / FFN | GB weights + KV |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    tpot = [r for r in rows if r.get("kind") == "tpot" and "error" not in r]
    for r in sorted(tpot, key=lambda r: (r["B"], r["ctx"], not is_default(r))):
        rule = r["rule"] + ("" if r.get("default_layout", True) else f", {r['kv_layout']} cache")
        rule += "" if is_default(r) else " (not default)"
        pairs = r.get("measured_attn_token_run")
        union = (r.get("measured_attn_union_run"), r.get("measured_ffn_union_run"))
        lines.append(
            f"| {r['B']} | {r['ctx']} | {r['level']} | {rule} | {r['tpot_ms']:.3f} "
            f"| {_f(r.get('tpot_speedup'), '.3f')} | {_f(r.get('byte_limit'), '.3f')} "
            f"| {_f(r.get('share_of_limit'), '.1%')} | {_f(r.get('tb_per_s'), '.2f')} "
            f"| {_f(pairs, '.3f')} | {_f(union[0], '.2f')} / {_f(union[1], '.2f')} "
            f"| {_gb(r.get('bytes_weights'))} + {_gb(r.get('bytes_kv'))} |"
        )
    return lines


def ttft_table(rows: list[dict]) -> list[str]:
    lines = [
        "| prompt | variant | TTFT ms | × dense | attention ms / layer | attention share of TTFT |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted((r for r in rows if r.get("kind") == "ttft" and "error" not in r), key=lambda r: r["prompt"]):
        level = r["level"] + ("" if r.get("default_layout", True) else f", {r['kv_layout']} cache")
        lines.append(
            f"| {r['prompt']} | {level} | {r['ttft_ms']:.1f} | {_f(r.get('ttft_speedup'), '.3f')} "
            f"| {r['attention_ms_per_layer']:.3f} | {r['attention_share']:.1%} |"
        )
    return lines


def render(rows: list[dict]) -> str:
    """The markdown of a record: header (card, commit, versions, commands), decode and TTFT tables, rows
    that did not run."""
    first = rows[0] if rows else {}
    cmds = list(dict.fromkeys(r["command"] for r in rows if r.get("command"))) or ["?"]
    out = [
        f"# Long-context decode grid ({first.get('gpu', '?')}, card {first.get('card', '?')}, commit "
        f"{first.get('commit', '?')}, torch {first.get('torch', '?')}, triton {first.get('triton', '?')})",
        "",
        "Command" + ("s (one device call each)" if len(cmds) > 1 else "") + ": " + "; ".join(f"`{c}`" for c in cmds),
        "",
        "Llama-3.1-8B shapes, random weights, bf16, fused decode layer, one CUDA-graph step at `context` random "
        "cached keys. × fused dense: against the same call's fused dense step under the same split rule. Byte "
        "limit: dense bytes / the row's bytes (weights of the groups the batch's union runs, K/V of the pairs "
        "that run); share of limit: speed-up / byte limit. Pairs run: fraction of (token, KV group) pairs.",
        "",
        *tpot_table(rows),
        "",
        "TTFT (B 1, prefill issued from Python; attention alone on the prompt's shapes, times the layers):",
        "",
        *ttft_table(rows),
    ]
    failed = [r for r in rows if "error" in r]
    if failed:
        out += ["", "Rows not measured:", ""]
        out += [f"- {r.get('kind')} B {r.get('B')} ctx {r.get('ctx')} {r.get('level')}: {r['error']}" for r in failed]
    return "\n".join(out) + "\n"


def write_markdown(rows: list[dict], path: Path) -> None:
    path.write_text(render(rows))


def plot(rows: list[dict], path: Path) -> bool:
    """Speed-up vs context per B (default split rule), each level's byte limit dashed; False: nothing to plot."""
    pts: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
    for r in rows:
        if r.get("kind") == "tpot" and r.get("variant") == "wide" and r.get("tpot_speedup") and is_default(r):
            pts.setdefault((r["B"], r["level"]), []).append((r["ctx"], r["tpot_speedup"], r["byte_limit"]))
    if not pts:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({b for b, _ in pts})
    levels = sorted({lv for _, lv in pts})
    colours = dict(zip(levels, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], batches, strict=True):
        for lv in levels:
            line = sorted(pts.get((b, lv), []))
            if not line:
                continue
            x = [p[0] for p in line]
            ax.plot(x, [p[1] for p in line], "o-", color=colours[lv], label=lv)
            ax.plot(x, [p[2] for p in line], "--", color=colours[lv], lw=1, label=f"{lv}: byte limit")
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(title=f"B = {b}", xlabel="context (cached keys)", ylabel="TPOT speed-up over fused dense")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    first = rows[0]
    fig.suptitle(f"WIDE decode at long context, Llama-3.1-8B shapes ({first.get('gpu', '?')}, {first.get('commit')})",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("record", type=Path, help="long-context-CARD.json")
    ap.add_argument("--md", type=Path, help="the markdown to write (default: beside the record)")
    ap.add_argument("--plot", type=Path, help="the .png to write (e.g. docs/plots/long-context-h100.png)")
    a = ap.parse_args(argv)
    try:
        rows = json.loads(a.record.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"{a.record}: cannot read a record ({e})", file=sys.stderr)
        return 2
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "kind" in r for r in rows):
        print(f"{a.record}: not a bench.decode.long_context record (a JSON list of rows)", file=sys.stderr)
        return 2
    md = a.md or a.record.with_suffix(".md")
    write_markdown(rows, md)
    print(f"wrote {md}")
    if a.plot is not None:
        if not plot(rows, a.plot):
            print(f"{a.record}: no WIDE decode rows with a speed-up to plot", file=sys.stderr)
            return 2
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
