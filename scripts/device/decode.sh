#!/usr/bin/env bash
# One device call for the fused decode layer, each step with its own time limit in seconds (0 skips it):
#   BENCH_S  bench/decode/bench_decode.py: TPOT dense / WIDE, fused / unfused, B 1 and 16 -> decode-CARD.{json,md}
#   PROF_S   scripts/profile_e2e.py on the fused step (B 1, ctx 4,096, 50%)         -> profile_e2e.txt
#   TUNE_S   scripts/tune_fused_decode.py: per-kernel launch-shape sweep (KERNELS, TUNE_BATCHES; TUNE_GRID: a JSON
#            list of overrides instead of each kernel's grid)                       -> fused-tune-CARD.{json,md}
#   ATTN_S   scripts/bench_attention_decode.py: routed decode attention vs SDPA     -> attn-decode-CARD.*
#   NCU_S    Nsight Compute on one call of each NCU_KERNELS case at B 1, dense and routed (tune_fused_decode.py
#            --once; speed of light, memory, occupancy, warp stalls; needs a runtime whose ncu reads counters)
#                                                                                    -> ncu-CARD.txt
#   TEST_S   the GPU test suite (kernels + runtime)                                 -> gpu-tests-CARD.log
# CARD: h100, h200, ... (the GPU's name, wide.bench.timing.card_tag).
# At most 8 files come back from $OUT: the defaults (bench, profile, tests) leave 4.
set -u
# Benchmarks tune every config of the unfused path's autotuned kernels, as a user's run does; only the tests take
# the first config of each list (WIDE_AUTOTUNE_MAX=1: compiling dominates them).
export PYTHONPATH=$PWD/src
CARD=$(python3 -c "from wide.bench.timing import card_tag; print(card_tag())")
BENCH_S=${BENCH_S:-200}; PROF_S=${PROF_S:-90}; TUNE_S=${TUNE_S:-0}; ATTN_S=${ATTN_S:-0}; TEST_S=${TEST_S:-300}
NCU_S=${NCU_S:-0}
git log -1 --format='%h %s' > "$OUT/commit.txt" 2>/dev/null || true
if [ "$BENCH_S" != 0 ]; then
  timeout "$BENCH_S" python3 -m bench.decode.bench_decode --out "$OUT" --budget-s $((BENCH_S - 60)) ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
fi
if [ "$PROF_S" != 0 ]; then
  WIDE_FUSED=1 PROFILE_CALLS=decode timeout "$PROF_S" python3 scripts/profile_e2e.py "$OUT" 4096 0.5 >/dev/null 2>&1
fi
if [ "$TUNE_S" != 0 ]; then
  grid=(); [ -z "${TUNE_GRID:-}" ] || grid=(--grid "$TUNE_GRID")
  # shellcheck disable=SC2086  # TUNE_ARGS: zero or more args (e.g. --once)
  timeout "$TUNE_S" python3 scripts/tune_fused_decode.py --out "$OUT" --budget-s $((TUNE_S - 30)) \
    --kernels "${KERNELS:-qkv,attn,o,ffn,router}" --batches "${TUNE_BATCHES:-1,16}" "${grid[@]}" ${TUNE_ARGS:-} \
    > "$OUT/tune.log" 2>&1
fi
if [ "$ATTN_S" != 0 ]; then
  timeout "$ATTN_S" python3 scripts/bench_attention_decode.py --out "$OUT" > "$OUT/attn.log" 2>&1
fi
if [ "$NCU_S" != 0 ]; then
  timeout "$NCU_S" ncu --clock-control none -k "regex:_ffn_kernel|_o_kernel" --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
    python3 scripts/tune_fused_decode.py --once --kernels "${NCU_KERNELS:-ffn,down}" --batches 1 --grid '[{}]' \
    --out /tmp > "$OUT/ncu-$CARD.txt" 2>&1
fi
if [ "$TEST_S" != 0 ]; then
  N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
  # shellcheck disable=SC2086  # $N: zero or two args
  WIDE_AUTOTUNE_MAX=1 timeout "$TEST_S" python3 -m pytest -q -m "not slow" $N -p no:cacheprovider tests/kernels \
    tests/runtime \
    > "$OUT/gpu-tests-$CARD.log" 2>&1
  echo "pytest exit $?" >> "$OUT/gpu-tests-$CARD.log"
fi
