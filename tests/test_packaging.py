"""What a non-editable install carries: the shipped routers, the demo's WikiText-2 slice and calibration sample; the
WikiText-2 lookup order (data root, packaged slice, hub); CLI help texts."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from wide.cli import build_parser
from wide.eval import tasks
from wide.paths import (
    CALIBRATION_SAMPLE,
    SHIPPED_ROUTERS,
    packaged_calibration_sample,
    packaged_wikitext_slice,
    resolve_routers,
    shipped_routers,
)

ROOT = Path(__file__).resolve().parents[1]

# Runs inside the unpacked wheel only (PYTHONPATH = the unpacked folder; no data root anywhere).
_CHECK_INSTALLED = r"""
import json, sys
from pathlib import Path
import wide
from safetensors.torch import load_file
from wide.eval.tasks import wikitext_test_pages
from wide.model.checkpoint import has_adapter, read_checkpoint_meta
from wide.paths import find_data_dir, packaged_calibration_sample, shipped_routers

site = Path(sys.argv[1]).resolve()
assert Path(wide.__file__).resolve().is_relative_to(site), wide.__file__
assert find_data_dir() is None
out = {"routers": {}}
for ckpt in shipped_routers():
    assert ckpt.resolve().is_relative_to(site), ckpt
    meta = read_checkpoint_meta(ckpt)
    n = len(load_file(ckpt / "routers.safetensors"))
    lora = len(load_file(ckpt / "adapter_model.safetensors")) if has_adapter(ckpt) else 0
    out["routers"][ckpt.name] = {"sparsity": meta["config"]["sparsity"], "tensors": n, "lora": lora}
pages, source = wikitext_test_pages(allow_slice=True)
out["pages"], out["source"], out["first"] = len(pages), source, pages[1].strip().splitlines()[0].strip()
assert packaged_calibration_sample().resolve().is_relative_to(site)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_wheel_ships_routers_and_demo_data(tmp_path):
    """Build the wheel from a copy of the sources, unpack it (a pure-Python wheel's install) and load the
    routers and the demo slice from there, with no repository and no data folder in reach."""
    src = tmp_path / "src-tree"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
        check=True,
        capture_output=True,
    )
    (whl,) = dist.glob("wide-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for n in SHIPPED_ROUTERS:
        assert {f"wide/checkpoints/{n}/wide_config.json", f"wide/checkpoints/{n}/routers.safetensors"} <= names
    for lora in ("wide/checkpoints/smollm2-135m-s25-lora", "wide/checkpoints/smollm2-135m-s50-lora"):
        assert {f"{lora}/adapter_config.json", f"{lora}/adapter_model.safetensors"} <= names
    assert {"wide/data/wikitext/wiki.test.demo.raw.gz", "wide/data/README.md", f"wide/{CALIBRATION_SAMPLE}"} <= names
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    env = {k: v for k, v in os.environ.items() if k not in ("WIDE_DATA", "PYTHONPATH")}
    env.update(PYTHONPATH=str(site), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-c", _CHECK_INSTALLED, str(site)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["routers"]["smollm2-135m-s25"]["sparsity"] == 0.25
    assert got["routers"]["smollm2-135m-s50"]["sparsity"] == 0.5
    assert got["routers"]["smollm2-135m-s25-lora"]["sparsity"] == 0.25
    assert got["routers"]["smollm2-135m-s25-lora"]["lora"] > 0 == got["routers"]["smollm2-135m-s25"]["lora"]
    assert got["routers"]["smollm2-135m-s50-lora"]["sparsity"] == 0.5
    assert got["routers"]["smollm2-135m-s50-lora"]["lora"] > 0 == got["routers"]["smollm2-135m-s50"]["lora"]
    assert all(r["tensors"] > 0 for r in got["routers"].values())
    assert (got["pages"], got["source"], got["first"]) == (3, "packaged slice", "= Du Fu =")


def test_shipped_routers_resolve_by_name_and_path(tmp_path):
    assert [p.name for p in shipped_routers()] == list(SHIPPED_ROUTERS)
    assert resolve_routers("smollm2-135m-s50") == shipped_routers()[SHIPPED_ROUTERS.index("smollm2-135m-s50")]
    assert resolve_routers(tmp_path) == tmp_path  # an existing folder wins over names
    with pytest.raises(FileNotFoundError, match="neither a folder nor a shipped checkpoint"):
        resolve_routers("smollm2-135m-s99")


@pytest.mark.data
def test_packaged_slice_is_a_prefix_of_the_test_file():
    """The slice is the first pages of wiki.test.raw byte for byte (checked against the full file when present)."""
    with gzip.open(packaged_wikitext_slice(), "rt", encoding="utf-8") as f:
        text = f.read()
    pages = tasks.wikitext_pages(text)
    assert [p.strip().splitlines()[0].strip() for p in pages] == [
        "= Robert Boulter =",
        "= Du Fu =",
        "= Kiss You ( One Direction song ) =",
    ]
    root = tasks.find_data_dir()
    full = root / "wikitext" / "wiki.test.raw" if root else None
    if full is None or not full.is_file():
        pytest.skip("no data root with wikitext/wiki.test.raw")
    raw = full.read_text(encoding="utf-8")
    assert raw.startswith(text)
    assert tasks.wikitext_pages(raw)[:3] == pages


def test_wikitext_lookup_order(tmp_path, monkeypatch):
    """Data root first; then the packaged slice when a slice is enough; then the hub."""
    (tmp_path / "wikitext").mkdir()
    (tmp_path / "wikitext" / "wiki.test.raw").write_text(" \n = A = \n\n a . \n\n = B = \n\n b . \n", encoding="utf-8")
    pages, source = tasks.wikitext_test_pages(tmp_path, allow_slice=True)
    assert (len(pages), source) == (2, "data root")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="wiki.test.raw"):  # a data root is used, never skipped
        tasks.wikitext_test_pages(empty, allow_slice=True)

    calls = []

    def fake_load_dataset(name, config, split):
        calls.append((name, config, split))
        return {"page": ["hub page one", "hub page two"]}

    import datasets

    monkeypatch.setattr(tasks, "find_data_dir", lambda override=None: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert tasks.wikitext_test_pages(allow_slice=True)[1] == "packaged slice"
    assert tasks.wikitext_test_pages() == (["hub page one", "hub page two"], "hub")
    assert calls == [tasks.WIKITEXT_HUB]

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(FileNotFoundError, match="WikiText-2 test set not found.*ConnectionError"):
        tasks.wikitext_test_pages()


def test_perplexity_falls_back_from_slice_to_hub_when_the_slice_is_too_short(monkeypatch):
    """A token budget the packaged pages cannot fill reads the full set; one they fill does not."""
    import datasets
    import torch

    from wide.eval import perplexity

    monkeypatch.setattr(tasks, "find_data_dir", lambda override=None: None)
    monkeypatch.setattr(perplexity, "wikitext_test_pages", tasks.wikitext_test_pages)
    hub = ["= X =\n" + "word " * 50] * 5
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: {"page": hub})

    class CharTok:  # one token per character; BOS 0
        bos_token_id, eos_token_id = 0, 0

        def decode(self, i):
            return ""

        def encode(self, text, **kw):
            return [1 + (ord(c) % 50) for c in text]

    class Uniform(torch.nn.Module):  # every token equally likely: the result only counts tokens
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, **kw):
            return type("O", (), {"logits": torch.zeros(*input_ids.shape, 64)})()

    model = Uniform()
    small = perplexity.wikitext_perplexity(model, CharTok(), max_tokens=2000, max_length=512, batch_size=4)
    assert small["source"] == "packaged slice" and small["tokens"] <= 2000
    big = perplexity.wikitext_perplexity(model, CharTok(), max_tokens=10**7, max_length=512, batch_size=4)
    assert big["source"] == "hub" and big["docs"] == 5


def _subparsers():
    p = build_parser()
    (sub,) = [a for a in p._actions if a.__class__.__name__ == "_SubParsersAction"]
    return sub.choices


def test_every_cli_flag_has_help_and_shows_its_default():
    for name, sp in _subparsers().items():
        text = " ".join(sp.format_help().split())
        for act in sp._actions:
            if act.dest == "help":
                continue
            assert act.help, f"wide {name} {act.option_strings or act.dest} has no help text"
            if act.default not in (None, False):
                assert f"(default: {act.default})" in text or f"(default: {act.default!s})" in text, (
                    f"wide {name} {act.option_strings}: default {act.default!r} not shown in --help"
                )


def test_cli_routers_accept_shipped_names():
    args = build_parser().parse_args(["viz", "--routers", "smollm2-135m-s25"])
    assert Path(args.routers) == shipped_routers()[0]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["viz", "--routers", "no-such-routers"])


def test_calibrate_without_any_data_names_the_flags(tmp_path, monkeypatch, capsys):
    """No --data and no data root: a one-line error naming --data and --data-dir, before any model loads."""
    import wide.paths
    from wide.cli import _training_data

    monkeypatch.setattr(wide.paths, "find_data_dir", lambda override=None: None)
    args = build_parser().parse_args(["calibrate", "--out", str(tmp_path / "o")])
    with pytest.raises(FileNotFoundError, match=r"--data .*--data-dir"):
        _training_data(args, tok=None, seq_len=8)


def test_task_configs_keep_the_hub_dataset_without_a_data_root(tmp_path, monkeypatch):
    """No data root: lm-eval's own config under the offline name (its hub dataset); with one: the local JSONL."""
    pytest.importorskip("lm_eval")
    monkeypatch.setattr(tasks, "find_data_dir", lambda override=None: None)
    out = tasks.write_task_dir(["boolq"], out_dir=tmp_path / "hub")
    cfg = json.loads((out / "offline_boolq.yaml").read_text())
    assert cfg["task"] == "offline_boolq" and "dataset_path" not in cfg
    assert cfg["include"].endswith("super_glue/boolq/default.yaml")
    assert not (out / "boolq.jsonl").exists()
    root = tmp_path / "data"
    (root / "boolq").mkdir(parents=True)
    (root / "boolq" / "dev.jsonl").write_text('{"question": "q", "title": "t", "passage": "p", "answer": true}\n')
    monkeypatch.setattr(tasks, "find_data_dir", lambda override=None: root)
    monkeypatch.setattr(tasks, "_data_root", lambda override=None: root)
    out = tasks.write_task_dir(["boolq"], out_dir=tmp_path / "local")
    cfg = json.loads((out / "offline_boolq.yaml").read_text())
    assert cfg["dataset_path"] == "json" and (out / "boolq.jsonl").is_file()


@pytest.mark.data
@pytest.mark.slow
def test_demo_budget_scores_the_same_tokens_from_the_slice_as_from_the_full_file(monkeypatch):
    """With SmolLM2's tokenizer, the demo's 8,192-token budget covers the same pages, tokens and words
    whether the pages come from the packaged slice or from the full wiki.test.raw."""
    import torch

    from wide.eval import perplexity
    from wide.model import SMOLLM2, load_model

    root = tasks.find_data_dir()
    if root is None or not (root / "wikitext" / "wiki.test.raw").is_file():
        pytest.skip("no data root with wikitext/wiki.test.raw")
    _, tok = load_model(SMOLLM2, dtype=torch.float32, device="cpu")

    class Uniform(torch.nn.Module):  # every token equally likely: only the counts matter here
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, **kw):
            return type("O", (), {"logits": torch.zeros(*input_ids.shape, len(tok))})()

    kw = dict(max_tokens=8192, max_length=2048, batch_size=1)
    full = perplexity.wikitext_perplexity(Uniform(), tok, data_dir=root, **kw)
    monkeypatch.setattr(tasks, "find_data_dir", lambda override=None: None)
    sliced = perplexity.wikitext_perplexity(Uniform(), tok, **kw)
    assert (full["source"], sliced["source"]) == ("data root", "packaged slice")
    for k in ("docs", "tokens", "words", "bytes", "windows"):
        assert full[k] == sliced[k], k


def test_calibration_sample_is_documented_training_text_not_the_test_slice():
    """The packaged calibration sample: jsonl documents the calibration loader reads, none of them from the
    WikiText-2 test slice, its sha256 and licence in src/wide/data/README.md."""
    import hashlib

    from wide.train.data import load_texts

    sample = packaged_calibration_sample()
    texts = load_texts(sample)
    assert len(texts) >= 100 and all(t.strip() for t in texts)
    with gzip.open(packaged_wikitext_slice(), "rt", encoding="utf-8") as f:
        test_text = f.read()
    assert not any(t[:200] in test_text for t in texts)
    readme = (sample.parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index(f"## {Path(CALIBRATION_SAMPLE).relative_to('data').as_posix()}") :]
    assert hashlib.sha256(sample.read_bytes()).hexdigest() in section
    assert "license" in section.lower() and "ODC-By" in section


def test_demo_calibration_needs_no_data_folder_and_checks_data_before_loading(tmp_path, monkeypatch):
    """Without a data root `wide demo --calibrate` trains on the packaged sample; a --data path that does not
    exist is refused by calibration_source, which runs before the model loads."""
    from wide.demo import calibration_source
    from wide.train.data import DataError

    monkeypatch.delenv("WIDE_DATA", raising=False)
    monkeypatch.setenv("WIDE_DATA_SEARCH", "0")
    assert calibration_source(None, None) == (str(packaged_calibration_sample()), None)
    with pytest.raises(DataError, match="does not exist"):
        calibration_source(None, str(tmp_path / "missing.jsonl"))
    root = tmp_path / "root"
    (root / "redpajama" / "sample_redpajama").mkdir(parents=True)
    (root / "redpajama" / "sample_redpajama" / "a.jsonl").write_text('{"text": "a document"}\n')
    assert calibration_source(str(root), None) == (str(root / "redpajama" / "sample_redpajama"), root)


def test_data_search_can_be_turned_off(tmp_path, monkeypatch):
    """WIDE_DATA_SEARCH=0: no shared/data next to the working folder is used (what CI's no-data run relies on)."""
    from wide.paths import find_data_dir

    (tmp_path / "shared" / "data").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WIDE_DATA", raising=False)
    monkeypatch.delenv("WIDE_DATA_SEARCH", raising=False)
    assert find_data_dir() == tmp_path / "shared" / "data"
    monkeypatch.setenv("WIDE_DATA_SEARCH", "0")
    assert find_data_dir() is None


@pytest.mark.parametrize(
    ("args", "cuda", "added"),
    [
        (["--model", "wide", "--tasks", "offline_boolq"], False, ["--include_path", "T", "--device", "cpu"]),
        (["--model", "wide", "--tasks", "offline_boolq"], True, ["--include_path", "T"]),
        (["run", "--model=wide", "--device", "cuda:1"], False, ["--include_path", "T"]),
        (["ls", "tasks"], False, ["--include_path", "T"]),
        (["--model", "wide", "--include_path", "mine"], False, ["--device", "cpu"]),
    ],
)
def test_wide_lm_eval_adds_the_task_folder_and_the_cpu_without_cuda(args, cuda, added):
    from wide.eval.lm_eval_cli import lm_eval_args

    assert lm_eval_args(args, "T", cuda) == args + added


def test_wide_lm_eval_refuses_zero_shot_tasks_without_data_or_hub(monkeypatch):
    """No data root, hub offline: the zero-shot tasks are refused in one line before lm-eval (or a model) runs."""
    import lm_eval.__main__

    from wide.eval import lm_eval_cli, runner

    monkeypatch.delenv("WIDE_DATA", raising=False)
    monkeypatch.setenv("WIDE_DATA_SEARCH", "0")
    monkeypatch.setattr(runner, "hub_online", lambda online=None: False)
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: pytest.fail("lm-eval ran"))
    with pytest.raises(SystemExit, match=r"^error: the zero-shot tasks \(offline_boolq, wide_offline\).*WIDE_DATA"):
        lm_eval_cli.main(["--model", "wide", "--tasks", "offline_boolq,offline_wikitext", "--tasks=wide_offline"])
    assert lm_eval_cli.named_tasks(["--tasks", "a,b", "c", "--limit", "1"]) == ["a", "b", "c"]


def test_demo_calibration_folder_is_removed_also_on_ctrl_c(tmp_path, monkeypatch):
    import tempfile

    from wide import demo

    monkeypatch.delenv("WIDE_DATA", raising=False)
    monkeypatch.setenv("WIDE_DATA_SEARCH", "0")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    def interrupted(*args, calibrate, **kw):
        (data, _), folder = calibrate
        seen.append((data, folder.is_dir()))
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(calibrate=True)
    assert seen == [(str(packaged_calibration_sample()), True)] and list(tmp_path.iterdir()) == []
