#!/usr/bin/env bash
# One device call after run 1: the fused kernels' and runtime's GPU tests on the kept tree, then the attention
# alone at small batches (the key step a routed launch expects: half its pairs running), the rule against 16 fixed
# splits.
set -u
export PYTHONPATH=$PWD/src
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
# shellcheck disable=SC2086  # $N: zero or two args; $TESTS: test paths
WIDE_AUTOTUNE_MAX=1 timeout "${TEST_S:-150}" python3 -m pytest -q -m "not slow" $N -p no:cacheprovider \
  ${TESTS:-tests/kernels/test_fused_decode.py tests/kernels/test_pdl.py tests/runtime} > "$OUT/gpu-tests.log" 2>&1
echo "pytest exit $?" >> "$OUT/gpu-tests.log"
timeout "${TUNE_S:-50}" python3 -m bench.kernels.tune_fused_decode --out "$OUT/attn-small" --kernels attn --batches 1,2,3,4 \
  --skip 0.5 --grid '[{}, {"attn_splits": 16}]' --budget-s $((${TUNE_S:-50} - 10)) > /tmp/attn.log 2>&1
{ nvidia-smi --query-gpu=name --format=csv,noheader; echo "== attn small: exit $?"; tail -3 /tmp/attn.log; } \
  > "$OUT/logs.txt"
