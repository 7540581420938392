"""`wide serve` / `wide bench serve` argument parsing, and the one-line error without the serve extra."""

from __future__ import annotations

import sys

from wide.cli import build_parser, main


def test_serve_parses_its_flags():
    a = build_parser().parse_args(
        ["serve", "--routers", "smollm2-135m-s50", "--max-batch", "4", "--port", "0", "--batch-invariant"]
    )
    assert a.max_batch == 4 and a.port == 0 and a.batch_invariant and a.routers.endswith("smollm2-135m-s50")
    dense = build_parser().parse_args(["serve"])
    assert dense.routers is None and dense.max_batch == 8 and not dense.batch_invariant


def test_bench_serve_parses_its_subset():
    a = build_parser().parse_args(
        ["bench", "serve", "--workloads", "long", "--concurrency", "1,16", "--parts", "engine", "--budget-s", "60"]
    )
    assert (a.workloads, a.concurrency, a.parts, a.budget_s) == (("long",), (1, 16), ("engine",), 60.0)


def test_serve_without_the_extra_names_the_install_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi -> ImportError
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == 'error: wide serve needs the serving extra: pip install "wide[serve]"'


def test_bench_serve_refuses_the_cpu_without_smoke(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "serve"]) == 2
    assert "--smoke" in capsys.readouterr().err
