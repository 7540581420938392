"""Routed decode attention vs SDPA, the decode rows of `wide bench kernels` alone (one H200, ~1 minute).

    python -m bench.kernels.bench_attention_decode --out $OUT     # -> $OUT/attn-decode-CARD.json and .md

Llama-3.1-8B attention shapes (Hq 32, Hk 8, d 128), bf16, B 1 / 16 / 64 at 4,096 and 32,768 cached tokens,
sparsity 0 / 25 / 50 / 70%: each level cycles many i.i.d. [B, Hk] mask draws (``mask_draws``), so that the
real sparsity of the timed calls (``real_sparsity``) is the labelled one; the baseline is the fastest SDPA
backend over the full cache (``wide.bench.attention_bench.bench_decode``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from wide.bench.attention_bench import bench_decode
from wide.bench.timing import card_tag


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sparsities", default="0,0.25,0.5,0.7")
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    levels = [float(s) for s in args.sparsities.split(",")]
    rows: list[dict] = []
    for ctx in (4096, 32768):
        for b in (1, 16, 64):
            rows += bench_decode(b, ctx, levels)
            torch.cuda.empty_cache()
            print(json.dumps(rows[-1]), flush=True)
    meta = {
        "command": f"python -m bench.kernels.bench_attention_decode --sparsities {args.sparsities}",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "wall_s": time.time() - t0,
    }
    with open(os.path.join(args.out, f"attn-decode-{card_tag()}.json"), "w") as fh:
        json.dump({"meta": meta, "records": rows}, fh, indent=1)
    lines = [f"# Routed decode attention vs SDPA ({meta['device']})", "", f"Command: `{meta['command']}`", "",
             "| B | ctx | sparsity | real sparsity | mask draws | SDPA ms | WIDE ms | speed-up |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['B']} | {r['ctx']} | {r['sparsity']:.2f} | {r['real_sparsity']:.3f} | {r['mask_draws']} "
            f"| {r['dense_ms']:.4f} | {r['wide_ms']:.4f} | {r['speedup']:.2f} |"
        )
    with open(os.path.join(args.out, f"attn-decode-{card_tag()}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
