#!/usr/bin/env bash
# The fused FFN launch at G 32 whose tokens skip or run adjacent groups together (--skip-run N: the skip
# pattern of 32 N-channel groups on the 32-channel kernel), against G 128, 50% skipped, B 1 and 16.
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
tune() {  # $1 name  $2 group size  $3 skip-run  $4 skip
  timeout 60 python3 -m bench.kernels.tune_fused_decode --out $OUT/$1 --budget-s 45 --kernels ffn --batches 1,16 \
    --ffn-group-size $2 --skip $4 --skip-run $3 --grid '[{}]' > $OUT/tune-$1.log 2>&1
}
tune g128 128 1 0.5; tune g32-run1 32 1 0.5; tune g32-run2 32 2 0.5; tune g32-run4 32 4 0.5
tune g32-run1-s70 32 1 0.7; tune g32-run4-s70 32 4 0.7; tune g128-s70 128 1 0.7
echo "elapsed $SECONDS"
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*/fused-tune-h200.json")):
    for r in json.load(open(f))["records"]:
        if r.get("ms"):
            print(f.split("/")[-2], r["B"], r["routed"], r.get("skip_run"), round(r["ms"] * 1000, 1), "us",
                  r.get("err_ok"), r.get("cublas_ms") and round(r["cublas_ms"] * 1000, 1))
PY
