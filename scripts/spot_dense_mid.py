"""Spot check of the mid-M fused SwiGLU epilogue on the GPU: correctness vs the torch reference and
dense vs WIDE time at M 64 / 256 (gate+up, G 32 and 128, 0% and 50%), timed as the kernel bench times.
Usage: python3 scripts/spot_dense_mid.py OUT_DIR"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from wide.bench.timing import copies_for, time_together
from wide.kernels import clear_autotune_cache, plan, plan_route, routed_swiglu
from wide.kernels.reference import routed_swiglu_ref


def main(out: str) -> None:
    n, k = 14336, 4096
    recs = []
    for g in (32, 128):
        nc = copies_for(2 * n * k * 2)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(nc)]
        w2s = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(nc)]
        for m in (64, 256):
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(nc)]
            for sp in (0.5, 0.0):
                clear_autotune_cache()
                masks = [torch.rand(m, n // g, device="cuda") >= sp for _ in range(nc)]
                pl = plan(m, g, n // g)  # the auto paths, no expected sparsity given
                r0 = plan_route(masks[0], pl)
                out0 = routed_swiglu(xs[0], ws[0], w2s[0], r0, g)
                ref = routed_swiglu_ref(xs[0].float(), ws[0].float(), w2s[0].float(), r0, g)
                low = routed_swiglu_ref(xs[0], ws[0], w2s[0], r0, g)
                err, terr = (out0.float() - ref).abs().max().item(), (low.float() - ref).abs().max().item()
                dense = [
                    lambda x=x, w=w, w2=w2: F.silu(F.linear(x, w)) * F.linear(x, w2) for x, w, w2 in zip(xs, ws, w2s)
                ]
                wide = [
                    (lambda x=x, w=w, w2=w2, mk=mk, g=g, pl=pl: routed_swiglu(x, w, w2, plan_route(mk, pl), g))
                    for x, w, w2, mk in zip(xs, ws, w2s, masks)
                ]
                d, wd = time_together([dense, wide])
                rec = dict(op="gate_up", group_size=g, M=m, sparsity=sp, dense_ms=d, wide_ms=wd, speedup=d / wd,
                           err=err, torch_err=terr, err_ok=err <= 2 * terr + 1e-6)  # fmt: skip
                recs.append(rec)
                print(json.dumps(rec), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    with open(f"{out}/spot-dense-mid-h200.json", "w") as f:
        json.dump({"meta": meta, "records": recs}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
