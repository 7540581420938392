"""GPU check for the routed GEMM kernels: bf16 tests at real sizes, then the kernel benchmark.

One process, so autotuning done by the tests is reused by the benchmark.
Usage: PYTHONPATH=src python3 scripts/gpu_kernels_check.py OUT_DIR [--full] [--no-tests]
"""

from __future__ import annotations

import sys
import time

import pytest


def main() -> int:
    out = sys.argv[1]
    t0 = time.time()
    rc = 0
    if "--no-tests" not in sys.argv:
        files = [
            "tests/kernels/test_reorder.py",
            "tests/kernels/test_gemm_mn.py",
            "tests/kernels/test_gemm_k.py",
        ]
        rc = int(pytest.main(["-q", "-m", "gpu", "-x", "-p", "no:cacheprovider", *files]))
        print(f"[check] gpu tests rc={rc} in {time.time() - t0:.0f}s", flush=True)
    from wide.bench.kernels import run_kernel_bench

    rows = run_kernel_bench(out, quick="--full" not in sys.argv)
    print(f"[check] bench: {len(rows)} records, total {time.time() - t0:.0f}s", flush=True)
    with open(f"{out}/kernels-h200.md") as f:
        print(f.read())
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
