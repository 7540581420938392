"""The `wide` command end to end on a tiny local model (saved with a real tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tiny_model
from wide.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from wide.model import smollm2_gguf_path

    p = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    d = tmp_path_factory.mktemp("tiny")
    model = tiny_model("llama", vocab=len(tok))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture
def text_file(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text(" ".join(f"The number {i} follows {i - 1} and precedes {i + 1}." for i in range(400)))
    return f


def cli(*args: object) -> int:
    """Run `wide ARGS` on the CPU; ARGS may mix strings, numbers and paths."""
    return main([str(a) for a in args] + ["--device", "cpu"])


def calibrate_tiny(tiny_dir, text_file, out, *extra: object, steps: int = 2) -> int:
    """A few calibration steps on the tiny model."""
    return cli(
        "calibrate",
        "--model",
        tiny_dir,
        "--data",
        text_file,
        "--steps",
        steps,
        "--seq-len",
        32,
        "--batch-size",
        2,
        "--ffn-group-size",
        16,
        "--router-rank",
        8,
        "--out",
        out,
        *extra,
    )


def test_calibrate_then_resume(tiny_dir, text_file, tmp_path, capsys):
    out = tmp_path / "run"
    extra = ("--sparsity", 0.3, "--save-every", 2)
    assert calibrate_tiny(tiny_dir, text_file, out, *extra, steps=4) == 0
    meta = json.loads((out / "wide_config.json").read_text())
    assert meta["base_model"] == str(tiny_dir) and meta["config"]["sparsity"] == 0.3
    assert meta["training"]["steps"] == 4 and (out / "routers.safetensors").is_file()
    assert calibrate_tiny(tiny_dir, text_file, out, *extra, "--resume", steps=4) == 0  # from checkpoint-2


def test_cli_errors_are_clear(tiny_dir, tmp_path, capsys):
    rc = cli(
        "calibrate", "--model", tiny_dir, "--data", tmp_path / "missing.jsonl", "--steps", 1, "--out", tmp_path / "o"
    )
    assert rc == 2 and "missing.jsonl" in capsys.readouterr().err
    rc = cli(
        "calibrate",
        "--model",
        tiny_dir,
        "--data",
        tmp_path,
        "--ffn-group-size",
        24,
        "--steps",
        1,
        "--out",
        tmp_path / "o",
    )
    assert rc == 2 and "power of two" in capsys.readouterr().err


def test_unsupported_family_via_cli(tiny_dir, tmp_path, capsys):
    import transformers as tf
    from transformers import AutoTokenizer

    d = tmp_path / "gpt2"
    tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)).save_pretrained(d)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(d)
    rc = cli("calibrate", "--model", d, "--data", tmp_path, "--steps", 1, "--out", tmp_path / "o")
    assert rc == 2 and "unsupported architecture 'gpt2'" in capsys.readouterr().err


def test_eval_command_writes_json_and_table(tiny_dir, text_file, tmp_path):
    out = tmp_path / "run"
    assert calibrate_tiny(tiny_dir, text_file, out) == 0
    res = tmp_path / "eval"
    rc = cli(
        "eval",
        "--model",
        tiny_dir,
        "--routers",
        out,
        "--tasks",
        "wikitext,arc_easy",
        "--limit",
        2,
        "--max-length",
        128,
        "--batch-size",
        2,
        "--dtype",
        "fp32",
        "--out",
        res,
    )
    assert rc == 0
    data = json.loads((tmp_path / "eval.json").read_text())
    text = json.dumps(data)
    assert "attn_sparsity" in text and "word_perplexity" in text and "arc_easy" in text
    assert (tmp_path / "eval.md").is_file()


def test_viz_writes_plots(tiny_dir, text_file, tmp_path):
    out = tmp_path / "run"
    assert calibrate_tiny(tiny_dir, text_file, out) == 0
    plots = tmp_path / "plots"
    assert cli("viz", "--model", tiny_dir, "--routers", out, "--max-tokens", 256, "--out", plots) == 0
    for name in ("layer_sparsity.png", "token_routing.png", "training.png", "layer_sparsity.json"):
        assert (plots / name).stat().st_size > 0, name


def test_refit_changes_thresholds_not_weights(tiny_dir, text_file, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    assert calibrate_tiny(tiny_dir, text_file, out, "--fit-mode", "none") == 0
    before = load_file(str(out / "routers.safetensors"))
    rc = cli(
        "refit",
        "--model",
        tiny_dir,
        "--routers",
        out,
        "--data",
        text_file,
        "--mode",
        "global",
        "--batches",
        2,
        "--batch-size",
        2,
        "--seq-len",
        32,
        "--out",
        tmp_path / "r2",
    )
    assert rc == 0
    after = load_file(str(tmp_path / "r2" / "routers.safetensors"))
    for k in before:
        if k.endswith("skip_bias"):
            continue
        assert torch.equal(before[k], after[k]), k
    biases = {float(v) for k, v in after.items() if k.endswith("skip_bias")}
    assert len(biases) == 1  # global mode: one offset everywhere
    meta = json.loads((tmp_path / "r2" / "wide_config.json").read_text())
    assert meta["training"]["refits"][-1]["mode"] == "global" and meta["training"]["steps"] == 2


def test_finetune_then_eval_merges_lora(tiny_dir, text_file, tmp_path):
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    assert calibrate_tiny(tiny_dir, text_file, s1) == 0
    rc = cli(
        "finetune",
        "--model",
        tiny_dir,
        "--data",
        text_file,
        "--steps",
        2,
        "--seq-len",
        32,
        "--batch-size",
        2,
        "--routers",
        s1,
        "--lora-r",
        4,
        "--out",
        s2,
    )
    assert rc == 0
    assert (s2 / "adapter_config.json").is_file() and (s2 / "routers.safetensors").is_file()
    meta = json.loads((s2 / "wide_config.json").read_text())
    assert meta["training"]["stage"] == "lora"
    rc = cli(
        "eval",
        "--model",
        tiny_dir,
        "--routers",
        s2,
        "--tasks",
        "wikitext",
        "--limit",
        1,
        "--max-length",
        64,
        "--dtype",
        "fp32",
        "--out",
        tmp_path / "e",
    )
    assert rc == 0


def test_generate_dense_equals_hf_and_routed_reports_sparsity(tiny_dir, text_file, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The number 7 follows"
    assert cli("generate", "--model", tiny_dir, "--prompt", prompt, "--max-new-tokens", 6) == 0
    text, stats = capsys.readouterr()
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    assert text.rstrip("\n") == tok.decode(ref[0, ids.shape[1] :], skip_special_tokens=True)
    assert "6 tokens in" in stats and "sparsity" not in stats

    out = tmp_path / "run"
    assert calibrate_tiny(tiny_dir, text_file, out) == 0
    capsys.readouterr()
    assert cli("generate", "--model", tiny_dir, "--routers", out, "--prompt", prompt, "--max-new-tokens", 4) == 0
    assert "real sparsity attention" in capsys.readouterr().err
    assert cli("generate", "--model", tiny_dir, "--max-new-tokens", 0) == 2  # clear error, no traceback


def test_bench_e2e_subset_options_parse_and_reject_bad_lists(capsys):
    from wide.cli import build_parser

    a = build_parser().parse_args(["bench", "e2e", "--batches", "1,16", "--sparsities", "0.5,0.7"])
    assert a.batches == (1, 16) and a.sparsities == (0.5, 0.7)
    for bad in (["--batches", "1,x"], ["--batches", "0"], ["--sparsities", "1.5"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "e2e", *bad])
        err = capsys.readouterr().err
        assert "expected a comma list" in err or "must lie in" in err
