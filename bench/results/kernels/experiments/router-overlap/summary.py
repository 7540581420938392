"""TPOT per (B, FFN router input, level) for each decode-<card>.json folder given, and against its own run's dense."""

import json
import sys
from pathlib import Path

runs = {Path(d).name: json.loads(next(Path(d).glob("decode-*.json")).read_text())["records"] for d in sys.argv[1:]}
keys: dict = {}
for name, recs in runs.items():
    dense = {r["B"]: r["tpot_ms"] for r in recs if r["variant"] == "dense" and r.get("tpot_ms")}
    for r in recs:
        if r.get("tpot_ms") is None or r["variant"] not in ("dense", "wide"):
            continue
        tune = ",".join(f"{a}={v}" for a, v in (r.get("fused_tune") or {}).items())
        k = (r["B"], r["variant"], r.get("ffn_group_size"), r.get("ffn_router_source"), str(r["sparsity"]), tune)
        keys.setdefault(k, {})[name] = f"{r['tpot_ms']:.3f} ms ({dense[r['B']] / r['tpot_ms']:.3f}x)"
print("B variant G source level tune | " + " | ".join(runs))
for k in sorted(keys, key=str):
    print(*k, "|", " | ".join(keys[k].get(n, "-") for n in runs))
