"""GPU check for the routed GEMM kernels: bf16 tests at real sizes, then the kernel benchmark.

One process, so autotuning done by the tests is reused by the benchmark.
Usage: PYTHONPATH=src python3 scripts/gpu_kernels_check.py OUT_DIR [--full] [--no-tests]
"""

from __future__ import annotations

import sys
import time

import pytest


def dump_autotune(path: str) -> None:
    """The configs the autotuners picked, per key (for the next tuning round)."""
    import json

    from wide.kernels import gemm_k, gemm_mn, small_m

    tuners = {
        "gemm_mn": gemm_mn._gemm_mn_tuned,
        "small_mn": small_m._small_mn_tuned,
        "small_k": small_m._small_k_tuned,
        "gemm_k_stat_split": gemm_k._stat_split,
        "gemm_k_stat_large": gemm_k._stat_large,
        "gemm_k_atomic": gemm_k._atomic,
    }
    out = {name: {str(key): str(cfg) for key, cfg in getattr(t, "cache", {}).items()} for name, t in tuners.items()}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


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
    dump_autotune(f"{out}/autotune.json")
    with open(f"{out}/kernels-h200.md") as f:
        print(f.read())
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
