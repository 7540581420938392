"""What a decode-sized launch costs before it reads anything: the floors under the fused decode layer.

    python -m bench.decode.bench_read_floor --out $OUT     # one GPU, ~1 min -> $OUT/read-floor-CARD.json and .md

A plain streaming read (every program sums its contiguous slice of a bf16 buffer; nothing else) timed
like the fused kernels (``wide.bench.timing``: CUDA graphs of back-to-back calls on rotated copies larger
than L2), at the byte counts of the Llama-3.1-8B decode layer's kernels (K/V cache 16.8 MB, O 33.5 MB,
QKV 50.3 MB, routed FFN 176 MB, FFN 352 MB) and several grid sizes:

* ``empty``: a launch that reads nothing (the graph's per-kernel floor);
* ``read``: t(bytes) per size, best grid; a least-squares fit t = c + bytes / BW over the sizes gives the
  fixed cost c of one launch and the streaming rate BW that no kernel of that size can beat;
* ``boundary``: reads of A then B bytes as two launches, as one launch of A + B, and as one launch whose
  second-phase programs wait for every first-phase program (a counter, as the fused FFN's consumers do),
  with and without loading their first blocks before waiting. The two-launch minus one-launch time is
  what a kernel boundary costs; the in-launch wait shows what a persistent layer would keep of it
  (docs/kernels.md, "Fused decode layer").

Every read's sum is checked against torch's before it is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl

from wide.bench.timing import card_tag, copies_for, time_together

BLOCK = 4096  # bf16 elements per load and program step (8 KiB)
SIZES_MB = (4.2, 8.4, 16.8, 33.5, 50.3, 176.2, 352.3)
GRIDS = (132, 264, 528, 1056)
BOUNDARIES = ((16.8, 33.5), (33.5, 176.2), (50.3, 16.8))  # (A, B) MB: attention -> O, O -> FFN, QKV -> attention
DEV = "cuda"


@triton.jit
def _empty_kernel(out_ptr):
    if tl.program_id(0) < 0:  # never: a launch that does no work
        tl.store(out_ptr, 0.0)


@triton.jit
def _sum_slice(x_ptr, base, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, n, BLOCK):
        acc += tl.load(x_ptr + base + i + tl.arange(0, BLOCK)).to(tl.float32)
    return tl.sum(acc)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_per, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, _sum_slice(x_ptr, pid.to(tl.int64) * n_per, n_per, BLOCK))


@triton.jit
def _two_phase_kernel(x_ptr, y_ptr, out_ptr, cnt_ptr, nx_per, ny_per, P1, P2, BLOCK: tl.constexpr,
                      PREFETCH: tl.constexpr):  # fmt: skip
    """Tickets < P1 read x; the rest wait for all of them (as a consumer of their output would), then read y.
    cnt: [ticket, phase-1 done, phase-2 done], left zeroed by the last phase-2 program."""
    ticket = tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")
    if ticket < P1:
        s = _sum_slice(x_ptr, ticket.to(tl.int64) * nx_per, nx_per, BLOCK)
        tl.store(out_ptr + ticket, s)
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + 1, 1, sem="release", scope="gpu")
    else:
        j = ticket - P1
        base = j.to(tl.int64) * ny_per
        acc = tl.zeros([BLOCK], tl.float32)
        start = 0
        if PREFETCH:  # the first two blocks are in flight while the program waits
            acc += tl.load(y_ptr + base + tl.arange(0, BLOCK)).to(tl.float32)
            acc += tl.load(y_ptr + base + BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
            start = 2 * BLOCK
        done = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire", scope="gpu")
        while done < P1:
            done = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire", scope="gpu")
        dep = tl.load(out_ptr, cache_modifier=".cg")  # phase 1's output: the data dependence
        for i in range(start, ny_per, BLOCK):
            acc += tl.load(y_ptr + base + i + tl.arange(0, BLOCK)).to(tl.float32)
        tl.store(out_ptr + P1 + j, tl.sum(acc) + dep * 0.0)
        if tl.atomic_add(cnt_ptr + 2, 1, sem="acq_rel", scope="gpu") == P2 - 1:
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(cnt_ptr + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(cnt_ptr + 2, 0, sem="relaxed", scope="gpu")


def _elems(mb: float, grid: int) -> tuple[int, int]:
    """(elements per program, total elements) for ~mb MB over ``grid`` programs, whole blocks each."""
    per = max(1, round(mb * 1e6 / 2 / grid / BLOCK)) * BLOCK
    return per, per * grid


def _buffers(total: int) -> list[torch.Tensor]:
    return [torch.randn(total, device=DEV, dtype=torch.bfloat16) for _ in range(copies_for(total * 2))]


def read_calls(mb: float, grid: int):
    per, total = _elems(mb, grid)
    xs, out = _buffers(total), torch.empty(grid, device=DEV)
    _read_kernel[(grid,)](xs[0], out, per, BLOCK=BLOCK)
    ref = xs[0].float().view(grid, per).sum(1)
    ok = torch.allclose(out, ref, rtol=1e-3, atol=1e-1)
    return [lambda x=x: _read_kernel[(grid,)](x, out, per, BLOCK=BLOCK) for x in xs], total * 2, ok


def two_phase_calls(mb_a: float, mb_b: float, grid: int, prefetch: bool):
    pa, ta = _elems(mb_a, grid)
    pb, tb = _elems(mb_b, grid)
    xs, ys = _buffers(ta), _buffers(tb)
    out = torch.empty(2 * grid, device=DEV)
    cnt = torch.zeros(3, device=DEV, dtype=torch.int32)

    def call(i: int):
        _two_phase_kernel[(2 * grid,)](xs[i % len(xs)], ys[i % len(ys)], out, cnt, pa, pb, grid, grid, BLOCK=BLOCK,
                                       PREFETCH=prefetch)  # fmt: skip

    call(0)
    ref = torch.cat([xs[0].float().view(grid, pa).sum(1), ys[0].float().view(grid, pb).sum(1)])
    ok = torch.allclose(out, ref, rtol=1e-3, atol=1e-1) and int(cnt.abs().sum()) == 0
    return [lambda i=i: call(i) for i in range(max(len(xs), len(ys)))], (ta + tb) * 2, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="check the kernels on the CPU (TRITON_INTERPRET=1), no timing")
    args = ap.parse_args()
    if args.smoke:
        global DEV, BLOCK
        DEV, BLOCK = "cpu", 64
        checks = [read_calls(0.001, 3)[2], two_phase_calls(0.001, 0.002, 3, False)[2],
                  two_phase_calls(0.001, 0.002, 3, True)[2]]  # fmt: skip
        print("smoke", "ok" if all(checks) else f"FAILED {checks}")
        raise SystemExit(0 if all(checks) else 1)
    t0 = time.time()
    meta = {"command": "python -m bench.decode.bench_read_floor", "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "block_elems": BLOCK}  # fmt: skip
    recs: list[dict] = []
    out1 = torch.empty(1, device=DEV)
    (empty_ms,) = time_together([[lambda: _empty_kernel[(132,)](out1)]])
    recs.append({"kind": "empty", "grid": 132, "us": empty_ms * 1e3})
    best: dict[float, dict] = {}
    for mb in SIZES_MB:
        runs = [read_calls(mb, g) for g in GRIDS]
        times = time_together([r[0] for r in runs])
        for g, (_, nbytes, ok), ms in zip(GRIDS, runs, times, strict=True):
            rec = {"kind": "read", "mb": mb, "grid": g, "bytes": nbytes, "ok": ok, "us": ms * 1e3,
                   "tb_per_s": nbytes / (ms * 1e-3) / 1e12}  # fmt: skip
            recs.append(rec)
            if ok and (mb not in best or rec["us"] < best[mb]["us"]):
                best[mb] = rec
        print(json.dumps(best.get(mb)), flush=True)
        del runs
        torch.cuda.empty_cache()
    # t = c + bytes / BW over the best grid per size (least squares)
    xb = torch.tensor([best[m]["bytes"] for m in best], dtype=torch.float64)
    yt = torch.tensor([best[m]["us"] for m in best], dtype=torch.float64)
    a = torch.stack([torch.ones_like(xb), xb], 1)
    c, inv_bw = torch.linalg.lstsq(a, yt[:, None]).solution[:, 0].tolist()
    fit = {"kind": "fit", "fixed_us": c, "tb_per_s": 1e-6 / inv_bw}  # inv_bw: µs per byte
    recs.append(fit)
    for mb_a, mb_b in BOUNDARIES:
        g = best[mb_b]["grid"]
        ra, rb, rab = read_calls(mb_a, g), read_calls(mb_b, g), read_calls(mb_a + mb_b, g)
        t_no, t_pf = two_phase_calls(mb_a, mb_b, g, False), two_phase_calls(mb_a, mb_b, g, True)
        fa, fb = ra[0], rb[0]
        two = [lambda i=i, fa=fa, fb=fb: (fa[i % len(fa)](), fb[i % len(fb)]()) for i in range(max(len(fa), len(fb)))]
        ms = time_together([two, rab[0], t_no[0], t_pf[0]])
        ok = ra[2] and rb[2] and t_no[2] and t_pf[2]
        rec = {"kind": "boundary", "a_mb": ra[1] / 1e6, "b_mb": rb[1] / 1e6, "grid": g, "ok": ok,
               "two_launches_us": ms[0] * 1e3, "one_launch_us": ms[1] * 1e3, "in_launch_wait_us": ms[2] * 1e3,
               "in_launch_wait_prefetch_us": ms[3] * 1e3}  # fmt: skip
        recs.append(rec)
        print(json.dumps(rec), flush=True)
        torch.cuda.empty_cache()
    meta["wall_s"] = time.time() - t0
    with open(os.path.join(args.out, f"read-floor-{card_tag()}.json"), "w") as fh:
        json.dump({"meta": meta, "records": recs}, fh, indent=1)
    lines = [f"# Streaming-read floors ({meta['device']})", "", f"Command: `{meta['command']}`", "",
             f"Empty launch in a CUDA graph: {empty_ms * 1e3:.2f} µs per kernel. Fit over the best grid per size: "
             f"t = {c:.2f} µs + bytes / {fit['tb_per_s']:.2f} TB/s.", "",
             "| MB | best grid | µs | TB/s |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['bytes'] / 1e6:.1f} | {r['grid']} | {r['us']:.2f} | {r['tb_per_s']:.2f} |" for r in best.values()]
    lines += ["", "| A → B MB | grid | two launches µs | one launch of A + B µs | one launch, B waits µs | "
              "B waits, first blocks prefetched µs |", "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['a_mb']:.1f} → {r['b_mb']:.1f} | {r['grid']} | {r['two_launches_us']:.2f} | "
              f"{r['one_launch_us']:.2f} | {r['in_launch_wait_us']:.2f} | {r['in_launch_wait_prefetch_us']:.2f} |"
              for r in recs if r["kind"] == "boundary"]  # fmt: skip
    with open(os.path.join(args.out, f"read-floor-{card_tag()}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
