"""Quality sweep driver: for each (method, target, options) run `wide calibrate` (+ optional `wide finetune`,
LoRA), then evaluate (WikiText-2 + zero-shot through `wide.eval.run_eval`), and append one JSON record per
run to --out. Resumable: finished records (same name) are skipped, finished checkpoints are reused and an
interrupted trained calibration continues from its latest checkpoint (`--resume`).

  python -m bench.quality.quality_runs --out bench/results/quality/smollm2/quality.json --work runs/quality \
      --methods dense,wide,module-skip,layer-skip,static-width,teal --targets 0.25,0.5 --steps 2000
  python -m bench.quality.quality_runs --spec runs.json --out ...     # a JSON list of run objects (RunSpec fields)
  python -m bench.quality.quality_runs --spec a.json b.json --out ...  # both lists' rows, in that order, one file
  python -m bench.quality.quality_runs --tiny --out /tmp/q.json --work /tmp/q   # CPU smoke test, tiny random model
  python -m bench.quality.quality_runs --spec runs.json --out ... --jobs 8 --budget-s 480 --grace-s 60   # one GPU

A record names: method, name, target, sparsity_kind, distill, steps, lora_steps, tokens (calibration +
LoRA), gpu_minutes (wall time of calibration + LoRA on this machine), eval_minutes, concurrent_jobs (the
--jobs the row ran under: its times are shared-machine times), eval_limit (examples per task, None =
full sets), real_sparsity (attn / ffn / overall = their mean, over every evaluated token), flops_removed
(the same tokens, router cost included, as wide.accounting counts), wikitext_word_ppl, tasks (per-task
table metric), avg_acc, the commands that produced the checkpoint, and the checkpoint directory.

Concurrent rows (--jobs N > 1, or --grace-s > 0): each row runs in its own process (this script with
--row WORK/NAME/row.json, which the driver writes), its output in WORK/NAME/log.txt; at most N at a
time; a match_flops, stage1_from or init_from row starts once the row it names has a finished record.
Only the driver writes --out: a finished row's record, or `status: "failed"` with the last line of its
log (the others go on), or `status: "interrupted"` for a row stopped at the budget. Records are kept in
spec order.
--budget-s S: no row starts after S seconds from the driver's start; with --grace-s G > 0 the rows
still running get SIGTERM at S + G (a trained stage resumes from its latest checkpoint on the next
call). With --jobs 1 and no grace the rows run in this process, one after the other, as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

METHODS = ("dense", "wide", "module-skip", "layer-skip", "static-width", "teal")
TRAINING_FREE = ("static-width", "teal")


@dataclass
class RunSpec:
    """One row of the sweep. target: the shared sparsity S (ignored for dense); attn_target and
    ffn_target (both) switch to separate targets (the uniform constraint, paper eq. 22)."""

    method: str
    target: float = 0.5
    sparsity_kind: str = "groups"
    distill: str = "none"  # the objective of every stage this row trains (calibration and LoRA)
    steps: int = 2000
    lora_steps: int = 0
    ffn_group_size: int = 128
    attn_target: float | None = None
    ffn_target: float | None = None
    name: str | None = None
    extra_args: list[str] = field(default_factory=list)  # more `wide calibrate` flags, verbatim
    # the name of a finished record whose measured flops_removed becomes this run's target (FLOP kind):
    # a baseline at equal FLOPs removed
    match_flops: str | None = None
    # the name of a finished trained row whose stage-1 routers this row's LoRA recovery starts from
    # (instead of calibrating its own copy); the record's tokens and times include that stage
    stage1_from: str | None = None
    # the name of a finished trained row whose stage-1 routers this row's calibration starts from (a warm
    # start, `wide calibrate --init-routers`; its own steps, target and objective); the record's tokens and
    # times include that stage
    init_from: str | None = None
    # sequences per step for this row's training stages (None: the driver's --batch-size)
    batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if (self.attn_target is None) != (self.ffn_target is None):
            raise ValueError(f"{self.method}: set both attn_target and ffn_target, or neither")
        if self.method == "teal" and self.lora_steps:
            raise ValueError("teal: LoRA recovery is not implemented (no routers to train)")
        if self.match_flops and (self.method == "dense" or self.attn_target is not None):
            raise ValueError(f"{self.method}: match_flops needs a method with the shared target")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"{self.method}: batch_size must be >= 1, got {self.batch_size}")
        if self.stage1_from and (not self.lora_steps or self.method in ("dense",) + TRAINING_FREE):
            raise ValueError(f"{self.method}: stage1_from needs a trained method with lora_steps")
        if self.init_from and (self.method in ("dense",) + TRAINING_FREE or self.stage1_from):
            raise ValueError(f"{self.method}: init_from needs a trained method that calibrates (no stage1_from)")

    @property
    def needs(self) -> list[str]:
        """Rows that must have a finished record before this one starts."""
        return [n for n in (self.match_flops, self.stage1_from, self.init_from) if n]

    @property
    def key(self) -> str:
        if self.name:
            return self.name
        if self.method == "dense":
            return "dense"
        t = f"{self.attn_target:g}a{self.ffn_target:g}f" if self.attn_target is not None else f"{self.target:g}"
        parts = [self.method, f"flopsof[{self.match_flops}]" if self.match_flops else f"{self.sparsity_kind}{t}"]
        if self.method != "static-width" and self.method != "teal":
            parts.append(f"s{self.steps}")
        if self.method not in ("module-skip", "layer-skip", "teal"):
            parts.append(f"g{self.ffn_group_size}")
        if self.distill != "none":
            parts.append(self.distill.replace("+", ""))
        if self.lora_steps:
            parts.append(f"lora{self.lora_steps}")
        return "-".join(parts)


# ------------------------------------------------------------------------------------- records
def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    return data["records"] if isinstance(data, dict) else data


def write_records(path: Path, records: list[dict], settings: dict) -> None:
    """Rewrite the whole file atomically (a crash keeps the previous version)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump({"settings": settings, "records": records}, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def merge_record(records: list[dict], rec: dict, order: dict[str, int]) -> list[dict]:
    """records with rec in place of any record of its name, in spec order (order: name -> index in the
    spec list); records of names outside the specs keep their relative order after those."""
    rest = [r for r in records if r.get("name") != rec["name"]] + [rec]
    return sorted(rest, key=lambda r: order.get(r.get("name"), len(order)))


def finished_record(records: list[dict], name: str) -> dict | None:
    return next((r for r in records if r.get("name") == name and r.get("status") == "done"), None)


# ------------------------------------------------------------------------------------- running
def _cli(args: list) -> tuple[str, float]:
    """Run `wide ARGS` in this process; return the command line and its wall time (s)."""
    from wide.cli import main

    argv = [str(a) for a in args]
    t0 = time.perf_counter()
    rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"`wide {shlex.join(argv)}` failed with exit code {rc}")
    return "wide " + shlex.join(argv), time.perf_counter() - t0


def _finished(ckpt: Path) -> dict | None:
    """The training summary of a finished checkpoint directory (None if unfinished)."""
    meta = ckpt / "wide_config.json"
    if not meta.is_file():
        return None
    training = json.loads(meta.read_text()).get("training", {})
    return training if training.get("stage") and not training.get("partial") else None


def run_stage(ckpt: Path, args: list, trained: bool) -> tuple[dict, str, float]:
    """Run one `wide calibrate` / `wide finetune` into ckpt unless it finished already; resume a trained
    run from its latest checkpoint. Returns (training summary, command, wall seconds of this call)."""
    done = _finished(ckpt)
    cmd = "wide " + shlex.join(str(a) for a in args)
    if done is not None:
        return done, cmd, 0.0
    resume = trained and (ckpt / "latest").is_file()
    # a stage stopped before its first checkpoint (or a training-free one stopped while saving) left
    # files that a fresh start refuses: it starts over in place
    restart = not resume and ckpt.is_dir() and any(ckpt.iterdir())
    cmd, wall = _cli(args + (["--resume"] if resume else ["--overwrite"] if restart else []))
    return _finished(ckpt) or {}, cmd, wall


def calibrate_args(spec: RunSpec, a: argparse.Namespace, out: Path) -> list:
    args = ["calibrate", "--model", a.model, "--method", spec.method, "--out", out]
    args += ["--steps", spec.steps, "--seq-len", a.seq_len, "--batch-size", spec.batch_size or a.batch_size]
    args += ["--ffn-group-size", spec.ffn_group_size, "--router-rank", a.router_rank]
    args += ["--sparsity-kind", spec.sparsity_kind, "--distill", spec.distill, "--calib-batches", a.calib_batches]
    args += ["--save-every", a.save_every, "--lr", a.lr, "--dtype", a.dtype]
    if spec.attn_target is not None:
        args += ["--attn-sparsity", spec.attn_target, "--ffn-sparsity", spec.ffn_target]
    else:
        args += ["--sparsity", spec.target]
    if a.compile and spec.method not in TRAINING_FREE:
        args.append("--compile")
    return args + _common(a) + list(spec.extra_args)


def finetune_args(spec: RunSpec, a: argparse.Namespace, stage1: Path, out: Path) -> list:
    args = ["finetune", "--model", a.model, "--routers", stage1, "--out", out, "--steps", spec.lora_steps]
    args += ["--seq-len", a.seq_len, "--batch-size", spec.batch_size or a.batch_size]
    args += ["--lr", a.lora_lr, "--save-every", a.save_every]
    args += ["--dtype", a.dtype, "--lora-r", a.lora_r]
    if spec.distill != "none":
        args += ["--distill", spec.distill]
    if a.compile:
        args.append("--compile")
    return args + _common(a)


def _common(a: argparse.Namespace) -> list:
    out = []
    for flag, v in (("--data", a.data), ("--data-dir", a.data_dir), ("--device", a.device)):
        if v:
            out += [flag, v]
    return out


def evaluate(a: argparse.Namespace, ckpt: Path | None) -> tuple[dict, float]:
    """(run_eval's row for ckpt, or the dense row when ckpt is None; its wall seconds)."""
    from wide.eval.runner import run_eval

    t0 = time.perf_counter()
    res = run_eval(
        a.model,
        [str(ckpt)] if ckpt else [],
        a.tasks,
        data_dir=a.data_dir,
        limit=a.eval_limit,
        batch_size=a.eval_batch_size,
        max_length=a.eval_max_length,
        dtype=a.eval_dtype,
        device=a.device,
        dense=ckpt is None,
        check_wikitext=False,
    )
    row = res["rows"]["dense" if ckpt is None else str(ckpt)]
    return row, time.perf_counter() - t0


def _identity(spec: RunSpec) -> dict:
    """What names a row in every record of it, finished or not."""
    return {
        "name": spec.key,
        "method": spec.method,
        "target": None if spec.method == "dense" else spec.target,
        "match_flops": spec.match_flops,
        "stage1_from": spec.stage1_from,
        "init_from": spec.init_from,
        "extra_args": list(spec.extra_args),
    }


def make_record(
    spec: RunSpec,
    row: dict,
    stages: list[tuple[dict, str, float]],
    eval_s: float,
    ckpt,
    *,
    jobs: int,
    eval_limit: int | None,
    init_steps: int | None = None,
) -> dict:
    """A finished row's record; jobs (rows run at once) and eval_limit (None: full sets) are the
    conditions its times and scores were measured under; init_steps: an init_from row's steps before its own."""
    sp = row.get("sparsity", {}).get("all") or {}
    attn, ffn = sp.get("attn_sparsity", 0.0), sp.get("ffn_sparsity", 0.0)
    tasks = {t: v["score"] for t, v in row.get("tasks", {}).items()}
    # a stage's own wall time (summed over resumed calls), else the time of the call that ran it
    wall = sum(summary.get("wall_time_s") or call_s for summary, _, call_s in stages)
    # stages run oldest first: the last one is this row's own, a warm start's may have run on other machines
    devices = [s[0].get("gpu") or s[0].get("device") for s in stages if s[0]]
    return _identity(spec) | {
        "attn_target": spec.attn_target,
        "ffn_target": spec.ffn_target,
        "sparsity_kind": spec.sparsity_kind,
        "distill": spec.distill,
        "ffn_group_size": spec.ffn_group_size,
        "steps": 0 if spec.method in ("dense",) + TRAINING_FREE else spec.steps,
        # a warm start's steps before this row's own (init_from's stage 1 and whatever it started from)
        "init_steps": init_steps,
        "lora_steps": spec.lora_steps,
        "tokens": sum(int(s[0].get("tokens", 0) or 0) for s in stages),
        "gpu_minutes": wall / 60.0,
        "eval_minutes": eval_s / 60.0,
        "concurrent_jobs": jobs,
        "eval_limit": eval_limit,
        "real_sparsity": {"attn": attn, "ffn": ffn, "overall": 0.5 * (attn + ffn)},
        "flops_removed": sp.get("flop_saving", 0.0),
        "eval_tokens": sp.get("tokens"),
        "wikitext_word_ppl": (row.get("wikitext") or {}).get("word_perplexity"),
        "tasks": tasks,
        "avg_acc": row.get("avg"),
        "eval_path": row.get("path"),  # "runtime" (the served kernels) or "masked" (the reference path)
        "commands": [s[1] for s in stages],
        "checkpoint": str(ckpt) if ckpt else None,
        "device": devices[-1] if devices else None,
        **({"stage_devices": devices} if len(set(devices)) > 1 else {}),
        "status": "done",
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _stage1_of(key: str, name: str, work: Path, records: list[dict]) -> tuple[Path, list[tuple[dict, str, float]]]:
    """Row name's finished stage-1 directory and the stages that made it (training summary, command, 0 s in
    this call), oldest first. A source that was itself warm-started brings its whole budget as its record
    counts it (steps, tokens, wall time), its earlier commands as stages of no tokens or time."""
    stage1 = work / name / "stage1"
    done = _finished(stage1)
    if done is None:
        raise SystemExit(f"{key}: {stage1} is not a finished stage 1 (run {name!r} first)")
    src = finished_record(records, name) or {}
    commands = src.get("commands") or ["(stage 1 of " + name + ")"]
    if not src.get("init_from"):
        return stage1, [(done, commands[0], 0.0)]
    if src.get("lora_steps"):  # its record's budget includes a LoRA stage that this row does not start from
        raise SystemExit(f"{key}: {name!r} is a warm start with LoRA: name a warm start without lora_steps")
    # commands: the source's own source(s) first, its stage 1 last
    whole = done | {
        "steps": src["steps"] + src["init_steps"],
        "tokens": src["tokens"],
        "wall_time_s": src["gpu_minutes"] * 60.0,
    }
    return stage1, [({}, c, 0.0) for c in commands[:-1]] + [(whole, commands[-1], 0.0)]


def run_one(spec: RunSpec, a: argparse.Namespace, work: Path, records: list[dict]) -> dict:
    matched = None
    if spec.match_flops:
        matched = finished_record(records, spec.match_flops)
        if matched is None:
            raise SystemExit(f"{spec.key}: no finished record {spec.match_flops!r} to match (run it first)")
        spec = dataclasses.replace(spec, target=round(matched["flops_removed"], 4), sparsity_kind="flops")
    conditions = {"jobs": a.jobs, "eval_limit": a.eval_limit}
    if spec.method == "dense":
        row, eval_s = evaluate(a, None)
        return make_record(spec, row, [], eval_s, None, **conditions)
    trained = spec.method not in TRAINING_FREE
    init_steps = None
    if spec.stage1_from:
        stage1, stages = _stage1_of(spec.key, spec.stage1_from, work, records)
    else:
        stages, init = [], []
        if spec.init_from:  # a warm start: the named row's stage 1 counts toward this row's budget
            src, stages = _stage1_of(spec.key, spec.init_from, work, records)
            init = ["--init-routers", src]
            init_steps = stages[-1][0]["steps"]
        stage1 = work / spec.key / "stage1"
        stages.append(run_stage(stage1, calibrate_args(spec, a, stage1) + init, trained))
    ckpt = stage1
    if spec.lora_steps:
        ckpt = work / spec.key / "lora"
        stages.append(run_stage(ckpt, finetune_args(spec, a, stage1, ckpt), True))
    row, eval_s = evaluate(a, ckpt)
    return make_record(spec, row, stages, eval_s, ckpt, **conditions, init_steps=init_steps)


# ------------------------------------------------------------------------------- concurrent rows
ROW_FILE, RECORD_FILE, LOG_FILE = "row.json", "record.json", "log.txt"  # in WORK/NAME/
POLL_S = 0.5
KILL_AFTER_S = 10.0  # a row still running this long after its SIGTERM is killed (SIGKILL)


@dataclass
class Child:
    """A row running in its own process; terminated_at: when the driver sent it SIGTERM, and why (None:
    not sent)."""

    spec: RunSpec
    proc: subprocess.Popen
    dir: Path
    started: float
    terminated_at: float | None = None
    why: str = ""

    def stop(self, why: str) -> None:
        if self.terminated_at is None:
            self.proc.terminate()
            self.terminated_at, self.why = time.monotonic(), why


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_row(path: Path) -> int:
    """The child side of --jobs: run the row that the driver described in path (row.json: spec, the
    resolved settings, work dir, the matched record) and write its record beside it. The record file
    is complete whenever it exists (atomic rename); the driver reads it once the child has exited."""
    job = json.loads(path.read_text())
    rec = run_one(RunSpec(**job["spec"]), argparse.Namespace(**job["args"]), Path(job["work"]), job["records"])
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{RECORD_FILE}.")
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f, indent=1, default=str)
    os.replace(tmp, path.parent / RECORD_FILE)
    return 0


def _wide_src() -> str | None:
    """The folder the driver imports `wide` from, so that every row runs the same code."""
    import importlib.util

    found = importlib.util.find_spec("wide")
    return str(Path(found.origin).parent.parent) if found and found.origin else None


def start_row(spec: RunSpec, a: argparse.Namespace, work: Path, matched: list[dict]) -> Child:
    """Start `quality_runs.py --row WORK/NAME/row.json` with its output appended to WORK/NAME/log.txt."""
    d = work / spec.key
    d.mkdir(parents=True, exist_ok=True)
    (d / RECORD_FILE).unlink(missing_ok=True)  # a record from an earlier call is not this call's result
    args = {k: v for k, v in vars(a).items() if k != "row"}
    job = {"spec": dataclasses.asdict(spec), "args": args, "work": str(work), "records": matched}
    (d / ROW_FILE).write_text(json.dumps(job, indent=1, default=str) + "\n")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", str(d / ROW_FILE)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_wide_src(), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // a.jobs)))  # CPU threads shared
    with open(d / LOG_FILE, "a") as log:
        log.write(f"=== {_stamp()} {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return Child(spec, proc, d, time.monotonic())


def _last_line(log: Path) -> str:
    """The last non-empty line of a row's log (progress bars' carriage returns count as line ends)."""
    try:
        lines = log.read_text(errors="replace").replace("\r", "\n").splitlines()
    except OSError:
        return ""
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")


def stub_record(spec: RunSpec, a: argparse.Namespace, status: str, error: str, log: Path | None) -> dict:
    """The record of a row that did not finish: status "failed" or "interrupted", never scores."""
    return _identity(spec) | {
        "concurrent_jobs": a.jobs,
        "eval_limit": a.eval_limit,
        "status": status,
        "error": error,
        "log": str(log) if log else None,
        "finished_at": _stamp(),
    }


def child_record(c: Child, a: argparse.Namespace) -> dict:
    """What an exited child leaves: its record when it finished, else a failed / interrupted stub."""
    rc, log = c.proc.returncode, c.dir / LOG_FILE
    if rc == 0 and (c.dir / RECORD_FILE).is_file():
        return json.loads((c.dir / RECORD_FILE).read_text())
    if c.terminated_at is not None:
        return stub_record(c.spec, a, "interrupted", f"stopped: {c.why}", log)
    return stub_record(c.spec, a, "failed", _last_line(log) or f"exit code {rc}", log)


def run_concurrent(
    specs: list[RunSpec], a: argparse.Namespace, work: Path, out: Path, settings: dict, order: dict, t0: float
) -> int:
    """Run the rows of specs not finished in out, up to a.jobs at a time (see the module docstring).
    Invariants: only this process writes out; a row's record is merged as soon as its process exits;
    a row with match_flops or stage1_from starts only once the row it names has a finished record (when that row is
    not waiting or running either, it fails at once); nothing starts after the budget."""
    records = read_records(out)
    waiting = [s for s in specs if finished_record(records, s.key) is None]
    running: list[Child] = []

    def elapsed() -> float:
        return time.monotonic() - t0

    def settle(rec: dict, what: str) -> None:
        nonlocal records
        records = merge_record(records, rec, order)
        write_records(out, records, settings)
        print(f"[{rec['status']}] {rec['name']} after {elapsed():.0f} s: {what}", file=sys.stderr)

    def on_sigterm(signum, frame):  # the driver itself stopped from outside: stop the rows, record them
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while running or (waiting and not (a.budget_s is not None and elapsed() > a.budget_s)):
            over = a.budget_s is not None and elapsed() > a.budget_s
            for spec in [] if over else list(waiting):
                if len(running) >= a.jobs:
                    break
                matched = [finished_record(records, n) for n in spec.needs]
                if None in matched:
                    pending = {s.key for s in waiting + [c.spec for c in running]}
                    missing = [n for n, m in zip(spec.needs, matched) if m is None]
                    if any(n in pending for n in missing):
                        continue  # waits for the rows it needs
                    waiting.remove(spec)
                    error = f"no finished record {missing[0]!r} (needed by {spec.key})"
                    settle(stub_record(spec, a, "failed", error, None), error)
                    continue
                waiting.remove(spec)
                running.append(start_row(spec, a, work, matched))
                print(
                    f"[start] {spec.key} at {elapsed():.0f} s ({len(running)} running, {len(waiting)} waiting), "
                    f"log {work / spec.key / LOG_FILE}",
                    file=sys.stderr,
                )
            if over and a.grace_s > 0 and elapsed() > a.budget_s + a.grace_s:
                for c in running:
                    if c.terminated_at is None:
                        c.stop("the time budget (--budget-s + --grace-s)")
                        print(f"[stop] {c.spec.key} at {elapsed():.0f} s: SIGTERM, {c.why}", file=sys.stderr)
            for c in list(running):
                if c.proc.poll() is None:
                    if c.terminated_at is not None and time.monotonic() - c.terminated_at > KILL_AFTER_S:
                        c.proc.kill()
                    continue
                running.remove(c)
                rec = child_record(c, a)
                took = f"ran {time.monotonic() - c.started:.0f} s"
                if rec["status"] == "done":
                    took += (
                        f", flops removed {rec['flops_removed']:.3f}, word ppl {rec['wikitext_word_ppl']}, "
                        f"avg acc {rec['avg_acc']}"
                    )
                else:
                    took += f"; {rec['error']}"
                settle(rec, took)
            time.sleep(POLL_S)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for c in running:  # only when the driver itself is stopped: the rows stop with it
            c.stop("the driver was stopped")
        for c in running:
            try:
                c.proc.wait(KILL_AFTER_S)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
            rec = child_record(c, a)
            settle(rec, rec.get("error", "finished as the driver stopped"))
    if waiting:
        print(f"[budget] not started: {', '.join(s.key for s in waiting)}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------- specs
def check_specs(specs: list[RunSpec]) -> None:
    """Run names are unique, and a match_flops that names a row of the list names an earlier one (so
    the rows run in list order and no two rows wait for each other). A name outside the list must
    have a finished record in --out when its row runs."""
    names = [s.key for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SystemExit(f"duplicate run names {dup}: give them distinct `name`s")
    for i, s in enumerate(specs):
        for n in s.needs:
            if n in names[i:]:
                raise SystemExit(
                    f"{s.key}: {n!r} (match_flops / stage1_from / init_from) must name a row listed before it"
                )


def grid(a: argparse.Namespace) -> list[RunSpec]:
    specs = []
    for m in a.methods.split(","):
        if m == "dense":
            specs.append(RunSpec("dense"))
            continue
        # group sizes matter to the methods with FFN channel groups only
        sizes = a.ffn_group_size if m in ("wide", "static-width") else a.ffn_group_size[:1]
        for t, g in ((float(x), g) for x in a.targets.split(",") for g in sizes):
            for lora in [0] + ([a.lora_steps] if a.lora_steps and m != "teal" else []):
                match = None
                if a.match_flops and m in TRAINING_FREE:  # at the FLOPs the WIDE row of this target removed
                    match = RunSpec("wide", target=t, sparsity_kind=a.sparsity_kind, distill=a.distill, steps=a.steps)
                    match.ffn_group_size = g
                    match = match.key
                specs.append(
                    RunSpec(
                        m,
                        match_flops=match,
                        target=t,
                        sparsity_kind=a.sparsity_kind,
                        distill=a.distill if m not in TRAINING_FREE else "none",
                        steps=a.steps,
                        lora_steps=lora,
                        ffn_group_size=g,
                        attn_target=t if a.uniform and m != "teal" else None,
                        ffn_target=t if a.uniform and m != "teal" else None,
                        # LoRA from the calibration row just listed, not from a second copy of it
                        stage1_from=specs[-1].key if lora and m not in TRAINING_FREE else None,
                    )
                )
    return specs


def load_specs(paths: list[Path]) -> list[RunSpec]:
    """The runs of every file, in the order given (one records file can hold several specs' rows)."""
    known = {f.name for f in dataclasses.fields(RunSpec)}
    out = []
    for path in paths:
        for i, d in enumerate(json.loads(path.read_text())):
            unknown = sorted(set(d) - known)
            if unknown:
                raise ValueError(f"--spec {path}: run {i} has unknown fields {unknown} (known: {sorted(known)})")
            out.append(RunSpec(**d))
    return out


def tiny_setup(a: argparse.Namespace, work: Path) -> list[RunSpec]:
    """A tiny random Llama with the SmolLM2 tokenizer and a small text file; every method once, a few steps."""
    from wide.model import save_tiny_llama

    model_dir = work / "tiny-model"
    if not (model_dir / "config.json").is_file():
        save_tiny_llama(model_dir, max_position_embeddings=512)
    corpus = work / "corpus.txt"
    text = " ".join(f"The number {i} follows {i - 1} and precedes {i + 1}." for i in range(300))
    if not corpus.is_file() or corpus.read_text() != text:  # written only when it differs: rows may be reading it
        corpus.write_text(text)
    a.model, a.data, a.device = str(model_dir), str(corpus), a.device or "cpu"
    a.seq_len, a.batch_size, a.router_rank, a.calib_batches, a.save_every = 32, 2, 8, 2, 1
    a.tasks, a.eval_limit, a.eval_max_length, a.eval_batch_size = "wikitext,arc_easy", 1, 64, 2
    a.dtype = a.eval_dtype = "fp32"
    common = dict(target=0.5, steps=2, ffn_group_size=16)
    return [
        RunSpec("dense"),
        *(RunSpec(m, **common) for m in ("wide", "module-skip", "layer-skip", "static-width", "teal")),
        # the tiny model is mostly lm_head (SmolLM2's vocabulary): a FLOP target of 1% is what routing can reach
        RunSpec("wide", sparsity_kind="flops", distill="kl+lm", **{**common, "target": 0.01}),
        RunSpec("wide", lora_steps=2, stage1_from="wide-groups0.5-s2-g16", **common),  # from the row above
        RunSpec("static-width", match_flops="wide-groups0.5-s2-g16", ffn_group_size=16),
        RunSpec("wide", init_from="wide-groups0.5-s2-g16", **{**common, "target": 0.3}),  # a warm start from it
        RunSpec("wide", name="wide-warm2", init_from="wide-groups0.3-s2-g16", **{**common, "target": 0.3}),  # and on
    ]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON file of records (required; rewritten as rows finish, resumable)")
    p.add_argument("--work", default="runs/quality", help="checkpoint directories, one per run name")
    p.add_argument(
        "--spec", type=Path, nargs="+", help="JSON lists of runs (RunSpec fields), in order; default: the grid flags"
    )
    p.add_argument("--methods", default="dense,wide,module-skip,layer-skip,static-width,teal")
    p.add_argument("--targets", default="0.25,0.5")
    p.add_argument("--sparsity-kind", choices=["groups", "flops"], default="groups")
    p.add_argument("--distill", choices=["none", "kl", "kl+lm"], default="none")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lora-steps", type=int, default=0, help="also a LoRA-recovered row per trained run")
    p.add_argument("--ffn-group-size", type=_ints, default=[128], help="comma list: one row per size (wide, static)")
    p.add_argument(
        "--match-flops",
        action="store_true",
        help="static-width / teal rows at the FLOPs removed measured for the WIDE row of the same target",
    )
    p.add_argument(
        "--uniform", action="store_true", help="separate attention / FFN targets equal to the target (eq. 22)"
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data")
    p.add_argument("--data-dir")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--router-rank", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lora-lr", type=float, default=2e-4)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--calib-batches", type=int, default=8, help="static-width / teal calibration batches")
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the decoder layers in trained calibrations and LoRA"
    )
    p.add_argument("--tasks", default="all")
    p.add_argument("--eval-limit", type=int)
    p.add_argument("--eval-max-length", type=int, default=4096)
    p.add_argument("--eval-batch-size", type=int, default=8)
    p.add_argument("--eval-dtype", default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--only", help="comma list of run names to run (default: all)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny random model, every method, 2 steps")
    p.add_argument("--jobs", type=int, default=1, help="rows run at once, each in its own process (1: in this one)")
    p.add_argument("--budget-s", type=float, help="no row starts after this many seconds from the driver's start")
    p.add_argument(
        "--grace-s",
        type=float,
        default=0.0,
        help="rows still running get SIGTERM at --budget-s + this (0: they run on); rows then run in processes",
    )
    p.add_argument("--row", type=Path, help=argparse.SUPPRESS)  # the child side of --jobs (run_row)
    a = p.parse_args(argv)
    if not a.row and not a.out:
        p.error("--out is required")
    if a.jobs < 1 or a.grace_s < 0:
        p.error("--jobs must be at least 1 and --grace-s at least 0")
    return a


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    a = parse_args(argv)
    if a.row:
        return run_row(a.row)
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    specs = tiny_setup(a, work) if a.tiny else (load_specs(a.spec) if a.spec else grid(a))
    if a.eval_dtype == "auto":
        import torch

        a.eval_dtype = "bfloat16" if torch.cuda.is_available() and a.device != "cpu" else "float32"
    check_specs(specs)
    order = {s.key: i for i, s in enumerate(specs)}  # records are written in this order
    if a.only:
        keep = set(a.only.split(","))
        specs = [s for s in specs if s.key in keep]
    settings = {k: v for k, v in vars(a).items() if k not in ("spec", "only", "tiny", "row")}
    finished = [s.key for s in specs if finished_record(read_records(out), s.key)]
    for name in finished:
        print(f"[skip] {name}: finished in {out}", file=sys.stderr)
    if a.jobs > 1 or a.grace_s > 0:
        return run_concurrent(specs, a, work, out, settings, order, t0)
    for spec in specs:
        if spec.key in finished:
            continue
        if a.budget_s is not None and time.monotonic() - t0 > a.budget_s:
            print(f"[budget] not started: {spec.key} and the rows after it", file=sys.stderr)
            break
        print(f"[run] {spec.key}", file=sys.stderr)
        rec = run_one(spec, a, work, read_records(out))
        write_records(out, merge_record(read_records(out), rec, order), settings)
        print(
            f"[done] {spec.key}: flops removed {rec['flops_removed']:.3f}, word ppl {rec['wikitext_word_ppl']}, "
            f"avg acc {rec['avg_acc']}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
