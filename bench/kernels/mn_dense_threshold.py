"""Where the sorted GEMM-MN starts to beat cuBLAS: both paths forced, timed together with the dense
baseline as the kernel bench times them (``wide.bench.gemm_bench.bench_op``), over low sparsities, for
the group sizes ``wide.kernels.mn_dense_below`` has a threshold for (Q G 512, gate/up G 128 / 64 / 32).
Usage (GPU): python3 -m bench.kernels.mn_dense_threshold OUT_DIR  -> OUT_DIR/mn-dense-threshold-h200.json"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from wide.bench import gemm_bench
from wide.kernels import mn_dense_below

OPS = [  # name, kind, N, K, G, route timed
    ("q", "gemm_mn", 4096, 4096, 512, True),
    ("gate_up", "gemm_mn_swiglu", 14336, 4096, 128, True),
    ("gate_up", "gemm_mn_swiglu", 14336, 4096, 64, True),
    ("gate_up", "gemm_mn_swiglu", 14336, 4096, 32, True),
]
SPARSITIES = {512: [0.05, 0.1, 0.15, 0.2], 128: [0.05, 0.1, 0.15, 0.2], 64: [0.1, 0.2, 0.3], 32: [0.3, 0.4, 0.5]}


def crossover(recs: list[dict], g: int, m: int) -> float | None:
    """The lowest measured sparsity from which 'sorted' is at least as fast as 'dense' at every higher one."""
    by_sp: dict[float, dict[str, float]] = {}
    for r in recs:
        if r["group_size"] == g and r["M"] == m:
            by_sp.setdefault(r["sparsity"], {})[r["variant"]] = r["wide_ms"]
    wins = [sp for sp, t in sorted(by_sp.items()) if t.get("sorted", 9e9) <= t.get("dense", 0.0)]
    levels = sorted(by_sp)
    for i, sp in enumerate(levels):
        if all(s in wins for s in levels[i:]):
            return sp
    return None


def main(out: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    recs, t0 = [], time.time()
    for name, kind, n, k, g, routed in OPS:
        recs += gemm_bench.bench_op(
            name, kind, n, k, g, routed, [1024, 4096, 16384], SPARSITIES[g], gen, variants=["dense", "sorted"]
        )
        print(f"[threshold] {name} G{g}: {time.time() - t0:.0f}s", flush=True)
    summary = [
        {"group_size": g, "M": m, "sorted_wins_from": crossover(recs, g, m), "mn_dense_below": mn_dense_below(g, m)}
        for *_, g, _ in OPS
        for m in (1024, 4096, 16384)
    ]
    for s in summary:
        print(s)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    Path(out).mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "summary": summary, "records": recs}
    (Path(out) / "mn-dense-threshold-h200.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
