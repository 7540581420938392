"""Where the host time of a runtime call goes: cProfile over prefill / decode calls (no CUDA graph).

profile_e2e.py showed the WIDE prefill at B 1 bound by the host (issue time above the summed kernel
time); this lists the Python functions that issue time is spent in. Llama-3.1-8B layer shapes with
LAYERS layers (default 4: the cost is per layer), random weights, routers at RATE.
Output: OUT/host_profile.txt. Usage: PYTHONPATH=src python3 scripts/host_profile.py OUT [RATE] [LAYERS]
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import torch

from wide.bench.e2e import LLAMA_8B, build_model, routers_at
from wide.config import WideConfig
from wide.model.wide_model import WideModel
from wide.runtime.model import WideRuntime

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
COMPILE = os.environ.get("WIDE_COMPILE", "0") == "1"


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def main() -> None:
    out = sys.argv[1]
    rate = float(sys.argv[2]) if len(sys.argv) > 2 else 0.7
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    small = {} if CUDA else dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                                 vocab_size=512)  # fmt: skip
    shape = dict(LLAMA_8B, num_hidden_layers=layers, **small)
    prompt = 4096 if CUDA else 64
    model = build_model(shape, DEV, torch.bfloat16 if CUDA else torch.float32)
    wm = WideModel(model, WideConfig(ffn_group_size=128))
    routers_at(wm, rate, torch.randint(0, shape["vocab_size"], (1, 256), device=DEV))
    ids = torch.randint(0, shape["vocab_size"], (1, prompt), device=DEV)
    step = torch.randint(0, shape["vocab_size"], (1, 1), device=DEV)
    report = [f"# host profile: {layers} layers, routers at {rate:.0%}, compile={COMPILE}, prompt {prompt}"]
    for routed in (False, True):
        rt = WideRuntime(wm, max_batch=1, max_seq=prompt + 8, routed=routed, compile=COMPILE)

        def prefill(rt=rt):
            rt.cache.reset()
            rt.prefill(ids)

        def decode(rt=rt):
            rt.cache.lens.fill_(prompt)
            rt.decode(step)

        for name, fn in (("prefill", prefill), ("decode", decode)):
            for _ in range(2):  # warm: compile, autotune
                fn()
            _sync()
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            host_ms = (time.perf_counter() - t0) / 5 * 1e3
            _sync()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                fn()
            prof.disable()
            _sync()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            head = f"=== {'WIDE' if routed else 'dense'} {name}: host issue {host_ms:.2f} ms per call ({layers} layers)"
            print(head, flush=True)
            report += [head, s.getvalue()]
        del rt
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/host_profile.txt", "w") as f:
        f.write("\n".join(report))


if __name__ == "__main__":
    main()
