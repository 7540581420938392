#!/usr/bin/env bash
# The routed rows of the README's zero-shot table (H200): the shipped SmolLM2 routers on the seven
# tasks and WikiText-2, full sets, lm-eval protocol (bf16, batch 64, max length 4096). The dense row is
# bench/results/quality/smollm2/dense.json (same protocol); DENSE=1 re-runs it here. Results are rewritten
# after every row, so a run cut short keeps the rows it finished.
# Usage (repo root), calls in a row on one warm machine (each carry stays under 64 MiB with the tree): one
# per GGUF part (.device-carry/smol.part.*, gguf_parts.sh) running `source scripts/device/setup.sh`; then
# carry data.tar.xz + evalwhl and run: bash scripts/device/eval_routed.sh OUT
set -u
source scripts/device/setup.sh
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
start=$(date +%s)
# ROUTERS="DIR DIR": other checkpoints than the shipped four (e.g. LoRA rows fetched from a quality run)
# shellcheck disable=SC2086  # ROUTERS: one or more names or directories
python3 -m wide.cli eval --model smollm2-135m \
  --routers ${ROUTERS:-smollm2-135m-s25 smollm2-135m-s25-lora smollm2-135m-s50 smollm2-135m-s50-lora} --tasks all \
  --dtype bf16 --batch-size 64 --max-length 4096 --no-lm-eval-check $([ "${DENSE:-0}" = 1 ] || echo --no-dense) \
  --out "$OUT/routed" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -20
echo "wall $(( $(date +%s) - start )) s" | tee "$OUT/routed_wall.txt"
