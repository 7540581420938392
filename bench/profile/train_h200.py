"""Router calibration of a Llama-3.1-8B-shaped model on one GPU: throughput, peak memory, largest fit.

Random bf16 weights (no download) and random tokens; stage-1 calibration through the public
`wide.train.calibrate.calibrate` with activation checkpointing, at world size 1:
  1. replica mode (the plain model) at the base size, a few steps: steady tokens/s (after step 1);
  2. a search over batch x sequence (one step each, in increasing tokens per step; a sequence length
     stops at its first OOM; sizes that would overrun the time budget are skipped and recorded);
  3. FSDP2 mode (`--parallel fsdp`, one rank) at the base size, then at the largest size that fit.
Every record is written to OUT/train-h200.json as soon as it exists (fields: world_size, fsdp,
activation_checkpointing, batch, seq_len, tokens_per_s, peak_gb, ...), so a timeout keeps what ran.
An OOM (or any error) is caught per size and recorded.

Usage (repo root, one H200):  PYTHONPATH=src python3 -m bench.profile.train_h200 --out "$OUT"
CPU smoke test of the same code:  PYTHONPATH=src python3 -m bench.profile.train_h200 --tiny --out /tmp/t
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from wide.bench.e2e import LLAMA_8B, TINY_LLAMA, build_model
from wide.config import WideConfig
from wide.model import WideModel
from wide.train.calibrate import TrainConfig, calibrate
from wide.train.data import TokenDataset
from wide.train.distributed import init_from_env
from wide.train.fsdp import ParallelConfig

Size = tuple[int, int]  # (batch, seq_len)
# the search, in increasing tokens per step, the two sequence lengths interleaved (a time budget cuts both)
SEARCH_8B: list[Size] = sorted(
    [(b, 4096) for b in (8, 16, 32, 48, 64, 96)] + [(b, 16384) for b in (2, 4, 8, 12, 16)],
    key=lambda s: (s[0] * s[1], s[1]),
)
SEARCH_TINY: list[Size] = [(2, 32), (4, 32), (2, 64)]


def random_dataset(n: int, seq_len: int, vocab: int, seed: int = 0) -> TokenDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq_len), generator=g)  # [n, T]
    return TokenDataset(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool))


def _clear(wm: WideModel, device: torch.device) -> None:
    """Drop what a failed run may leave behind: router gradients, the last forward's masks, cached blocks."""
    for p in wm.parameters():
        p.grad = None
    for m in wm.last_masks:
        m.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_one(wm: WideModel, parallel: ParallelConfig, size: Size, steps: int, device: torch.device, vocab: int) -> dict:
    """Calibrate `steps` steps at size; tokens/s over the steps after the first (all of them if only one)."""
    batch, seq_len = size
    ds = random_dataset(batch * max(2, steps), seq_len, vocab)
    tc = TrainConfig(
        steps=steps,
        batch_size=batch,
        seq_len=seq_len,
        log_every=1,
        save_every=10**9,
        fit_mode="none",
        parallel=parallel,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory() as out:
        summary = calibrate(wm, ds, tc, out, progress=False, device=device)
        log = [json.loads(x) for x in (Path(out) / "train_log.jsonl").read_text().splitlines()]
    if len(log) >= 2:
        tps = (log[-1]["tokens"] - log[0]["tokens"]) / (log[-1]["elapsed_s"] - log[0]["elapsed_s"])
    else:
        tps = summary["tokens_per_s"]
    rec = {
        "world_size": summary["world_size"],
        "fsdp": parallel.mode == "fsdp",
        "activation_checkpointing": parallel.activation_checkpointing,
        "cpu_offload": parallel.cpu_offload,
        "batch": batch,
        "seq_len": seq_len,
        "tokens_per_step": batch * seq_len,
        "steps": steps,
        "timed_steps": max(1, len(log) - 1),
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / summary["world_size"],
        "wall_s": summary["wall_time_s"],
        "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else None,
        "final_loss": log[-1]["loss"],
        "ok": True,
    }
    return rec


def guarded(fn: Callable[[], dict], base: dict, cleanup: Callable[[], None]) -> dict:
    """fn() or, on an OOM / any error, a record saying so (`ok` False, `error`)."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        err = "OOM"
    except Exception as e:  # a failed size must not take the other records with it
        err = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        cleanup()
    return {**base, "ok": False, "error": err}


def search(
    try_size: Callable[[Size], dict], sizes: list[Size], time_left: Callable[[], float], est_s: Callable[[Size], float]
) -> list[dict]:
    """Try sizes in order; a sequence length stops at its first failure; a size whose estimated time
    exceeds the time left is skipped (recorded)."""
    recs, failed_seq = [], set()
    for size in sizes:
        if size[1] in failed_seq:
            continue
        if est_s(size) > time_left():
            recs.append({"batch": size[0], "seq_len": size[1], "ok": False, "error": "skipped: time budget"})
            continue
        rec = try_size(size)
        recs.append(rec)
        if not rec["ok"]:
            failed_seq.add(size[1])
    return recs


def largest_fit(records: list[dict]) -> dict | None:
    fits = [r for r in records if r.get("ok")]
    return max(fits, key=lambda r: (r["batch"] * r["seq_len"], r["seq_len"])) if fits else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for train-h200.json (default $OUT)")
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama on the CPU (smoke test of this script)")
    ap.add_argument("--steps", type=int, default=4, help="steps of the timed runs at the base size")
    ap.add_argument("--base", default=None, help="base size BATCHxSEQ (default 4x4096; tiny 2x32)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new runs past this many seconds")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    created_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    try:
        init_from_env(single_process=True)  # FSDP needs a process group, even of one rank
        group_error = None
    except Exception as e:  # the replica runs do not need it
        group_error = f"process group: {type(e).__name__}: {e}"
        traceback.print_exc()
    shape = TINY_LLAMA if a.tiny else LLAMA_8B
    dtype = torch.float32 if a.tiny else torch.bfloat16
    base: Size = tuple(int(x) for x in (a.base or ("2x32" if a.tiny else "4x4096")).split("x"))  # type: ignore[assignment]
    sizes = SEARCH_TINY if a.tiny else SEARCH_8B

    model = build_model(shape, str(device), dtype)
    wm = WideModel(model, WideConfig(ffn_group_size=16 if a.tiny else 128, router_rank=8 if a.tiny else 32))
    doc = {
        "what": "stage-1 router calibration, Llama-3.1-8B-shaped random model" if not a.tiny else "tiny smoke test",
        "shape": shape,
        "dtype": str(dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "command": "python3 -m bench.profile.train_h200 " + " ".join(argv if argv is not None else sys.argv[1:]),
        "build_s": time.perf_counter() - t_start,
        "records": [],
    }
    if group_error:
        doc["fsdp_error"] = group_error

    def write() -> None:
        doc["largest_fit"] = largest_fit([r for r in doc["records"] if not r["fsdp"]])
        doc["elapsed_s"] = time.perf_counter() - t_start
        (out / "train-h200.json").write_text(json.dumps(doc, indent=1) + "\n")

    def attempt(parallel: ParallelConfig, size: Size, steps: int, phase: str) -> dict:
        base_rec = {
            "phase": phase,
            "world_size": 1,
            "fsdp": parallel.mode == "fsdp",
            "activation_checkpointing": parallel.activation_checkpointing,
            "batch": size[0],
            "seq_len": size[1],
        }
        rec = guarded(
            lambda: {**base_rec, **run_one(wm, parallel, size, steps, device, shape["vocab_size"])},
            base_rec,
            lambda: _clear(wm, device),
        )
        doc["records"].append(rec)
        write()
        print(json.dumps(rec), flush=True)
        return rec

    time_left = lambda: a.budget_s - (time.perf_counter() - t_start)  # noqa: E731
    replica = ParallelConfig("replica", activation_checkpointing=True)
    first = attempt(replica, base, a.steps, "base")
    rate = first["tokens_per_s"] if first["ok"] else None

    def est_s(size: Size) -> float:  # one step plus fixed overhead, from the measured rate
        return 0.0 if rate is None else 1.5 * size[0] * size[1] / rate + 5.0

    search(lambda s: attempt(replica, s, 1, "search"), sizes, time_left, est_s)
    fsdp = ParallelConfig("fsdp", activation_checkpointing=True)  # wraps the model in place: runs last
    if group_error is None and est_s(base) * a.steps < time_left():
        attempt(fsdp, base, a.steps, "fsdp")
    best = doc["largest_fit"]
    big: Size | None = (best["batch"], best["seq_len"]) if best is not None else None
    if group_error is None and big is not None and big != base and est_s(big) < time_left():
        attempt(fsdp, big, 1, "fsdp")
    write()
    print(f"wrote {out / 'train-h200.json'} ({doc['elapsed_s']:.0f} s); largest fit: {doc['largest_fit']}")
    if created_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
