"""GPU check for the routed GEMM kernels: bf16 tests at real sizes, then the kernel benchmark.

One process, so autotuning done by the tests is reused by the benchmark.
Usage: PYTHONPATH=src python3 -m bench.kernels.gpu_kernels_check OUT_DIR [--full] [--no-tests] [--check]
(--check: after the benchmark, bf16 error of the auto paths at Llama-8B shapes vs plain PyTorch's)
"""

from __future__ import annotations

import sys
import time

import pytest


def dump_autotune(path: str) -> None:
    """The configs the autotuners picked, per key (for the next tuning round): every Triton autotuner
    the kernel modules define, found by type (no private names), keyed by its kernel's name."""
    import importlib
    import json
    import pkgutil

    import triton

    import wide.kernels

    out = {}
    for info in pkgutil.walk_packages(wide.kernels.__path__, prefix="wide.kernels."):
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            if isinstance(obj, triton.runtime.Autotuner) and getattr(obj, "cache", None):
                name = f"{info.name.rsplit('.', 1)[-1]}.{getattr(obj.fn, '__name__', type(obj).__name__)}"
                out[name] = {str(key): str(cfg) for key, cfg in obj.cache.items()}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def quick_check(path: str) -> bool:
    """bf16 error of the auto paths at Llama-8B shapes vs plain PyTorch's (both against fp32), M over
    every regime; random 50% masks. Writes one record per case; True when all pass (err <= 2x torch)."""
    import json

    import torch

    from wide.bench.checks import within_bf16_rule
    from wide.kernels import plan, plan_route, routed_gemm_k, routed_gemm_mn, routed_swiglu
    from wide.kernels.gemm.reference import routed_gemm_k_ref, routed_gemm_mn_ref, routed_swiglu_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    recs = []
    for name, n, k, g in (("q", 4096, 4096, 512), ("gate_up", 14336, 4096, 128), ("o", 4096, 4096, 512),
                          ("down", 4096, 14336, 128), ("down", 4096, 14336, 32)):  # fmt: skip
        w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
        w2 = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
        for m in (1, 3, 16, 77, 300, 2048):
            x = torch.randn(m, k, device="cuda", generator=gen)
            ng = (k if name in ("o", "down") else n) // g
            mask = torch.rand(m, ng, device="cuda", generator=gen) < 0.5
            r = plan_route(mask, plan(m, g, ng))  # the auto paths, no expected sparsity given
            xb, wb, w2b = x.bfloat16(), w.bfloat16(), w2.bfloat16()
            if name == "q":
                out = routed_gemm_mn(xb, wb, r, g)
                ref, low = routed_gemm_mn_ref(x, w, r, g), routed_gemm_mn_ref(xb, wb, r, g)
            elif name == "gate_up":
                out = routed_swiglu(xb, wb, w2b, r, g)
                ref, low = routed_swiglu_ref(x, w, w2, r, g), routed_swiglu_ref(xb, wb, w2b, r, g)
            else:
                out = routed_gemm_k(xb, wb, r, g)
                ref, low = routed_gemm_k_ref(x, w, r, g), routed_gemm_k_ref(xb, wb, r, g)
            ok, err, base = within_bf16_rule(out, ref, low)
            recs.append(dict(op=name, N=n, K=k, G=g, M=m, err=err, torch_bf16_err=base, ok=ok))
    with open(path, "w") as f:
        json.dump(recs, f, indent=1)
    bad = [r for r in recs if not r["ok"]]
    print(f"[check] bf16 auto paths: {len(recs) - len(bad)}/{len(recs)} within 2x torch's error", flush=True)
    for r in bad:
        print(f"[check] FAIL {r}", flush=True)
    return not bad


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
    if "--check" in sys.argv and not quick_check(f"{out}/check.json"):
        rc = rc or 1
    with open(f"{out}/kernels-h200.md") as f:
        print(f.read())
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
