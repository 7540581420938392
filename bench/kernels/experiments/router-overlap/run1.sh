#!/usr/bin/env bash
# Run 1: the routers on a side stream beside a QKV launch that computes every Q head (router_overlap=1, the candidate
# rule) against the routers before QKV (router_overlap=0, the rule), measured row by row in one process (fused
# decode only, Llama-3.1-8B shapes, ctx 4,096, both FFN router inputs); then the GPU tests of the fused runtime
# (TESTS=all: the whole GPU suite, kernels + runtime, as decode.sh's TEST_S step).
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${AB_S:-175}" python3 -m bench.decode.bench_decode --out "$OUT/ab" --budget-s $((${AB_S:-175} - 25)) --fused-only \
  --no-hf --no-check --sparsities "${SPARS:-0,0.5,0.7}" --batches "${BATCHES:-1,16}" --ffn-router-sources block,layer \
  --fused-tunes "router_overlap=0/router_overlap=1" > "$OUT/ab.log" 2>&1
python3 bench/results/kernels/experiments/router-overlap/summary.py "$OUT"/ab | tee "$OUT/summary.txt"
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
sel=(-m "gpu and not slow" tests/runtime/test_fused_runtime.py)
[ "${TESTS:-}" = all ] && sel=(-m "not slow" tests/kernels tests/runtime)
# shellcheck disable=SC2086  # $N: zero or two args
if [ "${TEST_S:-60}" != 0 ]; then  # TEST_S=0: no tests
  WIDE_AUTOTUNE_MAX=1 timeout "${TEST_S:-60}" python3 -m pytest -q $N -p no:cacheprovider "${sel[@]}" > "$OUT/gpu-tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/gpu-tests.log"; tail -2 "$OUT/gpu-tests.log"
fi
mv "$OUT"/ab/decode-*.json "$OUT"/ab.json; mv "$OUT"/ab/decode-*.md "$OUT"/ab.md; rmdir "$OUT"/ab
echo "elapsed $SECONDS"
