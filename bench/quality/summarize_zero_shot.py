"""The README's zero-shot table: the dense row (bench/results/quality/smollm2/dense.json) and the routed rows
(routed.json, from scripts/device/eval_routed.sh) merged, retention recomputed against dense.
Both files must share the protocol (tasks, max length, dtype, batch size); the script checks it.
Usage: python -m bench.quality.summarize_zero_shot  -> bench/results/quality/smollm2/zero_shot.{json,md}
"""

from __future__ import annotations

import json
from pathlib import Path

from wide.eval.runner import summarise, to_markdown

RES = Path(__file__).resolve().parents[2] / "bench" / "results" / "quality" / "smollm2"
PROTOCOL = ("limit", "batch_size", "max_length", "ppl_max_length", "dtype", "softmax_dtype", "num_fewshot")


def main() -> None:
    dense = json.loads((RES / "dense.json").read_text())
    routed = json.loads((RES / "routed.json").read_text())
    for key in PROTOCOL:
        if dense["settings"].get(key) != routed["settings"].get(key):
            a, b = dense["settings"].get(key), routed["settings"].get(key)
            raise SystemExit(f"protocol differs on {key}: {a} vs {b}")
    if dense["tasks"] != routed["tasks"]:
        raise SystemExit("task lists differ")
    merged = dict(dense, rows={"dense": dense["rows"]["dense"], **routed["rows"]})
    merged["sources"] = {"dense": "dense.json", "routed": "routed.json"}
    summarise(merged)
    # BoolQ sits near chance for small models and moves with routing: also report the average without it
    others = [t for t in merged["tasks"] if t != "boolq"]
    base = None
    for name, row in merged["rows"].items():
        row["avg_without_boolq"] = sum(row["tasks"][t]["score"] for t in others) / len(others)
        base = row["avg_without_boolq"] if name == "dense" else base
        row["retention_without_boolq"] = row["avg_without_boolq"] / base
    merged["markdown"] = to_markdown(merged)
    (RES / "zero_shot.json").write_text(json.dumps(merged, indent=2, default=str) + "\n")
    (RES / "zero_shot.md").write_text(merged["markdown"])
    print(merged["markdown"])
    for name, row in merged["rows"].items():
        avg, ret = 100 * row["avg_without_boolq"], 100 * row["retention_without_boolq"]
        print(f"{name}: avg without BoolQ {avg:.2f} ({ret:.2f}%)")


if __name__ == "__main__":
    main()
