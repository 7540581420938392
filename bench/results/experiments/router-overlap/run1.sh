#!/usr/bin/env bash
# Run 1: the routers on a side stream beside a QKV launch that computes every Q head (router_overlap=1, the new
# rule on the GPU) against the routers before QKV (router_overlap=0), fused decode only, Llama-3.1-8B shapes,
# ctx 4,096, both FFN router inputs; then the GPU suite (kernels + runtime) with the new tests.
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
ab() {  # $1: folder, $2: router_overlap
  timeout 150 python3 scripts/bench_decode.py --out "$OUT/$1" --budget-s 125 --fused-only --no-hf \
    --sparsities 0,0.5,0.7 --ffn-router-sources block,layer --tune "router_overlap=$2" > "$OUT/$1.log" 2>&1
}
ab overlap0 0
ab overlap1 1
python3 bench/results/experiments/router-overlap/summary.py "$OUT"/overlap0 "$OUT"/overlap1 | tee "$OUT/summary.txt"
TEST_S=${TEST_S:-300} BENCH_S=0 PROF_S=0 bash scripts/device/decode.sh
tail -2 "$OUT/gpu-tests-h200.log"
tar czf "$OUT/runs.tgz" -C "$OUT" overlap0 overlap1 overlap0.log overlap1.log && rm -rf "$OUT"/overlap[01]*
echo "elapsed $SECONDS"
