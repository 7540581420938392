# ruff: noqa: B023  (closures are timed inside the loop iteration that defines them)
"""Routed GEMM / reorder / gather-scatter measurements on one GPU (Llama-3.1-8B operator shapes).

Timing (``wide.bench.timing.time_calls``, as the attention bench): a CUDA graph of back-to-back calls
cycling through copies of the weights, inputs and masks that together exceed the L2 cache (weights
come from HBM, as in a model whose layers each have their own); median per call. The dense baseline is
re-timed with every WIDE variant, the replays of the two interleaved. Each sparsity level is autotuned
afresh on its own masks (``clear_autotune_cache``), as a model deployed at that level is.

The WIDE operators are called as ``wide.runtime`` calls them: each decision is planned with
``wide.kernels.route.plan`` from M, the group size, the number of groups and the level the masks were drawn at
(the expected sparsity, as a deployment knows its routers'); for Q and fused gate+up (the first
operators of their decision) the timing includes ``plan_route(mask, plan)`` — the reorder when the
plan's GEMM-MN is sorted, nothing otherwise (the small and dense paths read the mask). Past M 256 the
plan sends levels too low for the sorted kernel to win to cuBLAS ('dense'; the full sweep also times
the sorted kernel forced there, as variant 'sorted', and every record names its ``path``). Q leaves
inactive heads unspecified (attention skips them); O and down reuse the route and get an input whose
inactive groups are 0 (``x_zeroed``, as routed attention / SwiGLU write it); the plan picks the
'ordered' GEMM-K for O at large M (its row order is computed inside the timed call). Extra variants
(full sweep, 50%) force the other paths (``plan(..., force_mn=...)`` / ``force_k``), GEMM-K on an input
that is not pre-zeroed. At decode-sized M the calls cycle over
DECODE_MASK_DRAWS masks (a single M-token mask of a few groups strays far from its level).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from wide.bench.timing import copies_for
from wide.bench.timing import time_calls as time_graph  # module names: the CPU test replaces them
from wide.bench.timing import time_together as time_variants
from wide.kernels import Plan, clear_autotune_cache, plan
from wide.kernels.gemm.gemm_k import routed_gemm_k
from wide.kernels.gemm.gemm_mn import routed_gemm_mn, routed_swiglu
from wide.kernels.gemm.reference import (
    _active_groups,
    fixed_count_mask,
    gather_scatter_gemm_k,
    gather_scatter_gemm_n,
)
from wide.kernels.route.plan import DENSE_M, ORDERED_MAX_GROUPS, SMALL_M
from wide.kernels.route.reorder import pattern_order, plan_route, reorder

# name, kind, N, K, G, reorder included in the WIDE timing
OPS = [
    ("q", "gemm_mn", 4096, 4096, 512, True),
    ("o", "gemm_k", 4096, 4096, 512, False),
    ("gate_up", "gemm_mn_swiglu", 14336, 4096, 128, True),
    ("gate_up", "gemm_mn_swiglu", 14336, 4096, 32, True),
    ("down", "gemm_k", 4096, 14336, 128, False),
    ("down", "gemm_k", 4096, 14336, 32, False),
]


DECODE_MASK_DRAWS = 64  # masks cycled at M <= SMALL_M (O at M 1: 512 group decisions, sd of the mean ~0.02)


def _mask(m: int, ng: int, sparsity: float, gen: torch.Generator | None, device: str = "cuda") -> torch.Tensor:
    return torch.rand(m, ng, device=device, generator=gen) >= sparsity


def _variants(kind: str, m: int, sp: float, extra: bool, g: int, ng: int) -> list[str]:
    """'auto' plus, in the full sweep, the forced paths worth comparing at this M: at 50% the other
    paths; where the plan sends a GEMM-MN past DENSE_M to cuBLAS, the sorted kernel it passed over."""
    out = ["auto"]
    if extra and kind != "gemm_k" and m > DENSE_M and plan(m, g, ng, sp).mn != "sorted":
        out.append("sorted")
    if not extra or sp != 0.5:
        return out
    if kind == "gemm_k":
        out.append("dense")  # x not pre-zeroed: one zeroing pass + cuBLAS
        if m >= 1024:
            out.append("ordered")
        if m <= 16:
            out.append("small")
    else:
        if m <= 16:
            out.append("dense")
        if m <= 256:
            out.append("sorted")
    return out


def _plan_of(kind: str, variant: str, m: int, g: int, ng: int, sparsity: float) -> Plan:
    """The decision's plan: the expected sparsity is the level the masks were drawn at, as a deployment
    knows its routers'; a variant other than 'auto' forces the operator's path."""
    forced = None if variant == "auto" else variant
    if kind == "gemm_k":
        return plan(m, g, ng, sparsity, force_k=forced)
    return plan(m, g, ng, sparsity, force_mn=forced)


def _op_call(kind: str, variant: str, x, w, w2, g: int, xz) -> Callable:
    """The WIDE call of one operator on one input copy, as a function of the route (which carries the plan)."""
    if kind == "gemm_mn":
        return lambda r: routed_gemm_mn(x, w, r, g, zero_inactive=False)
    if kind == "gemm_mn_swiglu":
        return lambda r: routed_swiglu(x, w, w2, r, g)
    if variant == "auto":
        return lambda r: routed_gemm_k(xz, w, r, g, x_zeroed=True)
    return lambda r: routed_gemm_k(x, w, r, g)


def _dense_call(kind: str, x, w, w2) -> Callable:
    if kind == "gemm_mn_swiglu":
        return lambda: F.silu(F.linear(x, w)) * F.linear(x, w2)
    return partial(F.linear, x, w)


def bench_op(
    name,
    kind,
    n,
    k,
    g,
    with_route,
    ms_list,
    sparsities,
    gen,
    extra_variants=False,
    device="cuda",
    dtype=torch.bfloat16,
    variants: list[str] | None = None,
) -> list[dict]:
    """Dense vs WIDE for one operator over M and sparsity (dense re-timed with every variant, replays
    interleaved). ``variants`` replaces the usual list ('auto' + extras) with paths forced at every
    point; ``device``/``dtype`` exist for CPU smoke tests of this code (timing replaced)."""
    rows = []
    dt = dtype
    swiglu = kind == "gemm_mn_swiglu"
    w_bytes = n * k * dt.itemsize * (2 if swiglu else 1)
    n_copies = copies_for(w_bytes)
    ws = [torch.randn(n, k, device=device, dtype=dt) / k**0.5 for _ in range(n_copies)]
    w2s = [torch.randn(n, k, device=device, dtype=dt) / k**0.5 if swiglu else None for _ in range(n_copies)]
    flops = (4.0 if swiglu else 2.0) * n * k
    ng = (n if kind != "gemm_k" else k) // g
    for m in ms_list:
        nc = copies_for(w_bytes + m * k * dt.itemsize)
        xs = [torch.randn(m, k, device=device, dtype=dt) for _ in range(nc)]
        dense_fns = [_dense_call(kind, x, w, w2) for x, w, w2 in zip(xs, ws, w2s, strict=False)]
        # decode-sized M: a mask has only M·N_G entries (8 at M 1 for O), so the calls cycle over more
        # draws than input copies, and their mean active fraction is the level's rather than one draw's
        draws = max(nc, DECODE_MASK_DRAWS) if m <= SMALL_M else nc
        xs_c, ws_c, w2s_c = ([t[i % nc] for i in range(draws)] for t in (xs, ws, w2s))
        for sp in sparsities:
            clear_autotune_cache()  # tune this sparsity level on its own masks
            masks = [_mask(m, ng, sp, gen, device) for _ in range(draws)]
            # O / down get the producer's zeros in the inactive groups
            xzs = [x * mk.repeat_interleave(g, dim=1).to(dt) if kind == "gemm_k" else x for x, mk in zip(xs_c, masks)]
            active = torch.stack(masks).float().mean().item()
            for variant in variants or _variants(kind, m, sp, extra_variants, g, ng):
                p = _plan_of(kind, variant, m, g, ng, sp)
                # as the runtime builds it: the reorder only if the plan's GEMM-MN takes the sorted path
                build = partial(plan_route, plan=p)
                build_name = "reorder" if variant == "sorted" else "plan_route"  # the forced sorted kernel
                ops = [_op_call(kind, variant, x, w, w2, g, xz) for x, w, w2, xz in zip(xs_c, ws_c, w2s_c, xzs)]
                routes = [build(mk) for mk in masks]
                timed = [dense_fns, [partial(op, r) for op, r in zip(ops, routes)]]
                if with_route:
                    timed.append([(lambda op=op, mk=mk: op(build(mk))) for op, mk in zip(ops, masks)])
                dense_ms, op_ms, *rest = time_variants(timed)
                wide_ms = rest[0] if with_route else op_ms
                rows.append(
                    dict(
                        kind=kind,
                        op=name,
                        M=m,
                        N=n,
                        K=k,
                        group_size=g,
                        sparsity=sp,
                        active_fraction=round(active, 4),
                        variant=variant,
                        route_included=with_route,
                        route_build=build_name,
                        path=p.mn if kind != "gemm_k" else p.k,
                        copies=nc,
                        mask_draws=draws,
                        dense_ms=dense_ms,
                        wide_ms=wide_ms,
                        wide_op_ms=op_ms,
                        speedup=dense_ms / wide_ms,
                        speedup_op_only=dense_ms / op_ms,
                        dense_tflops=flops * m / dense_ms * 1e-9,
                        wide_useful_tflops=flops * m * active / wide_ms * 1e-9,
                    )
                )
    return rows


def bench_reorder(ms_list, gen) -> list[dict]:
    """Reorder alone vs the dense time of the operators the decision serves."""
    rows = []
    dt = torch.bfloat16
    dense_w = {
        "attention": [(4096, 4096), (4096, 4096)],  # Q and O projections
        "ffn": [(14336, 4096), (14336, 4096), (4096, 14336)],  # gate, up, down
    }
    for decision, ng in (("attention", 8), ("ffn", 112), ("ffn", 448)):
        ws = [torch.randn(n, k, device="cuda", dtype=dt) for n, k in dense_w[decision]]
        for m in ms_list:
            mask = _mask(m, ng, 0.5, gen)
            r_ms = time_graph([lambda: reorder(mask)])
            order_ms = time_graph([lambda: pattern_order(mask)]) if ng <= ORDERED_MAX_GROUPS else None
            xs = {k: torch.randn(m, k, device="cuda", dtype=dt) for _, k in dense_w[decision]}
            dense_ms = time_graph([lambda: [F.linear(xs[w.shape[1]], w) for w in ws]])
            rows.append(
                dict(
                    kind="reorder",
                    op=f"{decision}_decision",
                    M=m,
                    group_size=None,
                    n_groups=ng,
                    sparsity=0.5,
                    dense_ms=dense_ms,
                    wide_ms=r_ms,
                    speedup=None,
                    reorder_frac_of_served_dense=r_ms / dense_ms,
                    pattern_order_ms=order_ms,  # the 'ordered' O projection's row order (few groups)
                    served_ops="q+o" if decision == "attention" else "gate+up+down",
                )
            )
    return rows


def _peak(fn) -> tuple[float, float]:
    """(ms, peak extra GiB) of an eager call; peak measured over one call after warm-up."""
    import triton

    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ms = triton.testing.do_bench(fn, warmup=1, rep=5, return_mode="median")
    return float(ms), peak


def bench_gather_scatter(sizes, gen, group_size: int = 128, sparsity: float = 0.5) -> list[dict]:
    """Appendix-A naive gather-scatter vs WIDE vs dense at S^3 (time + peak memory)."""
    rows = []
    dt = torch.bfloat16
    free = torch.cuda.mem_get_info()[0]
    for s in sizes:
        a = torch.randn(s, s, device="cuda", dtype=dt)
        b = torch.randn(s, s, device="cuda", dtype=dt) / s**0.5
        ng = s // group_size
        mask = fixed_count_mask(s, ng, int(round(ng * (1 - sparsity))), device="cuda", generator=None)
        groups = _active_groups(mask)
        route = plan_route(mask, plan(s, group_size, ng))  # no expected sparsity given
        dense_ms, dense_peak = _peak(lambda: F.linear(a, b))
        for axis in ("n", "k"):
            need = (1 - sparsity) * s**3 * 2 * (2 if axis == "k" else 1)
            rec = dict(kind="gather_scatter", op=f"gemm_{axis}", M=s, N=s, K=s, group_size=group_size)
            rec.update(sparsity=sparsity, dense_ms=dense_ms, dense_peak_gib=dense_peak)
            wide = (
                (lambda: routed_gemm_mn(a, b, route, group_size))
                if axis == "n"
                else (lambda: routed_gemm_k(a, b, route, group_size))
            )
            wide_ms, wide_peak = _peak(wide)
            rec.update(wide_ms=wide_ms, wide_peak_gib=wide_peak, speedup=dense_ms / wide_ms)
            naive = gather_scatter_gemm_n if axis == "n" else gather_scatter_gemm_k
            if need * 1.3 > free * 0.8:
                rec.update(naive_ms=None, naive_peak_gib=None, naive_skipped=f"needs ~{need / 2**30:.0f} GiB")
            else:
                try:
                    n_ms, n_peak = _peak(lambda: naive(a, b, groups, group_size))
                    rec.update(naive_ms=n_ms, naive_peak_gib=n_peak, wide_over_naive=n_ms / wide_ms)
                except torch.OutOfMemoryError as e:  # pragma: no cover - GPU only
                    rec.update(naive_ms=None, naive_peak_gib=None, naive_skipped=f"OOM: {str(e)[:80]}")
            gc.collect()
            torch.cuda.empty_cache()
            rows.append(rec)
    return rows
