"""Where a stage-1 calibration step spends its GPU time: a SmolLM2-135M-shaped model with random weights.

Through the public `wide.train.calibrate.calibrate` on random tokens (throughput does not depend on the
weights): for each objective (`--distill`, comma list: none, kl+lm, ...) a warm-up run (compile, autotune),
then a timed run (tokens/s from its training log, steps after the first), then one more run under
torch.profiler whose CUDA kernels are summed per name. Writes OUT/profile-calibrate.txt (the tables) and
OUT/profile-calibrate.json (tokens/s and the top kernels per objective) after every objective.

Usage (repo root, one GPU):  PYTHONPATH=src python3 -m bench.profile.profile_calibrate --out "$OUT"
CPU smoke test:              PYTHONPATH=src python3 -m bench.profile.profile_calibrate --tiny --out /tmp/p
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from wide.bench.e2e import TINY_LLAMA, build_model
from wide.config import WideConfig
from wide.model import WideModel
from wide.train.calibrate import TrainConfig, calibrate
from wide.train.data import TokenDataset

SMOLLM2_135M = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def run(wm: WideModel, tc: TrainConfig, ds: TokenDataset, device: torch.device) -> float:
    """One calibrate call; tokens/s over its logged steps after the first."""
    with tempfile.TemporaryDirectory() as out:
        summary = calibrate(wm, ds, tc, out, progress=False, device=device)
        log = [json.loads(x) for x in (Path(out) / "train_log.jsonl").read_text().splitlines()]
    if len(log) >= 2:
        return (log[-1]["tokens"] - log[0]["tokens"]) / (log[-1]["elapsed_s"] - log[0]["elapsed_s"])
    return summary["tokens_per_s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama on the CPU (smoke test)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8, help="steps of the timed run (the profiled run: half)")
    ap.add_argument("--distill", default="none,kl+lm", help="comma list of objectives (WideConfig.distill)")
    ap.add_argument("--no-compile", action="store_true", help="eager decoder layers (default: --compile)")
    ap.add_argument("--top", type=int, default=40, help="kernel names per table")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    shape = TINY_LLAMA if a.tiny else SMOLLM2_135M
    dtype = torch.float32 if a.tiny else torch.bfloat16
    batch, seq = (2, 32) if a.tiny else (a.batch, a.seq_len)
    model = build_model(shape, str(device), dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (batch * max(2, a.steps), seq), generator=g)  # [n, T]
    ds = TokenDataset(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool))
    doc = {"shape": shape, "batch": batch, "seq_len": seq, "compile": not a.no_compile, "runs": []}
    doc["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines: list[str] = []
    for mode in a.distill.split(","):
        cfg = WideConfig(ffn_group_size=16 if a.tiny else 128, router_rank=8 if a.tiny else 32, distill=mode)
        wm = WideModel(model, cfg)

        def tc(steps: int) -> TrainConfig:
            return TrainConfig(steps=steps, batch_size=batch, seq_len=seq, log_every=1, save_every=10**9,
                               fit_mode="none", compile=not a.no_compile)  # fmt: skip

        t0 = time.perf_counter()
        run(wm, tc(3), ds, device)  # warm-up: compile, autotune
        warm_s = time.perf_counter() - t0
        tps = run(wm, tc(a.steps), ds, device)
        prof_steps = max(2, a.steps // 2)
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
        )
        with torch.profiler.profile(activities=acts) as prof:
            run(wm, tc(prof_steps), ds, device)
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        kind = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
        # kernels only on a GPU (an aten op's device time is its kernels' again)
        evs = [e for e in prof.key_averages() if getattr(e, key) > 0 and e.device_type == kind]
        evs.sort(key=lambda e: getattr(e, key), reverse=True)
        total = sum(getattr(e, key) for e in evs)
        top = [
            {
                "name": e.key[:120],
                "calls": e.count,
                "ms_per_step": getattr(e, key) / 1e3 / prof_steps,
                "share": getattr(e, key) / total,
            }  # fmt: skip
            for e in evs[: a.top]
        ]
        rec = {
            "distill": mode,
            "warmup_s": warm_s,
            "tokens_per_s": tps,
            "step_ms": batch * seq / tps * 1e3,
            "profiled_steps": prof_steps,
            "device_ms_per_step": total / 1e3 / prof_steps,
            "top": top,
        }
        doc["runs"].append(rec)
        head = (
            f"=== distill {mode}: {tps:,.0f} tokens/s ({rec['step_ms']:.1f} ms a step of {batch} x {seq}); "
            f"profiled {prof_steps} steps: {rec['device_ms_per_step']:.1f} ms of kernels a step"
        )
        lines.append(head)
        lines += [f"{t['ms_per_step']:9.3f} ms {t['share']:6.1%} {t['calls']:6d}  {t['name']}" for t in top]
        lines.append("")
        (out / "profile-calibrate.txt").write_text("\n".join(lines))
        (out / "profile-calibrate.json").write_text(json.dumps(doc, indent=1) + "\n")
        wm.detach()
        print(head, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
