#!/usr/bin/env bash
# One device call: the fused decode GEMV sweep (scripts/tune_fused_decode.py), routed decode attention vs
# SDPA (scripts/bench_attention_decode.py), then the GPU test suite (kernels + runtime). Each step has its
# own time limit (TUNE_S, ATTN_S, TEST_S seconds; 0 skips). Records land in $OUT.
set -u
export PYTHONPATH=$PWD/src WIDE_AUTOTUNE_MAX=1
TUNE_S=${TUNE_S:-230}; ATTN_S=${ATTN_S:-90}; TEST_S=${TEST_S:-240}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.txt" 2>&1
if [ "$TUNE_S" != 0 ]; then
  timeout "$TUNE_S" python3 scripts/tune_fused_decode.py --out "$OUT" --budget-s $((TUNE_S - 30)) > "$OUT/tune.log" 2>&1
fi
if [ "$ATTN_S" != 0 ]; then
  timeout "$ATTN_S" python3 scripts/bench_attention_decode.py --out "$OUT" > "$OUT/attn.log" 2>&1
fi
if [ "$TEST_S" != 0 ]; then
  N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
  timeout "$TEST_S" python3 -m pytest -q -m "not slow" $N -p no:cacheprovider tests/kernels tests/runtime \
    > "$OUT/gpu-tests-h200.log" 2>&1
  echo "pytest exit $?" >> "$OUT/gpu-tests-h200.log"
fi
