"""Turn a finished training stage directory into a checkpoint folder as `wide.checkpoints` ships them.

  python scripts/ship_checkpoint.py STAGE_DIR DEST [--base-model smollm2-135m]

Copies the routers, `wide_config.json` and the training log; a LoRA stage's peft adapter is stored in bf16
(half the bytes; the loaders merge it into the base weights in the model's dtype) with
`base_model_name_or_path` set to the base model's registry name, so that no machine-local path travels.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from wide.model.checkpoint import ADAPTER_FILES, CONFIG_NAME, WEIGHTS_NAME, has_adapter
from wide.train.calibrate import LOG_NAME


def ship(stage: Path, dest: Path, base_model: str) -> list[Path]:
    """Write `dest` from `stage`; returns the files written."""
    missing = [n for n in (WEIGHTS_NAME, CONFIG_NAME) if not (stage / n).is_file()]
    if missing:
        raise SystemExit(f"{stage}: not a finished stage directory (missing {', '.join(missing)})")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in (WEIGHTS_NAME, CONFIG_NAME, LOG_NAME):
        if (stage / name).is_file():
            shutil.copyfile(stage / name, dest / name)
            written.append(dest / name)
    if has_adapter(stage):
        config_name, weights_name = ADAPTER_FILES
        weights = load_file(stage / weights_name)
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, dest / weights_name)
        config = json.loads((stage / config_name).read_text())
        config["base_model_name_or_path"] = base_model
        (dest / config_name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        written += [dest / weights_name, dest / config_name]
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", type=Path, help="a stage directory (stage1 or lora) with routers.safetensors")
    ap.add_argument("dest", type=Path)
    ap.add_argument("--base-model", default="smollm2-135m", help="registry name written into adapter_config.json")
    args = ap.parse_args()
    for f in ship(args.stage, args.dest, args.base_model):
        print(f"{f}  {f.stat().st_size} B")


if __name__ == "__main__":
    main()
