#!/usr/bin/env bash
# One device call: the routers beside the K / V launch, Q after the join (router_overlap=2, BESIDE_KV) against beside
# a QKV launch that computes every Q head (1, the rule), row by row in one process (fused decode only, Llama-3.1-8B
# shapes, ctx 4,096, both FFN router inputs, B 1 and 16); then the GPU tests of the fused QKV kernel and runtime
# (the CUDA-graph test runs all three schedules). Everything in $OUT/beside-kv.tar.
export PYTHONPATH=$PWD/src
R=$OUT/beside-kv; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$R/gpu.txt"
timeout "${AB_S:-200}" python3 -m bench.decode.bench_decode --out "$R/ab" --budget-s $((${AB_S:-200} - 25)) --fused-only \
  --no-hf --no-check --sparsities "${SPARS:-0,0.5,0.7}" --batches "${BATCHES:-1,16}" --ffn-router-sources block,layer \
  --kind-rates 0.6:0.41 --fused-tunes "router_overlap=1/router_overlap=2" > "$R/ab.log" 2>&1
python3 bench/results/kernels/experiments/router-overlap/summary.py "$R"/ab | tee "$R/summary.txt"
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
# shellcheck disable=SC2086  # $N: zero or two args
WIDE_AUTOTUNE_MAX=1 timeout "${TEST_S:-150}" python3 -m pytest -q $N -p no:cacheprovider -k "qkv or overlap or launches" \
  tests/kernels/test_fused_decode.py tests/runtime/test_fused_runtime.py > "$R/gpu-tests.log" 2>&1
echo "pytest exit $?" >> "$R/gpu-tests.log"; tail -2 "$R/gpu-tests.log"
tar -cf "$OUT/beside-kv.tar" -C "$OUT" beside-kv
echo "elapsed $SECONDS"
