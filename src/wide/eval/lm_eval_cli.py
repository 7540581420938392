"""`python -m wide.eval.lm_eval_cli ARGS`: lm-eval's own CLI with the `wide` model type registered and
the offline tasks (`offline_arc_easy`, ..., tag `wide_offline`) on the include path.

Data root: --data-dir is not an lm-eval flag; set WIDE_DATA (or keep shared/data next to the repo).
Device: lm-eval's default is cuda:0; without CUDA `--device cpu` is added unless --device is given.
"""

from __future__ import annotations

import os
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


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import wide.eval  # noqa: F401  (registers --model wide)
    from wide.eval.tasks import write_task_dir

    args = list(sys.argv[1:] if argv is None else argv)
    # the task configs live only as long as lm-eval runs (removed on exit, error or Ctrl-C)
    with tempfile.TemporaryDirectory(prefix="wide-tasks-") as tmp:
        args = lm_eval_args(args, tmp, torch.cuda.is_available())
        if tmp in args:
            write_task_dir(out_dir=tmp)
        sys.argv = [sys.argv[0], *args]
        from lm_eval.__main__ import cli_evaluate

        cli_evaluate()


if __name__ == "__main__":
    main()
