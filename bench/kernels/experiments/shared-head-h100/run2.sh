#!/usr/bin/env bash
# Run 2 (the merge): the shared head as rebuilt on main's tree (one program per 32 groups), on one warm GPU: the
# router launch per head schedule at G 32, then the whole GPU suite (scripts/device/decode.sh's TEST_S step).
# The decode table follows in the next call: BENCH_S=470 PROF_S=0 TEST_S=0 BENCH_ARGS="--ffn-group-sizes 128,32"
# bash scripts/device/decode.sh
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
GRID='[{"HEAD_PROGS": 0}, {}, {"HEAD_PROGS": 7, "BLOCK_G": 64}, {"HEAD_PROGS": 4, "BLOCK_G": 128}]'
timeout 110 python3 -m bench.kernels.tune_fused_decode --out "$OUT/router-g32" --budget-s 90 --kernels router \
  --batches 1,16 --ffn-group-size 32 --grid "$GRID" > "$OUT/router-g32.log" 2>&1
python3 - <<'PY' | tee "$OUT/summary.txt"
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/router-g*/fused-tune-h200.json")):
    for r in json.load(open(f))["records"]:
        print(f.split("/")[-2], "B", r["B"], r["tune"], r.get("ms") and round(r["ms"] * 1000, 2), "us", "err_ok",
              r.get("err_ok"))
PY
TEST_S=${TEST_S:-440} BENCH_S=0 PROF_S=0 bash scripts/device/decode.sh
tail -3 "$OUT/gpu-tests-h200.log"
echo "elapsed $SECONDS"
