"""docs/design.md's map of the house names only folders and files that exist (a move without the map fails)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_path_of_the_map_exists():
    text = (ROOT / "docs" / "design.md").read_text()
    house = text.split("## The house", 1)[1].split("\n## ", 1)[0]
    paths = set(re.findall(r"`((?:src|bench|scripts|docs)/[\w./-]*)`", house))
    assert len(paths) >= 10, paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing
