#!/usr/bin/env bash
# The router launch at decode (B 1 and 16, Llama-3.1-8B shapes) with its split schedule (the rule: 8 programs a row
# block, the last to arrive sums and runs the head) against the serial schedule (one program runs the 8 splits in
# turn, then the head: the same bits) -- what one program would add to a kernel's tail if it decided the router.
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
GRID='[{}, {"SERIAL": 1}, {"SERIAL": 1, "num_stages": 4}, {"SERIAL": 1, "num_stages": 6}, {"SERIAL": 1, "BLOCK_D": 256}, {"SERIAL": 1, "num_warps": 8}]'
for g in 128 32; do
  timeout 100 python3 -m bench.kernels.tune_fused_decode --out $OUT/g$g --budget-s 85 --kernels router --batches 1,16 \
    --ffn-group-size $g --grid "$GRID" > $OUT/tune-g$g.log 2>&1
done
echo "elapsed $SECONDS"
python3 - <<'PY' | tee $OUT/summary.txt
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*/fused-tune-h200.json")):
    for r in json.load(open(f))["records"]:
        print(f.split("/")[-2], "B", r["B"], r["tune"], r.get("ms") and round(r["ms"] * 1000, 2), "us", "err_ok",
              r.get("err_ok"), "cublas", r.get("cublas_ms") and round(r["cublas_ms"] * 1000, 2))
PY
