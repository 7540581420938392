"""Where the end-to-end time goes: torch.profiler over one prefill and one decode step (GPU).

Llama-3.1-8B shapes, random weights, routers fitted to skip 50%; dense and WIDE through `WideRuntime`.
Writes the top CUDA kernels by total time and the kernel count per call to OUT/profile_e2e.txt.
Usage: PYTHONPATH=src python3 scripts/profile_e2e.py OUT [PROMPT]
"""

from __future__ import annotations

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from wide.bench.e2e import LLAMA_8B, build_model, routers_at
from wide.config import WideConfig
from wide.model.wide_model import WideModel
from wide.runtime.model import WideRuntime

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


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _profile(fn, reps: int = 3) -> tuple[str, int]:
    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA if CUDA else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        _sync()
    events = prof.key_averages()
    kind = torch.autograd.DeviceType.CUDA if CUDA else torch.autograd.DeviceType.CPU
    n_kernels = sum(e.count for e in events if e.device_type == kind) // reps
    sort = "cuda_time_total" if CUDA else "cpu_time_total"
    return events.table(sort_by=sort, row_limit=25), n_kernels


COMPILE = os.environ.get("WIDE_COMPILE", "0") == "1"  # profile the torch.compile'd layer step


def main() -> None:
    out = sys.argv[1]
    prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    model = build_model(SHAPE, DEV, torch.bfloat16 if CUDA else torch.float32)
    wm = WideModel(model, WideConfig(ffn_group_size=128))
    vocab = SHAPE["vocab_size"]
    probe = torch.randint(0, vocab, (1, 512), device=DEV)
    routers_at(wm, 0.5, probe)
    ids = torch.randint(0, vocab, (1, prompt), device=DEV)
    step = torch.randint(0, vocab, (1, 1), device=DEV)
    lines = []
    for routed in (False, True):
        rt = WideRuntime(wm, max_batch=1, max_seq=prompt + 8, routed=routed, compile=COMPILE)

        def prefill(rt=rt):
            rt.cache.reset()
            rt.prefill(ids)

        def decode(rt=rt):
            rt.cache.lens.fill_(prompt)
            rt.decode(step)

        for name, fn in (("prefill", prefill), ("decode", decode)):
            table, n = _profile(fn)
            head = f"=== {'WIDE 50%' if routed else 'dense'} {name} (prompt {prompt}): {n} CUDA kernels per call"
            print(head, flush=True)
            lines += [head, table, ""]
        del rt
        if CUDA:
            torch.cuda.empty_cache()
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/profile_e2e.txt", "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
