"""Where the offline data and caches live (configurable by flag or environment)."""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "WIDE_DATA"
CACHE_ENV = "WIDE_CACHE"


def _candidates() -> list[Path]:
    here = Path(__file__).resolve()
    repo = here.parents[2]  # src/wide/paths.py -> repo root (editable installs)
    cwd = Path.cwd()
    return [
        cwd / "shared" / "data",
        cwd.parent / "shared" / "data",
        repo / "shared" / "data",
        repo.parent / "shared" / "data",
    ]


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
    raise FileNotFoundError(
        "no data directory found: pass --data-dir DIR or set WIDE_DATA=DIR to a folder laid out like "
        "shared/data (wikitext/wiki.test.raw, redpajama/, arc_easy/, ...); looked in "
        + ", ".join(str(c) for c in _candidates())
    )


def data_file(relative: str, override: str | os.PathLike | None = None) -> Path:
    """A file under the data root, with an error naming the exact path when it is missing."""
    root = data_dir(override)
    p = root / relative
    if not p.exists():
        raise FileNotFoundError(f"missing data file {p} (data root {root}; set WIDE_DATA or --data-dir)")
    return p


def cache_dir(sub: str = "") -> Path:
    """~/.cache/wide (or $WIDE_CACHE) / sub, created on demand."""
    root = Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "wide")).expanduser()
    p = root / sub if sub else root
    p.mkdir(parents=True, exist_ok=True)
    return p
