"""WIDE and its baselines behind one name (docs/baselines.md): `build` a routed model for a config's
method, `load` any method's checkpoint, `calibrate_training_free` for the methods that need no training.

  wide          WIDE: attention GQA groups and FFN channel groups routed per token
  module-skip   token-wise module skipping (SkipGPT): one decision per token for attention, one for FFN
  layer-skip    token-wise layer skipping (MoD / D-LLM family): one decision per token per layer
  static-width  static structured width pruning (FLAP / Wanda-sp style scores), fixed masks
  teal          training-free activation thresholding (TEAL-style), unstructured per token

Every model returned here offers WideModel's evaluation interface (meter, start_meter / stop_meter,
routing, detach, save); the trained methods are WideModels and calibrate / finetune as WIDE does.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from wide.config import METHODS, ModelDims, WideConfig

TRAINED = ("wide", "module-skip", "layer-skip")
TRAINING_FREE = ("static-width", "teal")
assert set(TRAINED + TRAINING_FREE) == set(METHODS)


def build(model: nn.Module, config: WideConfig, *, base_model_id: str | None = None):
    """Attach config.method's routing to model (in place) and return the routed model."""
    from wide.model.wide_model import WideModel

    if config.method == "layer-skip":
        from wide.baselines.layer_skip import LayerSkipModel

        return LayerSkipModel(model, config, base_model_id=base_model_id)
    if config.method == "teal":
        from wide.baselines.teal import TealModel

        return TealModel(model, config, base_model_id=base_model_id)
    if config.method == "static-width":
        from wide.baselines.static_width import StaticWidthMeter

        return WideModel(model, config, base_model_id=base_model_id, meter_cls=StaticWidthMeter)
    return WideModel(model, config, base_model_id=base_model_id)


def load(model: nn.Module, ckpt_dir: str | Path, *, strict_base: bool = True):
    """Load a checkpoint of any method into model (in place): `load_routers`' checks (dimensions, base
    model, tensor names and shapes) and the method's own hooks and meter."""
    from wide.model.checkpoint import CheckpointMismatchError, attach_out_biases, load_routers, read_checkpoint_meta

    meta = read_checkpoint_meta(ckpt_dir)
    config = WideConfig.from_dict(meta["config"])
    if config.method in ("wide", "module-skip"):
        return load_routers(model, ckpt_dir, strict_base=strict_base)
    if config.method in ("layer-skip", "static-width"):
        plain = load_routers(model, ckpt_dir, strict_base=strict_base)  # the checks; then rebuild as the method
        state, summary = plain.routers.state_dict(), plain.training_summary
        plain.detach()
    else:  # teal: thresholds, no routers
        saved = ModelDims(**meta["model_dims"])
        if saved != ModelDims.from_hf_config(model.config):
            raise CheckpointMismatchError(f"checkpoint {ckpt_dir} was made for a model with other dimensions: {saved}")
        model_id = getattr(model.config, "wide_model_id", None)
        if strict_base and model_id and meta.get("base_model") and model_id != meta["base_model"]:
            raise CheckpointMismatchError(
                f"checkpoint {ckpt_dir} was calibrated on {meta['base_model']!r}, not {model_id!r} "
                "(pass strict_base=False / --no-strict-base to load anyway)"
            )
        from wide.model.checkpoint import WEIGHTS_NAME, check_finite, load_tensors

        state, summary = load_tensors(Path(ckpt_dir) / WEIGHTS_NAME), meta.get("training", {})
        check_finite(state, Path(ckpt_dir) / WEIGHTS_NAME)
    wm = build(model, config, base_model_id=meta.get("base_model"))
    attach_out_biases(wm, state, ckpt_dir)  # static width's bias compensation, if any
    try:
        wm.routers.load_state_dict(state, strict=True)
    except RuntimeError as e:
        wm.detach()
        raise CheckpointMismatchError(f"tensors of {ckpt_dir} do not match a {config.method} model: {e}") from None
    wm.record_training(summary)  # as load_routers does: the runtime plans its kernel paths on the fitted rates
    return wm


def method_of(ckpt_dir: str | Path) -> str:
    """The method a checkpoint holds ("wide" for checkpoints older than the method field)."""
    from wide.model.checkpoint import read_checkpoint_meta

    return WideConfig.from_dict(read_checkpoint_meta(ckpt_dir)["config"]).method


@torch.no_grad()
def calibrate_training_free(
    wm, dataset, out_dir: str | Path, *, batches: int, batch_size: int, seq_len: int, seed: int = 0, **kw
) -> dict:
    """Fit a training-free method (static-width, teal) on `batches` batches of dataset (the calibration
    data order of `wide calibrate`), write its checkpoint into out_dir and return the summary."""
    import time

    from wide.train.data import DataOrder

    method = wm.config.method
    if method not in TRAINING_FREE:
        raise ValueError(f"{method} is trained with `calibrate`, not fitted")
    if batches < 1:
        raise ValueError(f"--calib-batches must be >= 1, got {batches}")
    device = next(wm.model.parameters()).device
    t0 = time.perf_counter()
    order = DataOrder(len(dataset), batch_size, seed=seed)
    data = [dataset.batch(order.next_batch()) for _ in range(batches)]
    tokens = int(sum(int(b["attention_mask"].sum()) for b in data))
    wm.model.eval()
    if method == "static-width":
        from wide.baselines.static_width import calibrate_static_width

        fit = calibrate_static_width(
            wm,
            data,
            device,
            seq_len,
            allocation=kw.get("allocation", "standardized"),
            compensate=kw.get("compensate", False),
        )
    else:
        fit = wm.calibrate(data, device, seq_len, seed=seed)
    wm.mode = "argmax"
    summary = {
        "stage": "training-free",
        "method": method,
        "steps": 0,
        "batches": batches,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "tokens": tokens,
        "wall_time_s": time.perf_counter() - t0,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "fit": fit,
    }
    wm.save(str(out_dir), training=summary)
    return summary
