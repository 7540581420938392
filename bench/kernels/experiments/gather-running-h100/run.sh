#!/usr/bin/env bash
# A/B of the down loop's gathered groups (this tree) against main's adjacent-group steps (ab/old_fused_decode.py).
# TOTAL: the call's seconds; the later parts run only while they fit.
export PYTHONPATH=$PWD/src
TOTAL=${TOTAL:-300}
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
WIDE_AUTOTUNE_MAX=1 timeout 120 python3 -m pytest -q $N -p no:cacheprovider tests/kernels/test_fused_decode.py \
  > $OUT/fused-tests.log 2>&1; echo "pytest exit $?" >> $OUT/fused-tests.log; tail -2 $OUT/fused-tests.log
cp src/wide/kernels/fused_decode.py /tmp/new.py
tune() {  # $1 new|old  $2 skip  $3 grid
  cp /tmp/$1.py src/wide/kernels/fused_decode.py
  timeout 45 python3 -m bench.kernels.tune_fused_decode --out $OUT/$1-$2 --budget-s 35 --kernels ffn --batches 1,16 \
    --ffn-group-size 32 --skip $2 --grid "$3" > $OUT/tune-$1-$2.log 2>&1
}
cp ab/old_fused_decode.py /tmp/old.py
GRID='[{}, {"down_span": 256}, {"down_span": 512}]'
tune new 0.5 "$GRID"; tune old 0.5 '[{}]'
[ "$SECONDS" -lt $((TOTAL - 95)) ] && { tune new 0.41 "$GRID"; tune old 0.41 '[{}]'; }
for v in old new; do
  [ "$SECONDS" -lt $((TOTAL - 80)) ] || break
  cp /tmp/$v.py src/wide/kernels/fused_decode.py
  timeout 75 python3 -m bench.decode.bench_decode --out $OUT/e2e-$v --fused-only --batches 1 --sparsities 0.5 \
    --ffn-group-sizes 32 --no-hf --budget-s 65 > $OUT/e2e-$v.log 2>&1
done
echo "elapsed $SECONDS"
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*/fused-tune-h200.json")):
    for r in json.load(open(f))["records"]:
        if r.get("ms"):
            print(f.split("/")[-2], r["B"], r["routed"], r.get("tune"), round(r["ms"] * 1000, 1), "us", r.get("err_ok"))
PY
grep -h "tpot" $OUT/e2e-*.log | cut -c1-200
