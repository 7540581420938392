"""Router checkpoints: a directory with wide_config.json and routers.safetensors, loaded strictly."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from wide.config import ModelDims, WideConfig

CONFIG_NAME = "wide_config.json"
WEIGHTS_NAME = "routers.safetensors"
# stage 2 (`wide finetune`) writes its LoRA adapter beside the routers, in peft's format
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
FORMAT = "wide-routers"
# a checkpoint folder is written under a name with this prefix, then renamed (wide.train.calibrate)
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1


class CheckpointMismatchError(ValueError):
    """A router checkpoint that does not fit the model it is loaded into."""


def versions() -> dict[str, str]:
    import transformers

    import wide

    return {"wide": wide.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def _umask() -> int:
    try:  # Linux reports the umask without changing it (os.umask would, for every thread, for a moment)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
        return umask


def file_mode() -> int:
    """The mode a plain open() gives a new file under the process umask (0o644 under umask 022):
    mkstemp / mkdtemp create private (0o600 / 0o700) ones, which atomic writes must not leave behind."""
    return 0o666 & ~_umask()


def dir_mode() -> int:
    """The mode os.mkdir gives a new folder under the process umask (0o755 under umask 022)."""
    return 0o777 & ~_umask()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder and os.replace: a crash leaves the old file. The file
    gets the umask's mode (`file_mode`), as a plain open() would."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_routers(wm, out_dir: str | Path, *, training: dict | None = None) -> Path:
    """Write `wide_config.json` and `routers.safetensors` into out_dir (atomically, file by file)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in wm.routers.state_dict().items()}
    check_finite(tensors, out / WEIGHTS_NAME, "it is not written")
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{WEIGHTS_NAME}.")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": FORMAT})
        os.chmod(tmp, file_mode())
        os.replace(tmp, out / WEIGHTS_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "base_model": wm.base_model_id,
        "model_type": wm.model.config.model_type,
        "model_dims": dataclasses.asdict(wm.dims),
        "routing_shape": dataclasses.asdict(wm.shape),
        "config": wm.config.to_dict(),
        "versions": versions(),
        "training": training or {},
    }
    atomic_write_bytes(out / CONFIG_NAME, (json.dumps(meta, indent=2) + "\n").encode())
    return out


def check_finite(tensors: dict[str, torch.Tensor], path: str | Path, action: str = "it is not loaded") -> None:
    """A one-line CheckpointMismatchError naming path and the first tensor holding NaN or inf: such a
    router skips everything or nothing (docs/design.md)."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointMismatchError(f"{path}: tensor {name} holds NaN or inf (a diverged training run); {action}")


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; a one-line CheckpointMismatchError naming the file when it
    is truncated or not a safetensors file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors' SafetensorError: a truncated or foreign file
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointMismatchError(f"{path} is truncated or not a safetensors file ({msg})") from None


def check_checkpoint(ckpt_dir: str | Path) -> dict:
    """Cheap validation of a router checkpoint before any model is loaded: wide_config.json parses and
    routers.safetensors (and a LoRA adapter, if any) has a complete safetensors layout. Returns the meta."""
    from safetensors import safe_open

    d = Path(ckpt_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"router checkpoint {d} does not exist")
    meta = read_checkpoint_meta(d)
    names = [WEIGHTS_NAME] + ([ADAPTER_FILES[1]] if has_adapter(d) else [])
    for name in names:
        path = d / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing")
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointMismatchError(f"{path} is truncated or not a safetensors file ({msg})") from None
    check_finite(load_tensors(d / WEIGHTS_NAME), d / WEIGHTS_NAME)  # the routers are small
    return meta


def read_checkpoint_meta(ckpt_dir: str | Path) -> dict:
    d = Path(ckpt_dir)
    if TMP_PREFIX in (d.name[: len(TMP_PREFIX)], d.resolve().name[: len(TMP_PREFIX)]):
        raise CheckpointMismatchError(
            f"{d} is an unfinished checkpoint (being written, or left by a killed run): it is never loaded; "
            "use the run folder or one of its checkpoint-N folders"
        )
    cfg = d / CONFIG_NAME
    if not cfg.is_file():
        raise FileNotFoundError(f"{d} is not a WIDE router checkpoint: {CONFIG_NAME} is missing")
    try:
        meta = json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        msg = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise CheckpointMismatchError(f"{cfg}: invalid JSON ({msg}{where})") from None
    if not isinstance(meta, dict):
        raise CheckpointMismatchError(f"{cfg}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise CheckpointMismatchError(f"{cfg} is not a {FORMAT} file (format={meta.get('format')!r})")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointMismatchError(
            f"{cfg} has format_version {meta['format_version']}, newer than this wide ({FORMAT_VERSION})"
        )
    for key in ("model_dims", "config"):
        if not isinstance(meta.get(key), dict):
            raise CheckpointMismatchError(f"{cfg}: the {key!r} entry is missing or not an object")
    try:
        ModelDims(**meta["model_dims"])
        WideConfig.from_dict(meta["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointMismatchError(f"{cfg}: {e}") from None
    return meta


def attach_out_biases(wm, state: dict[str, torch.Tensor], ckpt_dir: str | Path) -> None:
    """Register the routers' output biases a checkpoint carries ("<layer>.<kind>.out_bias": static width's
    bias compensation) on wm before its state is loaded; other keys are left to the strict load."""
    for key in [k for k in state if k.endswith(".out_bias")]:
        layer, kind, _ = key.split(".")
        if not (layer.isdigit() and int(layer) < len(wm.routers) and kind in ("attn", "ffn")):
            continue  # reported by the strict load
        if tuple(state[key].shape) != (wm.dims.hidden,):
            wm.detach()
            shape = tuple(state[key].shape)
            raise CheckpointMismatchError(f"{key} of {ckpt_dir} has shape {shape}, not ({wm.dims.hidden},)")
        wm.set_out_bias(int(layer), kind, state[key])


def has_adapter(ckpt_dir: str | Path) -> bool:
    """Whether ckpt_dir holds a LoRA adapter (a stage-2 checkpoint)."""
    return (Path(ckpt_dir) / ADAPTER_FILES[0]).is_file()


def merge_adapter(model: nn.Module, ckpt_dir: str | Path) -> None:
    """Merge ckpt_dir's LoRA adapter into model's weights, in place (the same modules keep their identity),
    at most once per model and checkpoint; nothing without an adapter. Its routers were trained beside
    those weights: every path that runs them (eval, generate, refit, viz, the runtime) loads through here,
    as `wide eval` scores them (docs/design.md, stage 2)."""
    if not has_adapter(ckpt_dir):
        return
    key = str(Path(ckpt_dir).resolve())
    merged: set = model.__dict__.setdefault("_wide_merged_adapters", set())
    if key in merged:
        return
    if any(hasattr(m, "lora_A") for m in model.modules()):
        raise CheckpointMismatchError(
            f"checkpoint {ckpt_dir} holds a LoRA adapter and the model already carries LoRA layers: merge the "
            "checkpoint's adapter first (wide.model.checkpoint.merge_adapter), then add new LoRA layers"
        )
    from peft import PeftModel

    wide_id = getattr(model.config, "wide_model_id", None)
    PeftModel.from_pretrained(model, str(ckpt_dir)).merge_and_unload()  # merges into model's own modules
    if wide_id is not None:
        model.config.wide_model_id = wide_id
    merged.add(key)


def load_routers(model: nn.Module, ckpt_dir: str | Path, *, strict_base: bool = True):
    """Attach the routers saved in ckpt_dir to model (in place) and return the WideModel; a stage-2
    checkpoint's LoRA adapter is merged into model's weights first (`merge_adapter`).

    Fails with CheckpointMismatchError naming what differs: model dimensions, base model id
    (when strict_base), or tensor shapes."""
    from wide.model.wide_model import WideModel

    meta = read_checkpoint_meta(ckpt_dir)
    dims = ModelDims.from_hf_config(model.config)
    saved = ModelDims(**meta["model_dims"])
    if dims != saved:
        diff = {
            k: (getattr(saved, k), getattr(dims, k))
            for k in dataclasses.asdict(dims)
            if getattr(saved, k) != getattr(dims, k)
        }
        raise CheckpointMismatchError(
            f"checkpoint {ckpt_dir} was made for {meta.get('base_model')!r} with other dimensions "
            f"(checkpoint vs model): {diff}"
        )
    model_id = getattr(model.config, "wide_model_id", None)
    if strict_base and model_id and meta.get("base_model") and model_id != meta["base_model"]:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt_dir} was calibrated on {meta['base_model']!r}, not {model_id!r} "
            "(pass --no-strict-base to `wide eval` / `wide finetune`, or strict_base=False, to load anyway)"
        )
    config = WideConfig.from_dict(meta["config"])
    state = load_tensors(Path(ckpt_dir) / WEIGHTS_NAME)  # before any hook is attached
    check_finite(state, Path(ckpt_dir) / WEIGHTS_NAME)
    merge_adapter(model, ckpt_dir)
    wm = WideModel(model, config, base_model_id=meta.get("base_model"))
    attach_out_biases(wm, state, ckpt_dir)
    own = wm.routers.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    bad = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or bad:
        wm.detach()
        raise CheckpointMismatchError(
            f"router tensors of {ckpt_dir} do not match: missing={missing[:5]} unexpected={unexpected[:5]} "
            f"shape mismatches={bad[:5]}"
        )
    wm.routers.load_state_dict(state)
    wm.record_training(meta.get("training", {}))
    return wm
