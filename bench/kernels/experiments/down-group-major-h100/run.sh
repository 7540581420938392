#!/usr/bin/env bash
# The fused FFN launch reading W_down group-major ([D'/G, D, G]: each group's columns one contiguous block) against
# the model's row-major [D, D'], G 32 and G 128, 50% / 70% skipped, B 1 and 16; the FFN kernel tests first.
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
WIDE_AUTOTUNE_MAX=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_decode.py -k ffn \
  > $OUT/ffn-tests.log 2>&1; echo "pytest exit $?" >> $OUT/ffn-tests.log; tail -2 $OUT/ffn-tests.log
tune() {  # $1 layout  $2 group size  $3 skip  $4 run label
  timeout 60 python3 -m bench.kernels.tune_fused_decode --out $OUT/$1-g$2-s$3${4:-} --budget-s 45 --kernels ffn --batches 1,16 \
    --ffn-group-size $2 --skip $3 --down-layout $1 --grid '[{}]' > /dev/null 2>&1
}
for s in 0.5 0.7; do for l in row group; do tune $l 32 $s; done; done
tune row 128 0.5; tune group 128 0.5; tune row 32 0.5 -b; tune group 32 0.5 -b  # repeats: the spread between runs
echo "elapsed $SECONDS"
python3 - <<'PY' | tee $OUT/summary.txt
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*/fused-tune-h200.json"), key=os.path.getmtime):
    for r in json.load(open(f))["records"]:
        if r.get("ms"):
            print(f.split("/")[-2], "B", r["B"], "routed" if r["routed"] else "dense", round(r["ms"] * 1000, 1), "us",
                  "err_ok", r.get("err_ok"), "cublas", r.get("cublas_ms") and round(r["cublas_ms"] * 1000, 1))
PY
