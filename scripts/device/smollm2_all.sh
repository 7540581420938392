#!/usr/bin/env bash
# One GPU-machine call (H200) behind the README's SmolLM2-135M numbers:
#  - router calibration at targets 25% and 50% (G_ffn 128, STEPS x 16 x 2,048 tokens, calibration
#    only), the two runs sharing the GPU concurrently;
#  - dense SmolLM2-135M on the seven zero-shot tasks + WikiText-2 (full sets, lm-eval protocol),
#    concurrently with the calibrations (quality only: nothing here is a speed measurement);
#  - WikiText-2 perplexity (full set) dense vs both router checkpoints, with the real sparsity.
# Usage (repo root, after the GGUF part-1 call): bash scripts/device/smollm2_all.sh OUT STEPS
set -u
source scripts/device/setup.sh
OUT=${1:-/tmp/out}; STEPS=${2:-600}
R=$HOME/.cache/wide/runs; mkdir -p "$R" "$OUT"
start=$(date +%s)
for s in 25 50; do
  r=""; [ -f "$R/s$s/latest" ] && r="--resume"   # a warm machine keeps $R: continue a cut-short run
  python3 -m wide.cli calibrate $r --model smollm2-135m --sparsity 0.$s --ffn-group-size 128 \
    --steps "$STEPS" --batch-size 16 --seq-len 2048 --save-every 100 --log-every 10 --out "$R/s$s" \
    > "$R/calibrate_s$s.log" 2>&1 &
done
SKIP_WHEELS=1 timeout 480 bash scripts/device/eval_dense.sh "$R/dense_eval" > "$R/dense_eval.log" 2>&1 &
wait
echo "calibrations + dense eval: $(( $(date +%s) - start )) s"
python3 -m wide.cli eval --model smollm2-135m --routers "$R/s25" "$R/s50" --tasks wikitext \
  --max-length 2048 --batch-size 16 --out "$R/wide_ppl" > "$R/wide_ppl.log" 2>&1
echo "total: $(( $(date +%s) - start )) s"
tail -n 3 "$R"/calibrate_s*.log | tr '\r' '\n' | tail -n 12
cat "$R/wide_ppl.md" "$R/dense_eval/dense.md" 2>/dev/null
tar -cf "$OUT/smollm2_results.tar" -C "$R" --exclude='checkpoint-*' --exclude='latest' .
ls -la "$OUT"
