#!/usr/bin/env bash
# One device call: decode attention's split count from the pairs the mask runs (num_splits=None) against 16 fixed
# splits (the routed rule before), kernel alone and in the decode step, and the fused kernels' / runtime's GPU tests.
set -u
export PYTHONPATH=$PWD/src
LOGS=$OUT/logs.txt
nvidia-smi --query-gpu=name --format=csv,noheader > "$LOGS"
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
# shellcheck disable=SC2086  # $N: zero or two args
WIDE_AUTOTUNE_MAX=1 timeout "${TEST_S:-170}" python3 -m pytest -q -m "not slow" $N -p no:cacheprovider \
  tests/kernels/test_fused_decode.py tests/kernels/test_pdl.py tests/runtime > "$OUT/gpu-tests.log" 2>&1
echo "pytest exit $?" >> "$OUT/gpu-tests.log"
for sk in 0.5 0.7; do
  timeout 75 python3 -m bench.kernels.tune_fused_decode --out "$OUT/attn-skip$sk" --kernels attn --batches 1,2,4,8,12,16 \
    --skip "$sk" --grid '[{}, {"attn_splits": 16}]' --budget-s 60 > /tmp/attn.log 2>&1
  { echo "== attn skip $sk: exit $?"; tail -5 /tmp/attn.log; } >> "$LOGS"
done
timeout "${STEP_S:-200}" python3 -m bench.decode.bench_decode --out "$OUT/step" --batches 1,4,16 --sparsities 0,0.5,0.7 \
  --kind-rates '' --fused-only --no-hf --no-check --fused-tunes "/attn_splits=16" --budget-s $((${STEP_S:-200} - 20)) \
  > /tmp/step.log 2>&1
{ echo "== step: exit $?"; tail -5 /tmp/step.log; } >> "$LOGS"
