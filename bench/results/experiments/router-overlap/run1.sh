#!/usr/bin/env bash
# Run 1: the routers on a side stream beside a QKV launch that computes every Q head (router_overlap=1, the new
# rule on the GPU) against the routers before QKV (router_overlap=0), fused decode only, Llama-3.1-8B shapes,
# ctx 4,096, both FFN router inputs; then the GPU tests of the runtime, the fused kernels and the router.
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
ab() {  # $1: folder, $2: router_overlap
  timeout "${AB_S:-130}" python3 scripts/bench_decode.py --out "$OUT/$1" --budget-s $((${AB_S:-130} - 25)) --fused-only --no-hf \
    --sparsities 0,0.5,0.7 --ffn-router-sources block,layer --tune "router_overlap=$2" > "$OUT/$1.log" 2>&1
}
ab overlap0 0
ab overlap1 1
python3 bench/results/experiments/router-overlap/summary.py "$OUT"/overlap0 "$OUT"/overlap1 | tee "$OUT/summary.txt"
# The GPU tests: the runtime's (TESTS=all: with the fused kernels' and the router's, as decode.sh's TEST_S step).
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
sel=(-m "gpu and not slow" tests/runtime/test_fused_runtime.py)
[ "${TESTS:-}" = all ] && sel=(-m "not slow" tests/runtime tests/kernels/test_fused_decode.py tests/kernels/test_router.py)
# shellcheck disable=SC2086  # $N: zero or two args
WIDE_AUTOTUNE_MAX=1 timeout "${TEST_S:-230}" python3 -m pytest -q $N -p no:cacheprovider "${sel[@]}" > "$OUT/gpu-tests.log" 2>&1
echo "pytest exit $?" >> "$OUT/gpu-tests.log"; tail -2 "$OUT/gpu-tests.log"
tar czf "$OUT/runs.tgz" -C "$OUT" overlap0 overlap1 overlap0.log overlap1.log && rm -rf "$OUT"/overlap[01]*
echo "elapsed $SECONDS"
