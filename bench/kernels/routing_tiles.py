"""Tile occupancy of the shipped SmolLM2 routers on real text: how much of O and down a token-tile
GEMM-K could skip, in natural row order and in the 'ordered' kernel's pattern order, against the active
fraction and against i.i.d. masks at the same per-group rates (``wide.eval.tile_occupancy``).

Routes the first ``--tokens`` tokens of WikiText-2 test (one sequence, argmax decisions) through
SmolLM2-135M with each shipped router checkpoint, on the CPU.
Usage: WIDE_DATA=../shared/data python -m bench.kernels.routing_tiles [--tokens 4096] [--rows 128]
Writes bench/results/quality/smollm2/routing-tiles.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from wide.eval.tasks import data_path
from wide.eval.tile_occupancy import occupancy_report
from wide.model import SMOLLM2, load_model, load_routers
from wide.paths import resolve_routers

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "quality" / "smollm2"
CHECKPOINTS = ("smollm2-135m-s25", "smollm2-135m-s50")
COLS = ("active", "natural", "ordered", "iid_natural", "iid_ordered")


@torch.no_grad()
def layer_reports(wm, ids: torch.Tensor, rows: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    with wm.routing("argmax"):
        wm(ids)
    out = []
    for layer, masks in enumerate(wm.last_masks):
        for kind in ("attn", "ffn"):
            m = masks[kind][0].bool()  # [T, N_G]
            out.append({"layer": layer, "kind": kind, **occupancy_report(m, rows, gen)})
    return out


def mean_of(rows: list[dict], kind: str) -> dict:
    sel = [r for r in rows if r["kind"] == kind]
    return {c: sum(r[c] for r in sel) / len(sel) for c in COLS}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(12, 3.2 * len(results)), squeeze=False)
    for row, (name, rep) in enumerate(results.items()):
        for col, kind in enumerate(("attn", "ffn")):
            ax = axes[row][col]
            sel = [r for r in rep["layers"] if r["kind"] == kind]
            x = [r["layer"] for r in sel]
            for c, style in zip(COLS, ("k-", "C0-", "C1-", "C0:", "C1:"), strict=True):
                ax.plot(x, [r[c] for r in sel], style, label=c.replace("_", " "))
            ax.set_title(f"{name}: {'O (attention groups)' if kind == 'attn' else 'down (FFN groups)'}")
            ax.set_xlabel("layer")
            ax.set_ylabel("share of (tile, group) pairs run")
            ax.set_ylim(0, 1.05)
    axes[0][1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=128, help="token rows per GEMM-K tile")
    a = ap.parse_args()
    t0 = time.time()
    model, tok = load_model(SMOLLM2)
    ids = tok(data_path("wikitext").read_text(), return_tensors="pt").input_ids[:, : a.tokens]
    results = {}
    for name in CHECKPOINTS:
        wm = load_routers(model, resolve_routers(name))
        layers = layer_reports(wm, ids, a.rows, seed=0)
        results[name] = {"layers": layers, "mean": {k: mean_of(layers, k) for k in ("attn", "ffn")}}
        wm.detach()
    meta = {"tokens": int(ids.shape[1]), "rows_per_tile": a.rows, "text": "WikiText-2 test, from its start",
            "decisions": "argmax", "wall_s": round(time.time() - t0, 1),
            "command": f"python -m bench.kernels.routing_tiles --tokens {a.tokens} --rows {a.rows}"}  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "routing-tiles.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [
        f"# Tile occupancy of the shipped routers ({meta['tokens']} WikiText-2 tokens, tiles of {a.rows} rows)",
        "",
        "Share of (tile, group) pairs a token-tile GEMM-K must run (mean over layers). `active`: the share "
        "of (token, group) decisions that run (per-token skipping); `natural` / `ordered`: tiles of "
        "consecutive rows in the text's order / in the 'ordered' kernel's Gray pattern order; `iid_*`: the "
        "same masks with each group's column shuffled (same rates, no correlation), as the kernel "
        f"benchmark's random masks. Command: `{meta['command']}` (WIDE_DATA=../shared/data).",
        "",
        "| routers | projection | groups | " + " | ".join(COLS) + " |",
        "|---|---|---|" + "---|" * len(COLS),
    ]
    for name, rep in results.items():
        for kind, label in (("attn", "O"), ("ffn", "down")):
            ng = next(r["groups"] for r in rep["layers"] if r["kind"] == kind)
            vals = " | ".join(f"{rep['mean'][kind][c]:.3f}" for c in COLS)
            lines.append(f"| {name} | {label} | {ng} | {vals} |")
    lines += ["", "![tile occupancy per layer](routing-tiles.png)", ""]
    (OUT / "routing-tiles.md").write_text("\n".join(lines))
    plot(results, OUT / "routing-tiles.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
