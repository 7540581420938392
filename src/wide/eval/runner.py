"""`wide eval`: dense + router checkpoints over the paper's seven zero-shot tasks and WikiText-2.

Writes `<out>.json` (everything) and `<out>.md` (Table 1 layout) when `out` is given.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from wide.eval.tasks import (
    ALL_TASKS,
    TABLE_METRIC,
    ZERO_SHOT_TASKS,
    data_path,
    offline_name,
    resolve_tasks,
    write_task_dir,
)

COLUMNS = {
    "arc_easy": "ARC-E",
    "arc_challenge": "ARC-C",
    "boolq": "BoolQ",
    "winogrande": "WinoGrande",
    "piqa": "PIQA",
    "openbookqa": "OpenbookQA",
    "hellaswag": "HellaSwag",
}


def _eval_tasks(tasks: str | list[str]) -> tuple[list[str], bool]:
    """(zero-shot tasks in table order, whether WikiText-2 is wanted). 'all' = the seven + wikitext."""
    if isinstance(tasks, str) and tasks.strip().lower() == "all":
        names = list(ALL_TASKS)
    else:
        names = resolve_tasks(tasks)
    return [t for t in ZERO_SHOT_TASKS if t in names], "wikitext" in names


HUB_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_online(online: bool | None = None) -> bool:
    """Whether this process may load from the Hugging Face hub. online: set the mode (the HF_HUB_OFFLINE /
    HF_DATASETS_OFFLINE variables, read when huggingface_hub and datasets are imported); None: the
    environment's, offline where unset. The answer is what the libraries themselves read."""
    for k in HUB_ENV:
        if online is None:
            os.environ.setdefault(k, "1")
        else:
            os.environ[k] = "0" if online else "1"
    from huggingface_hub import constants

    try:
        import datasets.config
    except ImportError:  # no `datasets` (the eval extra): nothing comes from the hub's datasets
        return False
    return not (constants.HF_HUB_OFFLINE or datasets.config.HF_DATASETS_OFFLINE)


def _check_data(tasks: list[str], wikitext: bool, data_dir, online: bool) -> str | None:
    """Where the data comes from, checked before any model loads: the zero-shot tasks from the data root or,
    online, the hub (else a one-line refusal); WikiText-2 from the data root, the hub, else the packaged
    slice. Returns the WikiText-2 source (None when not wanted) and prints both."""
    import sys

    from wide.eval.tasks import DATA_FILES, find_data_dir, wikitext_test_pages

    root = find_data_dir(data_dir)
    hub = "the Hugging Face hub (online)" if online else "the Hugging Face hub's local cache (offline)"
    if tasks and root is None and not online:
        raise FileNotFoundError(
            f"the zero-shot tasks ({', '.join(tasks)}) need their data: set WIDE_DATA or --data-dir to a folder "
            "laid out like shared/data, or pass --online to load them from the Hugging Face hub "
            "(`--tasks wikitext` runs offline, on the packaged slice)"
        )
    for t in tasks if root is not None else []:
        for i in range(len(DATA_FILES[t])):
            data_path(t, i, data_dir)
    source = wikitext_test_pages(data_dir, fallback_slice=True)[1] if wikitext else None
    where = {"data root": f"the data root {root}", "hub": hub, "packaged slice": "the slice packaged with wide"}
    if tasks:
        print(f"zero-shot tasks from {where['data root'] if root is not None else hub}", file=sys.stderr)
    if source is not None:
        note = f"{SLICE_NOTE}; WIDE_DATA / --data-dir or --online: the full set" if source == "packaged slice" else ""
        print(f"WikiText-2 test set from {where[source]}{note}", file=sys.stderr)
    return source


SLICE_NOTE = ": its first pages only, not the full test set (no data root, and the hub is off or does not have it)"


def _lm_eval_scores(results: dict, tasks: list[str]) -> dict:
    out = {}
    for t in tasks:
        r = results["results"][offline_name(t)]
        out[t] = {
            "score": r[f"{TABLE_METRIC[t]},none"],
            "metric": TABLE_METRIC[t],
            **{m: r.get(f"{m},none") for m in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr") if f"{m},none" in r},
            "n": results.get("n-samples", {}).get(offline_name(t), {}).get("effective"),
        }
    return out


def _combine(parts: list[dict]) -> dict:
    """Token-weighted attention / FFN sparsity and FLOP saving over several meter summaries."""
    parts = [p for p in parts if p and p.get("tokens")]
    n = sum(p["tokens"] for p in parts)
    if not n:
        return {}
    return {
        "tokens": n,
        **{k: sum(p[k] * p["tokens"] for p in parts) / n for k in ("attn_sparsity", "ffn_sparsity", "flop_saving")},
    }


def _evaluate_one(
    lm,
    wm,
    tasks,
    wikitext,
    *,
    task_dir,
    limit,
    batch_size,
    max_length,
    ppl_max_length,
    data_dir,
    check_wikitext,
    label: str = "",
) -> dict:
    from lm_eval import simple_evaluate

    from wide.eval.perplexity import wikitext_perplexity

    row: dict = {"tasks": {}, "sparsity": {}}
    t0 = time.time()
    if tasks:
        if wm is not None:
            wm.start_meter()
        from lm_eval.tasks import TaskManager

        tm = TaskManager(include_path=str(task_dir), include_defaults=False)
        res = simple_evaluate(
            model=lm,
            tasks=[offline_name(t) for t in tasks],
            limit=limit,
            task_manager=tm,
            batch_size=batch_size,
            bootstrap_iters=0,
            log_samples=False,
        )
        row["tasks"] = _lm_eval_scores(res, tasks)
        if wm is not None:
            row["sparsity"]["tasks"] = wm.meter.summary()
    row["tasks_seconds"] = time.time() - t0
    if wikitext:
        t1 = time.time()
        if wm is not None:
            wm.start_meter()
        ppl = wikitext_perplexity(
            lm.scorer if hasattr(lm, "runtime") else lm.model,
            lm.tokenizer,
            data_dir=data_dir,
            max_length=ppl_max_length,
            batch_size=batch_size,
            limit_docs=limit,
            meter=wm.meter if wm is not None else None,
            desc=f"{label} wikitext".strip(),  # the progress bar names the row it scores
            fallback_slice=True,  # as _check_data found: the row records its source
        )
        if wm is not None:
            row["sparsity"]["wikitext"] = wm.meter.summary()
        row["wikitext"] = ppl
        row["wikitext_seconds"] = time.time() - t1
        if check_wikitext:
            from lm_eval.tasks import TaskManager

            if wm is not None:
                wm.metering = False
            saved = lm._max_length
            lm._max_length = ppl_max_length
            tm = TaskManager(include_path=str(task_dir), include_defaults=False)
            res = simple_evaluate(
                model=lm,
                tasks=[offline_name("wikitext")],
                limit=limit,
                task_manager=tm,
                batch_size=batch_size,
                bootstrap_iters=0,
            )
            lm._max_length = saved
            ref = res["results"][offline_name("wikitext")]["word_perplexity,none"]
            row["wikitext"]["lm_eval_word_perplexity"] = ref
            row["wikitext"]["lm_eval_rel_diff"] = abs(ppl["word_perplexity"] - ref) / ref
    if wm is not None:
        row["sparsity"]["all"] = _combine([row["sparsity"].get("tasks"), row["sparsity"].get("wikitext")])
        wm.metering = False
    return row


def run_eval(
    model: str = "smollm2-135m",
    routers: list[str] | tuple[str, ...] = (),
    tasks: str | list[str] = "all",
    *,
    data_dir: str | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    max_length: int = 4096,
    ppl_max_length: int | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | None = None,
    out: str | None = None,
    dense: bool = True,
    check_wikitext: bool = True,
    softmax_dtype: str | None = "float32",
    strict_base: bool = True,
    runtime: bool | None = None,
    online: bool | None = None,
) -> dict:
    """Evaluate the dense base model and each router checkpoint; return (and write) the results.

    runtime: score through ``wide.runtime.WideRuntime`` (the routed kernels users are served; dense rows
    through the same runtime with routed=False) instead of the masked Hugging Face path (the reference).
    None (default): the runtime on a CUDA device where it serves the row (per-group routers, a dtype its
    kernels take, a cache that fits), else the masked path; each row records the path it took.
    On CPU both paths give bit-identical logits; on the GPU they differ by the kernels' bf16 rounding.

    tasks: "all" (seven zero-shot tasks + wikitext), or names from ALL_TASKS. limit: first N examples
    (WikiText-2: first N documents) per task. max_length: lm-eval context length (paper: 4096);
    ppl_max_length: WikiText-2 window (default max_length). check_wikitext: also run lm-eval's
    wikitext task (routers not metered there) and record its agreement with the native perplexity.
    softmax_dtype: lm-eval HFLM's log-softmax dtype (None = model dtype, lm-eval's default).
    out: path prefix; writes out.json and out.md (a directory gets results.json / results.md).
    online: load what no data root holds from the Hugging Face hub (`hub_online`; None: the environment's
    HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, offline where unset). Without a data root the zero-shot tasks
    need it; WikiText-2 then falls back to the packaged slice, and the records say so."""
    online = hub_online(online)
    from wide.baselines import load as load_method
    from wide.eval.lm_eval_model import WideLM, default_device, load_routed, parse_dtype
    from wide.model import WideModel, check_context
    from wide.model.checkpoint import has_adapter

    zs, wikitext = _eval_tasks(tasks)
    wikitext_source = _check_data(zs, wikitext, data_dir, online)
    routers = [str(r) for r in (routers or [])]
    for r in routers:
        if not Path(r).is_dir():
            raise FileNotFoundError(f"router checkpoint {r} does not exist")
    device = device or default_device()
    ppl_max_length = ppl_max_length or max_length
    with tempfile.TemporaryDirectory(prefix="wide-tasks-") as tmp:  # removed on return, error or Ctrl-C
        task_dir = write_task_dir(
            zs + (["wikitext"] if wikitext and check_wikitext else []),
            data_dir=data_dir,
            out_dir=tmp,
            wikitext_slice=wikitext_source == "packaged slice",
        )
        t_start = time.time()
        base, tok, _ = load_routed(model, None, dtype=dtype, device=device)
        check_context(base, max(max_length, ppl_max_length), what="--max-length")
        load_seconds = time.time() - t_start
        lm_kwargs = dict(max_length=max_length, batch_size=batch_size, softmax_dtype=softmax_dtype)
        rows: dict[str, dict] = {}

        def evaluate(lm, wm, label: str) -> dict:
            return {"path": lm.path} | _evaluate_one(
                lm,
                wm,
                zs,
                wikitext,
                task_dir=task_dir,
                limit=limit,
                batch_size=batch_size,
                max_length=max_length,
                ppl_max_length=ppl_max_length,
                data_dir=data_dir,
                check_wikitext=check_wikitext,
                label=label,
            )

        def result_of(rows: dict) -> dict:
            res = {
                "model": model,
                "tasks": zs,
                "wikitext": wikitext,
                "settings": {
                    "limit": limit,
                    "batch_size": batch_size,
                    "max_length": max_length,
                    "ppl_max_length": ppl_max_length,
                    "dtype": str(parse_dtype(dtype)),
                    "device": str(device),
                    "softmax_dtype": softmax_dtype,
                    "path": {True: "runtime", False: "masked", None: "auto"}[runtime],
                    "hub": "online" if online else "offline",
                    "wikitext_source": wikitext_source,
                    "num_fewshot": 0,
                    "table_metric": {t: TABLE_METRIC[t] for t in zs},
                },
                "rows": rows,
                "load_seconds": load_seconds,
                "wall_seconds": time.time() - t_start,
                "env": _env(),
            }
            summarise(res)
            res["markdown"] = to_markdown(res)
            if out:  # after every row: an interrupted run keeps the rows it finished
                write_outputs(res, out)
            return res

        def make_lm(m, wm: WideModel | None, **kw):
            """The lm-eval model of one row: over the runtime or the masked path (see ``runtime``)."""

            def masked() -> WideLM:
                lm = WideLM(model, model=m, tokenizer=tok, wide_model=wm, **kw, **lm_kwargs)
                lm.path = "masked"
                return lm

            from wide.config import NO_GROUP_ROUTERS

            unsupported = wm is not None and wm.config.method in NO_GROUP_ROUTERS
            if runtime is False or (runtime is None and (unsupported or not str(device).startswith("cuda"))):
                return masked()
            if unsupported:
                raise ValueError(f"--runtime serves per-group routers; {kw.get('routers')} holds {wm.config.method}")
            from wide.config import WideConfig
            from wide.eval.lm_eval_model import RuntimeLM, RuntimeScorer
            from wide.runtime import WideRuntime

            carrier = wm if wm is not None else WideModel(m, WideConfig())  # dense: routers unused
            try:
                rt = WideRuntime(
                    carrier, max_batch=batch_size, max_seq=max(max_length, ppl_max_length), routed=wm is not None
                )
            except (ValueError, torch.cuda.OutOfMemoryError) as e:
                if runtime is True:
                    raise
                print(f"evaluating {kw.get('routers', 'dense')} on the masked path: the runtime cannot serve it ({e})")
                return masked()
            finally:
                if wm is None:
                    carrier.detach()
            lm = RuntimeLM(model, model=m, tokenizer=tok, wide_model=wm, runtime=rt, **kw, **lm_kwargs)
            lm.scorer = RuntimeScorer(rt)
            lm.path = "runtime"
            return lm

        if dense:
            rows["dense"] = evaluate(make_lm(base, None), None, "dense")
            if routers:  # the last row's write is the final one below
                result_of(rows)
        for i, r in enumerate(routers):
            t0 = time.time()
            # a stage-2 checkpoint merges its LoRA adapter into the weights it loads onto: a copy, as the
            # base serves the other rows
            m = copy.deepcopy(base) if has_adapter(r) else base
            wm = load_method(m, r, strict_base=strict_base).eval()  # any method of wide.baselines
            try:
                # the bar names the checkpoint with its parent folder (runs/<name>/stage1 reads "<name>/stage1")
                row = evaluate(make_lm(m, wm, routers=r), wm, "/".join(Path(r).parts[-2:]))
            finally:
                wm.detach()
            row["config"] = wm.config.to_dict()
            row["method"] = wm.config.method
            row["base_model"] = wm.base_model_id
            row["load_seconds"] = time.time() - t0 - row.get("tasks_seconds", 0) - row.get("wikitext_seconds", 0)
            rows[r] = row
            if i < len(routers) - 1:
                result_of(rows)
        return result_of(rows)


def summarise(result: dict) -> None:
    """Average over the tasks and retention vs dense per row (in place)."""
    dense = result["rows"].get("dense")
    for row in result["rows"].values():
        scores = [row["tasks"][t]["score"] for t in result["tasks"] if t in row["tasks"]]
        row["avg"] = sum(scores) / len(scores) if scores else None
        row["retention"] = row["avg"] / dense["avg"] if dense and dense.get("avg") and row["avg"] is not None else None


def _fmt(x: float | None, scale: float = 100.0, nd: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * scale:.{nd}f}"


def to_markdown(result: dict) -> str:
    """The paper's Table 1 layout: one row per model, accuracy in %, the table metric per task."""
    tasks = result["tasks"]
    head = ["Model", "Real sparsity (attn/ffn)"]
    sliced = result["settings"].get("wikitext_source") == "packaged slice"
    if result["wikitext"]:
        head.append("WikiText2 (slice)" if sliced else "WikiText2")
    head += [COLUMNS[t] for t in tasks] + ["Avg (retention %)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in result["rows"].items():
        sp = row["sparsity"].get("all")
        cells = [
            "Dense" if name == "dense" else Path(name).name or name,
            f"{_fmt(sp['attn_sparsity'], nd=1)}% / {_fmt(sp['ffn_sparsity'], nd=1)}%" if sp else "–",
        ]
        if result["wikitext"]:
            cells.append(_fmt(row["wikitext"]["word_perplexity"], 1.0))
        cells += [_fmt(row["tasks"][t]["score"]) if t in row["tasks"] else "–" for t in tasks]
        cells.append(f"{_fmt(row['avg'])} ({_fmt(row['retention'])}%)" if row["avg"] is not None else "–")
        lines.append("| " + " | ".join(cells) + " |")
    s = result["settings"]
    notes = [
        "",
        f"Zero-shot, lm-eval {_lm_eval_version()} task configs over the offline data (shared/data); "
        "acc_norm for ARC-E, ARC-C, PIQA, OpenbookQA, HellaSwag; acc for BoolQ, WinoGrande. "
        f"max_length {s['max_length']}, {s['dtype']}, batch {s['batch_size']}"
        + (f", limit {s['limit']} per task" if s["limit"] else "")
        + ".",
    ]
    if len(tasks) < len(ZERO_SHOT_TASKS):
        notes.append(f"Avg over {len(tasks)} of the 7 tasks.")
    if "hellaswag" in tasks:
        notes.append("HellaSwag: approximate input (llama.cpp's text file; see SOURCES.md and wide.eval.tasks).")
    if result["wikitext"]:
        checked = {n: r["wikitext"].get("lm_eval_rel_diff") for n, r in result["rows"].items()}
        rd = [x for x in checked.values() if x is not None]
        which = (
            ""
            if len(rd) == len(checked)
            else " (rows checked: "
            + ", ".join("Dense" if n == "dense" else Path(n).name for n, x in checked.items() if x is not None)
            + ")"
        )
        notes.append(
            f"WikiText2: word perplexity, {s['ppl_max_length']}-token rolling windows (lm-eval's "
            "`wikitext` method)" + (f"; agrees with lm-eval's own run to {max(rd):.1e} relative{which}." if rd else ".")
        )
        if sliced:
            notes.append(
                "WikiText2 on the first pages of the test split packaged with wide: a slice, not the full test set "
                "(not comparable with full-set numbers)."
            )
    paths = {("Dense" if n == "dense" else Path(n).name): r.get("path") for n, r in result["rows"].items()}
    if any(paths.values()):  # docs/routing.md: the served runtime, or the masked reference path
        notes.append("Scored through: " + ", ".join(f"{n} {p}" for n, p in paths.items() if p) + ".")
    return "\n".join(lines + notes) + "\n"


def _lm_eval_version() -> str:
    try:
        from importlib.metadata import version

        return version("lm_eval")
    except Exception:  # noqa: BLE001
        return "?"


def _env() -> dict:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lm_eval": _lm_eval_version(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def write_outputs(result: dict, out: str) -> tuple[Path, Path]:
    """Write result JSON and markdown; `out` is a path prefix, or a directory (-> results.*)."""
    p = Path(out)
    if p.is_dir() or out.endswith(os.sep):
        p.mkdir(parents=True, exist_ok=True)
        p = p / "results"
    p.parent.mkdir(parents=True, exist_ok=True)
    pj, pm = p.with_suffix(".json"), p.with_suffix(".md")
    pj.write_text(json.dumps(result, indent=2, default=str) + "\n")
    pm.write_text(result["markdown"])
    return pj, pm
