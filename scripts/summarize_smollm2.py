"""Summarise the committed SmolLM2-135M results into bench/results/smollm2/summary.{json,md}.

Reads committed files only: checkpoints/smollm2-135m-s*/wide_config.json (training summaries),
bench/results/smollm2/wide_ppl.json (H200, bf16, at training time: per-router threshold fit) and
bench/results/smollm2/wide_ppl_cpu_kindfit.json (CPU, fp32: the shipped checkpoints after
`scripts/refit_shipped_cpu.sh`, per-kind threshold fit).
Usage: python scripts/summarize_smollm2.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "bench" / "results" / "smollm2"
H200_COMMAND = (
    "device call 1: cp .device-carry/smol.part.aa $HOME/.cache/wide/ ; device call 2 (carry "
    ".device-carry/smol.part.ab, .device-carry/evalwhl, .device-carry/data.tar.xz): "
    "bash scripts/device_smollm2_all.sh $OUT 600"
)
CPU_COMMAND = "WIDE_DATA=../shared/data bash scripts/refit_shipped_cpu.sh"


def _rows(path: Path) -> tuple[dict, dict]:
    rows = json.loads(path.read_text())["rows"]
    return rows["dense"]["wikitext"], {k.rstrip("/").rsplit("/", 1)[-1]: v for k, v in rows.items() if k != "dense"}


def _cells(wt: dict, sp: dict, dense: dict) -> str:
    ratio = wt["token_perplexity"] / dense["token_perplexity"]
    return (
        f"{sp['attn_sparsity']:.1%} / {sp['ffn_sparsity']:.1%} | {sp['flop_saving']:.1%} | "
        f"{wt['word_perplexity']:.2f} | {wt['token_perplexity']:.2f} ({ratio:.2f}×)"
    )


def main() -> None:
    h_dense, h_rows = _rows(RES / "wide_ppl.json")
    c_dense, c_rows = _rows(RES / "wide_ppl_cpu_kindfit.json")
    out = {"h200_command": H200_COMMAND, "cpu_command": CPU_COMMAND, "runs": []}
    md = [
        "| target | steps × batch × seq (H200) | wall s | tokens/s | evaluation | real attn / FFN sparsity "
        "| FLOPs removed | WikiText-2 word ppl | token ppl (× dense) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| dense | – | – | – | H200 bf16 | – | – | {h_dense['word_perplexity']:.2f} | "
        f"{h_dense['token_perplexity']:.2f} (1.00×) |",
        f"| dense | – | – | – | CPU fp32 | – | – | {c_dense['word_perplexity']:.2f} | "
        f"{c_dense['token_perplexity']:.2f} (1.00×) |",
    ]
    for name in ("s25", "s50"):
        meta = json.loads((ROOT / "checkpoints" / f"smollm2-135m-{name}" / "wide_config.json").read_text())
        tr, cfg = meta["training"], meta["config"]
        tc = tr["train_config"]
        head = (
            f"| {cfg['sparsity']:.0%} | {tr['steps']} × {tc['batch_size']} × {tc['seq_len']} | "
            f"{tr['wall_time_s']:.0f} | {tr['tokens_per_s']:,.0f} |"
        )
        h, c = h_rows[name], c_rows[f"smollm2-135m-{name}"]
        md.append(f"{head} H200 bf16, router fit | {_cells(h['wikitext'], h['sparsity']['all'], h_dense)} |")
        md.append(f"{head} CPU fp32, kind fit (shipped) | {_cells(c['wikitext'], c['sparsity']['all'], c_dense)} |")
        out["runs"].append(
            {
                "target": cfg["sparsity"],
                "steps": tr["steps"],
                "tokens": tr["tokens"],
                "wall_time_s": tr["wall_time_s"],
                "tokens_per_s": tr["tokens_per_s"],
                "h200_router_fit": {"wikitext": h["wikitext"], "sparsity": h["sparsity"]["all"]},
                "cpu_kind_fit": {"wikitext": c["wikitext"], "sparsity": c["sparsity"]["all"]},
            }
        )
    md += [
        "",
        "Calibration on the H200 (G_ffn 128, one GQA group per attention decision, rank 32, α 20, τ 5 → 0.5, "
        "lr 2e-3, bf16 autocast; the two runs shared the GPU, so tokens/s is per run while sharing it). "
        "WikiText-2: full test set, lm-eval's rolling 2048-token windows; sparsity measured at inference "
        "(argmax) over every scored token.",
        f"H200 rows: `{H200_COMMAND}`.",
        f"CPU rows (thresholds re-fitted per kind, no training): `{CPU_COMMAND}`.",
    ]
    (RES / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    (RES / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
