"""Where the end-to-end time goes: torch.profiler over one prefill and one decode step (GPU).

Llama-3.1-8B shapes, random weights, routers fitted to skip RATE (default 0.5); dense and WIDE through
`WideRuntime`. Writes the top CUDA kernels by total time, the kernel count per call, and per call the
summed kernel time, the host time to issue the call and its wall time (issue + finish): a wall time
near the host time and well above the kernel time means the call is bound by the host, not the GPU.
Output: OUT/profile_e2e.txt. Usage: PYTHONPATH=src python3 -m bench.profile.profile_e2e OUT [PROMPT] [RATE]
Env: WIDE_COMPILE=1 profiles the torch.compile'd layer step; WIDE_FUSED=1 decodes through the fused decode
layer (`WideRuntime(fused_decode=True)`, eager: the summed kernel time is the figure to read); PROFILE_CALLS
(default "prefill,decode") picks the calls.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from wide.bench.e2e import LLAMA_8B, build_model, routers_at
from wide.config import WideConfig
from wide.model import WideModel
from wide.runtime import WideRuntime

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# without a GPU: a tiny Llama on the CPU, to smoke-test this script
TINY = dict(
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=512,
    vocab_size=512,
)
SHAPE = LLAMA_8B if CUDA else dict(LLAMA_8B, **TINY)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _profile(fn, reps: int = 3) -> tuple[str, int, float]:
    """(top-25 table, kernels per call, summed kernel ms per call)."""
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if CUDA else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        sync()
    events = prof.key_averages()
    kind = torch.autograd.DeviceType.CUDA if CUDA else torch.autograd.DeviceType.CPU
    kernels = [e for e in events if e.device_type == kind]
    n_kernels = sum(e.count for e in kernels) // reps
    kernel_ms = sum(e.self_device_time_total for e in kernels) / reps / 1e3 if CUDA else float("nan")
    sort = "cuda_time_total" if CUDA else "cpu_time_total"
    return events.table(sort_by=sort, row_limit=25), n_kernels, kernel_ms


def _host_and_wall_ms(fn, reps: int = 5) -> tuple[float, float]:
    """Median host ms to issue one call (no sync) and its wall ms (issue + wait for the GPU)."""
    host, wall = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        host.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(host), statistics.median(wall)


COMPILE = os.environ.get("WIDE_COMPILE", "0") == "1"  # profile the torch.compile'd layer step
FUSED = os.environ.get("WIDE_FUSED", "0") == "1"  # decode through the fused decode layer
CALLS = tuple(os.environ.get("PROFILE_CALLS", "prefill,decode").split(","))


def runtime_calls(shape: dict, rate: float, prompt: int, compile: bool):
    """Yields (routed, 'prefill' | 'decode', fn) for the dense and the WIDE runtime of one random model
    (routers fitted to skip ``rate``); fn runs one batch-1 call (prefill of ``prompt`` tokens, or one
    decode step at that context). Each runtime is freed after its two calls."""
    model = build_model(shape, DEV, torch.bfloat16 if CUDA else torch.float32)
    wm = WideModel(model, WideConfig(ffn_group_size=128))
    vocab = shape["vocab_size"]
    routers_at(wm, rate, torch.randint(0, vocab, (1, min(prompt, 512)), device=DEV))
    ids = torch.randint(0, vocab, (1, prompt), device=DEV)
    step = torch.randint(0, vocab, (1, 1), device=DEV)
    for routed in (False, True):
        rt = WideRuntime(wm, max_batch=1, max_seq=prompt + 8, routed=routed, compile=compile, fused_decode=FUSED)

        def prefill(rt=rt):
            rt.cache.reset()
            rt.prefill(ids)

        def decode(rt=rt):
            rt.cache.lens.fill_(prompt)
            rt.decode(step)

        if "prefill" in CALLS:
            yield routed, "prefill", prefill
        if "decode" in CALLS:
            yield routed, "decode", decode
        del rt, prefill, decode
        if CUDA:
            torch.cuda.empty_cache()


def main() -> None:
    out = sys.argv[1]
    prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    rate = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
    lines = []
    for routed, name, fn in runtime_calls(SHAPE, rate, prompt, COMPILE):
        table, n, kernel_ms = _profile(fn)
        host_ms, wall_ms = _host_and_wall_ms(fn)
        head = (
            f"=== {f'WIDE {rate:.0%}' if routed else 'dense'}{' fused' if FUSED and name == 'decode' else ''} "
            f"{name} (prompt {prompt}): {n} CUDA kernels per "
            f"call; per call: kernels {kernel_ms:.2f} ms, host issue {host_ms:.2f} ms, wall {wall_ms:.2f} ms; "
            f"autotune: {os.environ.get('WIDE_AUTOTUNE_MAX') or 'every'} config(s)"
        )
        print(head, flush=True)
        lines += [head, table, ""]
        os.makedirs(out, exist_ok=True)
        with open(f"{out}/profile_e2e.txt", "w") as f:  # after every call: a stopped run keeps what it measured
            f.write("\n".join(lines))


if __name__ == "__main__":
    main()
