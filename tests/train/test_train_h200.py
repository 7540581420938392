"""bench/profile/train_h200.py: the OOM-guarded size search, and a whole --tiny run on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from bench.profile import train_h200


@pytest.fixture(scope="module")
def script():
    return train_h200


def test_search_stops_a_sequence_length_at_its_first_oom_and_respects_the_budget(script):
    cleaned = []

    def try_size(size):
        def run():
            if size[0] * size[1] > 64:
                raise torch.OutOfMemoryError("CUDA out of memory")
            if size == (1, 7):
                raise RuntimeError("boom")
            return {"batch": size[0], "seq_len": size[1], "ok": True}

        return script.guarded(run, {"batch": size[0], "seq_len": size[1]}, lambda: cleaned.append(size))

    sizes = [(2, 16), (4, 16), (8, 16), (16, 16), (1, 7), (2, 7), (1, 32), (2, 32), (4, 32)]
    est = lambda s: 100.0 if s == (1, 32) else 1.0  # noqa: E731
    recs = script.search(try_size, sizes, time_left=lambda: 50.0, est_s=est)
    got = [(r["batch"], r["seq_len"], r["ok"], r.get("error")) for r in recs]
    assert got == [
        (2, 16, True, None),
        (4, 16, True, None),
        (8, 16, False, "OOM"),  # (16, 16) is not tried
        (1, 7, False, "RuntimeError: boom"),  # any error ends that sequence length too
        (1, 32, False, "skipped: time budget"),
        (2, 32, True, None),
        (4, 32, False, "OOM"),
    ]
    assert len(cleaned) == 6  # every attempt cleans up, failed or not
    assert script.largest_fit(recs) == {"batch": 2, "seq_len": 32, "ok": True}  # 64 tokens; the longer sequence
    assert script.largest_fit([{"ok": False}]) is None


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_tiny_run_writes_the_records(script, tmp_path):
    assert script.main(["--tiny", "--out", str(tmp_path), "--steps", "2", "--budget-s", "600"]) == 0
    assert not dist.is_initialized()  # the one-rank group it created is gone
    doc = json.loads((tmp_path / "train-h200.json").read_text())
    recs = doc["records"]
    fields = {"world_size", "fsdp", "activation_checkpointing", "batch", "seq_len", "tokens_per_s", "peak_gb"}
    assert all(fields <= r.keys() and r["ok"] for r in recs), recs
    assert [r["phase"] for r in recs] == ["base"] + ["search"] * len(script.SEARCH_TINY) + ["fsdp", "fsdp"]
    assert {r["fsdp"] for r in recs} == {False, True}
    assert all(r["world_size"] == 1 and r["activation_checkpointing"] and r["tokens_per_s"] > 0 for r in recs)
    assert all(r["peak_gb"] is None for r in recs)  # CPU: no CUDA memory to report
    biggest = max(script.SEARCH_TINY, key=lambda s: (s[0] * s[1], s[1]))
    assert (doc["largest_fit"]["batch"], doc["largest_fit"]["seq_len"]) == biggest
    assert (recs[-1]["batch"], recs[-1]["seq_len"]) == biggest  # fsdp rerun at the largest fit
