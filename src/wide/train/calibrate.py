"""Stage 1: router calibration on a frozen backbone (paper §3.2).

loss = L_LM + sparsity loss (eq. 6 or 22); AdamW (no decay on biases), 10% warm-up + cosine,
gradient accumulation, clipping, τ annealed per optimizer step. Checkpoints are written atomically
every `save_every` steps and `resume=True` continues bit-for-bit (routers, optimizer, scheduler, τ,
step, data position, RNG). After the last step the per-router skip offsets are fitted so that
argmax routing skips at the rate the model was trained under (Gumbel-time rate), closing the
Gumbel/argmax gap.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from wide.config import WideConfig
from wide.model.checkpoint import atomic_write_bytes, save_routers
from wide.model.wide_model import WideModel
from wide.train.distributed import all_reduce_mean_, barrier, broadcast_, shard
from wide.train.distributed import world as dist_world
from wide.train.losses import model_flop_weights, routing_sparsity_loss, task_loss, teacher_hidden
from wide.train.threshold_fit import FIT_MODES, fit_thresholds

STATE_NAME = "trainer_state.pt"
LATEST = "latest"


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 16
    grad_accum: int = 1
    seq_len: int = 2048
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.1
    max_grad_norm: float = 1.0
    log_every: int = 10
    save_every: int = 200
    keep_checkpoints: int = 1
    fit_mode: str = "kind"  # argmax threshold fit after training: kind | router | global | none
    fit_batches: int = 4
    loss_chunk_tokens: int = 8192  # LM loss in chunks of this many tokens (0: the model's own loss)
    compile: bool = False  # torch.compile the decoder layers (hooks included)
    data_mode: str = "packed"
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fit_mode not in FIT_MODES:
            raise ValueError(f"fit_mode must be one of {FIT_MODES}, got {self.fit_mode!r}")
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "log_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPU, none (fp32) on CPU."""
    return torch.bfloat16 if device.type == "cuda" else None


def trainable_parameters(wm: WideModel, adapter=None) -> dict[str, torch.nn.Parameter]:
    """Routers, plus the LoRA parameters of `adapter` (a peft model wrapping wm.model) in stage 2."""
    params = {f"routers.{n}": p for n, p in wm.routers.named_parameters()}
    if adapter is not None:
        params.update({n: p for n, p in wm.model.named_parameters() if "lora_" in n})
    return params


def build_optimizer(params: dict[str, torch.nn.Parameter], tc: TrainConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in params.items():
        (no_decay if name.endswith("bias") else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(0.9, 0.95),
    )


def warmup_cosine(total_steps: int, warmup_frac: float):
    warm = max(1, int(round(total_steps * warmup_frac)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    return f


# ------------------------------------------------------------------------ RNG state
def rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------- checkpoints
def save_trainable(wm: WideModel, out: Path, adapter=None, training: dict | None = None) -> None:
    """Routers (wide_config.json + routers.safetensors) and, in stage 2, the LoRA adapter (peft format)."""
    save_routers(wm, out, training=training)
    if adapter is not None:
        adapter.save_pretrained(str(out))


def save_trainer_checkpoint(
    out: Path, step: int, wm: WideModel, opt, sched, order, tc: TrainConfig, log_state: dict, adapter=None
) -> Path:
    """Write checkpoint-{step}/ completely, then move the `latest` pointer to it (atomic), then prune.
    A kill at any moment leaves `latest` naming a complete checkpoint."""
    rank, ws = dist_world()
    ckpt = out / f"checkpoint-{step}"
    tmp = out / f".tmp-checkpoint-{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        save_trainable(wm, tmp, adapter, training={"step": step, "partial": True})
        state = {
            "step": step,
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "data_order": order.state_dict(),
            "rng": rng_state(),
            "tau": wm.tau,
            "train_config": asdict(tc),
            "log_state": log_state,
            "world_size": ws,
        }
        torch.save(state, tmp / STATE_NAME)
    barrier()
    if rank > 0:  # every rank keeps its own Gumbel-noise stream
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    barrier()
    if rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
        tmp.rename(ckpt)
        atomic_write_bytes(out / LATEST, ckpt.name.encode())
        olds = sorted((p for p in out.glob("checkpoint-*") if p != ckpt), key=lambda p: int(p.name.split("-")[1]))
        for p in olds[: max(0, len(olds) - (tc.keep_checkpoints - 1))]:
            shutil.rmtree(p, ignore_errors=True)
    barrier()
    return ckpt


def latest_checkpoint(out: Path) -> Path | None:
    ptr = out / LATEST
    if not ptr.is_file():
        return None
    ckpt = out / ptr.read_text().strip()
    return ckpt if (ckpt / STATE_NAME).is_file() else None


# -------------------------------------------------------------------------- the loop
def calibrate(
    wm: WideModel,
    dataset,
    tc: TrainConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    adapter=None,
) -> dict:
    """Train the routers of wm on dataset (a wide.train.data.TokenDataset); write checkpoints and the
    final routers into out_dir; return the training summary.

    adapter: stage 2 (LoRA recovery) — a peft model whose LoRA layers were injected into wm.model
    before the routers were attached; its LoRA parameters train together with the routers."""
    from wide.train.data import DataOrder

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = next(wm.model.parameters()).device
    cfg: WideConfig = wm.config
    rank, ws = dist_world()
    if tc.batch_size % ws:
        raise ValueError(f"batch_size {tc.batch_size} must be divisible by the {ws} data-parallel ranks")
    seed_everything(tc.seed + rank)
    wm.freeze_base()
    params = trainable_parameters(wm, adapter)
    for p in params.values():
        p.requires_grad_(True)
    wm.model.train(adapter is not None)  # stage 1: no dropout at all; stage 2: LoRA dropout on
    broadcast_([p.data for p in params.values()])  # identical starting point on every rank
    if tc.compile:
        wm.compile_layers()
    opt = build_optimizer(params, tc)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(tc.steps, tc.warmup_frac))
    order = DataOrder(len(dataset), tc.batch_size, seed=tc.seed)
    start, log_state = 0, {"tokens": 0, "elapsed": 0.0}
    if resume:
        ckpt = latest_checkpoint(out)
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {out}")
        from safetensors.torch import load_file

        wm.routers.load_state_dict(load_file(str(ckpt / "routers.safetensors")))
        if adapter is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(adapter, load_file(str(ckpt / "adapter_model.safetensors")))
        st = torch.load(ckpt / STATE_NAME, weights_only=False)
        if st["train_config"]["steps"] != tc.steps:
            raise ValueError(
                f"--resume with steps={tc.steps} but the run was started with "
                f"{st['train_config']['steps']} (the schedule depends on it)"
            )
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        order.load_state_dict(st["data_order"])
        if st.get("world_size", 1) != ws:
            raise ValueError(f"--resume on {ws} ranks, but the run was started on {st.get('world_size', 1)}")
        set_rng_state(st["rng"] if rank == 0 else torch.load(ckpt / f"rng_rank{rank}.pt", weights_only=False))
        start, log_state = st["step"], st["log_state"]
    amp = autocast_dtype(device)
    flop_w = model_flop_weights(wm, tc.seq_len) if cfg.sparsity_kind == "flops" else None  # FLOP-weighted target
    log_path = out / "train_log.jsonl"
    wm.mode = "gumbel"
    bar = tqdm(total=tc.steps, initial=start, disable=not progress or rank > 0, desc="calibrate", dynamic_ncols=True)
    t0 = time.perf_counter() - log_state["elapsed"]
    for step in range(start, tc.steps):
        wm.tau = cfg.tau_at(step, tc.steps)
        stats = torch.zeros(6, device=device)  # loss, lm, attn, ffn, attn_argmax, ffn_argmax
        for _ in range(tc.grad_accum):
            batch = dataset.batch(shard(order.next_batch(), rank, ws))
            ids, am = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            labels = batch["labels"].to(device)
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                teacher = teacher_hidden(wm, ids, am, adapter)  # [B, T, D] dense teacher, None unless distilling
                if tc.loss_chunk_tokens or teacher is not None:
                    hidden = wm.hidden_states(ids, attention_mask=am)
                    objective, lm = task_loss(wm, hidden, labels, teacher, tc.loss_chunk_tokens or 8192)
                else:
                    lm = objective = wm(ids, attention_mask=am, labels=labels).loss
            a, f = wm.skip_rates()
            loss = objective.float() + routing_sparsity_loss(a, f, cfg, flop_w)
            (loss / tc.grad_accum).backward()
            a_arg, f_arg = wm.skip_rates("_argmax")
            stats += (
                torch.stack(
                    [
                        loss.detach(),
                        lm.detach().float(),
                        a.mean().detach(),
                        f.mean().detach(),
                        a_arg.mean(),
                        f_arg.mean(),
                    ]
                )
                / tc.grad_accum
            )
            log_state["tokens"] += int(batch["attention_mask"].sum()) * ws  # host copy: no device sync
        all_reduce_mean_([p.grad for p in params.values() if p.grad is not None])
        torch.nn.utils.clip_grad_norm_(list(params.values()), tc.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.update(1)
        done = step + 1
        if done % tc.log_every == 0 or done == tc.steps:
            all_reduce_mean_([stats])
            s = stats.tolist()
            elapsed = time.perf_counter() - t0
            rec = {
                "step": done,
                "loss": s[0],
                "lm_loss": s[1],
                "attn_skip": s[2],
                "ffn_skip": s[3],
                "attn_skip_argmax": s[4],
                "ffn_skip_argmax": s[5],
                "tau": wm.tau,
                "lr": sched.get_last_lr()[0],
                "tokens": log_state["tokens"],
                "elapsed_s": elapsed,
                "tokens_per_s": log_state["tokens"] / max(elapsed, 1e-9),
            }
            if rank == 0:
                with open(log_path, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
            bar.set_postfix(loss=f"{s[1]:.3f}", attn=f"{s[4]:.2f}", ffn=f"{s[5]:.2f}", tau=f"{wm.tau:.2f}")
        if done % tc.save_every == 0 and done < tc.steps:
            log_state["elapsed"] = time.perf_counter() - t0
            save_trainer_checkpoint(out, done, wm, opt, sched, order, tc, log_state, adapter)
    bar.close()
    elapsed = time.perf_counter() - t0
    summary = {
        "steps": tc.steps,
        "tokens": log_state["tokens"],
        "wall_time_s": elapsed,
        "world_size": ws,
        "tokens_per_s": log_state["tokens"] / max(elapsed, 1e-9),
        "train_config": asdict(tc),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    wm.model.eval()
    if tc.fit_mode != "none":  # every rank fits on the same batches: identical thresholds everywhere
        fit_order = DataOrder(len(dataset), tc.batch_size, seed=tc.seed + 1)
        batches = [dataset.batch(fit_order.next_batch()) for _ in range(tc.fit_batches)]
        torch.manual_seed(tc.seed + 1)  # the fit samples Gumbel routes too: same noise on every rank
        summary["skip_bias_fit"] = fit_thresholds(wm, batches, device, tc.fit_mode)
    wm.mode = "argmax"
    summary["stage"] = "lora" if adapter is not None else "calibration"
    if rank == 0:
        save_trainable(wm, out, adapter, training=summary)
    barrier()
    return summary
