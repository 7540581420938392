"""`python -m wide.eval.lm_eval_cli ARGS`: lm-eval's own CLI with the `wide` model type registered and
the offline tasks (`offline_arc_easy`, ..., tag `wide_offline`) on the include path.

Data root: --data-dir is not an lm-eval flag; set WIDE_DATA (or keep shared/data next to the repo). Without one
and with the hub offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, offline where unset), `offline_wikitext` reads the
WikiText-2 slice packaged with wide and the zero-shot tasks are refused before any model loads.
Device: lm-eval's default is cuda:0; without CUDA `--device cpu` is added unless --device is given.
"""

from __future__ import annotations

import sys
import tempfile

# lm-eval's subcommands that take no --device (a bare `--model ...` call is its `run`)
_NO_DEVICE = ("ls", "validate")


def lm_eval_args(args: list[str], task_dir: str, cuda: bool) -> list[str]:
    """ARGS as passed to lm-eval: the offline tasks' folder on the include path where tasks are named,
    and `--device cpu` for an evaluation on a machine without CUDA."""
    args = list(args)
    wants_tasks = any(a in ("run", *_NO_DEVICE) or a.startswith("--tasks") for a in args)
    if wants_tasks and not any(a.startswith("--include_path") for a in args):
        args += ["--include_path", task_dir]
    runs = any(a == "--model" or a.startswith("--model=") for a in args) and not any(a in _NO_DEVICE for a in args)
    if runs and not cuda and not any(a == "--device" or a.startswith("--device=") for a in args):
        args += ["--device", "cpu"]
    return args


def named_tasks(args: list[str]) -> list[str]:
    """The task names of `--tasks a,b` / `--tasks=a,b` (lm-eval also takes them space-separated)."""
    names: list[str] = []
    for i, a in enumerate(args):
        if a.startswith("--tasks="):
            names += a.split("=", 1)[1].split(",")
        elif a == "--tasks":
            for b in args[i + 1 :]:
                if b.startswith("-"):
                    break
                names += b.split(",")
    return [n.strip() for n in names if n.strip()]


def main(argv: list[str] | None = None) -> None:
    import torch

    import wide.eval  # noqa: F401  (registers --model wide)
    from wide.eval.runner import SLICE_NOTE, hub_online
    from wide.eval.tasks import OFFLINE_PREFIX, OFFLINE_TAG, ZERO_SHOT_TASKS, find_data_dir, write_task_dir

    args = list(sys.argv[1:] if argv is None else argv)
    local_only = find_data_dir() is None and not hub_online()
    if local_only:
        names = named_tasks(args)
        zero_shot = [n for n in names if n == OFFLINE_TAG or n.removeprefix(OFFLINE_PREFIX) in ZERO_SHOT_TASKS]
        if zero_shot:
            sys.exit(
                f"error: the zero-shot tasks ({', '.join(zero_shot)}) need their data: set WIDE_DATA to a folder "
                "laid out like shared/data, or HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0 to load them from the hub"
            )
        if OFFLINE_PREFIX + "wikitext" in names:
            full = "WIDE_DATA or HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0: the full set"
            print(f"offline_wikitext: the WikiText-2 slice packaged with wide{SLICE_NOTE}; {full}", file=sys.stderr)
    # the task configs live only as long as lm-eval runs (removed on exit, error or Ctrl-C)
    with tempfile.TemporaryDirectory(prefix="wide-tasks-") as tmp:
        args = lm_eval_args(args, tmp, torch.cuda.is_available())
        if tmp in args:
            write_task_dir(out_dir=tmp, wikitext_slice=local_only)
        sys.argv = [sys.argv[0], *args]
        from lm_eval.__main__ import cli_evaluate

        cli_evaluate()


if __name__ == "__main__":
    main()
