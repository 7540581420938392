#!/usr/bin/env bash
# One GPU-machine call (H200) for the kernels: the `wide bench kernels` sweep (GEMMs, reorder,
# gather-scatter, attention), the GPU tests (bf16 at real sizes, determinism, CUDA graphs; 8 pytest
# workers, since Triton compilation dominates), a quick `wide bench e2e` and a profile of one
# prefill / decode. Each step has its own time limit (0 skips it) so that a slow step cannot take the
# others' results with it.
# Usage (repo root): BENCH_S=150 TEST_S=180 E2E_S=60 PROFILE_S=90 bash scripts/device/kernels.sh OUT
#   E2E_ARGS (default --quick) go to `wide bench e2e`, e.g. "--compile"; WIDE_COMPILE=1 profiles the compiled step;
#   PROFILE_ARGS ("PROMPT RATE", default "4096 0.5") go to bench/profile/profile_e2e.py.
#   BENCH_FULL=0 runs the quick sweep. (VARIANTS_S, the decode-config sweep of older records, is gone
#   with scripts/decode_variants.py: docs/history.md.) The tests run every (non-slow) test of the kernel
#   and runtime files on the GPU with WIDE_AUTOTUNE_MAX=1 (one config per kernel: compile time
#   dominates; the benchmark's --check covers the tuned configs).
set -u
source scripts/device/setup.sh > /dev/null 2>&1
OUT=${1:-/tmp/out}; mkdir -p "$OUT/bench"
BENCH_S=${BENCH_S:-150}; TEST_S=${TEST_S:-180}; E2E_S=${E2E_S:-60}; PROFILE_S=${PROFILE_S:-90}
FULL=--full; [ "${BENCH_FULL:-1}" = 0 ] && FULL=""
start=$(date +%s)
since() { echo "$(( $(date +%s) - start )) s"; }
if [ "$BENCH_S" -gt 0 ]; then
  WIDE_BENCH_COMMAND="python3 -m bench.kernels.gpu_kernels_check \$OUT/bench --no-tests $FULL --check  (step of scripts/device/kernels.sh)" \
    timeout "$BENCH_S" python3 -m bench.kernels.gpu_kernels_check "$OUT/bench" --no-tests $FULL --check > "$OUT/bench.log" 2>&1
  echo "bench rc=$? $(since)"; grep "^\[bench\]\|^\[check\]" "$OUT/bench.log" | tail -4
fi
if [ "$TEST_S" -gt 0 ]; then
  WIDE_AUTOTUNE_MAX=1 timeout "$TEST_S" python3 -m pytest -q -m "not slow" -n 8 -p no:cacheprovider \
    tests/kernels/test_gemm_mn.py tests/kernels/test_router.py tests/kernels/test_pdl.py \
    tests/kernels/test_gemm_k.py tests/kernels/test_reorder.py tests/kernels/test_attention.py tests/runtime/test_runtime.py \
    > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? $(since): $(tail -n 1 "$OUT/gpu_tests.log")"
  grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.log" | head -20
fi
if [ "$E2E_S" -gt 0 ]; then
  timeout "$E2E_S" python3 -m wide.cli bench e2e ${E2E_ARGS:---quick} --out "$OUT/e2e" > "$OUT/e2e.log" 2>&1
  echo "e2e rc=$? $(since)"; grep "^{" "$OUT/e2e.log" | cut -c1-330
fi
if [ "$PROFILE_S" -gt 0 ]; then
  timeout "$PROFILE_S" python3 -m bench.profile.profile_e2e "$OUT" ${PROFILE_ARGS:-} > "$OUT/profile.log" 2>&1
  echo "profile rc=$? $(since)"; grep "^===" "$OUT/profile.log"
fi
