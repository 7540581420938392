"""Summarise the committed SmolLM2-135M H200 results into bench/results/smollm2/summary.{json,md}.

Reads only committed files: checkpoints/smollm2-135m-s*/wide_config.json (training summaries and the
argmax-threshold fit), bench/results/smollm2/wide_ppl.json and dense.json (evaluations).
Usage: python scripts/summarize_smollm2.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "bench" / "results" / "smollm2"
COMMAND = ("device call 1: cp .device-carry/smol.part.aa $HOME/.cache/wide/ ; device call 2 (carry "
           ".device-carry/smol.part.ab, .device-carry/evalwhl, .device-carry/data.tar.xz): "
           "bash scripts/device_smollm2_all.sh $OUT 600")


def mean_of(d: dict, prefix: str) -> float:
    return statistics.mean(v for k, v in d.items() if k.startswith(prefix))


def main() -> None:
    ppl = json.loads((RES / "wide_ppl.json").read_text())
    rows = ppl["rows"]
    dense = rows["dense"]["wikitext"]
    out = {"command": COMMAND, "gpu": None, "dense": {"word_ppl": dense["word_perplexity"],
                                                      "token_ppl": dense["token_perplexity"]}, "runs": []}
    md = ["| target | steps × batch × seq | wall (s) | tokens/s | real attn / FFN sparsity (argmax) | "
          "FLOPs removed | WikiText-2 word ppl | token ppl (× dense) | argmax skip before → after threshold fit |",
          "|---|---|---|---|---|---|---|---|---|",
          f"| dense | – | – | – | – | – | {dense['word_perplexity']:.2f} | "
          f"{dense['token_perplexity']:.2f} (1.00) | – |"]
    for name in ("s25", "s50"):
        meta = json.loads((ROOT / "checkpoints" / f"smollm2-135m-{name}" / "wide_config.json").read_text())
        tr, cfg = meta["training"], meta["config"]
        row = next(v for k, v in rows.items() if k.rstrip("/").endswith(name))
        wt, sp = row["wikitext"], row["sparsity"]["all"]
        fit = tr["skip_bias_fit"]
        before = 0.5 * (mean_of(fit["argmax_skip_before"], "attn") + mean_of(fit["argmax_skip_before"], "ffn"))
        after = 0.5 * (mean_of(fit["argmax_skip_after"], "attn") + mean_of(fit["argmax_skip_after"], "ffn"))
        tc = tr["train_config"]
        out["gpu"] = tr.get("gpu")
        r = {"target": cfg["sparsity"], "ffn_group_size": cfg["ffn_group_size"], "steps": tr["steps"],
             "batch_size": tc["batch_size"], "seq_len": tc["seq_len"], "tokens": tr["tokens"],
             "wall_time_s": tr["wall_time_s"], "tokens_per_s": tr["tokens_per_s"],
             "attn_sparsity": sp["attn_sparsity"], "ffn_sparsity": sp["ffn_sparsity"],
             "flop_saving": sp["flop_saving"], "word_ppl": wt["word_perplexity"],
             "token_ppl": wt["token_perplexity"], "token_ppl_ratio": wt["token_perplexity"] / dense["token_perplexity"],
             "argmax_skip_before_fit": before, "argmax_skip_after_fit": after}
        out["runs"].append(r)
        md.append(f"| {cfg['sparsity']:.0%} | {tr['steps']} × {tc['batch_size']} × {tc['seq_len']} | "
                  f"{tr['wall_time_s']:.0f} | {tr['tokens_per_s']:,.0f} | {sp['attn_sparsity']:.1%} / "
                  f"{sp['ffn_sparsity']:.1%} | {sp['flop_saving']:.1%} | {wt['word_perplexity']:.2f} | "
                  f"{wt['token_perplexity']:.2f} ({r['token_ppl_ratio']:.2f}) | {before:.1%} → {after:.1%} |")
    md.append("")
    md.append(f"H200 ({out['gpu']}), bf16 autocast, G_ffn 128, one GQA group per attention decision, rank 32, "
              "α 20, τ 5 → 0.5, lr 2e-3; the two calibrations ran concurrently on one GPU (tokens/s is per "
              "run, while sharing it). WikiText-2: full test set, lm-eval's rolling 2048-token windows; "
              "sparsity is measured at inference (argmax) over every scored token.")
    md.append(f"Command: {COMMAND}")
    (RES / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    (RES / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
