"""`python -m wide.eval.lm_eval_cli ARGS`: lm-eval's own CLI with the `wide` model type registered and
the offline tasks (`offline_arc_easy`, ..., tag `wide_offline`) on the include path.

Data root: --data-dir is not an lm-eval flag; set WIDE_DATA (or keep shared/data next to the repo).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import wide.eval  # noqa: F401  (registers --model wide)
    from wide.eval.tasks import write_task_dir

    args = list(sys.argv[1:] if argv is None else argv)
    wants_tasks = any(a in ("run", "ls", "validate") or a.startswith("--tasks") for a in args)
    if wants_tasks and not any(a.startswith("--include_path") for a in args):
        args += ["--include_path", str(write_task_dir())]
    sys.argv = [sys.argv[0], *args]
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
