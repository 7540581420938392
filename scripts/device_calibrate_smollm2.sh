#!/usr/bin/env bash
# The SmolLM2-135M router calibrations quoted in the README (H200): targets 25% and 50%, G_ffn 128,
# 2,000 steps x 16 x 2,048 tokens, calibration only. The two runs share the GPU (run concurrently to
# fit the device budget); each resumes from its latest checkpoint when a call ends early.
# Usage (on the GPU machine, repo root): bash scripts/device_calibrate_smollm2.sh OUT_DIR SECONDS
set -u
source scripts/device_setup.sh
OUT=${1:-/tmp/out}; LIMIT=${2:-540}
RUNS=$HOME/.cache/wide/runs; mkdir -p "$RUNS" "$OUT"
for s in 25 50; do
  r=""; [ -f "$RUNS/s$s/latest" ] && r="--resume"
  timeout "$LIMIT" python3 -m wide.cli calibrate --model smollm2-135m --sparsity 0.$s --ffn-group-size 128 \
    --steps ${STEPS:-2000} --batch-size ${BS:-16} --seq-len ${SEQ:-2048} --save-every 100 --log-every 10 --out "$RUNS/s$s" $r \
    > "$OUT/calibrate_s$s.log" 2>&1 &
done
wait
for s in 25 50; do
  tail -c 3000 "$OUT/calibrate_s$s.log"; cp "$RUNS/s$s/train_log.jsonl" "$OUT/train_log_s$s.jsonl" 2>/dev/null
  if [ -f "$RUNS/s$s/routers.safetensors" ]; then
    tar -cf "$OUT/routers_s$s.tar" -C "$RUNS/s$s" routers.safetensors wide_config.json
  fi
done
ls -la "$OUT"
