"""Offline task documents and their equality with lm-eval's built-in tasks on the same docs."""

from __future__ import annotations

import json

import pytest

from wide.eval.tasks import (
    BUILTIN,
    UnknownTaskError,
    build_docs,
    builtin_yaml,
    offline_name,
    resolve_tasks,
    swapped_config,
    write_task_dir,
)

COUNTS = {
    "arc_easy": 2376,
    "arc_challenge": 1172,
    "boolq": 3270,
    "piqa": 1838,
    "winogrande": 1267,
    "openbookqa": 500,
    "hellaswag": 10042,
    "wikitext": 62,
}


@pytest.mark.parametrize("task", list(COUNTS))
def test_doc_counts(data_root, task):
    assert len(build_docs(task)) == COUNTS[task]


def test_doc_fields(data_root):
    b = build_docs("boolq")
    assert b[0]["passage"].startswith("Ethanol fuel -- All biomass goes through")
    assert sum(d["label"] for d in b) == 2033
    a = build_docs("arc_easy")[0]
    assert a["choices"]["label"][a["choices"]["label"].index(a["answerKey"])] == a["answerKey"]
    h = build_docs("hellaswag")[0]
    assert (h["activity_label"], h["ctx_a"], h["ctx_b"], h["label"]) == (
        "Roof shingle removal",
        "A man is sitting on a roof.",
        "he",
        "3",
    )
    words = sum(len(__import__("re").split(r"\s+", d["page"])) for d in build_docs("wikitext"))
    assert words == 241335


def test_resolve_tasks():
    assert resolve_tasks("all")[0] == "arc_easy" and len(resolve_tasks("all")) == 7
    assert resolve_tasks("offline_boolq,piqa") == ["boolq", "piqa"]
    with pytest.raises(UnknownTaskError, match="valid tasks: arc_easy"):
        resolve_tasks(["mmlu"])


def test_missing_data_file(tmp_path):
    (tmp_path / "boolq").mkdir()
    with pytest.raises(FileNotFoundError, match=r"boolq/dev.jsonl.*WIDE_DATA"):
        build_docs("boolq", data_dir=tmp_path)


def _reference_configs(tasks, tmp_path):
    """The built-in lm-eval configs, loaded from lm-eval's own YAML, with only the dataset swapped to
    hub-format docs rebuilt from the local files."""
    from lm_eval.tasks._yaml_loader import load_yaml

    cfgs = []
    for t in tasks:
        f = tmp_path / f"ref_{t}.jsonl"
        f.write_text("".join(json.dumps(d) + "\n" for d in build_docs(t)))
        cfg = load_yaml(builtin_yaml(t))
        cfg.update(swapped_config(t, f, f"ref_{t}"))
        cfg.pop("tag", None)
        cfgs.append(cfg)
    return cfgs


SAME_DATA = ["arc_easy", "arc_challenge", "boolq", "piqa", "winogrande", "openbookqa", "hellaswag"]


def test_offline_equals_builtin(data_root, tiny, tmp_path):
    """Our offline_* tasks give the built-in tasks' exact results (prompts, targets, metrics)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from wide.eval.lm_eval_model import WideLM

    model, tok = tiny
    lm = WideLM("tiny", model=model, tokenizer=tok, batch_size=16, max_length=512)
    tm = TaskManager(include_path=str(write_task_dir(SAME_DATA, out_dir=tmp_path / "tasks")), include_defaults=False)
    ours = simple_evaluate(
        model=lm,
        tasks=[offline_name(t) for t in SAME_DATA],
        limit=4,
        task_manager=tm,
        bootstrap_iters=0,
        log_samples=True,
    )
    ref = simple_evaluate(
        model=lm,
        tasks=_reference_configs(SAME_DATA, tmp_path),
        limit=4,
        task_manager=tm,
        bootstrap_iters=0,
        log_samples=True,
    )
    for t in SAME_DATA:
        a, b = ours["results"][offline_name(t)], ref["results"][f"ref_{t}"]
        for m in ("acc,none", "acc_norm,none"):
            assert a.get(m) == b.get(m), (t, m)
        sa = [(s["arguments"], s["resps"]) for s in ours["samples"][offline_name(t)]]
        sb = [(s["arguments"], s["resps"]) for s in ref["samples"][f"ref_{t}"]]
        assert sa == sb, t
        assert len(sa) >= 4


def test_builtin_table_covers_tasks():
    for t in BUILTIN:
        assert builtin_yaml(t).is_file()
