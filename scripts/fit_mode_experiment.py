"""Which argmax-threshold fit serves quality best? Re-fits the shipped SmolLM2 routers (trained on the
H200) under every fit mode and scores a WikiText-2 slice on the CPU, with the real sparsity.

Usage: WIDE_DATA=../shared/data python scripts/fit_mode_experiment.py [--max-tokens 16384]
Writes bench/results/smollm2/fit_modes_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from wide.eval.perplexity import wikitext_perplexity
from wide.model import SMOLLM2, load_model, load_routers
from wide.paths import data_dir
from wide.train.data import DataOrder, load_calibration_data
from wide.train.threshold_fit import FIT_MODES, _overall, _rates, collect_margins, fit_offsets

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--fit-batches", type=int, default=2)
    ap.add_argument("--fit-batch-size", type=int, default=8)
    a = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    model, tok = load_model(SMOLLM2)
    ds = load_calibration_data(data_dir() / "redpajama" / "sample_redpajama", tok, seq_len=2048)
    order = DataOrder(len(ds), a.fit_batch_size, seed=1)
    batches = [ds.batch(order.next_batch()) for _ in range(a.fit_batches)]
    dense = wikitext_perplexity(model, tok, max_tokens=a.max_tokens, batch_size=1)
    rows = [
        {
            "checkpoint": "dense",
            "mode": "-",
            "token_ppl": dense["token_perplexity"],
            "word_ppl": dense["word_perplexity"],
        }
    ]
    for name in ("smollm2-135m-s25", "smollm2-135m-s50"):
        wm = load_routers(model, ROOT / "checkpoints" / name)
        margins, expected = collect_margins(wm, batches, torch.device("cpu"))
        for mode in FIT_MODES:
            deltas = fit_offsets(margins, expected, mode)
            for (i, k), d in deltas.items():
                getattr(wm.routers[i], k).skip_bias.fill_(d)
            wm.start_meter()
            r = wikitext_perplexity(model, tok, max_tokens=a.max_tokens, batch_size=1, meter=wm.meter)
            sp = wm.stop_meter()
            rows.append(
                {
                    "checkpoint": name,
                    "mode": mode,
                    "token_ppl": r["token_perplexity"],
                    "word_ppl": r["word_perplexity"],
                    "attn_sparsity": sp["attn_sparsity"],
                    "ffn_sparsity": sp["ffn_sparsity"],
                    "flop_saving": sp["flop_saving"],
                    "fit_batches_overall_rate": _overall(_rates(margins, deltas)),
                    "expected_gumbel_overall_rate": _overall(expected),
                }
            )
            print(rows[-1], flush=True)
        wm.detach()
    out = ROOT / "bench" / "results" / "smollm2"
    meta = {
        "command": f"WIDE_DATA=../shared/data python scripts/fit_mode_experiment.py --max-tokens {a.max_tokens}",
        "device": "cpu (2 cores), fp32",
        "wikitext_tokens": a.max_tokens,
        "fit_tokens": a.fit_batches * a.fit_batch_size * 2048,
        "wall_s": time.time() - t0,
    }
    (out / "fit_modes_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md = [
        "| routers | fit mode | real attn / FFN sparsity | FLOPs removed | token ppl (× dense) | word ppl |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["checkpoint"] == "dense":
            md.append(f"| dense | – | – | – | {r['token_ppl']:.2f} (1.00) | {r['word_ppl']:.2f} |")
            continue
        md.append(
            f"| {r['checkpoint']} | {r['mode']} | {r['attn_sparsity']:.1%} / {r['ffn_sparsity']:.1%} | "
            f"{r['flop_saving']:.1%} | {r['token_ppl']:.2f} ({r['token_ppl'] / dense['token_perplexity']:.2f}) | "
            f"{r['word_ppl']:.2f} |"
        )
    md += [
        "",
        f"First {a.max_tokens} WikiText-2 tokens, CPU fp32; thresholds fitted on "
        f"{meta['fit_tokens']} RedPajama tokens. Command: `{meta['command']}`",
    ]
    (out / "fit_modes_cpu.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
