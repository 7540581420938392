#!/usr/bin/env bash
# One device call: do the fused FFN's and O's launch shapes, chosen at 50%, still fit when more groups are skipped?
# B 1, Llama-3.1-8B layer shapes, random masks (bench/kernels/tune_fused_decode.py --skip), then the fused step's profile at
# 70%. Run from the repository root with $OUT set; everything lands in $OUT/sparse-shapes.tar.
set -u
export PYTHONPATH=$PWD/src
R=$OUT/sparse-shapes; mkdir -p "$R"
git log -1 --format='%h %s' > "$R/commit.txt" 2>/dev/null || true
FFN='[{}, {"ffn_chunk": 16}, {"ffn_chunk": 16, "ffn_splits": 4}, {"ffn_chunk": 16, "ffn_splits": 8},
 {"ffn_chunk": 32, "ffn_splits": 4}, {"ffn_chunk": 32, "ffn_splits": 8}, {"ffn_chunk": 16, "ffn_splits": 4, "ffn_block_n": 32},
 {"ffn_chunk": 16, "ffn_splits": 8, "ffn_block_n": 32}]'
for s in 0.5 0.7 0.85; do
  timeout 110 python3 -m bench.kernels.tune_fused_decode --out "$R/ffn-$s" --kernels ffn --batches 1 --skip $s \
    --grid "$FFN" --budget-s 100 > "$R/ffn-$s.log" 2>&1
done
timeout 80 python3 -m bench.kernels.tune_fused_decode --out "$R/o-0.7" --kernels o,qkv --batches 1 --skip 0.7 --budget-s 70 \
  > "$R/o-0.7.log" 2>&1
WIDE_FUSED=1 PROFILE_CALLS=decode timeout 90 python3 -m bench.profile.profile_e2e "$R" 4096 0.7 > /dev/null 2>&1
tar -cf "$OUT/sparse-shapes.tar" -C "$OUT" sparse-shapes
