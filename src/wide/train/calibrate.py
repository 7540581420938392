"""Stage 1: router calibration on a frozen backbone (paper §3.2).

loss = L_LM + sparsity loss (eq. 6 or 22); AdamW (no decay on biases), 10% warm-up + cosine,
gradient accumulation, clipping, τ annealed per optimizer step. Checkpoints are written atomically
every `save_every` steps and `resume=True` continues bit-for-bit (routers, optimizer, scheduler, τ,
step, data position, RNG). After the last step the per-router skip offsets are fitted so that
argmax routing skips at the rate the model was trained under (Gumbel-time rate), closing the
Gumbel/argmax gap.

Run directory (``out_dir``, docs/training.md#run-folders): ``wide_run.json`` (the run manifest: the
checkpoints this run wrote, of which pruning touches only those, and what the result depends on beyond
the settings: dtype, device kind, the data's content hash, versions; see ``run_provenance``),
``.wide-lock`` while a process writes there (one writer per folder, `wide.train.run_lock`),
``checkpoint-{step}/`` (routers + ``trainer_state.safetensors``: tensors plus a JSON header, never a
pickle), ``latest``, ``train_log.jsonl`` and the final routers. A fresh run refuses a non-empty directory
unless ``overwrite``; ``resume`` refuses any change of a setting that shapes training (see
``check_out_dir``) and, unless ``resume_anyway``, any change of the provenance.
A step whose loss or router gradients are not finite stops the run before the optimizer applies it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from wide.config import WideConfig
from wide.model.checkpoint import (
    CONFIG_NAME,
    TMP_PREFIX,
    WEIGHTS_NAME,
    atomic_write_bytes,
    check_finite,
    dir_mode,
    file_mode,
    load_tensors,
    save_routers,
)
from wide.model.wide_model import WideModel
from wide.target import model_flop_weights, routing_sparsity_loss
from wide.train.distributed import all_reduce_mean_, barrier, broadcast_, global_batch_terms, rank_seed, shard
from wide.train.distributed import world as dist_world
from wide.train.fsdp import (
    ParallelConfig,
    clip_grad_norm_,
    load_lora_state_,
    load_optimizer_state_dict_,
    lora_state_dict,
    optimizer_state_dict,
    perf_fields,
    prepare_model,
)
from wide.train.losses import task_loss, teacher_hidden
from wide.train.run_lock import LOCK_NAME, run_lock
from wide.train.threshold_fit import FIT_MODES, fit_thresholds, skip_biases

STATE_NAME = "trainer_state.safetensors"  # tensors + a JSON header (safetensors metadata): no pickle
LEGACY_STATE_NAME = "trainer_state.pt"  # written by older versions as a pickle: never loaded
STATE_FORMAT = "wide-trainer-state"
STATE_VERSION = 1
LATEST = "latest"
LOG_NAME = "train_log.jsonl"
MANIFEST_NAME = "wide_run.json"
MANIFEST_FORMAT = "wide-run"
# TrainConfig fields that may change on --resume: they do not shape the training trajectory.
# parallel (replica / fsdp, activation checkpointing, CPU offload) is a layout, not a setting of the
# training: a run may resume in another layout and on another number of ranks (docs/training.md).
RESUME_MAY_CHANGE = frozenset(
    {
        "log_every",
        "save_every",
        "keep_checkpoints",
        "compile",
        "fit_mode",
        "fit_batches",
        "loss_chunk_tokens",
        "parallel",
    }
)


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
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # replica / fsdp, checkpointing, offload

    def __post_init__(self) -> None:
        if isinstance(self.parallel, dict):
            self.parallel = ParallelConfig(**self.parallel)
        if self.compile and (self.parallel.mode == "fsdp" or self.parallel.activation_checkpointing):
            raise ValueError("--compile cannot be combined with --parallel fsdp or --activation-checkpointing")
        if self.fit_mode not in FIT_MODES:
            raise ValueError(f"fit_mode must be one of {FIT_MODES}, got {self.fit_mode!r}")
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "log_every", "save_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not 0.0 <= self.warmup_frac <= 1.0:
            raise ValueError(f"warmup_frac must be in [0, 1], got {self.warmup_frac}")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a finite number > 0, got {self.max_grad_norm}")
        if self.fit_batches < 1 and self.fit_mode != "none":
            raise ValueError(f"fit_batches must be >= 1, got {self.fit_batches}")
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens must be >= 0, got {self.loss_chunk_tokens}")
        if self.data_mode not in ("packed", "padded"):
            raise ValueError(f"data_mode must be 'packed' or 'padded', got {self.data_mode!r}")


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


def seeded_wide_model(model: torch.nn.Module, config: WideConfig, **kwargs) -> WideModel:
    """WideModel whose routers are initialised from ``config.seed``: the same seed gives bit-identical
    routers (the router initialisation draws from the global torch generator)."""
    seed_everything(config.seed)
    return WideModel(model, config, **kwargs)


def rng_to_portable(s: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An rng_state() as (tensors, JSON-able dict): torch / CUDA generator bytes as uint8 tensors,
    Python's Mersenne Twister as its 625 ints, numpy's as its 624 keys plus position and Gaussian cache."""
    tensors = {"rng.torch": s["torch"]}
    for i, c in enumerate(s.get("cuda", [])):
        tensors[f"rng.cuda.{i}"] = c
    version, mt, gauss = s["python"]
    name, keys, pos, has_gauss, cached = s["numpy"]
    js = {
        "python": {"version": version, "state": list(mt), "gauss_next": gauss},
        "numpy": {"name": name, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss)},
        "n_cuda": len(s.get("cuda", [])),
    }
    js["numpy"]["cached_gaussian"] = float(cached)
    return tensors, js


def rng_from_portable(tensors: dict[str, torch.Tensor], js: dict) -> dict:
    """Inverse of rng_to_portable (KeyError / TypeError / ValueError on a malformed state)."""
    py, npy = js["python"], js["numpy"]
    if len(py["state"]) != 625 or len(npy["keys"]) != 624:
        raise ValueError("RNG state of the wrong length")
    s = {
        "torch": tensors["rng.torch"],
        "python": (int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]),
        "numpy": (
            str(npy["name"]),
            np.asarray(npy["keys"], dtype=np.uint32),
            int(npy["pos"]),
            int(npy["has_gauss"]),
            float(npy["cached_gaussian"]),
        ),
    }
    if js.get("n_cuda"):
        s["cuda"] = [tensors[f"rng.cuda.{i}"] for i in range(int(js["n_cuda"]))]
    return s


# -------------------------------------------------------------- trainer state files
def write_state(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """tensors + a JSON header in one safetensors file, written to a temporary name then renamed."""
    from safetensors.torch import save_file

    header = {"format": STATE_FORMAT, "format_version": str(STATE_VERSION), "state": json.dumps(meta)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp, metadata=header)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_state(path: Path, *, tensors: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of a write_state file; a one-line ValueError naming the file for anything
    else (a truncated file, a pickle, a foreign safetensors file). Never unpickles."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            if header.get("format") != STATE_FORMAT:
                raise ValueError(f"not a {STATE_FORMAT} file")
            if int(header.get("format_version", 0)) > STATE_VERSION:
                raise ValueError(f"format_version {header['format_version']} is newer than this wide's")
            meta = json.loads(header["state"])
            out = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}  # noqa: SIM118 (not iterable)
    except FileNotFoundError:
        raise FileNotFoundError(f"trainer state {path} is missing") from None
    except Exception as e:  # SafetensorError (truncated / not safetensors), bad JSON, bad header
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"trainer state {path} is unreadable (truncated or not written by wide): {msg}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"trainer state {path} has a malformed header")
    return out, meta


def optimizer_to_portable(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state_dict as (tensors, JSON-able dict)."""
    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, dict] = {}
    for pid, st in sd["state"].items():
        entry: dict = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optimizer.{pid}.{k}"] = v
                entry[k] = {"tensor": f"optimizer.{pid}.{k}"}
            else:
                entry[k] = {"value": v}
        state[str(pid)] = entry
    return tensors, {"state": state, "param_groups": sd["param_groups"]}


def optimizer_from_portable(tensors: dict[str, torch.Tensor], js: dict, opt: torch.optim.Optimizer) -> dict:
    """Inverse of optimizer_to_portable; tuples (AdamW's betas) come back as tuples, as opt has them."""
    state = {
        int(pid): {k: tensors[v["tensor"]] if "tensor" in v else v["value"] for k, v in entry.items()}
        for pid, entry in js["state"].items()
    }
    groups = []
    for saved, cur in zip(js["param_groups"], opt.param_groups, strict=True):
        groups.append({k: tuple(v) if isinstance(cur.get(k), tuple) else v for k, v in saved.items()})
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------- run directory
def _step_of(name: str) -> int | None:
    """The step of a `checkpoint-{step}` name, None for any other name (checkpoint-best, ...)."""
    tail = name.removeprefix("checkpoint-")
    return int(tail) if tail != name and tail.isdigit() else None


def read_manifest(out: Path) -> dict | None:
    """The run manifest of out (the checkpoints this run wrote), None when there is none."""
    path = out / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("checkpoints"), list):
        raise ValueError(f"{path} is not a {MANIFEST_FORMAT} manifest")
    m["checkpoints"] = [c for c in m["checkpoints"] if isinstance(c, str) and _step_of(c) is not None]
    return m


def write_manifest(out: Path, checkpoints: list[str], run: dict | None = None) -> None:
    """run: what the result depends on (`run_provenance`, and the changes a --resume-anyway accepted);
    None keeps what the manifest records."""
    if run is None:
        run = (read_manifest(out) or {}).get("run")
    m = {"format": MANIFEST_FORMAT, "format_version": 1, "checkpoints": checkpoints}
    if run is not None:
        m["run"] = run
    atomic_write_bytes(out / MANIFEST_NAME, (json.dumps(m, indent=1) + "\n").encode())


def device_kind(device: torch.device) -> str:
    """The kind of device: cpu, or cuda:<the GPU's name> (another GPU model gives other arithmetic)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def run_provenance(dtype: torch.dtype, device: torch.device, dataset=None) -> dict:
    """What a run's result depends on beyond its TrainConfig and WideConfig: the weights' dtype, the
    device kind, the package versions and (given the dataset) the content hash of its tokens. A resume
    must see the same, or it is no longer the uninterrupted run bit for bit."""
    import wide

    prov = {
        "dtype": str(dtype).removeprefix("torch."),
        "device": device_kind(device),
        "wide": wide.__version__,
        "torch": torch.__version__,
    }
    content_hash = getattr(dataset, "content_hash", None)
    if content_hash is not None:
        prov["data_sha256"] = content_hash()
    return prov


def _remove(path: Path) -> None:
    """Remove a checkpoint folder of this run; a symlink put in its place is removed, never followed."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _is_tmp_of(name: str, checkpoints: list[str]) -> bool:
    """Whether name is the temporary folder of one of checkpoints (`.tmp-checkpoint-N`, with a writer's tag)."""
    base = name.removeprefix(TMP_PREFIX)
    return base != name and any(base == c or base.startswith(c + ".") for c in checkpoints)


def is_wide_run(out: Path) -> bool:
    """True when out holds a run manifest or the final routers of a run (wide_config.json of ours)."""
    if (out / MANIFEST_NAME).is_file():
        return True
    try:
        return json.loads((out / CONFIG_NAME).read_text()).get("format") == "wide-routers"
    except (OSError, ValueError, AttributeError):
        return False


def check_writable(out: Path) -> None:
    """Raise a one-line ValueError when out (or, if it does not exist yet, its nearest existing parent)
    cannot take new files; creates nothing that stays."""
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--out {out}: {probe} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ValueError(f"--out {out} is not writable ({e.strerror or e})") from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _compare(what: str, saved: dict, now: dict, skip: frozenset = frozenset(), where: Path | None = None) -> None:
    for k in sorted(set(saved) | set(now)):
        if k in skip or saved.get(k) == now.get(k):
            continue
        why = " (the LR and tau schedules depend on it)" if k == "steps" else ""
        raise ValueError(
            f"--resume: {_flag(k)} {now.get(k)!r} differs from {saved.get(k)!r} that the run in {where} was "
            f"started with ({what}){why}; resume with the same value or start a new run in another --out"
        )


def check_out_dir(
    out_dir: str | Path,
    tc: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    config: WideConfig | None = None,
    base_model: str | None = None,
    provenance: dict | None = None,
    resume_anyway: bool = False,
) -> dict:
    """Everything about --out that can fail, checked before any expensive work; writes nothing.
    Returns the provenance entries that differ from the resumed checkpoint's ({name: (then, now)}), which
    only resume_anyway accepts (a one-line ValueError otherwise); {} for a fresh run.

    Fresh run: out must be writable and empty, or (with overwrite) a directory WIDE may write its own
    files into; checkpoint names this run will write must not belong to anyone else.
    Resume: the latest checkpoint must be readable and every setting that shapes training (the
    TrainConfig outside RESUME_MAY_CHANGE, its `extra` (model, data, ...), the WideConfig, the base
    model) equal to the one the run was started with."""
    from wide.paths import check_outside_package

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    check_outside_package(out, "--out")
    check_writable(out)
    if resume:
        if overwrite:
            raise ValueError("--resume and --overwrite exclude each other")
        ckpt = latest_checkpoint(out)
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {out}")
        _, meta = read_state(ckpt / STATE_NAME, tensors=False)
        saved_tc = dict(meta.get("train_config", {}))
        saved_extra, now_extra = saved_tc.pop("extra", {}) or {}, asdict(tc).pop("extra", {})
        _compare("training", saved_extra, now_extra, where=out)
        _compare("training", saved_tc, {k: v for k, v in asdict(tc).items() if k != "extra"}, RESUME_MAY_CHANGE, out)
        if config is not None:
            # from_dict: a field added after the run started was absent then, so the run had its default
            saved_cfg = WideConfig.from_dict(meta.get("wide_config", {})).to_dict()
            _compare("routing config", saved_cfg, config.to_dict(), where=out)
        if base_model is not None and meta.get("base_model") not in (None, base_model):
            raise ValueError(
                f"--resume: --model {base_model!r} differs from {meta['base_model']!r} that the run in {out} "
                "was started with"
            )
        # a checkpoint older than the record has none: nothing to compare
        then, now = meta.get("run") or {}, provenance or {}
        changed = {k: (then[k], now[k]) for k in sorted(set(then) & set(now)) if then[k] != now[k]}
        if changed and not resume_anyway:
            what = "; ".join(f"{k} {a!r} then, {b!r} now" for k, (a, b) in changed.items())
            raise ValueError(
                f"--resume: the run in {out} changed ({what}): it would not continue bit for bit; resume as it "
                "was started, start a new run, or pass --resume-anyway to continue regardless"
            )
        return changed
    entries = [p for p in out.iterdir() if p.name != LOCK_NAME] if out.is_dir() else []
    if not entries:
        return {}
    if is_wide_run(out):
        if not overwrite:
            raise ValueError(
                f"--out {out} already holds a WIDE run: pass --resume to continue it, or --overwrite to "
                "start a new run there (its previous checkpoints and results are replaced)"
            )
    elif not overwrite:
        names = sorted(p.name for p in entries)
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise ValueError(
            f"--out {out} is not empty ({shown}) and is not a WIDE run: choose a new or empty directory, "
            "or pass --overwrite to let WIDE write its files there"
        )
    ours = set((read_manifest(out) or {"checkpoints": []})["checkpoints"])
    for p in entries:
        step = _step_of(p.name.removeprefix(".tmp-"))
        if step is None or p.name.removeprefix(".tmp-") in ours:
            continue
        if step % tc.save_every == 0 and step < tc.steps:
            raise ValueError(
                f"--out {out} holds {p.name}/, which this run would write over but did not make: "
                "move it away or choose another --out"
            )
    return {}


def prepare_out_dir(out: Path, *, resume: bool, overwrite: bool, run: dict | None = None) -> None:
    """Rank 0, after check_out_dir, holding the run lock: create out; remove the temporary folders a
    killed writer of this run left; a fresh run removes what an earlier run there wrote (its manifest's
    checkpoints, `latest`, the log and final routers; with overwrite only) and starts a new manifest.
    run: the provenance to record (`run_provenance`)."""
    out.mkdir(parents=True, exist_ok=True)
    ours = (read_manifest(out) or {"checkpoints": []})["checkpoints"]
    for p in out.iterdir():  # no other process writes here (the lock): these are a dead writer's
        if _is_tmp_of(p.name, ours):
            _remove(p)
    if resume:
        write_manifest(out, ours or [latest_checkpoint(out).name], run)  # pre-manifest runs: latest is ours
        return
    if overwrite:
        for name in ours:
            _remove(out / name)
        for name in (LATEST, LOG_NAME, WEIGHTS_NAME, CONFIG_NAME, "adapter_model.safetensors", "adapter_config.json"):
            (out / name).unlink(missing_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # nothing of the earlier run's record carries over
    write_manifest(out, [], run)


def truncate_log(path: Path, step: int) -> None:
    """Keep the log records up to `step` (a resumed run logs the later ones again); drop torn lines."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            keep.append(line + "\n")
    atomic_write_bytes(path, "".join(keep).encode())


# ---------------------------------------------------------------------- checkpoints
def save_trainable(wm: WideModel, out: Path, adapter=None, training: dict | None = None, lora_state=None) -> None:
    """Routers (wide_config.json + routers.safetensors) and, in stage 2, the LoRA adapter (peft format).
    lora_state: the LoRA tensors gathered by wide.train.fsdp.lora_state_dict (needed when sharded)."""
    save_routers(wm, out, training=training)
    if adapter is not None:
        adapter.save_pretrained(str(out), state_dict=lora_state)


def writer_tag() -> str:
    """This run's tag in the names of its temporary folders (rank 0's pid and a random part, the same on
    every rank): two writers never share one, and the run lock keeps a second writer out anyway."""
    token = torch.tensor([os.getpid(), random.SystemRandom().getrandbits(31)], dtype=torch.int64)
    broadcast_([token])
    return f"{int(token[0])}-{int(token[1]):x}"


def save_trainer_checkpoint(
    out: Path,
    step: int,
    wm: WideModel,
    opt,
    sched,
    order,
    tc: TrainConfig,
    log_state: dict,
    adapter=None,
    tag: str | None = None,
    run: dict | None = None,
) -> Path:
    """Write checkpoint-{step}/ completely (in `.tmp-checkpoint-{step}.{tag}`, then renamed), then move the
    `latest` pointer to it (atomic), then prune the oldest checkpoints this run wrote (those in the
    manifest; nothing else is ever deleted). A kill at any moment leaves `latest` naming a complete
    checkpoint; a failed write (a full disk) leaves no temporary folder. run: the provenance, recorded
    with the trainer state (what a resume compares)."""
    rank, ws = dist_world()
    ckpt = out / f"checkpoint-{step}"
    tmp = out / f"{TMP_PREFIX}{ckpt.name}.{tag or os.getpid()}"
    optim, lora = optimizer_state_dict(wm, opt), lora_state_dict(adapter)  # collectives when sharded
    try:
        _write_checkpoint_tmp(out, tmp, ckpt, step, wm, optim, lora, sched, order, tc, log_state, adapter, run)
    except BaseException:
        if rank == 0:
            _remove(tmp)
        raise
    if rank == 0:
        manifest = read_manifest(out) or {"checkpoints": []}
        mine = [c for c in manifest["checkpoints"] if c != ckpt.name]
        _remove(ckpt)
        tmp.rename(ckpt)
        atomic_write_bytes(out / LATEST, ckpt.name.encode())
        olds = sorted(mine, key=_step_of)
        drop = olds[: max(0, len(olds) - (tc.keep_checkpoints - 1))]
        for name in drop:
            _remove(out / name)
        write_manifest(out, [c for c in mine if c not in drop] + [ckpt.name])
    barrier()
    return ckpt


def _write_checkpoint_tmp(out, tmp, ckpt, step, wm, optim, lora, sched, order, tc, log_state, adapter, run) -> None:
    """save_trainer_checkpoint's writing, into tmp, by every rank."""
    rank, ws = dist_world()
    if rank == 0:
        manifest = read_manifest(out) or {"checkpoints": []}
        mine = [c for c in manifest["checkpoints"] if c != ckpt.name]
        write_manifest(out, mine + [ckpt.name])  # recorded before it exists: a kill leaves no unowned dir
        _remove(tmp)
        tmp.mkdir()
        tmp.chmod(dir_mode())
        save_trainable(wm, tmp, adapter, training={"step": step, "partial": True}, lora_state=lora)
        opt_tensors, opt_js = optimizer_to_portable(optim)  # full tensors, torch's numbering: any rank count
        rng_tensors, rng_js = rng_to_portable(rng_state())
        meta = {
            "step": step,
            "optimizer": opt_js,
            "scheduler": sched.state_dict(),
            "data_order": order.state_dict(),
            "rng": rng_js,
            "tau": wm.tau,
            "train_config": asdict(tc),
            "wide_config": wm.config.to_dict(),
            "base_model": wm.base_model_id,
            "log_state": log_state,
            "world_size": ws,
            "run": run,
        }
        write_state(tmp / STATE_NAME, {**opt_tensors, **rng_tensors}, meta)
    barrier()
    if rank > 0:  # every rank keeps its own Gumbel-noise stream
        rng_tensors, rng_js = rng_to_portable(rng_state())
        write_state(tmp / f"rng_rank{rank}.safetensors", rng_tensors, {"rng": rng_js})
    barrier()


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint `latest` names, None when there is no complete one; a ValueError for one
    written by an older wide as a pickle (never loaded: unpickling can run code)."""
    ptr = out / LATEST
    if not ptr.is_file():
        return None
    name = ptr.read_text(errors="replace").strip()
    if _step_of(name) is None:
        return None
    ckpt = out / name
    if not (ckpt / STATE_NAME).is_file() and (ckpt / LEGACY_STATE_NAME).is_file():
        raise ValueError(
            f"{ckpt / LEGACY_STATE_NAME} is a pickled trainer state from an older wide; it is not loaded "
            "(unpickling can run code): start a new run"
        )
    return ckpt if (ckpt / STATE_NAME).is_file() else None


# -------------------------------------------------------------------------- the loop
def calibrate(
    wm: WideModel,
    dataset,
    tc: TrainConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    adapter=None,
    device: torch.device | None = None,
    resume_anyway: bool = False,
) -> dict:
    """Train the routers of wm on dataset (a wide.train.data.TokenDataset); write checkpoints and the
    final routers into out_dir; return the training summary.

    overwrite: start in a non-empty out_dir (see check_out_dir); resume: continue its latest checkpoint;
    resume_anyway: also when the dtype, device kind, data content or versions changed (each change is
    printed and recorded in the manifest).
    adapter: stage 2 (LoRA recovery) — a peft model whose LoRA layers were injected into wm.model
    before the routers were attached; its LoRA parameters train together with the routers.
    device: where the computation runs (default: where the model's parameters are; needed when the
    model was loaded on the CPU for `tc.parallel` fsdp / cpu_offload).

    Rank 0 holds out_dir's run lock throughout (`wide.train.run_lock`): a second writer is refused.
    A ValueError stops a step whose loss or router gradients are not finite, before the optimizer applies
    it: no checkpoint ever holds its weights."""
    lock = run_lock(out_dir) if dist_world()[0] == 0 else contextlib.nullcontext()
    with lock, contextlib.ExitStack() as scope:  # scope: closes the progress bar before an error is shown
        args = (resume, overwrite, progress, adapter, device, resume_anyway, scope)
        return _calibrate(wm, dataset, tc, Path(out_dir), *args)


def _calibrate(wm, dataset, tc, out, resume, overwrite, progress, adapter, device, resume_anyway, scope) -> dict:
    from wide.train.data import DataError, DataOrder

    device = device or next(wm.model.parameters()).device
    cfg: WideConfig = wm.config
    rank, ws = dist_world()
    if tc.batch_size % ws:
        raise ValueError(f"batch_size {tc.batch_size} must be divisible by the {ws} data-parallel ranks")
    dtype = getattr(wm.model, "dtype", None) or next(wm.model.parameters()).dtype
    run = run_provenance(dtype, device, dataset)
    changed = check_out_dir(
        out,
        tc,
        resume=resume,
        overwrite=overwrite,
        config=cfg,
        base_model=wm.base_model_id,
        provenance=run,
        resume_anyway=resume_anyway,
    )
    if changed:
        ckpt_name = latest_checkpoint(out).name
        for k, (then, now) in changed.items():
            if rank == 0:
                print(f"--resume-anyway: {k} was {then!r}, is {now!r} from {ckpt_name} on", file=sys.stderr)
        earlier = ((read_manifest(out) or {}).get("run") or {}).get("resumed_anyway", [])
        run = {**run, "resumed_anyway": [*earlier, {"from": ckpt_name, "changed": changed}]}
    order = DataOrder(len(dataset), tc.batch_size, seed=tc.seed)
    tag = writer_tag()  # a collective
    barrier()  # every rank has checked out_dir before rank 0 changes it
    if rank == 0:
        prepare_out_dir(out, resume=resume, overwrite=overwrite, run=run)
    barrier()
    seed_everything(tc.seed + rank)
    wm.freeze_base()
    params = trainable_parameters(wm, adapter)
    for p in params.values():
        p.requires_grad_(True)
    wm.model.train(adapter is not None)  # stage 1: no dropout at all; stage 2: LoRA dropout on
    broadcast_([p.data for p in params.values()])  # identical starting point on every rank
    prepare_model(wm, tc.parallel, device)  # activation checkpointing, FSDP2 (docs/training.md)
    params = trainable_parameters(wm, adapter)  # FSDP replaces the LoRA parameters by sharded ones
    if tc.compile:
        wm.compile_layers()
    opt = build_optimizer(params, tc)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(tc.steps, tc.warmup_frac))
    start, log_state = 0, {"tokens": 0, "elapsed": 0.0}
    log_path = out / LOG_NAME
    if resume:
        ckpt = latest_checkpoint(out)
        tensors, st = read_state(ckpt / STATE_NAME)
        same_world = st.get("world_size", 1) == ws  # else the per-rank noise streams restart (below)
        saved_n = st.get("data_order", {}).get("n_examples")
        if saved_n is not None and saved_n != len(dataset):
            raise DataError(
                f"--resume: --data now gives {len(dataset)} training sequences, the run in {out} was "
                f"trained on {saved_n}: the data changed; resume with the same data or start a new run"
            )
        state = load_tensors(ckpt / WEIGHTS_NAME)
        check_finite(state, ckpt / WEIGHTS_NAME)
        wm.routers.load_state_dict(state)
        if adapter is not None:
            load_lora_state_(adapter, load_tensors(ckpt / "adapter_model.safetensors"))
        rng_file = ckpt / f"rng_rank{rank}.safetensors"
        try:
            load_optimizer_state_dict_(wm, opt, optimizer_from_portable(tensors, st["optimizer"], opt))
            sched.load_state_dict(st["scheduler"])
            order.load_state_dict(st["data_order"])
            rng = None
            if same_world:
                rng = rng_from_portable(tensors, st["rng"]) if rank == 0 else rng_from_portable(*_rank_rng(rng_file))
            start, log_state = int(st["step"]), dict(st["log_state"])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"trainer state {ckpt / STATE_NAME} is malformed: {type(e).__name__}: {e}") from None
        if rng is not None:
            set_rng_state(rng)
        else:  # per-rank noise streams cannot continue on another number of ranks: restart them
            seed_everything(rank_seed(tc.seed, rank, start))
        if rank == 0:
            truncate_log(log_path, start)
    amp = autocast_dtype(device)
    # the offsets this run samples under (0 in stage 1, the stage-1 fit's in stage 2): the final fit's target
    train_bias = skip_biases(wm)
    flop_w = model_flop_weights(wm, tc.seq_len) if cfg.sparsity_kind == "flops" else None  # FLOP-weighted target
    wm.mode = "gumbel"
    bar = tqdm(total=tc.steps, initial=start, disable=not progress or rank > 0, desc="calibrate", dynamic_ncols=True)
    scope.enter_context(bar)
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
                    objective, lm = task_loss(
                        wm, hidden, labels, teacher, tc.loss_chunk_tokens or 8192, compiled=tc.compile
                    )
                else:
                    lm = objective = wm(ids, attention_mask=am, labels=labels).loss
            a, f = wm.skip_rates()
            # the global batch's terms: objective and LM loss weighted by token share, rates all-reduced
            objective, a, f, lm = global_batch_terms(objective, a, f, labels, am, lm)
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
        norm = clip_grad_norm_(params.values(), tc.max_grad_norm, device)  # the same on every rank
        # stats[0]: the step's loss, global over ranks (global_batch_terms); one host sync per step
        if not bool(torch.isfinite(stats[0]) & torch.isfinite(norm)):
            raise NonFiniteError(
                f"training diverged at step {step + 1}: loss {float(stats[0])}, router gradient norm "
                f"{float(norm)}; the step was not applied and no checkpoint holds it "
                f"({_last_checkpoint_note(out)}): lower --lr or --alpha, train in --dtype fp32, or check the data"
            )
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
            rec.update(perf_fields(log_state["tokens"], elapsed, device))  # per GPU; a collective
            if rank == 0:
                with open(log_path, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
            bar.set_postfix(loss=f"{s[1]:.3f}", attn=f"{s[4]:.2f}", ffn=f"{s[5]:.2f}", tau=f"{wm.tau:.2f}")
        if done % tc.save_every == 0 and done < tc.steps:
            log_state["elapsed"] = time.perf_counter() - t0
            save_trainer_checkpoint(out, done, wm, opt, sched, order, tc, log_state, adapter, tag=tag, run=run)
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
    summary.update(perf_fields(log_state["tokens"], elapsed, device))
    wm.model.eval()
    if tc.fit_mode != "none":  # every rank fits on the same batches: identical thresholds everywhere
        fit_order = DataOrder(len(dataset), tc.batch_size, seed=tc.seed + 1)
        batches = [dataset.batch(fit_order.next_batch()) for _ in range(tc.fit_batches)]
        torch.manual_seed(tc.seed + 1)  # the fit samples Gumbel routes too: same noise on every rank
        summary["skip_bias_fit"] = fit_thresholds(wm, batches, device, tc.fit_mode, train_bias)
    wm.mode = "argmax"
    summary["stage"] = "lora" if adapter is not None else "calibration"
    lora = lora_state_dict(adapter)  # a collective when sharded
    if rank == 0:
        save_trainable(wm, out, adapter, training=summary, lora_state=lora)
    barrier()
    return summary


class NonFiniteError(ValueError):
    """A training step whose loss or gradients hold NaN or inf."""


def _last_checkpoint_note(out: Path) -> str:
    try:
        ckpt = latest_checkpoint(out)
    except ValueError:
        ckpt = None
    return f"the last one is {ckpt}" if ckpt is not None else "none was written yet"


def _rank_rng(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, meta = read_state(path)
    return tensors, meta["rng"]
