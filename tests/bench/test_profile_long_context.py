"""bench.profile.profile_long_context --smoke: the per-kernel profile of a long-context decode step on a tiny model
(CPU: the wide:: ops' CPU time stands in for kernel time), its record and its table."""

from __future__ import annotations

import json

import pytest

from bench.profile import profile_long_context as P


def test_family_of_the_fused_layer_kernels():
    assert [P.family(n) for n in ("_attn_kernel", "_qkv_kernel", "_o_kernel", "_ffn_kernel", "_norm_kernel")] == [
        "attention", "qkv", "o_proj", "ffn", "norm"]  # fmt: skip
    assert P.family("_router_pair_kernel") == "router" and P.family("elementwise_kernel") == "other"


@pytest.mark.slow
def test_smoke_profile_writes_families_per_level(tmp_path):
    P.main(["--smoke", "--out", str(tmp_path), "--batch", "3", "--ctx", "150", "--reps", "2",
            "--attn-sweep", "attn_programs=8;attn_splits=2,attn_block_n=32"])  # fmt: skip
    rec = json.loads((tmp_path / "profile-long-context-cpu.json").read_text())
    rows = {r["level"]: r for r in rec["rows"] if not r["overrides"]}
    swept = [(r["level"], r["overrides"]) for r in rec["rows"] if r["overrides"]]
    assert swept == [(lv, ov) for lv in rows for ov in ({"attn_programs": 8}, {"attn_splits": 2, "attn_block_n": 32})]
    assert set(rows) == {"dense", "wide 50%", "shipped smollm2-135m-s50"}
    assert all(r["B"] == 3 and r["ctx"] == 150 and r["kernel_ms"] > 0 for r in rows.values())
    assert rows["dense"]["families"].get("router", 0.0) == 0.0 < rows["wide 50%"]["families"]["router"]
    assert abs(sum(rows["dense"]["families"].values()) - rows["dense"]["kernel_ms"]) < 1e-9
    md = (tmp_path / "profile-long-context-cpu.md").read_text()
    assert "| attention |" in md and "| total |" in md and "wide 50% / dense" in md
    assert "| wide 50% | attn_splits=2, attn_block_n=32 |" in md and "| dense | (rules) |" in md
    assert rec["meta"]["command"].startswith("python -m bench.profile.profile_long_context --smoke")


def test_bad_override_sets_are_one_line_errors():
    assert P.parse_overrides("attn_programs=264; attn_warps=4,attn_block_n=64") == [
        {"attn_programs": 264}, {"attn_warps": 4, "attn_block_n": 64}]  # fmt: skip
    for bad in ("attn_programs", "no_such=3", "attn_block_n=48"):
        with pytest.raises(SystemExit, match="--attn-sweep: bad override set"):
            P.parse_overrides(bad)
