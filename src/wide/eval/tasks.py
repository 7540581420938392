"""Offline lm-eval tasks over the local files of shared/data (see its SOURCES.md).

Each task is lm-eval's own built-in config (prompt, choices, target, metrics, process_docs) with only
the dataset swapped: the local file is rebuilt into the hub dataset's fields (document builders
below), written as JSONL, and a YAML config that `include`s lm-eval's built-in YAML points
`dataset_path: json` at it. The tasks are named `offline_<task>` and tagged `wide_offline`.

HellaSwag is approximate (llama.cpp's text format, see `hellaswag_docs`); all other tasks carry the
same data as lm-eval's hub datasets. Without any data root a task keeps its hub dataset (online).
"""

from __future__ import annotations

import bz2
import gzip
import json
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from wide.paths import data_dir as _data_root
from wide.paths import find_data_dir, packaged_wikitext_slice

# The seven zero-shot tasks of the paper's Table 1, in its column order, and the metric it reports.
ZERO_SHOT_TASKS = ("arc_easy", "arc_challenge", "boolq", "winogrande", "piqa", "openbookqa", "hellaswag")
TABLE_METRIC = {
    "arc_easy": "acc_norm",
    "arc_challenge": "acc_norm",
    "boolq": "acc",
    "winogrande": "acc",
    "piqa": "acc_norm",
    "openbookqa": "acc_norm",
    "hellaswag": "acc_norm",
}
ALL_TASKS = (*ZERO_SHOT_TASKS, "wikitext")
OFFLINE_PREFIX = "offline_"
OFFLINE_TAG = "wide_offline"

# task -> (lm-eval built-in YAML under lm_eval/tasks, the split lm-eval evaluates on)
BUILTIN = {
    "arc_easy": ("arc/arc_easy.yaml", "test"),
    "arc_challenge": ("arc/arc_challenge.yaml", "test"),
    "boolq": ("super_glue/boolq/default.yaml", "validation"),
    "piqa": ("piqa/piqa.yaml", "validation"),
    "winogrande": ("winogrande/default.yaml", "validation"),
    "openbookqa": ("openbookqa/openbookqa.yaml", "test"),
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation"),
    "wikitext": ("wikitext/wikitext.yaml", "test"),
}

# task -> files under the data root (relative)
DATA_FILES = {
    "arc_easy": ("arc_easy/ARC-Easy-Test.jsonl",),
    "arc_challenge": ("arc_challenge/ARC-Challenge-Test.jsonl",),
    "boolq": ("boolq/dev.jsonl",),
    "piqa": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
    "winogrande": ("winogrande/dev.jsonl", "winogrande/dev-labels.lst"),
    "openbookqa": ("openbookqa/test.jsonl",),
    "hellaswag": ("hellaswag/hellaswag_val_full.txt.bz2",),
    "wikitext": ("wikitext/wiki.test.raw",),
}


class UnknownTaskError(ValueError):
    """A task name that is not one of ALL_TASKS."""


def resolve_tasks(tasks: str | Sequence[str]) -> list[str]:
    """'all' (the seven zero-shot tasks), a comma-separated string or a list -> validated task names.
    `offline_` prefixes are accepted."""
    if isinstance(tasks, str):
        if tasks.strip().lower() == "all":
            return list(ZERO_SHOT_TASKS)
        tasks = [t for t in tasks.split(",") if t.strip()]
    out = []
    for t in tasks:
        name = t.strip().lower().removeprefix(OFFLINE_PREFIX)
        if name == "all":
            out += [x for x in ZERO_SHOT_TASKS if x not in out]
            continue
        if name not in BUILTIN:
            raise UnknownTaskError(f"unknown task {t!r}; valid tasks: {', '.join(ALL_TASKS)} (or 'all')")
        if name not in out:
            out.append(name)
    return out


def data_path(task: str, index: int = 0, data_dir: str | Path | None = None) -> Path:
    """The local file `DATA_FILES[task][index]`, or FileNotFoundError naming it and how to fix it."""
    root = _data_root(data_dir)
    p = root / DATA_FILES[task][index]
    if not p.is_file():
        raise FileNotFoundError(
            f"missing data file for task {task!r}: {p} (data root {root}). Point WIDE_DATA or --data-dir "
            "at a folder laid out like shared/data (see its SOURCES.md)."
        )
    return p


def _jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _labels(path: Path) -> list[str]:
    return [x.strip() for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


# ----------------------------------------------------------------------------- document builders
# Each returns the rows of the hub dataset lm-eval's built-in task reads, with the same fields.


def arc_docs(path: Path) -> list[dict]:
    """allenai/ai2_arc fields: id, question, choices{text, label}, answerKey."""
    out = []
    for r in _jsonl(path):
        ch = r["question"]["choices"]
        out.append(
            {
                "id": r["id"],
                "question": r["question"]["stem"],
                "choices": {"text": [c["text"] for c in ch], "label": [c["label"] for c in ch]},
                "answerKey": r["answerKey"],
            }
        )
    return out


def openbookqa_docs(path: Path) -> list[dict]:
    """allenai/openbookqa (main) fields: id, question_stem, choices{text, label}, answerKey."""
    return [
        {"id": d["id"], "question_stem": d["question"], "choices": d["choices"], "answerKey": d["answerKey"]}
        for d in arc_docs(path)
    ]


def boolq_docs(path: Path) -> list[dict]:
    """super_glue/boolq fields: question, passage ("{title} -- {passage}"), idx, label (0 no / 1 yes)."""
    return [
        {
            "question": r["question"],
            "passage": f"{r['title']} -- {r['passage']}",
            "idx": i,
            "label": int(bool(r["answer"])),
        }
        for i, r in enumerate(_jsonl(path))
    ]


def piqa_docs(path: Path, labels: Path) -> list[dict]:
    """piqa fields: goal, sol1, sol2, label (from the aligned .lst)."""
    rows, lab = _jsonl(path), _labels(labels)
    if len(rows) != len(lab):
        raise ValueError(f"{path} has {len(rows)} rows but {labels} has {len(lab)} labels")
    return [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(y)} for r, y in zip(rows, lab)]


def winogrande_docs(path: Path, labels: Path) -> list[dict]:
    """winogrande fields: sentence, option1, option2, answer ("1"/"2"), checked against the .lst."""
    rows, lab = _jsonl(path), _labels(labels)
    if len(rows) != len(lab) or any(str(r["answer"]) != y for r, y in zip(rows, lab)):
        raise ValueError(f"{path} answers disagree with {labels}")
    return [
        {"sentence": r["sentence"], "option1": r["option1"], "option2": r["option2"], "answer": str(r["answer"])}
        for r in rows
    ]


_LAST_PARTIAL = re.compile(r"^(.*[.!?]) ([a-z].*)$")


def hellaswag_docs(path: Path) -> list[dict]:
    """Rowan/hellaswag-like fields (activity_label, ctx_a, ctx_b, ctx, endings, label) rebuilt from
    llama.cpp's 6-line format: `activity_label: ctx`, gold label, 4 endings.

    lm-eval's own `process_docs` then builds `activity_label: ctx_a + " " + ctx_b.capitalize()` and
    applies `preprocess`. The file lost the ctx_a / ctx_b split, so ctx_b is recovered as the last,
    lower-case, partial sentence of ctx (3,263 items; SOURCES.md estimates ~3,240 affected). Remaining
    differences from lm-eval's input: endings that began with a `[tag]` lost their leading space, and
    the split heuristic can misfire on a context whose genuine last sentence starts in lower case."""
    with bz2.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise ValueError(f"{path}: {len(lines)} lines, not a multiple of 6")
    out = []
    for i in range(0, len(lines), 6):
        label, _, ctx = lines[i].partition(": ")
        m = _LAST_PARTIAL.match(ctx)
        ctx_a, ctx_b = (m.group(1), m.group(2)) if m else (ctx, "")
        out.append(
            {
                "ind": i // 6,
                "activity_label": label,
                "ctx_a": ctx_a,
                "ctx_b": ctx_b,
                "ctx": ctx,
                "endings": lines[i + 2 : i + 6],
                "source_id": "",
                "split": "val",
                "split_type": "",
                "label": lines[i + 1].strip(),
            }
        )
    return out


def wikitext_pages(text: str) -> list[str]:
    """EleutherAI/wikitext_document_level's page split of a wiki.*.raw file (62 pages for the test
    set): a line that, after collapsing '= = =' / '= =', reads '= ... =' starts a new page."""
    pages: list[str] = []
    page: list[str] = []
    for line in text.split("\n"):
        rline = line.replace("= = =", "===").replace("= =", "==").strip()
        if rline.startswith("= ") and rline.endswith(" ="):
            joined = "\n".join(page)
            if joined.strip():
                pages.append(joined)
            page = []
        page.append(line)
    joined = "\n".join(page)
    if joined.strip():
        pages.append(joined)
    return pages


# The hub dataset lm-eval's `wikitext` task reads: the same pages as `wikitext_pages(wiki.test.raw)`.
WIKITEXT_HUB = ("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1", "test")


def wikitext_test_pages(
    data_dir: str | Path | None = None, *, allow_slice: bool = False, fallback_slice: bool = False
) -> tuple[list[str], str]:
    """(pages of WikiText-2's test split, where they came from: "data root", "packaged slice" or "hub").

    Lookup: wikitext/wiki.test.raw under the data root (flag, $WIDE_DATA, shared/data; a root without
    that file is an error naming it); with no data root, the first pages packaged with `wide` when
    `allow_slice` (a caller that needs more pages than the slice holds must call again without it); else
    `datasets.load_dataset(WIKITEXT_HUB)` (online, or its cache under HF_DATASETS_OFFLINE); when that fails
    too, the packaged pages if `fallback_slice` (the caller must say it scored a slice). FileNotFoundError
    when none is available."""
    if find_data_dir(data_dir) is not None:
        return wikitext_pages(data_path("wikitext", 0, data_dir).read_text(encoding="utf-8")), "data root"
    if allow_slice:
        return packaged_wikitext_pages(), "packaged slice"
    try:
        import datasets

        name, config, split = WIKITEXT_HUB
        pages = list(datasets.load_dataset(name, config, split=split)["page"])
    except Exception as e:  # offline, hub unreachable, datasets missing: all surface the same way
        if fallback_slice:
            return packaged_wikitext_pages(), "packaged slice"
        raise FileNotFoundError(
            "WikiText-2 test set not found: no data root (set WIDE_DATA or --data-dir), and loading "
            f"{WIKITEXT_HUB[0]} ({WIKITEXT_HUB[1]}) "
            f"from the Hugging Face hub failed ({type(e).__name__}: {e})"
        ) from e
    return pages, "hub"


def packaged_wikitext_pages() -> list[str]:
    """The first pages of WikiText-2's test split packaged with `wide` (wide.paths.WIKITEXT_SLICE)."""
    with gzip.open(packaged_wikitext_slice(), "rt", encoding="utf-8") as f:
        return wikitext_pages(f.read())


def wikitext_docs(path: Path) -> list[dict]:
    """EleutherAI/wikitext_document_level fields: page."""
    return [{"page": p} for p in wikitext_pages(path.read_text(encoding="utf-8"))]


_BUILDERS = {
    "arc_easy": arc_docs,
    "arc_challenge": arc_docs,
    "boolq": boolq_docs,
    "piqa": piqa_docs,
    "winogrande": winogrande_docs,
    "openbookqa": openbookqa_docs,
    "hellaswag": hellaswag_docs,
    "wikitext": wikitext_docs,
}


def build_docs(task: str, data_dir: str | Path | None = None) -> list[dict]:
    """The hub-format documents of `task`, rebuilt from the local files."""
    (task,) = resolve_tasks([task])
    if task == "wikitext":  # also from the hub when no data root holds it
        return [{"page": p} for p in wikitext_test_pages(data_dir)[0]]
    paths = [data_path(task, i, data_dir) for i in range(len(DATA_FILES[task]))]
    return _BUILDERS[task](*paths)


# ----------------------------------------------------------------------------- lm-eval configs


def builtin_yaml(task: str) -> Path:
    """lm-eval's own YAML for `task` (lm-eval 0.4.13 layout)."""
    import lm_eval.tasks

    p = Path(lm_eval.tasks.__file__).parent / BUILTIN[task][0]
    if not p.is_file():
        raise FileNotFoundError(f"lm-eval has no {p}; wide's offline tasks are written for lm-eval 0.4.13")
    return p


def swapped_config(task: str, docs_file: Path, name: str) -> dict:
    """Config keys that replace the hub dataset of the built-in task by a local JSONL file."""
    split = BUILTIN[task][1]
    cfg = {
        "task": name,
        "tag": [OFFLINE_TAG],
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {split: str(docs_file)}},
        "training_split": None,
        "validation_split": None,
        "test_split": None,
    }
    cfg[f"{split}_split" if split != "train" else "training_split"] = split
    return cfg


def write_task_dir(
    tasks: Iterable[str] = ALL_TASKS,
    *,
    data_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    wikitext_slice: bool = False,
) -> Path:
    """Write `offline_<task>` configs (+ their JSONL docs) into out_dir (a new temp dir by default, which
    the caller removes) and return it: pass it to lm-eval as `include_path` / `--include_path`. With no data
    root at all a task keeps lm-eval's hub dataset (loaded online, cached by `datasets`); a data root that
    lacks a task's file is an error naming it. wikitext_slice: `wikitext` reads the packaged slice."""
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="wide-tasks-"))
    out.mkdir(parents=True, exist_ok=True)
    for task in resolve_tasks(list(tasks)):
        if task == "wikitext" and wikitext_slice:
            docs = [{"page": p} for p in packaged_wikitext_pages()]
        elif find_data_dir(data_dir) is None:  # no data root: lm-eval's own config, its hub dataset (online)
            cfg = {"include": str(builtin_yaml(task)), "task": OFFLINE_PREFIX + task, "tag": [OFFLINE_TAG]}
            (out / f"{OFFLINE_PREFIX}{task}.yaml").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
            continue
        else:
            docs = build_docs(task, data_dir)
        docs_file = (out / f"{task}.jsonl").resolve()
        with docs_file.open("w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        cfg = {"include": str(builtin_yaml(task)), **swapped_config(task, docs_file, OFFLINE_PREFIX + task)}
        (out / f"{OFFLINE_PREFIX}{task}.yaml").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    return out


def offline_name(task: str) -> str:
    return OFFLINE_PREFIX + task
