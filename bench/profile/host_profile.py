"""Where the host time of a runtime call goes: cProfile over prefill / decode calls (no CUDA graph).

profile_e2e.py showed the WIDE prefill at B 1 bound by the host (issue time above the summed kernel
time); this lists the Python functions that issue time is spent in. Llama-3.1-8B layer shapes with
LAYERS layers (default 4: the cost is per layer), random weights, routers at RATE.
Output: OUT/host_profile.txt. Usage: PYTHONPATH=src python3 -m bench.profile.host_profile OUT [RATE] [LAYERS]
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

from bench.profile.profile_e2e import COMPILE, CUDA, SHAPE, runtime_calls, sync


def main() -> None:
    out = sys.argv[1]
    rate = float(sys.argv[2]) if len(sys.argv) > 2 else 0.7
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    shape = dict(SHAPE, num_hidden_layers=layers)
    prompt = 4096 if CUDA else 64
    report = [f"# host profile: {layers} layers, routers at {rate:.0%}, compile={COMPILE}, prompt {prompt}"]
    for routed, name, fn in runtime_calls(shape, rate, prompt, COMPILE):
        for _ in range(2):  # warm: compile, autotune
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        host_ms = (time.perf_counter() - t0) / 5 * 1e3
        sync()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            fn()
        prof.disable()
        sync()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        head = f"=== {'WIDE' if routed else 'dense'} {name}: host issue {host_ms:.2f} ms per call ({layers} layers)"
        print(head, flush=True)
        report += [head, s.getvalue()]
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/host_profile.txt", "w") as f:
        f.write("\n".join(report))


if __name__ == "__main__":
    main()
