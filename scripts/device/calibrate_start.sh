#!/usr/bin/env bash
# Device call 1 of the 2,000-step SmolLM2-135M router calibrations (targets 25% and 50%, G_ffn 128,
# 16 x 2,048 tokens a step, --compile), both runs sharing the H200: launches them detached (setsid, so
# they run on after this call while the machine stays warm), resuming any run that has a checkpoint
# here (warm machine) or carried in .device-carry (fresh machine; see calibrate_lib.sh); relaunches
# once without --compile a run that dies under --compile before its first checkpoint; returns after
# DEADLINE_S (default 540) s or when both runs finished, with each run's newest complete checkpoint in
# $OUT/calib_sNN.tar, the logs and progress.txt. Then, within ~30 s (before the machine goes back):
# calibrate_finish.sh.
# Usage (repo root; carry .device-carry/smol.part.ab, whl, data.tar.xz after the part-1 call):
#   bash scripts/device/calibrate_start.sh OUT [STEPS]
# CPU smoke test: STEPS=4 BATCH=1 SEQ=64 SAVE_EVERY=2 DEADLINE_S=300 WIDE_DATA=../shared/data bash ... /tmp/o1
# Exit: 0 (runs going or finished), 4 model or data missing, 5 a run stopped unfinished.
set -u
T0=$(date +%s)
OUT=${1:-/tmp/out}
STEPS=${2:-${STEPS:-2000}}
source scripts/device/calibrate_lib.sh
DEADLINE_S=${DEADLINE_S:-540}

for s in $SPARSITIES; do restore "$s"; done
if inputs_ready; then
  start_missing
  monitor "$DEADLINE_S"
  for s in $SPARSITIES; do finished "$s" || alive "$s" || rc=5; done # 5: a run stopped unfinished
else
  rc=4
fi
echo "after $(elapsed) s:"
report | tee "$OUT/progress.txt"
for s in $SPARSITIES; do
  snapshot "$s"
  cp "$R/calibrate_s$s.log" "$OUT/" 2>/dev/null
  cat "$R/s$s/compile_fallback.txt" 2>/dev/null | tee -a "$OUT/progress.txt"
done
tail_logs
ls -la "$OUT"
exit "${rc:-0}"
