#!/usr/bin/env bash
# Re-fit the argmax thresholds of the shipped SmolLM2 routers with the per-kind fit (attention / FFN
# offsets; see wide.train.threshold_fit and bench/results/smollm2/fit_modes_cpu.md), then score the full
# WikiText-2 test set dense vs both checkpoints. CPU, fp32. Usage: WIDE_DATA=../shared/data bash scripts/refit_shipped_cpu.sh
set -euo pipefail
for s in 25 50; do
  wide refit --routers src/wide/checkpoints/smollm2-135m-s$s --mode kind --batches 4 --batch-size 8 --device cpu
done
wide eval --routers smollm2-135m-s25 smollm2-135m-s50 --tasks wikitext \
  --max-length 2048 --batch-size 4 --dtype fp32 --device cpu --no-lm-eval-check \
  --out bench/results/smollm2/wide_ppl_cpu_kindfit
