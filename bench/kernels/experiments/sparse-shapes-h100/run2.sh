#!/usr/bin/env bash
# One device call: the fused FFN with its consumers' K lists built before they wait for the producers, against
# run.sh's numbers (the tree before it): FFN and down alone at B 1, the rule's shape and chunk 32 x 4 splits, at 50 / 70 /
# 85% skipped; the fused-decode kernel and runtime tests; then a B 1 fused decode table. Everything in
# $OUT/run2.tar.
set -u
export PYTHONPATH=$PWD/src
R=$OUT/run2; mkdir -p "$R"
git log -1 --format='%h %s' > "$R/commit.txt" 2>/dev/null || true
for s in 0.5 0.7 0.85; do
  timeout 60 python3 -m bench.kernels.tune_fused_decode --out "$R/ffn-$s" --kernels ffn,down --batches 1 --skip $s \
    --grid '[{}, {"ffn_chunk": 32, "ffn_splits": 4}]' --budget-s 50 > "$R/ffn-$s.log" 2>&1
done
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
# shellcheck disable=SC2086  # $N: zero or two args
WIDE_AUTOTUNE_MAX=1 timeout 200 python3 -m pytest -q $N -p no:cacheprovider tests/kernels/test_fused_decode.py \
  tests/runtime/test_fused_runtime.py > "$R/gpu-tests.log" 2>&1
echo "pytest exit $?" >> "$R/gpu-tests.log"
timeout 170 python3 -m bench.decode.bench_decode --out "$R" --batches 1 --sparsities 0,0.5,0.7 --kind-rates '' --no-hf \
  --fused-only --no-check --budget-s 150 > "$R/bench.log" 2>&1
tar -cf "$OUT/run2.tar" -C "$OUT" run2
