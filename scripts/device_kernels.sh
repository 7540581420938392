#!/usr/bin/env bash
# One GPU-machine call (H200) for the kernels: GPU tests (bf16 at real sizes, determinism, CUDA
# graphs), the full `wide bench kernels` sweep, then a quick `wide bench e2e`. Each step has its own
# time limit so that one slow step cannot take the others' results with it.
# Usage (repo root): bash scripts/device_kernels.sh OUT [TEST_S BENCH_S E2E_S]   (a limit of 0 skips
# the step; BENCH_FULL=0 runs the quick sweep)
set -u
source scripts/device_setup.sh > /dev/null 2>&1
OUT=${1:-/tmp/out}; mkdir -p "$OUT/bench"
TEST_S=${2:-150}; BENCH_S=${3:-330}; E2E_S=${4:-90}
FULL=--full; [ "${BENCH_FULL:-1}" = 0 ] && FULL=""
start=$(date +%s)
[ "$TEST_S" -gt 0 ] && timeout "$TEST_S" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gemm_mn.py \
  tests/kernels/test_gemm_k.py tests/kernels/test_reorder.py tests/kernels/test_attention.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/gpu_tests.log")"
grep -E "FAILED|Error" "$OUT/gpu_tests.log" | head -20
[ "$BENCH_S" -gt 0 ] && \
WIDE_BENCH_COMMAND="python3 scripts/gpu_kernels_check.py \$OUT/bench --no-tests $FULL  (in scripts/device_kernels.sh)" \
  timeout "$BENCH_S" python3 scripts/gpu_kernels_check.py "$OUT/bench" --no-tests $FULL > "$OUT/bench.log" 2>&1
echo "bench rc=$? $(( $(date +%s) - start )) s"
grep "^\[bench\]\|^\[check\]" "$OUT/bench.log" | tail -12
[ "$E2E_S" -gt 0 ] && timeout "$E2E_S" python3 -m wide.cli bench e2e --quick --out "$OUT/e2e" > "$OUT/e2e.log" 2>&1
echo "e2e rc=$? $(( $(date +%s) - start )) s"; tail -n 15 "$OUT/e2e.log"
