"""`run_eval` end to end on a tiny random Llama, the `wide` lm-eval model type, and error messages."""

from __future__ import annotations

import json
import math

import pytest

import wide.eval  # noqa: F401  (registers the lm-eval model type)


def test_registered():
    from lm_eval.api.registry import get_model

    from wide.eval.lm_eval_model import WideLM

    assert get_model("wide") is WideLM
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own types still resolve


def test_padding_excluded_from_sparsity(data_root, tiny_dir, tiny_routers, tmp_path):
    """Real-token counts and skip rates do not depend on how HFLM pads batches."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from wide.eval.tasks import write_task_dir

    tm = TaskManager(include_path=str(write_task_dir(["piqa"], out_dir=tmp_path)), include_defaults=False)
    out = []
    for bs in (1, 4):
        res = simple_evaluate(
            model="wide",
            model_args=f"pretrained={tiny_dir},routers={tiny_routers},device=cpu",
            tasks=["offline_piqa"],
            limit=3,
            batch_size=bs,
            task_manager=tm,
            bootstrap_iters=0,
        )
        out.append(res["config"]["wide_sparsity"])
    a, b = out
    assert a["tokens"] == b["tokens"] > 0
    for k in ("attn_sparsity", "ffn_sparsity", "flop_saving"):
        assert math.isclose(a[k], b[k], rel_tol=1e-9), k
    assert 0.05 < a["attn_sparsity"] < 0.95 and 0.05 < a["ffn_sparsity"] < 0.95


def test_run_eval_end_to_end(data_root, tiny_dir, tiny_routers, tmp_path):
    from wide.eval.runner import run_eval

    res = run_eval(
        str(tiny_dir),
        [str(tiny_routers)],
        "all",
        limit=2,
        batch_size=8,
        max_length=256,
        device="cpu",
        out=str(tmp_path / "res"),
    )
    assert set(res["rows"]) == {"dense", str(tiny_routers)}
    dense, routed = res["rows"]["dense"], res["rows"][str(tiny_routers)]
    assert len(dense["tasks"]) == 7 and dense["retention"] == 1.0
    assert routed["sparsity"]["all"]["attn_sparsity"] > 0
    for row in (dense, routed):
        assert row["wikitext"]["lm_eval_rel_diff"] < 1e-4
    assert routed["wikitext"]["word_perplexity"] != dense["wikitext"]["word_perplexity"]
    md = (tmp_path / "res.md").read_text()
    assert "| Model | Real sparsity (attn/ffn) | WikiText2 | ARC-E | ARC-C | BoolQ | WinoGrande | PIQA" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert len(rows) == 3 and rows[1].startswith("| Dense |")  # header, Dense, one checkpoint
    assert json.loads((tmp_path / "res.json").read_text())["settings"]["max_length"] == 256


def test_run_eval_keeps_finished_rows_when_interrupted(data_root, tiny_dir, tiny_routers, tmp_path, monkeypatch):
    """Results are rewritten after every row: a run that dies on its second checkpoint keeps the first."""
    import wide.eval.runner as runner

    real, calls = runner._evaluate_one, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "_evaluate_one", flaky)
    out = tmp_path / "res"
    with pytest.raises(KeyboardInterrupt):
        runner.run_eval(
            str(tiny_dir), [str(tiny_routers), str(tiny_routers)], "wikitext", limit=1, batch_size=4,
            max_length=128, device="cpu", out=str(out), dense=False, check_wikitext=False,
        )  # fmt: skip
    saved = json.loads((tmp_path / "res.json").read_text())
    assert list(saved["rows"]) == [str(tiny_routers)]


def test_errors(data_root, tiny_dir, tmp_path, monkeypatch, make_ckpt):
    from wide.eval.runner import run_eval
    from wide.eval.tasks import UnknownTaskError
    from wide.model import CheckpointMismatchError

    with pytest.raises(UnknownTaskError, match="valid tasks"):
        run_eval(str(tiny_dir), [], ["arc_easy", "mmlu"], device="cpu")
    (tmp_path / "data").mkdir()
    with pytest.raises(FileNotFoundError, match="arc_easy/ARC-Easy-Test.jsonl"):
        run_eval(str(tiny_dir), [], ["arc_easy"], data_dir=str(tmp_path / "data"), device="cpu")
    monkeypatch.setenv("WIDE_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="WIDE_DATA"):
        run_eval(str(tiny_dir), [], ["boolq"], device="cpu")
    monkeypatch.setenv("WIDE_DATA", str(data_root))
    other = make_ckpt(tiny_dir, tmp_path / "other", base_model="some/other-model")
    with pytest.raises(CheckpointMismatchError, match="other-model"):
        run_eval(str(tiny_dir), [str(other)], ["boolq"], limit=1, device="cpu", dense=False)
    with pytest.raises(FileNotFoundError, match="router checkpoint"):
        run_eval(str(tiny_dir), [str(tmp_path / "missing")], ["boolq"], device="cpu")


def test_run_eval_through_the_runtime_equals_the_masked_path(data_root, tiny_dir, tiny_routers, monkeypatch):
    """`wide eval --runtime` scores through WideRuntime: on the CPU torch path its perplexity, task scores
    and metered sparsity equal the masked path's exactly (docs/routing.md)."""
    from wide.eval.runner import run_eval

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kw = dict(limit=2, batch_size=4, max_length=128, device="cpu", check_wikitext=False)
    masked = run_eval(str(tiny_dir), [str(tiny_routers)], "wikitext,arc_easy,boolq", **kw)
    served = run_eval(str(tiny_dir), [str(tiny_routers)], "wikitext,arc_easy,boolq", runtime=True, **kw)
    assert served["settings"]["path"] == "runtime" and masked["settings"]["path"] == "auto"
    assert {r["path"] for r in masked["rows"].values()} == {"masked"}  # auto on the CPU: the masked path
    assert {r["path"] for r in served["rows"].values()} == {"runtime"}
    assert "Scored through: Dense runtime" in served["markdown"]
    for name in ("dense", str(tiny_routers)):
        m, s = masked["rows"][name], served["rows"][name]
        assert s["wikitext"]["word_perplexity"] == m["wikitext"]["word_perplexity"]
        assert s["tasks"] == m["tasks"]
    m, s = masked["rows"][str(tiny_routers)]["sparsity"], served["rows"][str(tiny_routers)]["sparsity"]
    assert s["all"]["tokens"] == m["all"]["tokens"] > 0
    assert s["all"]["attn_sparsity"] == m["all"]["attn_sparsity"] > 0


@pytest.fixture
def no_data_no_hub(monkeypatch, tmp_path):
    """As on a fresh machine: no data root (WIDE_DATA unset, no shared/data search), the hub unreachable, and
    a temp folder of its own (to see what is left there)."""
    import tempfile

    import datasets

    local = datasets.load_dataset

    def hub_unreachable(path, *a, **k):  # local files (lm-eval's "json" tasks) still load
        if path == "json":
            return local(path, *a, **k)
        raise ConnectionError("no network")

    monkeypatch.delenv("WIDE_DATA", raising=False)
    monkeypatch.setenv("WIDE_DATA_SEARCH", "0")
    monkeypatch.setattr(datasets, "load_dataset", hub_unreachable)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def test_run_eval_without_data_or_hub_scores_the_packaged_slice_and_says_so(tiny_dir, no_data_no_hub, capsys):
    """WikiText-2 falls back to the pages packaged with wide: the output, the records and the table say it is a
    slice; lm-eval's own wikitext task scores the same pages; the task folder is removed afterwards."""
    from wide.eval.runner import run_eval
    from wide.eval.tasks import packaged_wikitext_pages

    res = run_eval(str(tiny_dir), [], "wikitext", max_length=128, batch_size=8, device="cpu")
    err = capsys.readouterr().err
    assert "slice packaged with wide" in err and "not the full test set" in err
    ppl = res["rows"]["dense"]["wikitext"]
    assert ppl["source"] == "packaged slice" and ppl["docs"] == len(packaged_wikitext_pages())
    assert ppl["lm_eval_rel_diff"] < 1e-4  # lm-eval's wikitext task read the same pages
    assert (res["settings"]["wikitext_source"], res["settings"]["hub"]) == ("packaged slice", "offline")
    assert "WikiText2 (slice)" in res["markdown"] and "not the full test set" in res["markdown"]
    assert list(no_data_no_hub.iterdir()) == []


def test_zero_shot_tasks_without_data_or_hub_refuse_in_one_line_before_loading(no_data_no_hub, monkeypatch, capsys):
    from wide.cli import main
    from wide.eval import lm_eval_model

    def loaded(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(lm_eval_model, "load_routed", loaded)
    assert main(["eval", "--tasks", "all", "--limit", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the zero-shot tasks") and "--online" in err
    assert "WIDE_DATA" in err and list(no_data_no_hub.iterdir()) == []


def test_hub_mode_is_what_the_libraries_read():
    """Unset variables: offline; online=True: what huggingface_hub and datasets then read (fresh processes:
    both read the variables once, when imported)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    for arg, want in (("None", "False"), ("True", "True"), ("False", "False")):
        code = f"from wide.eval.runner import hub_online; print(hub_online({arg}))"
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert run.stdout.strip().splitlines()[-1] == want, arg


def test_run_eval_removes_its_task_folder_on_ctrl_c(tiny_dir, no_data_no_hub, monkeypatch):
    from wide.eval import lm_eval_model
    from wide.eval.runner import run_eval

    def interrupted(*a, **k):
        assert [p.name for p in no_data_no_hub.iterdir()][0].startswith("wide-tasks-")
        raise KeyboardInterrupt

    monkeypatch.setattr(lm_eval_model, "load_routed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_eval(str(tiny_dir), [], "wikitext", device="cpu")
    assert list(no_data_no_hub.iterdir()) == []
