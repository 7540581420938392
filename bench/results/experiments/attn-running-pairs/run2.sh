#!/usr/bin/env bash
# One device call after run 1: the whole GPU suite on the kept tree, then the attention alone at small batches
# (the key step a routed launch expects: half its pairs running), the rule against 16 fixed splits.
set -u
export PYTHONPATH=$PWD/src
TEST_S=${TEST_S:-240} BENCH_S=0 PROF_S=0 bash scripts/device/decode.sh
timeout "${TUNE_S:-50}" python3 scripts/tune_fused_decode.py --out "$OUT/attn-small" --kernels attn --batches 1,2,3,4 \
  --skip 0.5 --grid '[{}, {"attn_splits": 16}]' --budget-s $((${TUNE_S:-50} - 10)) > /tmp/attn.log 2>&1
{ nvidia-smi --query-gpu=name --format=csv,noheader; echo "== attn small: exit $?"; tail -3 /tmp/attn.log; } \
  > "$OUT/logs.txt"
