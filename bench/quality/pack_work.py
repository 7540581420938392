"""Pack what lets a fresh GPU machine go on with a quality sweep into parts that come back from one call.

  python -m bench.quality.pack_work WORK DEST [PARTS] [--rows NAME,NAME...]

WORK is `bench/quality/quality_runs.py --work` (one directory per row, its records in WORK/quality.json); DEST gets
work.tar.00, work.tar.01, ...: 15 MiB parts of one tar (a file back from $OUT is at most 16 MiB, and at most
PARTS of them fit beside the call's other files). Per row it holds the small files of each stage directory
(routers, configs, `latest`, the training log) and, for a stage that has not finished, the checkpoint its
`latest` names; never the rows' logs or the model.

Whole rows only, so that the parts that come back always make a complete tar: unfinished rows first, the
furthest-trained first (a checkpoint is the GPU time it saves), then the routers of finished rows; a row that
would not fit stays on the machine and is printed. `--rows` packs only the rows named, in that order (a later
call on the same warm machine fetching what did not fit: a finished LoRA row's fp32 adapter alone is ~20 MB).
"""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

PART = 15 * 2**20
SMALL = (
    "wide_config.json",
    "routers.safetensors",
    "wide_run.json",
    "latest",
    "train_log.jsonl",
    "adapter_config.json",
    "adapter_model.safetensors",
)
STAGES = ("stage1", "lora")


def _tar_bytes(files: list[Path], work: Path) -> int:
    """Bytes these files take in a GNU tar: a 512-byte header each (and a long-name header for a name over 100
    bytes), contents padded to 512."""
    size = 0
    for f in files:
        name = len(str(f.relative_to(work)).encode())
        size += 512 + -(-f.stat().st_size // 512) * 512 + (512 + -(-name // 512) * 512 if name > 100 else 0)
    return size


def _stage_files(stage: Path) -> tuple[list[Path], int]:
    """(files to carry, steps of its latest checkpoint; 0 when the stage finished or has none)."""
    files = [stage / n for n in SMALL if (stage / n).is_file()]
    latest = stage / "latest"
    # the stage's own wide_config.json is written last: without it, the checkpoint `latest` names
    if (stage / "wide_config.json").is_file() or not latest.is_file():
        return files, 0
    ckpt = stage / latest.read_text().strip()
    files += sorted(f for f in ckpt.rglob("*") if f.is_file())
    step = ckpt.name.rsplit("-", 1)[-1]
    return files, int(step) if step.isdigit() else 0


def pack(
    work: Path, dest: Path, parts: int, part_bytes: int = PART, only: list[str] | None = None
) -> tuple[list[str], list[str]]:
    """Write DEST/work.tar.NN (at most ``parts`` parts of ``part_bytes``); returns (rows packed, rows left).
    ``only``: these rows, in this order (each must have files to carry), instead of every row."""
    try:
        records = json.loads((work / "quality.json").read_text())["records"]
        done = {r["name"] for r in records if r.get("status") == "done"}
    except (OSError, ValueError, KeyError):
        done = set()
    rows: dict[str, tuple[list[Path], int]] = {}
    for row in sorted(p for p in work.iterdir() if p.is_dir()):
        files, steps = [], 0
        for stage in (row / s for s in STAGES if (row / s).is_dir()):
            f, s = _stage_files(stage)
            files += f
            steps += s
        if files:
            rows[row.name] = (files, steps)
    if only is not None:
        missing = [n for n in only if n not in rows]
        if missing:
            raise SystemExit(f"pack: no files to carry for {missing} in {work}")
        order = list(only)
    else:
        going = sorted((n for n in rows if n not in done), key=lambda n: (-rows[n][1], n))
        order = going + sorted(n for n in rows if n in done)
    room = parts * part_bytes - 2 * 512 - tarfile.RECORDSIZE  # the end-of-archive blocks, the last record's padding
    packed, left = [], []
    for name in order:
        size = _tar_bytes(rows[name][0], work)
        if size <= room:
            packed.append(name)
            room -= size
        else:
            left.append(name)
    dest.mkdir(parents=True, exist_ok=True)
    tar = dest / "work.tar"
    with tarfile.open(tar, "w", format=tarfile.GNU_FORMAT) as t:  # PAX would add a header per file (mtime)
        for name in packed:
            for f in rows[name][0]:
                t.add(f, arcname=str(f.relative_to(work)), recursive=False)
    data = tar.read_bytes()
    tar.unlink()
    for i in range(0, len(data), part_bytes):
        (dest / f"work.tar.{i // part_bytes:02d}").write_bytes(data[i : i + part_bytes])
    return packed, left


def main(argv: list[str]) -> int:
    only = None
    if "--rows" in argv:
        i = argv.index("--rows")
        only, argv = [n for n in argv[i + 1].split(",") if n], argv[:i] + argv[i + 2 :]
    if len(argv) not in (2, 3):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    work, dest, parts = Path(argv[0]), Path(argv[1]), int(argv[2]) if len(argv) == 3 else 3
    packed, left = pack(work, dest, parts, only=only)
    n = len(list(dest.glob("work.tar.*")))
    print(f"pack: {len(packed)} rows in {n} part(s) in {dest}")
    for name in left:
        print(f"pack: {name} stays on this machine (over {parts} parts)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
