"""Where the offline data, the packaged demo data, the shipped routers and the caches live.

Data lookup (see README "Data"): the data root is ``--data-dir``, else ``$WIDE_DATA``, else a
``shared/data`` next to the working directory or the repository (a search ``WIDE_DATA_SEARCH=0`` turns off:
CI does, to run the tests as on a machine without any data folder); when there is one, its files are used.
Without a data root: the WikiText-2 slice packaged with ``wide`` (the demo's tokens only), then Hugging
Face ``datasets`` when online (cached by ``datasets``).
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "WIDE_DATA"
SEARCH_ENV = "WIDE_DATA_SEARCH"  # "0": no shared/data search next to the working directory or the repository
CACHE_ENV = "WIDE_CACHE"

PACKAGE_DIR = Path(__file__).resolve().parent
# Router checkpoints shipped as package data (made on the H200; see docs/history.md). "-lora": a stage-2
# checkpoint, whose LoRA adapter every loader merges into the base weights (docs/design.md, Parts: calibration).
SHIPPED_ROUTERS = ("smollm2-135m-s25", "smollm2-135m-s25-lora", "smollm2-135m-s50", "smollm2-135m-s50-lora")
# The first pages of WikiText-2's test split, as raw text (gzip): the pages `wide demo` scores plus the
# one that ends its token budget. Attribution and provenance: src/wide/data/README.md.
WIKITEXT_SLICE = "data/wikitext/wiki.test.demo.raw.gz"
# A few hundred KB of RedPajama's C4 sample (training text, not the test slice): what `wide demo --calibrate`
# trains on without a data root. Attribution and provenance: src/wide/data/README.md.
CALIBRATION_SAMPLE = "data/calibration/c4-sample.jsonl"


def check_outside_package(path: str | os.PathLike, flag: str) -> None:
    """A one-line ValueError when path lies inside the installed wide package (its shipped checkpoints and
    data are read-only inputs; in an editable install they are the repository's files)."""
    p = Path(path).expanduser().resolve()
    if p == PACKAGE_DIR or PACKAGE_DIR in p.parents:
        raise ValueError(f"{flag} {path} lies inside the installed wide package ({PACKAGE_DIR}): write it elsewhere")


def _candidates() -> list[Path]:
    if os.environ.get(SEARCH_ENV, "1") == "0":
        return []
    here = Path(__file__).resolve()
    repo = here.parents[2]  # src/wide/paths.py -> repo root (editable installs)
    cwd = Path.cwd()
    return [
        cwd / "shared" / "data",
        cwd.parent / "shared" / "data",
        repo / "shared" / "data",
        repo.parent / "shared" / "data",
    ]


class _NoDataDir(FileNotFoundError):
    """No data root configured and none found next to the working directory or the repository."""


def find_data_dir(override: str | os.PathLike | None = None) -> Path | None:
    """As `data_dir`, but None (instead of an error) when no flag, no $WIDE_DATA and no shared/data is found.
    A flag or variable naming a missing folder is still an error."""
    try:
        return data_dir(override)
    except _NoDataDir:
        return None


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """The data root laid out like ../shared/data: the flag, else $WIDE_DATA, else a shared/data found
    next to the working directory or the repository."""
    if override:
        p = Path(override).expanduser()
        if not p.is_dir():
            raise FileNotFoundError(f"data directory {p} (from --data-dir) does not exist")
        return p
    env = os.environ.get(DATA_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_dir():
            raise FileNotFoundError(f"data directory {p} (from ${DATA_ENV}) does not exist")
        return p
    for c in _candidates():
        if c.is_dir():
            return c
    raise _NoDataDir(
        "no data directory found: pass --data-dir DIR or set WIDE_DATA=DIR to a folder laid out like "
        "shared/data (wikitext/wiki.test.raw, redpajama/, arc_easy/, ...); looked in "
        + (", ".join(str(c) for c in _candidates()) or f"no folder (${SEARCH_ENV}=0)")
    )


def cache_dir(sub: str = "") -> Path:
    """~/.cache/wide (or $WIDE_CACHE) / sub, created on demand."""
    root = Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "wide")).expanduser()
    p = root / sub if sub else root
    p.mkdir(parents=True, exist_ok=True)
    return p


def packaged_wikitext_slice() -> Path:
    """The gzip'd first pages of WikiText-2's test split shipped with the package (enough for `wide demo`)."""
    p = PACKAGE_DIR / WIKITEXT_SLICE
    if not p.is_file():
        raise FileNotFoundError(f"packaged WikiText-2 slice {p} is missing (a broken install?)")
    return p


def packaged_calibration_sample() -> Path:
    """The small calibration text shipped with the package (what `wide demo --calibrate` trains on by default)."""
    p = PACKAGE_DIR / CALIBRATION_SAMPLE
    if not p.is_file():
        raise FileNotFoundError(f"packaged calibration sample {p} is missing (a broken install?)")
    return p


def shipped_routers_dir() -> Path:
    """The folder holding the router checkpoints shipped with the package."""
    return PACKAGE_DIR / "checkpoints"


def shipped_routers() -> list[Path]:
    """The SmolLM2-135M router checkpoints shipped with the package (25%, 25% + LoRA, 50%), in
    SHIPPED_ROUTERS order."""
    root = shipped_routers_dir()
    found = [root / n for n in SHIPPED_ROUTERS if (root / n / "wide_config.json").is_file()]
    if not found:
        raise FileNotFoundError(f"no shipped routers under {root} (a broken install?); pass --routers DIR")
    return found


def resolve_routers(path_or_name: str | os.PathLike) -> Path:
    """A router checkpoint folder: an existing path as given, else a shipped checkpoint's name
    (e.g. "smollm2-135m-s50"). Raises FileNotFoundError naming both places."""
    p = Path(path_or_name).expanduser()
    if p.exists():
        return p
    shipped = shipped_routers_dir() / str(path_or_name)
    if str(path_or_name) in SHIPPED_ROUTERS and shipped.is_dir():
        return shipped
    raise FileNotFoundError(
        f"router checkpoint {str(path_or_name)!r} is neither a folder nor a shipped checkpoint "
        f"({', '.join(SHIPPED_ROUTERS)})"
    )
