"""Summarise the committed SmolLM2-135M calibration results into bench/results/quality/smollm2/summary.{json,md}.

Reads committed files only: src/wide/checkpoints/smollm2-135m-s*/wide_config.json (training summaries) and
bench/results/quality/smollm2/wide_ppl.json (H200, bf16, full WikiText-2, the shipped routers as trained:
thresholds fitted per kind at the end of training). The first session's 600-step results are in git
only (docs/history.md, "Superseded runs").
Usage: python -m bench.quality.summarize_smollm2
"""

from __future__ import annotations

import json
from pathlib import Path

from wide.paths import resolve_routers

ROOT = Path(__file__).resolve().parents[2]
RES = ROOT / "bench" / "results" / "quality" / "smollm2"
H200_COMMAND = (
    "three device calls in a row on one warm H200: (1) carry .device-carry/smol.part.aa (any command; "
    "scripts/device/setup.sh keeps it); (2) carry .device-carry/{smol.part.ab,whl,data.tar.xz}: "
    "`DEADLINE_S=545 bash scripts/device/calibrate_start.sh $OUT 2000`; (3) carry .device-carry/evalwhl: "
    "`DEADLINE_S=400 bash scripts/device/calibrate_finish.sh $OUT 2000`"
)
# DESIGN.md §2: a minimal implementation's token perplexity at 50% (× dense), the floor to beat
FLOOR_50 = 4.2


def overall_rate(sp: dict) -> float:
    """The sparsity loss's overall rate: mean over layers of ½(attention + FFN skip rate)."""
    per = sp["per_layer"]
    return sum(0.5 * (a + f) for a, f in zip(per["attn"], per["ffn"], strict=True)) / len(per["attn"])


def main() -> None:
    rows = json.loads((RES / "wide_ppl.json").read_text())["rows"]
    dense = rows["dense"]["wikitext"]
    by_name = {k.rstrip("/").rsplit("/", 1)[-1]: v for k, v in rows.items() if k != "dense"}
    out: dict = {"h200_command": H200_COMMAND, "floor_50_token_ppl_ratio": FLOOR_50, "runs": []}
    md = [
        "| target | steps × batch × seq | wall s | tokens/s per run | real sparsity (overall) | attn / FFN "
        "| FLOPs removed | WikiText-2 word ppl | token ppl (× dense) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| dense | – | – | – | – | – | – | {dense['word_perplexity']:.2f} | {dense['token_perplexity']:.2f} (1.00×) |",
    ]
    for name in ("s25", "s50"):
        meta = json.loads((resolve_routers(f"smollm2-135m-{name}") / "wide_config.json").read_text())
        tr, cfg = meta["training"], meta["config"]
        tc = tr["train_config"]
        row = by_name[name]
        wt, sp = row["wikitext"], row["sparsity"]["wikitext"]
        ratio = wt["token_perplexity"] / dense["token_perplexity"]
        rate = overall_rate(sp)
        md.append(
            f"| {cfg['sparsity']:.0%} | {tr['steps']} × {tc['batch_size']} × {tc['seq_len']} | "
            f"{tr['wall_time_s']:.0f} | {tr['tokens_per_s']:,.0f} | {rate:.1%} | "
            f"{sp['attn_sparsity']:.1%} / {sp['ffn_sparsity']:.1%} | {sp['flop_saving']:.1%} | "
            f"{wt['word_perplexity']:.2f} | {wt['token_perplexity']:.2f} ({ratio:.2f}×) |"
        )
        out["runs"].append(
            {
                "target": cfg["sparsity"],
                "steps": tr["steps"],
                "tokens": tr["tokens"],
                "wall_time_s": tr["wall_time_s"],
                "tokens_per_s": tr["tokens_per_s"],
                "compile": tc.get("compile"),
                "fit_mode": tc.get("fit_mode"),
                "overall_rate": rate,
                "within_3_points": abs(rate - cfg["sparsity"]) <= 0.03,
                "attn_sparsity": sp["attn_sparsity"],
                "ffn_sparsity": sp["ffn_sparsity"],
                "flop_saving": sp["flop_saving"],
                "word_perplexity": wt["word_perplexity"],
                "token_perplexity": wt["token_perplexity"],
                "token_ppl_ratio": ratio,
            }
        )
    s50 = next(r for r in out["runs"] if r["target"] == 0.5)
    out["beats_floor_50"] = s50["token_ppl_ratio"] < FLOOR_50
    md += [
        "",
        "Calibration-only (stage 1) on one H200: G_ffn 128, one GQA group per attention decision, rank 32, "
        "α 20, τ 5 → 0.5, lr 2e-3, bf16 autocast, `--compile`; both targets ran concurrently on the GPU "
        "(tokens/s is per run while sharing it); thresholds fitted per kind at the end of training. "
        "WikiText-2: full test set, lm-eval's rolling 2048-token windows, bf16; sparsity measured at inference "
        "(argmax) over every scored token; overall = mean over layers of ½(attention + FFN skip rate), the "
        "rate the sparsity loss trains toward.",
        f"At 50% the token perplexity is {s50['token_ppl_ratio']:.2f}× dense, against {FLOOR_50}× for the "
        "minimal implementation of DESIGN.md §2.",
        f"Command: {H200_COMMAND}; then `python -m bench.quality.summarize_smollm2`.",
    ]
    (RES / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    (RES / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
