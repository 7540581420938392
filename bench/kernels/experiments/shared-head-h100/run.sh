#!/usr/bin/env bash
# The router's margin head shared by several programs (this tree) against the last split running it alone
# (ab/old_router.py: `git show main:src/wide/kernels/router.py`), on one warm GPU: GPU router + fused decode tests, the router launch
# per head schedule, then the fused decode step end to end with each file.
export PYTHONPATH=$PWD/src
TOTAL=${TOTAL:-400}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
WIDE_AUTOTUNE_MAX=1 timeout 150 python3 -m pytest -q $N -p no:cacheprovider tests/kernels/test_router.py \
  tests/kernels/test_fused_decode.py > $OUT/tests.log 2>&1; echo "pytest exit $?" >> $OUT/tests.log; tail -2 $OUT/tests.log
GRID='[{"HEAD_PROGS": 0}, {}, {"HEAD_PROGS": 2}, {"HEAD_PROGS": 7, "BLOCK_G": 64}, {"HEAD_PROGS": 14, "BLOCK_G": 32}]'
for g in 32 128; do
  timeout 90 python3 -m bench.kernels.tune_fused_decode --out $OUT/router-g$g --budget-s 75 --kernels router \
    --batches 1,16 --ffn-group-size $g --grid "$GRID" > $OUT/router-g$g.log 2>&1
done
cp src/wide/kernels/router.py /tmp/new.py; cp ab/old_router.py /tmp/old.py
for v in old new old new; do
  [ "$v" = new ] || [ "$SECONDS" -lt $((TOTAL - 150)) ] || break  # a pair, or nothing
  cp /tmp/$v.py src/wide/kernels/router.py
  timeout 70 python3 -m bench.decode.bench_decode --out $OUT/e2e-$v --fused-only --batches 1 --sparsities 0,0.5 \
    --ffn-group-sizes 32 --no-hf --budget-s 60 >> $OUT/e2e-$v.log 2>&1
done
cp /tmp/new.py src/wide/kernels/router.py
echo "elapsed $SECONDS"
python3 - <<'PY' | tee $OUT/summary.txt
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/router-g*/fused-tune-h200.json")):
    for r in json.load(open(f))["records"]:
        print(f.split("/")[-2], "B", r["B"], r["tune"], r.get("ms") and round(r["ms"] * 1000, 2), "us", "err_ok",
              r.get("err_ok"))
PY
grep -h "tpot" $OUT/e2e-*.log | cut -c1-220
