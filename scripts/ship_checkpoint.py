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

COPIED = ("routers.safetensors", "wide_config.json", "train_log.jsonl")


def ship(stage: Path, dest: Path, base_model: str) -> list[Path]:
    """Write `dest` from `stage`; returns the files written."""
    missing = [n for n in ("routers.safetensors", "wide_config.json") if not (stage / n).is_file()]
    if missing:
        raise SystemExit(f"{stage}: not a finished stage directory (missing {', '.join(missing)})")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in COPIED:
        if (stage / name).is_file():
            shutil.copyfile(stage / name, dest / name)
            written.append(dest / name)
    if (stage / "adapter_model.safetensors").is_file():
        weights = load_file(stage / "adapter_model.safetensors")
        save_file(
            {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, dest / "adapter_model.safetensors"
        )
        config = json.loads((stage / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = base_model
        (dest / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        written += [dest / "adapter_model.safetensors", dest / "adapter_config.json"]
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
