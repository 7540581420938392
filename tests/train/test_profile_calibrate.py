"""bench/profile/profile_calibrate.py: a whole --tiny run on the CPU writes both objectives' records."""

from __future__ import annotations

import json

from bench.profile import profile_calibrate


def test_tiny_run_records_both_objectives(tmp_path):
    script = profile_calibrate
    assert script.main(["--tiny", "--no-compile", "--steps", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "profile-calibrate.json").read_text())
    assert [r["distill"] for r in doc["runs"]] == ["none", "kl+lm"]
    for r in doc["runs"]:
        assert r["tokens_per_s"] > 0 and r["top"] and all(t["ms_per_step"] > 0 for t in r["top"])
    assert (tmp_path / "profile-calibrate.txt").read_text().count("=== distill") == 2
