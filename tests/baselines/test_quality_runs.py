"""scripts/quality_runs.py (run names, grid, records, resume, the --tiny smoke run) and
scripts/plot_sweep.py (series and the figure)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


qr = _script("quality_runs")
ps = _script("plot_sweep")


def test_run_names_and_grid():
    R = qr.RunSpec
    assert R("dense").key == "dense"
    assert R("wide", target=0.5, steps=2000).key == "wide-groups0.5-s2000-g128"
    assert R("module-skip", target=0.25, steps=10).key == "module-skip-groups0.25-s10"
    assert R("static-width", target=0.5, sparsity_kind="flops", ffn_group_size=64).key == "static-width-flops0.5-g64"
    assert R("wide", distill="kl+lm", lora_steps=500).key == "wide-groups0.5-s2000-g128-kllm-lora500"
    assert R("wide", attn_target=0.3, ffn_target=0.7).key == "wide-groups0.3a0.7f-s2000-g128"
    with pytest.raises(ValueError, match="method must be one of"):
        R("skipgpt")
    with pytest.raises(ValueError, match="teal: LoRA"):
        R("teal", lora_steps=10)
    a = qr.parse_args(["--out", "x.json", "--methods", "dense,wide,teal", "--targets", "0.25,0.5", "--lora-steps", "7"])
    keys = [s.key for s in qr.grid(a)]
    assert keys == [
        "dense",
        "wide-groups0.25-s2000-g128",
        "wide-groups0.25-s2000-g128-lora7",
        "wide-groups0.5-s2000-g128",
        "wide-groups0.5-s2000-g128-lora7",
        "teal-groups0.25",
        "teal-groups0.5",
    ]
    a = qr.parse_args(["--out", "x", "--methods", "wide,layer-skip", "--targets", "0.5", "--ffn-group-size", "32,64"])
    want = ["wide-groups0.5-s2000-g32", "wide-groups0.5-s2000-g64", "layer-skip-groups0.5-s2000"]
    assert [s.key for s in qr.grid(a)] == want
    a = qr.parse_args(["--out", "x", "--methods", "wide,teal", "--targets", "0.5", "--match-flops"])
    want = ["wide-groups0.5-s2000-g128", "teal-flopsof[wide-groups0.5-s2000-g128]"]
    assert [s.key for s in qr.grid(a)] == want
    a = qr.parse_args(["--out", "x", "--methods", "wide", "--targets", "0.5", "--uniform"])
    assert [s.key for s in qr.grid(a)] == ["wide-groups0.5a0.5f-s2000-g128"]


def test_spec_file_and_record(tmp_path):
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps([{"method": "layer-skip", "target": 0.5, "steps": 3}, {"method": "wide", "bogus": 1}]))
    with pytest.raises(ValueError, match="unknown fields"):
        qr.load_specs(spec)
    row = {
        "sparsity": {"all": {"tokens": 100, "attn_sparsity": 0.6, "ffn_sparsity": 0.4, "flop_saving": 0.35}},
        "tasks": {"piqa": {"score": 0.6}, "boolq": {"score": 0.5}},
        "avg": 0.55,
        "wikitext": {"word_perplexity": 42.0},
    }
    stages = [({"tokens": 1000, "wall_time_s": 120.0, "gpu": "H200"}, "wide calibrate ...", 0.0)]
    rec = qr.make_record(qr.RunSpec("wide", steps=5), row, stages, 30.0, tmp_path)
    assert rec["real_sparsity"] == {"attn": 0.6, "ffn": 0.4, "overall": 0.5}
    assert rec["flops_removed"] == 0.35 and rec["wikitext_word_ppl"] == 42.0 and rec["avg_acc"] == 0.55
    assert rec["tasks"] == {"piqa": 0.6, "boolq": 0.5} and rec["tokens"] == 1000 and rec["steps"] == 5
    assert rec["gpu_minutes"] == pytest.approx(2.0) and rec["eval_minutes"] == pytest.approx(0.5)
    assert rec["method"] == "wide" and rec["status"] == "done" and rec["device"] == "H200"


def test_plot_series_and_file(tmp_path):
    def rec(method, flops, ppl, acc, **kw):
        base = {"method": method, "flops_removed": flops, "wikitext_word_ppl": ppl, "avg_acc": acc}
        return base | {"status": "done"} | kw

    records = [
        rec("dense", 0.0, 20.0, 0.5),
        rec("wide", 0.4, 30.0, 0.45, ffn_group_size=128),
        rec("wide", 0.2, 22.0, 0.48, ffn_group_size=128),
        rec("wide", 0.2, 21.0, 0.49, ffn_group_size=128, lora_steps=100),
        rec("teal", 0.3, 40.0, None),
    ]
    series, dense = ps.group_series(records)
    assert dense["wikitext_word_ppl"] == 20.0
    assert list(series) == ["teal", "wide", "wide +LoRA"]
    assert [r["flops_removed"] for r in series["wide"]] == [0.2, 0.4]
    out = ps.plot(records, tmp_path / "sweep.png", "test")
    assert out.is_file() and out.stat().st_size > 1000


@pytest.mark.slow
def test_tiny_mode_end_to_end_and_resume(tmp_path, capsys):
    from wide.paths import data_dir

    try:
        root = data_dir()
    except FileNotFoundError:
        pytest.skip("offline data not found: set WIDE_DATA")
    if not (root / "wikitext" / "wiki.test.raw").is_file():
        pytest.skip("no WikiText-2 data")
    out = tmp_path / "q.json"
    assert qr.main(["--tiny", "--out", str(out), "--work", str(tmp_path / "w")]) == 0
    recs = json.loads(out.read_text())["records"]
    methods = [r["method"] for r in recs]
    want = ["dense", "wide", "module-skip", "layer-skip", "static-width", "teal", "wide", "wide", "static-width"]
    assert methods == want
    for r in recs:
        assert r["status"] == "done" and r["wikitext_word_ppl"] > 1 and "arc_easy" in r["tasks"]
        if r["method"] != "dense":
            assert -0.05 < r["flops_removed"] < 1 and r["tokens"] > 0 and r["commands"]
        if r["sparsity_kind"] == "groups" and r["method"] != "dense":  # targets of 50% of the groups
            assert r["flops_removed"] > 0 and r["real_sparsity"]["overall"] > 0.2, r
    assert recs[-2]["lora_steps"] == 2 and len(recs[-2]["commands"]) == 2
    matched = recs[-1]  # static width at the FLOPs the WIDE row removed
    assert matched["match_flops"] == recs[1]["name"] and matched["sparsity_kind"] == "flops"
    assert matched["target"] == pytest.approx(recs[1]["flops_removed"], abs=1e-4)
    assert abs(matched["flops_removed"] - recs[1]["flops_removed"]) < 0.01
    capsys.readouterr()
    assert qr.main(["--tiny", "--out", str(out), "--work", str(tmp_path / "w")]) == 0  # everything finished
    assert capsys.readouterr().err.count("[skip]") == len(recs)
    assert json.loads(out.read_text())["records"] == recs
