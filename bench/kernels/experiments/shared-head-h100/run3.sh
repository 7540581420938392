#!/usr/bin/env bash
# Run 3: the GPU suite after run 2's one failure (test_shared_head_rule_and_bad_settings built its
# inputs on the CPU, so on a GPU machine the kernel refused them before the check under test), and the head step
# again at G 32 (32 vs 64 groups a program, alternating, as run 1 and run 2 ordered them differently).
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu3.txt"
# The whole GPU suite (kernels + runtime), not only the router's file: ff40157's host-side changes ran on the CPU only.
TEST_S=330 BENCH_S=0 PROF_S=0 bash scripts/device/decode.sh; tail -2 "$OUT/gpu-tests-h200.log"
GRID='[{"HEAD_PROGS": 0}, {}, {"HEAD_PROGS": 7, "BLOCK_G": 64}, {}, {"HEAD_PROGS": 7, "BLOCK_G": 64}, {"HEAD_PROGS": 0}]'
timeout 120 python3 -m bench.kernels.tune_fused_decode --out "$OUT/router3-g32" --budget-s 100 --kernels router \
  --batches 1,16 --ffn-group-size 32 --grid "$GRID" > "$OUT/router3-g32.log" 2>&1
python3 - <<'PY' | tee "$OUT/summary3.txt"
import json, os
for r in json.load(open(os.environ["OUT"] + "/router3-g32/fused-tune-h200.json"))["records"]:
    print("B", r["B"], r["tune"], r.get("ms") and round(r["ms"] * 1000, 2), "us", "err_ok", r.get("err_ok"))
PY
echo "elapsed $SECONDS"
