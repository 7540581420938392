"""bench/quality/quality_runs.py (run names, grid, records, resume, the --tiny smoke run, concurrent rows
with --jobs, the time budget, the device spec list), bench/quality/plot_sweep.py (series and the figure),
bench/quality/plot_budget.py, bench/quality/quality_table.py and bench/quality/pack_work.py (what a device call
carries back)."""

from __future__ import annotations

import argparse
import io
import json
import tarfile
import time
from pathlib import Path

import pytest

from bench.quality import pack_work as pw
from bench.quality import plot_budget as pb
from bench.quality import plot_sweep as ps
from bench.quality import quality_runs as qr
from bench.quality import quality_table as qt

ROOT = Path(__file__).resolve().parents[2]


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
        qr.load_specs([spec])
    good = tmp_path / "more.json"
    good.write_text(json.dumps([{"method": "teal", "target": 0.5}]))
    spec.write_text(json.dumps([{"method": "layer-skip", "target": 0.5, "steps": 3}]))
    assert [s.method for s in qr.load_specs([spec, good])] == ["layer-skip", "teal"]  # files in the order given
    assert qr.parse_args(["--out", "x", "--spec", str(spec), str(good)]).spec == [spec, good]
    row = {
        "sparsity": {"all": {"tokens": 100, "attn_sparsity": 0.6, "ffn_sparsity": 0.4, "flop_saving": 0.35}},
        "tasks": {"piqa": {"score": 0.6}, "boolq": {"score": 0.5}},
        "avg": 0.55,
        "wikitext": {"word_perplexity": 42.0},
    }
    stages = [({"tokens": 1000, "wall_time_s": 120.0, "gpu": "H200"}, "wide calibrate ...", 0.0)]
    rec = qr.make_record(qr.RunSpec("wide", steps=5), row, stages, 30.0, tmp_path, jobs=4, eval_limit=None)
    assert rec["concurrent_jobs"] == 4 and rec["eval_limit"] is None
    assert rec["real_sparsity"] == {"attn": 0.6, "ffn": 0.4, "overall": 0.5}
    assert rec["flops_removed"] == 0.35 and rec["wikitext_word_ppl"] == 42.0 and rec["avg_acc"] == 0.55
    assert rec["tasks"] == {"piqa": 0.6, "boolq": 0.5} and rec["tokens"] == 1000 and rec["steps"] == 5
    assert rec["gpu_minutes"] == pytest.approx(2.0) and rec["eval_minutes"] == pytest.approx(0.5)
    assert rec["method"] == "wide" and rec["status"] == "done" and rec["device"] == "H200"
    assert rec["eval_path"] is None  # the row above names no path; run_eval's rows do
    spec = qr.RunSpec("wide", lora_steps=3, stage1_from="w", extra_args=["--x"])
    stub = qr.stub_record(spec, qr.parse_args(["--out", "x"]), "failed", "boom", None)
    row_with_path = {**row, "path": "runtime"}
    full = qr.make_record(spec, row_with_path, stages, 1.0, tmp_path, jobs=1, eval_limit=None)
    assert full["eval_path"] == "runtime" and "stage_devices" not in full
    warm = [({"tokens": 9, "gpu": "H200"}, "wide calibrate (init)", 0.0), ({"tokens": 5, "gpu": "H100"}, "c", 0.0)]
    rec = qr.make_record(qr.RunSpec("wide", steps=5), row, warm, 1.0, tmp_path, jobs=1, eval_limit=None)
    assert rec["device"] == "H100" and rec["stage_devices"] == ["H200", "H100"]  # the row's own stage names it
    for r in (stub, full):  # a row is named alike whether it finished or not
        assert r["stage1_from"] == "w" and r["extra_args"] == ["--x"] and r["match_flops"] is None


def test_spec_checks_order_and_device_spec():
    R = qr.RunSpec
    with pytest.raises(SystemExit, match="duplicate run names"):
        qr.check_specs([R("wide", name="a"), R("teal", name="a")])
    with pytest.raises(SystemExit, match="listed before it"):  # it would wait for a row that waits for it
        qr.check_specs([R("teal", match_flops="w"), R("wide", name="w")])
    qr.check_specs([R("wide", name="w"), R("teal", match_flops="w"), R("static-width", match_flops="elsewhere")])
    with pytest.raises(SystemExit, match="listed before it"):
        qr.check_specs([R("wide", lora_steps=3, stage1_from="w"), R("wide", name="w")])
    with pytest.raises(ValueError, match="stage1_from needs"):
        R("wide", stage1_from="w")  # no LoRA stage to start
    with pytest.raises(ValueError, match="stage1_from needs"):
        R("static-width", lora_steps=3, stage1_from="w")
    assert R("wide", lora_steps=3, stage1_from="w", match_flops=None).needs == ["w"]
    assert R("wide", init_from="w").needs == ["w"]
    with pytest.raises(SystemExit, match="listed before it"):
        qr.check_specs([R("wide", init_from="w"), R("wide", name="w")])
    for bad in (dict(method="teal"), dict(method="wide", lora_steps=3, stage1_from="v")):
        with pytest.raises(ValueError, match="init_from needs"):
            R(init_from="w", **bad)
    order = {"a": 0, "b": 1, "c": 2}
    recs = qr.merge_record([{"name": "c"}, {"name": "x"}, {"name": "a", "v": 1}], {"name": "a", "v": 2}, order)
    assert recs == [{"name": "a", "v": 2}, {"name": "c"}, {"name": "x"}]

    # the first same-budget comparison of scripts/device/quality.sh
    specs = qr.load_specs([ROOT / "scripts" / "device" / "quality-first.json"])
    qr.check_specs(specs)
    names = {s.key for s in specs}
    names_by = {s.key: s for s in specs}
    names_sweep = {s.key: s for s in qr.load_specs([ROOT / "scripts" / "device" / "quality-sweep.json"])}
    assert len(specs) == 21 and sum(s.method == "dense" for s in specs) == 1
    for t in (0.25, 0.5):
        trained = {s.method: s for s in specs if s.name == f"{s.method}-{round(100 * t)}"}  # calibration only
        assert set(trained) == {"wide", "module-skip", "layer-skip"}
        assert all(s.steps == 300 and s.name for s in trained.values())
        matched = [s for s in specs if s.match_flops == trained["wide"].key]
        assert sorted(s.method for s in matched) == ["static-width", "static-width", "teal"]
        assert sum("--bias-compensation" in s.extra_args for s in matched) == 1  # FLAP's variant beside it
    assert all(n in names for s in specs for n in s.needs)
    lora = [s for s in specs if s.lora_steps]  # LoRA recovery from the calibrated rows' own routers
    assert {s.stage1_from for s in lora} == {"wide-25", "wide-50", "module-skip-50"}
    assert all(names_by[s.stage1_from].method == s.method for s in lora)
    # Figure 6: the levels between and beyond (the 25% / 50% rows above complete it), same budget
    sweep = qr.load_specs([ROOT / "scripts" / "device" / "quality-sweep.json"])
    qr.check_specs(specs + sweep)  # one spec list, one records file: no name twice
    trained = [s for s in sweep if not s.match_flops]
    assert {s.target for s in trained} == {0.1, 0.3, 0.7} and all(s.steps == 300 for s in trained)
    assert sorted(s.method for s in sweep if s.match_flops) == ["static-width"] * 3 + ["teal"] * 3
    assert all(names_sweep[s.match_flops].method == "wide" for s in sweep if s.match_flops)
    long = qr.load_specs([ROOT / "scripts" / "device" / "quality-long.json"])
    skip_lora = qr.load_specs([ROOT / "scripts" / "device" / "quality-skip-lora.json"])
    qr.check_specs(specs + sweep + long + skip_lora)  # one records file: new names, LoRA from their own stage 1
    assert [(s.method, s.target, s.steps, s.lora_steps) for s in skip_lora][-1] == ("module-skip", 0.25, 300, 300)
    assert {s.target for s in long} == {0.25, 0.5} and all(s.steps > 10 * 300 for s in long)
    assert all(s.batch_size == 16 for s in long) and all(s.batch_size is None for s in skip_lora)
    a = qr.parse_args(["--spec", "x.json", "--out", "q.json", "--batch-size", "8"])
    for spec, want in ((long[0], 16), (skip_lora[0], 8)):  # a row's own batch size, else the driver's
        args = [str(x) for x in qr.calibrate_args(spec, a, Path("out"))]
        assert args[args.index("--batch-size") + 1] == str(want)
    args = [str(x) for x in qr.finetune_args(long[-1], a, Path("s1"), Path("out"))]
    assert args[args.index("--batch-size") + 1] == "16" and "--distill" not in args
    # LoRA with distillation from the long routers: the row's objective reaches its LoRA stage
    kd = qr.load_specs([ROOT / "scripts" / "device" / "quality-lora-distill.json"])
    qr.check_specs(long + kd)
    args = [str(x) for x in qr.finetune_args(kd[0], a, Path("s1"), Path("out"))]
    assert args[args.index("--distill") + 1] == "kl+lm" and kd[0].stage1_from == long[1].key
    assert all(s.stage1_from in {t.key for t in long if not t.lora_steps} for s in long if s.lora_steps)
    # Table 2's other recovered baselines: layer skipping (stage 1 again), static width at WIDE + LoRA's FLOPs
    base_lora = qr.load_specs([ROOT / "scripts" / "device" / "quality-lora-baselines.json"])
    qr.check_specs(specs + sweep + long + skip_lora + base_lora)
    recovered = [s for s in base_lora if s.lora_steps]
    assert sorted(s.method for s in recovered) == ["layer-skip", "layer-skip", "static-width", "static-width"]
    assert all(s.lora_steps == 300 and s.batch_size is None for s in recovered)
    assert {s.match_flops for s in recovered if s.match_flops} == {"wide-25-lora", "wide-50-lora"}
    assert all(names_by[s.match_flops].lora_steps == s.lora_steps for s in recovered if s.match_flops)
    # the FFN router on the layer input, at the budget of the calibration-only WIDE rows it is compared with
    source = qr.load_specs([ROOT / "scripts" / "device" / "quality-router-source.json"])
    qr.check_specs(specs + sweep + long + skip_lora + base_lora + source)
    for s in source:
        ref = names_by[f"wide-{round(100 * s.target)}"]
        assert (s.steps, s.method, s.batch_size) == (ref.steps, ref.method, ref.batch_size)
        args = [str(x) for x in qr.calibrate_args(s, a, Path("out"))]
        assert args[args.index("--ffn-router-source") + 1] == "layer"
    # the two levers that moved WIDE most at 300 steps together: the long budget with distillation
    long_kd = qr.load_specs([ROOT / "scripts" / "device" / "quality-long-distill.json"])
    qr.check_specs(specs + sweep + long + skip_lora + base_lora + source + long_kd)
    by_target = {s.target: s for s in long if not s.lora_steps}
    for s in long_kd:
        ref = by_target[s.target]
        assert (s.steps, s.batch_size, s.distill) == (ref.steps, ref.batch_size, "kl+lm")
    # the long routers trained on with distillation (a warm start: calibration only, 4,000 + 3,000 steps at 50%,
    # 4,000 + 2,500 at 25% and for the layer-input row), the fourth row once more from the first
    # (4,000 + 3,000 + 2,500), the last the first's control without it
    warm = qr.load_specs([ROOT / "scripts" / "device" / "quality-warm-distill.json"])
    qr.check_specs(specs + sweep + long + skip_lora + base_lora + source + long_kd + warm)
    *distilled, control = warm
    for s in distilled:
        ref = by_target[s.target] if s is not distilled[-1] else warm[0]
        assert s.init_from == ref.key and (s.batch_size, s.distill, s.lora_steps) == (ref.batch_size, "kl+lm", 0)
        assert s.target == ref.target and s.steps == (3000 if s is warm[0] else 2500)
    same = ("init_from", "target", "steps", "batch_size", "lora_steps", "extra_args")
    assert [getattr(control, f) for f in same] == [getattr(warm[0], f) for f in same] and control.distill == "none"
    moved = [s for s in warm if s.extra_args]  # one 50% row moves its FFN routers to the layer input
    assert [(s.target, s.extra_args) for s in moved] == [(0.5, ["--ffn-router-source", "layer"])]
    # the shipped calibration-only routers (the warm starts' last rows) trained on again, with distillation
    warm3 = qr.load_specs([ROOT / "scripts" / "device" / "quality-warm3-distill.json"])
    qr.check_specs(specs + sweep + long + skip_lora + base_lora + source + long_kd + warm + warm3)
    shipped = {0.5: warm[3], 0.25: warm[1]}
    for s in warm3:
        ref = shipped[s.target]
        assert s.init_from == ref.key and (s.batch_size, s.distill, s.lora_steps, s.extra_args) == (16, "kl+lm", 0, [])
    # the group-size ablation at the long budget: the 4,000-step rows with 32-channel FFN groups
    g32 = qr.load_specs([ROOT / "scripts" / "device" / "quality-long-g32.json"])
    qr.check_specs(specs + sweep + long + skip_lora + base_lora + source + long_kd + warm + warm3 + g32)
    for s in g32:
        ref = by_target[s.target]
        assert (s.steps, s.batch_size, s.distill, s.ffn_group_size) == (ref.steps, ref.batch_size, ref.distill, 32)
    # their routers trained on with distillation, each from the G 32 row of its target
    g32_warm = qr.load_specs([ROOT / "scripts" / "device" / "quality-g32-warm-distill.json"])
    qr.check_specs(specs + sweep + long + skip_lora + base_lora + source + long_kd + warm + warm3 + g32 + g32_warm)
    g32_by_target = {s.target: s for s in g32}
    assert sorted(s.target for s in g32_warm) == [0.25, 0.5]
    for s in g32_warm:
        ref = g32_by_target[s.target]
        assert s.init_from == ref.key and s.ffn_group_size == 32 and (s.distill, s.lora_steps) == ("kl+lm", 0)
        assert (s.steps, s.batch_size) == (1500, ref.batch_size)
    # 32-channel routers warm-started from the 128-channel rows that were shipped (their groups split)
    split = qr.load_specs([ROOT / "scripts" / "device" / "quality-g32-split.json"])
    qr.check_specs(specs + sweep + long + skip_lora + base_lora + source + long_kd + warm + warm3 + g32 + split)
    assert [(s.target, s.init_from) for s in split] == [(0.25, warm[1].key), (0.5, warm[3].key)]
    assert all(s.ffn_group_size == 32 and (s.distill, s.lora_steps) == ("kl+lm", 0) for s in split)
    assert split[1].steps == g32_warm[0].steps  # the 50% row against the G 32 row from scratch, same warm steps
    compiled = qr.parse_args(["--spec", "x.json", "--out", "q.json", "--compile"])
    assert "--compile" in qr.finetune_args(long[-1], compiled, Path("s1"), Path("out"))  # LoRA stages compile too
    assert "--compile" not in qr.finetune_args(long[-1], a, Path("s1"), Path("out"))
    levers = {s.name: s for s in specs if s.name.startswith("wide-50-") and not s.lora_steps}
    assert {s.distill for s in levers.values()} == {"none", "kl+lm"} and levers[
        "wide-50-flops"
    ].sparsity_kind == "flops"
    assert sorted(s.ffn_group_size for s in levers.values()) == [32, 64, 128, 128, 128]


def test_stopped_stage_restarts_or_resumes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(qr, "_cli", lambda args: (calls.append([str(x) for x in args]), ("wide ...", 1.0))[1])
    ckpt = tmp_path / "stage1"
    qr.run_stage(ckpt, ["calibrate"], trained=True)  # nothing there: a fresh start
    ckpt.mkdir()
    (ckpt / "wide_run.json").write_text("{}")  # stopped before its first checkpoint
    qr.run_stage(ckpt, ["calibrate"], trained=True)
    (ckpt / "latest").write_text("checkpoint-100")
    qr.run_stage(ckpt, ["calibrate"], trained=True)
    assert calls == [["calibrate"], ["calibrate", "--overwrite"], ["calibrate", "--resume"]]


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
        rec("static-width", 0.2, 50.0, 0.4, sparsity_kind="flops", match_flops="w"),
        rec("static-width", 0.2, 60.0, 0.4, sparsity_kind="flops", extra_args=["--bias-compensation"]),
        rec(
            "static-width",
            0.4,
            70.0,
            0.4,
            sparsity_kind="flops",
            match_flops="w",
            commands=["wide c --bias-compensation"],
        ),
    ]
    series, dense = ps.group_series(records)
    assert dense["wikitext_word_ppl"] == 20.0
    want = ["static-width", "static-width flops target bias-compensation", "static-width bias-compensation"]
    assert list(series) == sorted(want) + ["teal", "wide", "wide +LoRA"]
    assert [r["flops_removed"] for r in series["wide"]] == [0.2, 0.4]
    # a longer calibration is its own series; two runs at one target: one mean point (geometric in perplexity)
    more = [
        rec("wide", 0.3, 25.0, 0.46, target=0.5, steps=300),
        rec("wide", 0.35, 26.0, 0.47, target=0.5, steps=4000),
        rec("wide", 0.36, 24.0, 0.48, target=0.5, steps=300, init_steps=4000),  # a warm start: not a 300-step row
        rec("module-skip", 0.3, 100.0, 0.40, target=0.5, steps=300),
        rec("module-skip", 0.4, 400.0, 0.44, target=0.5, steps=300),
        rec("module-skip", 0.2, 50.0, 0.42, target=0.25, steps=300),
    ]
    series, _ = ps.group_series(more)
    assert sorted(series) == ["module-skip", "wide", "wide 4000 steps", "wide 4300 steps"]
    pts = ps.level_means(series["module-skip"])
    assert (
        pts[0] == pytest.approx((0.2, 50.0, 0.42))
        and pts[1][0] == pytest.approx(0.35)
        and pts[1][1] == pytest.approx(200.0)
    )
    assert pts[1][2] == pytest.approx(0.42)
    ps.plot(more, tmp_path / "more.png")
    out = ps.plot(records, tmp_path / "sweep.png", "test")
    assert out.is_file() and out.stat().st_size > 1000


def test_warm_start_sources_bring_their_budget(tmp_path):
    """A source row that was itself warm-started counts its whole chain; one with LoRA is refused (its record's
    budget includes a stage this row does not start from)."""
    stage1 = tmp_path / "w" / "stage1"
    stage1.mkdir(parents=True)
    (stage1 / "wide_config.json").write_text(
        json.dumps({"training": {"stage": "calibration", "steps": 3, "tokens": 30}})
    )
    plain = {"name": "w", "status": "done", "commands": ["c1"], "steps": 3, "tokens": 30}
    path, stages = qr._stage1_of("x", "w", tmp_path, [plain])
    assert path == stage1 and stages == [({"stage": "calibration", "steps": 3, "tokens": 30}, "c1", 0.0)]
    warm = plain | {"init_from": "v", "init_steps": 4, "tokens": 70, "gpu_minutes": 2.0, "commands": ["c0", "c1"]}
    _, stages = qr._stage1_of("x", "w", tmp_path, [warm])
    assert [c for _, c, _ in stages] == ["c0", "c1"] and stages[0][0] == {}
    assert {k: stages[-1][0][k] for k in ("steps", "tokens", "wall_time_s")} == {
        "steps": 7,
        "tokens": 70,
        "wall_time_s": 120.0,
    }
    with pytest.raises(SystemExit, match="a warm start with LoRA"):
        qr._stage1_of("x", "w", tmp_path, [warm | {"lora_steps": 2}])


def test_budget_plot_rows_labels_and_goals(tmp_path):
    def rec(name, target, tokens, ppl, **kw):
        base = {"name": name, "method": "wide", "target": target, "tokens": tokens, "wikitext_word_ppl": ppl}
        return base | {"status": "done", "steps": 300} | kw

    records = [
        {"name": "dense", "method": "dense", "wikitext_word_ppl": 10.0, "status": "done"},
        rec("a", 0.5, 5e6, 80.0),
        rec("b", 0.5, 1.3e8, 40.0, steps=4000),
        rec("c", 0.5, 2.3e8, 30.0, steps=3000, init_steps=4000, distill="kl+lm", init_from="b"),
        rec("d", 0.5, 1.6e8, 25.0, steps=4000, lora_steps=1000, stage1_from="b"),
        rec("g64", 0.5, 5e6, 90.0, ffn_group_size=64),  # another series: left out
        rec("moved", 0.5, 5e6, 70.0, extra_args=["--ffn-router-source", "layer"]),  # left out
        rec("one", 0.1, 5e6, 12.0),  # a target at one budget: no panel
        rec("e", 0.25, 5e6, 20.0),
        rec("f", 0.25, 1.3e8, 15.0, steps=4000),
    ]
    dense, by_target = pb.points(records)
    assert dense == 10.0 and list(by_target) == [0.25, 0.5]
    assert [r["name"] for r in by_target[0.5]] == ["a", "b", "d", "c"]  # by tokens
    labels = [pb.steps_label(r) for r in by_target[0.5]]
    assert labels == ["300", "4000", "4000 + LoRA 1000", "4000 + 3000 kl+lm"]
    assert pb.parse_goal("0.5:3.0") == (0.5, 3.0, "calibration only")
    assert pb.parse_goal("0.5:2.2:LoRA") == (0.5, 2.2, "LoRA")
    for bad in ("0.5", "x:3", "0.5:3:a:b"):
        with pytest.raises(argparse.ArgumentTypeError, match="--goal"):
            pb.parse_goal(bad)
    out = tmp_path / "budget.png"
    records_file = tmp_path / "q.json"
    records_file.write_text(json.dumps({"records": records}))
    assert pb.main([str(records_file), "--out", str(out), "--goal", "0.5:3.0"]) == 0
    assert out.is_file() and out.stat().st_size > 1000
    with pytest.raises(SystemExit, match="no dense record"):
        pb.points(records[1:])
    # another group size is its own series when asked for
    _, both = pb.points(records, (128, 64))
    assert [r["name"] for r in both[0.5]] == ["a", "g64", "b", "d", "c"]
    assert pb.main([str(records_file), "--out", str(out), "--group-sizes", "128,64"]) == 0
    with pytest.raises(SystemExit):
        pb.main([str(records_file), "--out", str(out), "--group-sizes", "x"])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, data_root) -> Path:
    """The --tiny model directory, made once for the tests below (each links it into its --work); needs the
    data root (tests/conftest.py's data_root: skipped without one)."""
    work = tmp_path_factory.mktemp("tiny")
    qr.tiny_setup(qr.parse_args(["--tiny", "--out", "unused"]), work)
    return work / "tiny-model"


def _work(tmp_path: Path, tiny_model: Path) -> Path:
    work = tmp_path / "w"
    work.mkdir()
    (work / "tiny-model").symlink_to(tiny_model)
    return work


@pytest.mark.slow
def test_tiny_mode_end_to_end_and_resume(tmp_path, capsys, tiny_model):
    out = tmp_path / "q.json"
    assert qr.main(["--tiny", "--out", str(out), "--work", str(_work(tmp_path, tiny_model))]) == 0
    recs = json.loads(out.read_text())["records"]
    methods = [r["method"] for r in recs]
    want = [
        "dense",
        "wide",
        "module-skip",
        "layer-skip",
        "static-width",
        "teal",
        "wide",
        "wide",
        "static-width",
        "wide",
        "wide",
    ]
    assert methods == want
    for r in recs:
        assert r["status"] == "done" and r["wikitext_word_ppl"] > 1 and "arc_easy" in r["tasks"]
        if r["method"] != "dense":
            assert -0.05 < r["flops_removed"] < 1 and r["tokens"] > 0 and r["commands"]
        if r["sparsity_kind"] == "groups" and r["method"] != "dense":  # targets of 50% of the groups
            assert r["flops_removed"] > 0 and r["real_sparsity"]["overall"] > 0.2, r
    assert recs[-4]["lora_steps"] == 2 and len(recs[-4]["commands"]) == 2
    matched = recs[-3]  # static width at the FLOPs the WIDE row removed
    assert matched["match_flops"] == recs[1]["name"] and matched["sparsity_kind"] == "flops"
    assert matched["target"] == pytest.approx(recs[1]["flops_removed"], abs=1e-4)
    assert abs(matched["flops_removed"] - recs[1]["flops_removed"]) < 0.01
    warm = recs[-2]  # the WIDE row's routers trained on at another target: both stages in its budget
    assert warm["init_from"] == recs[1]["name"] and (warm["init_steps"], warm["steps"]) == (2, 2)
    assert warm["tokens"] == 2 * recs[1]["tokens"] and "--init-routers" in warm["commands"][1]
    assert warm["commands"][0] == recs[1]["commands"][0] and warm["target"] == 0.3
    again = recs[-1]  # a warm start from a warm start: the whole chain in its budget
    assert again["init_from"] == warm["name"] and (again["init_steps"], again["steps"]) == (4, 2)
    assert again["tokens"] == 3 * recs[1]["tokens"] and again["commands"][:2] == warm["commands"]
    assert again["gpu_minutes"] > warm["gpu_minutes"] and "--init-routers" in again["commands"][2]
    capsys.readouterr()
    assert qr.main(["--tiny", "--out", str(out), "--work", str(tmp_path / "w")]) == 0  # everything finished
    assert capsys.readouterr().err.count("[skip]") == len(recs)
    assert json.loads(out.read_text())["records"] == recs


@pytest.mark.slow
def test_tiny_rows_concurrently(tmp_path, capsys, tiny_model):
    """--jobs 2: dense and WIDE at once, then the static-width row at WIDE's FLOPs (it waits for it)."""
    out, work = tmp_path / "q.json", _work(tmp_path, tiny_model)
    wide, matched = "wide-groups0.5-s2-g16", "static-width-flopsof[wide-groups0.5-s2-g16]-g16"
    only = ["dense", wide, matched]
    argv = ["--tiny", "--out", str(out), "--work", str(work), "--jobs", "2", "--only", ",".join(only)]
    assert qr.main(argv) == 0
    recs = json.loads(out.read_text())["records"]
    assert [r["name"] for r in recs] == only  # spec order, whatever order they finished in
    for r in recs:
        assert r["status"] == "done" and r["wikitext_word_ppl"] > 1 and "arc_easy" in r["tasks"], r
        assert r["concurrent_jobs"] == 2 and r["eval_limit"] == 1
        assert (work / r["name"] / "log.txt").is_file()
    assert recs[2]["target"] == pytest.approx(recs[1]["flops_removed"], abs=1e-4)
    err = capsys.readouterr().err
    assert err.index(f"[done] {wide}") < err.index(f"[start] {matched}")  # the dependency was respected
    assert err.count("[start]") == err.count("[done]") == 3


@pytest.mark.slow
def test_failed_row_is_recorded_and_the_others_finish(tmp_path, capsys, tiny_model, monkeypatch):
    tiny = qr.tiny_setup
    bad = qr.RunSpec("teal", name="bad", extra_args=["--no-such-flag"])
    monkeypatch.setattr(qr, "tiny_setup", lambda a, work: [bad, *tiny(a, work)])
    out, work = tmp_path / "q.json", _work(tmp_path, tiny_model)
    argv = ["--tiny", "--out", str(out), "--work", str(work), "--jobs", "2", "--only", "bad,dense"]
    assert qr.main(argv) == 0
    failed, dense = json.loads(out.read_text())["records"]
    assert dense["name"] == "dense" and dense["status"] == "done"
    assert failed["name"] == "bad" and failed["status"] == "failed" and "--no-such-flag" in failed["error"]
    assert "wikitext_word_ppl" not in failed and Path(failed["log"]).is_file()
    assert "[failed] bad" in capsys.readouterr().err
    assert qr.main([*argv, "--budget-s", "0"]) == 0  # past the budget: nothing starts, nothing changes
    assert json.loads(out.read_text())["records"] == [failed, dense]
    assert "[budget] not started: bad" in capsys.readouterr().err


def test_budget_and_grace_stop_rows(tmp_path, capsys):
    """Past --budget-s nothing starts; at --budget-s + --grace-s a running row gets SIGTERM and is recorded
    as interrupted (never done). The rows here never get far: the stop comes while they start."""
    out, work = tmp_path / "q.json", tmp_path / "w"
    a = qr.parse_args(["--out", str(out), "--work", str(work), "--budget-s", "0.2", "--grace-s", "0.3"])
    specs = [qr.RunSpec("wide", steps=10_000, name="long"), qr.RunSpec("dense")]
    order = {s.key: i for i, s in enumerate(specs)}
    assert qr.run_concurrent(specs, a, work, out, {}, order, time.monotonic()) == 0  # --jobs 1: one slot
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["name"] == "long" and rec["status"] == "interrupted" and rec["concurrent_jobs"] == 1
    err = capsys.readouterr().err
    assert "[stop] long" in err and "[budget] not started: dense" in err


def test_quality_table_levels_and_comparisons():
    def rec(name, method, flops, ppl, acc, **kw):
        tasks = {t: acc for t in qt.TASKS}
        base = {"name": name, "method": method, "flops_removed": flops, "wikitext_word_ppl": ppl, "avg_acc": acc}
        return base | {"status": "done", "tasks": tasks, "steps": 10, "tokens": 1000, "sparsity_kind": "groups"} | kw

    records = [
        rec("dense", "dense", 0.0, 20.0, 0.5, steps=0, tokens=0),
        rec("w25", "wide", 0.15, 30.0, 0.48, target=0.25),
        rec("w50", "wide", 0.35, 60.0, 0.40, target=0.5),
        rec("m50", "module-skip", 0.36, 600.0, 0.35, target=0.5),
        rec("s50", "static-width", 0.35, 120.0, 0.38, target=0.35, sparsity_kind="flops", match_flops="w50", steps=0),
        {"name": "t50", "method": "teal", "match_flops": "w50", "status": "interrupted"},
        rec("w50-lora", "wide", 0.37, 40.0, 0.42, target=0.5, lora_steps=5),
        rec("m50-lora", "module-skip", 0.37, 80.0, 0.40, target=0.5, lora_steps=5),
        rec("s50-lora", "static-width", 0.37, 60.0, 0.41, steps=0, lora_steps=5, match_flops="w50-lora"),
        rec("w50-long", "wide", 0.36, 45.0, 0.41, target=0.5, steps=40),
        rec("w50-src", "wide", 0.36, 50.0, 0.41, target=0.5, extra_args=["--ffn-router-source", "layer"]),
    ]
    text = qt.table(records)
    t25, t50 = text.split("### Target 50%")
    assert "| w25 |" in t25 and "| m50 |" not in t25 and "| s50 |" in t50  # matched rows sit at their row's level
    assert "| w50 | wide | 10 steps, 0.0M tok | 0.350 |" in t50 and "| 3.00 |" in t50  # 60 / 20 dense
    assert "Not finished: t50 (interrupted)" in text
    assert "`m50` (FLOPs removed 0.360): perplexity 10.0× WIDE's, average accuracy -0.050" in text
    assert "`s50` (FLOPs removed 0.350): perplexity 2.0× WIDE's" in text
    assert "| s50-lora | static-width | training-free + 5 LoRA, 0.0M tok |" in t50
    # + LoRA rows against + LoRA rows only; a longer WIDE budget against the training-free rows only
    lora = text.split("WIDE row `w50-lora` (target 50% + 5 LoRA, FLOPs removed 0.370):")[1].split("\n\n")[0]
    assert "`m50-lora` (FLOPs removed 0.370): perplexity 2.0× WIDE's, average accuracy -0.020" in lora
    assert "`s50-lora`" in lora and "`m50`" not in lora and "`s50`" not in lora.replace("`s50-lora`", "")
    plain = text.split("WIDE row `w50` ")[1].split("\n\n")[0]
    assert "lora" not in plain and "`m50`" in plain
    assert "WIDE row `w50-src`" not in text and "| w50-src | wide |" in t50  # a variant: a row, no comparison block
    long = text.split("WIDE row `w50-long` ")[1].split("\n\n")[0]
    assert "`s50`" in long and "`m50`" not in long


def test_pack_work_whole_rows_furthest_first(tmp_path):
    """The parts always make a complete tar: a row that does not fit stays out whole; unfinished rows go first,
    the furthest-trained first, then finished rows' routers."""
    work = tmp_path / "work"

    def stage(row: str, name: str, ckpt_step: int | None, size: int) -> None:
        d = work / row / name
        d.mkdir(parents=True)
        (d / "train_log.jsonl").write_text("{}\n")
        if ckpt_step is None:  # finished: its own config and routers
            (d / "wide_config.json").write_text("{}")
            (d / "routers.safetensors").write_bytes(b"r" * size)
        else:
            (d / "latest").write_text(f"checkpoint-{ckpt_step}")
            c = d / f"checkpoint-{ckpt_step}"
            c.mkdir()
            (c / "trainer_state.safetensors").write_bytes(b"s" * size)
            (c / "wide_config.json").write_text("{}")
        (work / row / "log.txt").write_text("never packed")

    kib = 1024
    stage("long", "stage1", 2900, 40 * kib)  # the most GPU time in it
    stage("short", "stage1", 100, 40 * kib)
    stage("lora-row", "stage1", None, 4 * kib)
    stage("lora-row", "lora", 200, 30 * kib)
    stage("done-row", "stage1", None, 2 * kib)
    (work / "quality.json").write_text(json.dumps({"records": [{"name": "done-row", "status": "done"}]}))

    packed, left = pw.pack(work, tmp_path / "out", parts=4, part_bytes=26 * kib)  # room for ~93 KiB
    assert packed == ["long", "lora-row", "done-row"] and left == ["short"]  # 200 steps before 100
    parts = sorted((tmp_path / "out").glob("work.tar.*"))
    assert len(parts) <= 4 and all(p.stat().st_size <= 26 * kib for p in parts)
    whole = tmp_path / "whole.tar"
    whole.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(whole) as t:
        names = set(t.getnames())
    assert "long/stage1/checkpoint-2900/trainer_state.safetensors" in names
    assert "lora-row/stage1/routers.safetensors" in names and "lora-row/lora/latest" in names
    assert "done-row/stage1/routers.safetensors" in names
    assert not any(n.startswith("short/") or n.endswith("log.txt") for n in names)

    # the size estimate never undershoots, long names (a GNU long-name header each) included
    stage("r" * 120, "stage1", 7, 5 * kib)
    for i, part_bytes in enumerate(range(12 * kib, 80 * kib, 3 * kib + 17)):
        dest = tmp_path / f"sweep{i}"
        pw.pack(work, dest, parts=3, part_bytes=part_bytes)
        assert len(list(dest.glob("work.tar.*"))) <= 3

    # only the rows named, in that order (a later fetch of what did not fit); a name without files: an error
    assert pw.pack(work, tmp_path / "some", parts=4, part_bytes=26 * kib, only=["done-row", "short"]) == (
        ["done-row", "short"],
        [],
    )
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in sorted((tmp_path / "some").iterdir())))) as t:
        assert {n.split("/")[0] for n in t.getnames()} == {"done-row", "short"}
    with pytest.raises(SystemExit, match="nope"):
        pw.pack(work, tmp_path / "x", parts=4, only=["nope"])

    # everything fits: every row; nothing at all fits: an empty (still valid) tar
    assert pw.pack(work, tmp_path / "all", parts=8)[1] == []
    assert pw.pack(work, tmp_path / "none", parts=1, part_bytes=12 * kib) == (
        [],
        ["long", "lora-row", "short", "r" * 120, "done-row"],  # by steps: 2,900, 200, 100, 7; then finished
    )
