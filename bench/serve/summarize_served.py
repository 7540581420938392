"""The shipped routers' quality through both paths, one table: the masked Hugging Face path (the
reference) and the runtime users are served, from the committed H200 records.

    python -m bench.serve.summarize_served   # writes bench/results/quality/smollm2/served-summary.md

Reads bench/results/quality/smollm2/{dense,zero-shot-masked,zero-shot-runtime,served-vs-evaluated}.json.
"""

from __future__ import annotations

import json
from pathlib import Path

R = Path(__file__).resolve().parents[2] / "bench" / "results" / "quality" / "smollm2"
TASKS = ["arc_easy", "arc_challenge", "boolq", "winogrande", "piqa", "openbookqa", "hellaswag"]
NAMES = ["ARC-E", "ARC-C", "BoolQ", "WinoGrande", "PIQA", "OpenbookQA", "HellaSwag"]


def _row(rows: dict, name: str) -> dict:
    return next(v for k, v in rows.items() if Path(k).name == name)


def main() -> None:
    dense = json.loads((R / "dense.json").read_text())["rows"]["dense"]
    masked = json.loads((R / "zero-shot-masked.json").read_text())["rows"]
    served = json.loads((R / "zero-shot-runtime.json").read_text())["rows"]
    sve = json.loads((R / "served-vs-evaluated.json").read_text())["rows"]
    base = dense["avg"]
    head = "| Model | path | Real sparsity (attn/ffn) | WikiText2 | " + " | ".join(NAMES) + " | Avg (retention %) |"
    lines = [head, "|" + "---|" * (len(NAMES) + 5)]
    cells = [f"{dense['tasks'][t]['score'] * 100:.2f}" for t in TASKS]
    ppl = dense["wikitext"]["word_perplexity"]
    lines.append(f"| Dense | both | – | {ppl:.2f} | " + " | ".join(cells) + f" | {base * 100:.2f} (100.00%) |")
    for name in ("smollm2-135m-s25", "smollm2-135m-s50"):
        w = _row(sve, name)["wikitext_word_ppl"]
        for path, rows, p in (("masked", masked, w["masked"]), ("served", served, w["runtime"])):
            r = _row(rows, name)
            sp = r["sparsity"]["tasks"]
            cells = [f"{r['tasks'][t]['score'] * 100:.2f}" for t in TASKS]
            lines.append(
                f"| {name} | {path} | {sp['attn_sparsity']:.1%} / {sp['ffn_sparsity']:.1%} | {p:.2f} | "
                + " | ".join(cells)
                + f" | {r['avg'] * 100:.2f} ({r['avg'] / base:.2%}) |"
            )
    lines += [
        "",
        "Masked: the Hugging Face modules with the routers' hooks (`wide eval`); served: `WideRuntime`, the routed",
        "Triton kernels (`wide eval --runtime`). Both under the one decision rule (docs/routing.md), bf16, H200,",
        "lm-eval 0.4.13 task configs over the offline data, batch 64, max length 4096; WikiText-2 word perplexity",
        "over 4,096-token rolling windows. Sparsity: real, over every token of the seven tasks.",
    ]
    g = [(n, _row(sve, n)["greedy"]) for n in ("smollm2-135m-s25", "smollm2-135m-s50")] + [
        ("dense", sve["dense"]["greedy"])
    ]
    lines += ["", "| greedy, 8 WikiText-2 prompts of 128 tokens, 64 new | tokens equal | sequences identical |",
              "|---|---|---|"]  # fmt: skip
    for n, x in g:
        lines.append(f"| {n}: served (CUDA-graph decode) vs masked (re-scored) | {x['token_agreement']:.1%} | "
                     f"{x['sequences_identical']}/{x['prompts']} |")  # fmt: skip
    out = R / "served-summary.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
