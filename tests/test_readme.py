"""The README is a product page: its quick-start block runs as written, its first screen has exactly the
commands a fresh machine needs (torch for the CPU with the GPU line beside it, demo, tests — as CI runs them),
its command table names real subcommands, and its links resolve."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from wide.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_is_short():
    assert len(README.splitlines()) <= 150


def test_first_screen_has_the_demo_and_the_ci_test_command():
    first = _blocks("bash")[0]
    assert README.index(first) < len("\n".join(README.splitlines()[:25]))  # on the first screen
    lines = [line for line in first.splitlines() if line.split("#")[0].strip()]
    cmds = [line.split("#")[0].strip() for line in lines]
    assert len(cmds) == 3
    ci_text = (ROOT / ".ci" / "run").read_text()
    # torch: the CPU wheel CI installs, the GPU line beside it
    assert cmds[0].startswith("pip install torch==") and cmds[0].split("pip ", 1)[1] in ci_text
    assert f"GPU: {cmds[0].split(' --index-url')[0]}" in lines[0]
    assert cmds[1].endswith("wide demo") and "pip install" in cmds[1]
    ci = [ln.strip() for ln in ci_text.splitlines() if ln.strip().startswith("python3 -m pytest")]
    assert ci, ".ci/run runs no pytest"
    # the same pytest invocation (CI says python3, the README python)
    assert shlex.split(cmds[2])[1:] == shlex.split(ci[0])[1:]


def test_command_table_names_real_subcommands():
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    named = set(re.findall(r"^\| `wide ([a-z]+)", README, flags=re.M))
    assert named and named <= set(sub.choices), named - set(sub.choices)
    assert set(sub.choices) <= named | {"bench"}


def test_relative_links_exist():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README):
        assert (ROOT / target).exists(), target


@pytest.mark.slow
def test_quick_start_block_runs_as_written(tmp_path, monkeypatch, capsys):
    (block,) = _blocks("python")
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md:python", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    m = re.search(r"attention (\d+)%, FFN (\d+)%; FLOPs removed (\d+)%", out)
    assert m, out
    attn, ffn, flops = map(int, m.groups())
    assert attn > 20 and ffn > 10 and 0 < flops < 100  # the 50% routers really skip work
    assert (tmp_path / "my-routers" / "wide_config.json").is_file()
    assert (tmp_path / "my-routers" / "routers.safetensors").is_file()
