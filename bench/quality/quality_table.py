"""Markdown tables of a quality sweep (bench/quality/quality_runs.py records): one table per sparsity level (a
row's own target, or for a row at another row's FLOPs, that row's target), dense on top, then each row's
FLOPs removed, real sparsity, WikiText-2 word perplexity (and its ratio to dense), the seven zero-shot
scores and their average (and its retention of dense's); below, the issue's comparisons computed from
the same records. Rows that did not finish are listed with their status.

  python -m bench.quality.quality_table bench/results/quality/smollm2/quality-h200.json            # to stdout
  python -m bench.quality.quality_table bench/results/quality/smollm2/quality-h200.json --out x.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TASKS = ("arc_easy", "arc_challenge", "boolq", "winogrande", "piqa", "openbookqa", "hellaswag")


def level_of(rec: dict, by_name: dict[str, dict]) -> float | None:
    """The sparsity level a record is compared at (None: dense)."""
    if rec["method"] == "dense":
        return None
    if rec.get("match_flops") and rec["match_flops"] in by_name:
        return by_name[rec["match_flops"]].get("target")
    return rec.get("target")


def _budget(rec: dict) -> str:
    if rec["method"] == "dense":
        return "-"
    if not rec.get("steps"):
        if rec.get("lora_steps"):  # a static mask recovered with LoRA: calibration + LoRA tokens
            return f"training-free + {rec['lora_steps']} LoRA, {rec.get('tokens', 0) / 1e6:.1f}M tok"
        return f"training-free, {rec.get('tokens', 0) / 1e6:.2f}M calibration tok"
    parts = [f"{rec['init_steps']} + {rec['steps']} steps" if rec.get("init_from") else f"{rec['steps']} steps"]
    if rec.get("lora_steps"):
        parts.append(f"+ {rec['lora_steps']} LoRA")
    return " ".join(parts) + f", {rec['tokens'] / 1e6:.1f}M tok"


def table(records: list[dict]) -> str:
    by_name = {r["name"]: r for r in records}
    dense = next((r for r in records if r["method"] == "dense" and r.get("status") == "done"), None)
    done = [r for r in records if r.get("status") == "done"]
    levels = sorted({lv for r in done if (lv := level_of(r, by_name)) is not None})
    head = "| row | method | budget | FLOPs removed | attn / FFN skipped | word ppl | × dense | "
    head += " | ".join(TASKS) + " | avg | retention |"
    rule = "|" + "---|" * (head.count("|") - 1)
    out = []

    def line(r: dict) -> str:
        ppl = r.get("wikitext_word_ppl")
        ratio = f"{ppl / dense['wikitext_word_ppl']:.2f}" if dense and ppl else "-"
        keep = f"{100 * r['avg_acc'] / dense['avg_acc']:.1f}%" if dense and r.get("avg_acc") else "-"
        sp = r.get("real_sparsity") or {}
        cells = [
            r["name"],
            r["method"] + (" (kl+lm)" if r.get("distill", "none") != "none" else ""),
            _budget(r),
            f"{r.get('flops_removed', 0):.3f}",
            f"{sp.get('attn', 0):.2f} / {sp.get('ffn', 0):.2f}",
            f"{ppl:.1f}" if ppl else "-",
            ratio,
            *(f"{r['tasks'][t]:.3f}" if t in r.get("tasks", {}) else "-" for t in TASKS),
            f"{r['avg_acc']:.3f}" if r.get("avg_acc") is not None else "-",
            keep,
        ]
        return "| " + " | ".join(cells) + " |"

    for lv in levels:
        out += [f"### Target {100 * lv:g}%", "", head, rule]
        if dense:
            out.append(line(dense))
        out += [line(r) for r in done if level_of(r, by_name) == lv]
        out.append("")
    unfinished = [r for r in records if r.get("status") != "done"]
    if unfinished:
        out += ["Not finished: " + ", ".join(f"{r['name']} ({r.get('status')})" for r in unfinished), ""]
    out += comparisons(done, by_name, dense)
    return "\n".join(out)


def comparisons(done: list[dict], by_name: dict[str, dict], dense: dict | None) -> list[str]:
    """Per level: each plain WIDE row (groups target, shared constraint, G_ffn 128, no distillation) against
    every baseline row at that level with the same budget: calibration-only rows against calibration-only
    ones, + LoRA rows against + LoRA ones with as many LoRA steps, trained baselines only at the same
    calibration steps (training-free ones at any), in perplexity and average accuracy."""
    out = []
    for r in done:
        plain = r["method"] == "wide" and r.get("distill", "none") == "none"
        plain = plain and r.get("sparsity_kind") == "groups" and r.get("attn_target") is None
        plain = plain and r.get("ffn_group_size", 128) == 128 and not r.get("extra_args")
        if not plain:
            continue
        lv = level_of(r, by_name)
        peers = [p for p in done if p["method"] not in ("wide", "dense") and level_of(p, by_name) == lv]
        peers = [p for p in peers if (p.get("lora_steps") or 0) == (r.get("lora_steps") or 0)]
        peers = [p for p in peers if not p.get("steps") or p["steps"] == r.get("steps")]
        if not peers:
            continue
        stage = f" + {r['lora_steps']} LoRA" if r.get("lora_steps") else ""
        out.append(f"WIDE row `{r['name']}` (target {100 * lv:g}%{stage}, FLOPs removed {r['flops_removed']:.3f}):")
        for p in peers:
            pr = p["wikitext_word_ppl"] / r["wikitext_word_ppl"]
            da = p["avg_acc"] - r["avg_acc"]
            out.append(
                f"- `{p['name']}` (FLOPs removed {p['flops_removed']:.3f}): perplexity {pr:.1f}× WIDE's, "
                f"average accuracy {da:+.3f}"
            )
        if dense:
            ratio = r["wikitext_word_ppl"] / dense["wikitext_word_ppl"]
            out.append(f"- WIDE's word perplexity is {ratio:.2f}× dense's")
        out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", type=Path)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    data = json.loads(a.records.read_text())
    text = table(data["records"] if isinstance(data, dict) else data)
    if a.out:
        a.out.write_text(text + "\n")
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
