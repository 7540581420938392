"""The `wide` command end to end on a tiny local model (saved with a real tokenizer)."""

from __future__ import annotations

import json
import shutil

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
    extra = ("--sparsity", 0.3, "--save-every", 2, "--ffn-router-source", "layer")
    assert calibrate_tiny(tiny_dir, text_file, out, *extra, steps=4) == 0
    meta = json.loads((out / "wide_config.json").read_text())
    assert meta["base_model"] == str(tiny_dir) and meta["config"]["sparsity"] == 0.3
    assert meta["config"]["ffn_router_source"] == "layer"
    assert meta["training"]["steps"] == 4 and (out / "routers.safetensors").is_file()
    assert calibrate_tiny(tiny_dir, text_file, out, *extra, "--resume", steps=4) == 0  # from checkpoint-2


def test_calibrate_init_routers_warm_starts(tiny_dir, text_file, tmp_path, capsys):
    """`wide calibrate --init-routers CKPT` trains CKPT's routers on (another target, objective or router
    input), not a fresh draw; a checkpoint of other router shapes, a stage-2 one or a training-free method is
    refused."""
    from wide.model.checkpoint import ADAPTER_FILES, load_tensors

    s1 = tmp_path / "s1"
    assert calibrate_tiny(tiny_dir, text_file, s1, "--lr", 0.05, steps=3) == 0

    def weights(d):  # the router weights, without the skip offsets that every run's final fit sets
        return {k: v for k, v in load_tensors(d / "routers.safetensors").items() if not k.endswith("skip_bias")}

    still = ("--lr", 1e-12, "--seed", 1, "--sparsity", 0.3, "--distill", "kl+lm")  # another draw, target, objective
    assert calibrate_tiny(tiny_dir, text_file, tmp_path / "warm", *still, "--init-routers", s1) == 0
    assert calibrate_tiny(tiny_dir, text_file, tmp_path / "fresh", *still) == 0
    w1, warm, fresh = weights(s1), weights(tmp_path / "warm"), weights(tmp_path / "fresh")
    assert all(torch.allclose(warm[k], w1[k], atol=1e-6) for k in w1)
    assert not all(torch.allclose(fresh[k], w1[k], atol=1e-3) for k in w1)
    meta = json.loads((tmp_path / "warm" / "wide_config.json").read_text())
    assert meta["config"]["sparsity"] == 0.3 and meta["config"]["distill"] == "kl+lm"
    # the FFN routers moved to the layer input: the same tensors to start from, hooks on the attention's norm
    moved = tmp_path / "moved"
    assert calibrate_tiny(tiny_dir, text_file, moved, *still, "--init-routers", s1, "--ffn-router-source", "layer") == 0
    assert all(torch.allclose(weights(moved)[k], w1[k], atol=1e-6) for k in w1)
    assert json.loads((moved / "wide_config.json").read_text())["config"]["ffn_router_source"] == "layer"
    # router shapes left out are the checkpoint's (its G_ffn 16 and rank 8, not the defaults 128 and 32)
    bare = tmp_path / "bare"
    args = ("calibrate", "--model", tiny_dir, "--data", text_file, "--steps", 1, "--seq-len", 32, "--batch-size", 2)
    assert cli(*args, "--init-routers", s1, "--out", bare) == 0
    assert all(torch.allclose(weights(bare)[k], w1[k], atol=1e-2) for k in w1)
    saved = json.loads((bare / "wide_config.json").read_text())["config"]
    assert (saved["ffn_group_size"], saved["router_rank"]) == (16, 8)
    # narrower FFN groups: each of the checkpoint's groups split, the same decisions to start from
    coarse, split = tmp_path / "coarse", tmp_path / "split"
    assert calibrate_tiny(tiny_dir, text_file, coarse, "--ffn-group-size", 32, "--lr", 0.05, steps=3) == 0
    assert cli(*args, "--init-routers", coarse, "--ffn-group-size", 16, "--lr", 1e-12, "--out", split) == 0
    assert json.loads((split / "wide_config.json").read_text())["config"]["ffn_group_size"] == 16
    got = weights(split)
    for k, v in weights(coarse).items():
        if ".ffn.up." in k:  # [2 N_G(, r)] -> [4 N_G(, r)]: each (execute, skip) row pair twice
            v = v.view(-1, 2, *v.shape[1:]).repeat_interleave(2, dim=0).reshape(-1, *v.shape[1:])
        assert torch.allclose(got[k], v, atol=1e-6), k
    capsys.readouterr()
    assert cli(*args, "--init-routers", s1, "--ffn-group-size", 32, "--out", tmp_path / "coarser") == 2
    assert "a divisor of it splits its groups" in capsys.readouterr().err
    assert cli(*args, "--out", tmp_path / "fresh-default") == 0  # without --init-routers: the defaults
    assert json.loads((tmp_path / "fresh-default" / "wide_config.json").read_text())["config"]["ffn_group_size"] == 128
    capsys.readouterr()

    assert calibrate_tiny(tiny_dir, text_file, tmp_path / "x", "--init-routers", s1, "--router-rank", 4) == 2
    assert "its router_rank is 8, this run's --router-rank is 4" in capsys.readouterr().err
    rc = calibrate_tiny(tiny_dir, text_file, tmp_path / "y", "--init-routers", s1, "--method", "module-skip")
    assert rc == 2 and "its method is 'wide'" in capsys.readouterr().err
    assert calibrate_tiny(tiny_dir, text_file, tmp_path / "z", "--init-routers", s1, "--method", "teal") == 2
    assert "teal has no routers to train" in capsys.readouterr().err
    stage2 = shutil.copytree(s1, tmp_path / "s2")
    (stage2 / ADAPTER_FILES[0]).write_text("{}")  # what makes a folder a stage-2 checkpoint
    assert calibrate_tiny(tiny_dir, text_file, tmp_path / "w", "--init-routers", stage2) == 2
    assert "a stage-2 checkpoint" in capsys.readouterr().err


def test_cli_errors_are_clear(tiny_dir, tmp_path, capsys):
    missing = ("--data", tmp_path / "missing.jsonl", "--seq-len", 32)  # a length the tiny model has positions for
    rc = cli("calibrate", "--model", tiny_dir, *missing, "--steps", 1, "--out", tmp_path / "o")
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
    # a data root without the default calibration text: named before the model loads
    (tmp_path / "root").mkdir()
    rc = cli("calibrate", "--model", tiny_dir, "--data-dir", tmp_path / "root", "--steps", 1, "--out", tmp_path / "o")
    assert rc == 2 and "redpajama/sample_redpajama" in capsys.readouterr().err


def test_unsupported_family_via_cli(tiny_dir, tmp_path, capsys):
    import transformers as tf
    from transformers import AutoTokenizer

    d = tmp_path / "gpt2"
    tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)).save_pretrained(d)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(d)
    rc = cli("calibrate", "--model", d, "--data", tmp_path, "--steps", 1, "--out", tmp_path / "o")
    assert rc == 2 and "unsupported architecture 'gpt2'" in capsys.readouterr().err


def test_eval_command_writes_json_and_table(tiny_dir, text_file, tmp_path, data_root):  # arc_easy: data root
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


def test_generate_samples_with_a_seed_and_stops_at_a_stop_string(tiny_dir, tmp_path, capsys):
    """--temperature/--seed: the same seed gives the same text, another seed (almost surely) another; --stop ends the
    text before the stop string; a bad sampling flag is refused in one line before the model loads."""
    args = ("generate", "--model", tiny_dir, "--prompt", "The number 7 follows", "--max-new-tokens", 12)
    texts = []
    for seed in (1, 1, 2):
        assert cli(*args, "--temperature", "1.5", "--seed", seed) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0] != texts[2]
    assert cli(*args) == 0
    greedy = capsys.readouterr().out.rstrip("\n")
    stop = greedy[len(greedy) // 2 :][:3]
    assert stop.strip()
    assert cli(*args, "--stop", stop) == 0
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == greedy[: greedy.index(stop)] and "finish: stop" in err
    assert cli("generate", "--model", tmp_path / "no-model", "--top-p", "1.5") == 2
    assert "--top-p" in capsys.readouterr().err


def test_generate_fused_decode_same_text_or_one_line_error(tiny_dir, tmp_path, capsys):
    """--fused-decode: the same greedy text as the unfused runtime where the fused layer serves the model;
    a one-line error where it does not (the tiny model's head_dim 16)."""
    from transformers import AutoTokenizer

    assert cli("generate", "--model", tiny_dir, "--max-new-tokens", 4, "--fused-decode") == 2
    assert "head_dim a multiple of 32" in capsys.readouterr().err
    d = tmp_path / "hd32"  # head_dim 32
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tiny_model("llama", hidden=128, heads=4, kv=2, inter=128, vocab=len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    texts = []
    for extra in ((), ("--fused-decode",)):
        assert cli("generate", "--model", d, "--prompt", "The number 7 follows", "--max-new-tokens", 5, *extra) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()


def test_bench_e2e_subset_options_parse_and_reject_bad_lists(capsys):
    from wide.cli import build_parser

    a = build_parser().parse_args(["bench", "e2e", "--batches", "1,16", "--sparsities", "0.5,0.7"])
    assert a.batches == (1, 16) and a.sparsities == (0.5, 0.7) and a.ffn_group_size == 128
    assert build_parser().parse_args(["bench", "e2e", "--ffn-group-size", "32"]).ffn_group_size == 32
    for bad in (["--batches", "1,x"], ["--batches", "0"], ["--sparsities", "1.5"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "e2e", *bad])
        err = capsys.readouterr().err
        assert "expected a comma list" in err or "must lie in" in err


# ------------------------------------------------------------------ issue 16: runs that are safe
@pytest.fixture
def no_model_load(monkeypatch):
    """Fail loudly if a command gets as far as loading a model."""
    import wide.model

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was found")

    monkeypatch.setattr(wide.model, "load_model", refuse)


def _routers(d):
    from safetensors.torch import load_file

    return load_file(str(d / "routers.safetensors"))


def _log_steps(d):
    return [json.loads(x) for x in (d / "train_log.jsonl").read_text().splitlines()]


def test_same_command_twice_is_bit_identical(tiny_dir, text_file, tmp_path):
    for name in ("a", "b"):
        assert calibrate_tiny(tiny_dir, text_file, tmp_path / name, steps=3) == 0
    assert calibrate_tiny(tiny_dir, text_file, tmp_path / "c", "--seed", 1, steps=3) == 0
    a, b, c = (_routers(tmp_path / n) for n in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in _log_steps(tmp_path / "a")] == [r["loss"] for r in _log_steps(tmp_path / "b")]
    assert not all(torch.equal(a[k], c[k]) for k in a)  # the seed matters: the check above can fail


def test_resume_refuses_changed_flags_before_loading(tiny_dir, text_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert calibrate_tiny(tiny_dir, text_file, out, "--save-every", 2, "--log-every", 1, steps=4) == 0  # ckpt 2 stays
    other = tmp_path / "other.txt"
    other.write_text(text_file.read_text())
    import wide.model

    real_load = wide.model.load_model
    monkeypatch.setattr(wide.model, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    capsys.readouterr()
    for flag, value in (
        ("--lr", 0.1),
        ("--sparsity", 0.25),
        ("--ffn-group-size", 32),
        ("--seq-len", 16),
        ("--router-rank", 4),
        ("--seed", 5),
    ):
        assert calibrate_tiny(tiny_dir, text_file, out, "--save-every", 2, "--resume", flag, value, steps=4) == 2
        err = capsys.readouterr().err
        assert f"--resume: {flag} " in err and err.count("\n") == 1, err
    assert calibrate_tiny(tiny_dir, text_file, out, "--save-every", 2, "--resume", "--data", other, steps=4) == 2
    assert "--resume: --data " in capsys.readouterr().err
    monkeypatch.setattr(wide.model, "load_model", real_load)
    # checkpointing / logging flags may change; the log then holds every step exactly once (no 3, 4 twice)
    assert calibrate_tiny(tiny_dir, text_file, out, "--save-every", 3, "--log-every", 1, "--resume", steps=4) == 0
    assert [r["step"] for r in _log_steps(out)] == [1, 2, 3, 4]


def test_resume_of_a_run_older_than_a_config_field(tiny_dir, text_file, tmp_path, capsys):
    """A run started before a WideConfig field existed resumes (it had the field's default) and still refuses
    a value other than that default."""
    from wide.train.calibrate import STATE_NAME, latest_checkpoint, read_state, write_state

    out = tmp_path / "run"
    assert calibrate_tiny(tiny_dir, text_file, out, "--save-every", 2, steps=4) == 0
    state = latest_checkpoint(out) / STATE_NAME
    tensors, meta = read_state(state)
    del meta["wide_config"]["ffn_router_source"]
    write_state(state, tensors, meta)
    capsys.readouterr()
    assert calibrate_tiny(tiny_dir, text_file, out, "--resume", "--ffn-router-source", "layer", steps=4) == 2
    assert "--resume: --ffn-router-source 'layer' differs from 'block'" in capsys.readouterr().err
    assert calibrate_tiny(tiny_dir, text_file, out, "--save-every", 2, "--resume", steps=6) == 2  # steps: schedules
    assert calibrate_tiny(tiny_dir, text_file, out, "--save-every", 2, "--resume", steps=4) == 0


def test_foreign_out_dir_needs_overwrite_and_stays_intact(tiny_dir, text_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "project"
    for name in ("checkpoint-500", "checkpoint-1000", "checkpoint-best"):
        (out / name).mkdir(parents=True)
        (out / name / "weights.bin").write_text(name)
    (out / "train_log.jsonl").write_text('{"theirs": 1}\n')
    import wide.model

    real_load = wide.model.load_model
    monkeypatch.setattr(wide.model, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert calibrate_tiny(tiny_dir, text_file, out, "--save-every", 1, steps=2) == 2
    assert "is not a WIDE run" in capsys.readouterr().err
    monkeypatch.setattr(wide.model, "load_model", real_load)
    assert calibrate_tiny(tiny_dir, text_file, out, "--save-every", 1, "--log-every", 1, "--overwrite", steps=3) == 0
    for name in ("checkpoint-500", "checkpoint-1000", "checkpoint-best"):
        assert (out / name / "weights.bin").read_text() == name
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-1000",
        "checkpoint-2",
        "checkpoint-500",
        "checkpoint-best",
    ]
    assert [r["step"] for r in _log_steps(out)] == [1, 2, 3]


def test_bad_input_fails_before_loading_and_leaves_no_dir(tiny_dir, text_file, tmp_path, capsys, no_model_load):
    out = tmp_path / "run"
    assert calibrate_tiny(tiny_dir, text_file, out, "--lr", -1) == 2
    assert "lr must be a positive number" in capsys.readouterr().err and not out.exists()
    assert cli("finetune", "--model", tiny_dir, "--routers", tmp_path, "--lora-dropout", 1.5, "--out", out) == 2
    assert "--lora-dropout" in capsys.readouterr().err and not out.exists()


def test_read_only_out_fails_before_loading(tiny_dir, text_file, tmp_path, capsys, monkeypatch, no_model_load):
    import errno

    import wide.train.calibrate as cal

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cal.tempfile, "TemporaryFile", read_only)
    out = tmp_path / "ro" / "run"
    assert calibrate_tiny(tiny_dir, text_file, out) == 2
    assert "is not writable (Read-only file system)" in capsys.readouterr().err and not out.exists()


def test_eval_rejects_broken_checkpoints_with_one_line(tiny_dir, text_file, tmp_path, capsys, monkeypatch):
    import shutil

    import wide.eval.runner

    out = tmp_path / "run"
    assert calibrate_tiny(tiny_dir, text_file, out, "--fit-mode", "none") == 0
    monkeypatch.setattr(wide.eval.runner, "run_eval", lambda *a, **k: pytest.fail("evaluation started"))
    truncated, bad_json = tmp_path / "truncated", tmp_path / "bad_json"
    shutil.copytree(out, truncated)
    data = (truncated / "routers.safetensors").read_bytes()
    (truncated / "routers.safetensors").write_bytes(data[: len(data) // 2])
    shutil.copytree(out, bad_json)
    (bad_json / "wide_config.json").write_text('{"format": "wide-routers", ')
    capsys.readouterr()
    for ckpt, name in ((truncated, "routers.safetensors"), (bad_json, "wide_config.json")):
        assert cli("eval", "--model", tiny_dir, "--routers", ckpt, "--tasks", "wikitext") == 2
        err = capsys.readouterr().err
        assert str(ckpt / name) in err and err.count("\n") == 1, err
    # the same files through the library loader and --resume's router file
    from transformers import AutoModelForCausalLM

    from wide.model import CheckpointMismatchError, load_routers

    with pytest.raises(CheckpointMismatchError, match="routers.safetensors is truncated"):
        load_routers(AutoModelForCausalLM.from_pretrained(tiny_dir), truncated, strict_base=False)


def test_eval_and_finetune_accept_no_strict_base(tmp_path):
    from wide.cli import build_parser

    r = str(tmp_path)  # --routers must name an existing folder (or a shipped checkpoint) at parse time
    a = build_parser().parse_args(["eval", "--routers", r, "--no-strict-base"])
    assert a.no_strict_base
    a = build_parser().parse_args(["finetune", "--routers", r, "--out", "o", "--no-strict-base"])
    assert a.no_strict_base


def _fake_gguf(path, arch: str) -> None:
    """A GGUF header only (no tensors): general.name, then general.architecture."""
    import struct

    def kv(key: bytes, value: bytes) -> bytes:
        return struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value

    path.write_bytes(
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 2)
        + kv(b"general.name", b"fake")
        + kv(b"general.architecture", arch.encode())
    )


def test_unsupported_gguf_gets_the_wide_error_before_loading(tmp_path, capsys):
    f = tmp_path / "m.gguf"
    _fake_gguf(f, "gpt2")
    want = "unsupported architecture 'gpt2': WIDE routes llama, mistral, qwen2, qwen3 models"
    assert cli("calibrate", "--model", f, "--data", tmp_path, "--steps", 1, "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert want in err and str(f) in err and not (tmp_path / "o").exists()
    assert cli("generate", "--model", f) == 2
    assert want in capsys.readouterr().err
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 a zip file")
    assert cli("generate", "--model", tmp_path / "not.gguf") == 2
    assert "is not a GGUF file" in capsys.readouterr().err


def test_any_gguf_path_or_directory_resolves(tmp_path):
    from wide.model import smollm2_gguf_path
    from wide.model.loading import resolve_source

    link = tmp_path / "models" / "my-model.gguf"
    link.parent.mkdir()
    link.symlink_to(smollm2_gguf_path())
    assert resolve_source(str(link)) == (str(link.parent), {"gguf_file": "my-model.gguf"})
    assert resolve_source(str(link.parent)) == (str(link.parent), {"gguf_file": "my-model.gguf"})
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        resolve_source(str(tmp_path / "absent.gguf"))


@pytest.mark.slow
def test_gguf_path_loads_and_routes(tmp_path):
    from wide.config import WideConfig
    from wide.model import WideModel, load_model, smollm2_gguf_path

    link = tmp_path / "other-name.gguf"
    link.symlink_to(smollm2_gguf_path())
    model, tok = load_model(str(link))
    assert model.config.model_type == "llama" and model.config.wide_model_id == str(link)
    wm = WideModel(model, WideConfig(ffn_group_size=64))
    with torch.no_grad():
        assert torch.isfinite(wm(tok("Hello", return_tensors="pt").input_ids).logits).all()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_local_directory_of_each_family_loads(tiny_dir, tmp_path, family):
    from transformers import AutoTokenizer

    from wide.config import WideConfig
    from wide.model import WideModel, load_model

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    d = tmp_path / family
    tiny_model(family, vocab=len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    model, tok = load_model(str(d))
    assert model.config.model_type == family
    wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8))
    with torch.no_grad():
        assert torch.isfinite(wm(tok("one two three", return_tensors="pt").input_ids).logits).all()


def test_finetune_compiled_saves_the_whole_adapter(tiny_dir, text_file, tmp_path):
    """`wide finetune --compile`: the decoder layers compile with their LoRA modules and routing hooks, and
    the adapter written (final and in every checkpoint) holds every LoRA tensor under peft's names, as the
    eager run's does (layers compiled by replacing them hid the names from peft: an empty adapter). The
    weights themselves differ: compiled and eager training draw their Gumbel noise and dropout differently."""
    from safetensors.torch import load_file

    s1 = tmp_path / "s1"
    assert calibrate_tiny(tiny_dir, text_file, s1) == 0

    def finetune(out, *extra):
        args = ("--data", text_file, "--steps", 3, "--seq-len", 32, "--batch-size", 2, "--save-every", 2)
        return cli("finetune", "--model", tiny_dir, "--routers", s1, "--lora-r", 4, *args, "--out", out, *extra)

    assert finetune(tmp_path / "eager") == 0 and finetune(tmp_path / "compiled", "--compile") == 0
    meta = json.loads((tmp_path / "compiled" / "wide_config.json").read_text())
    assert meta["training"]["train_config"]["compile"] is True
    want = load_file(str(tmp_path / "eager" / "adapter_model.safetensors"))
    assert want
    for path in (tmp_path / "compiled", tmp_path / "compiled" / "checkpoint-2"):
        got = load_file(str(path / "adapter_model.safetensors"))
        assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}, path
        assert all(torch.isfinite(v).all() for v in got.values())
        assert any(v.abs().max() > 0 for k, v in got.items() if "lora_B" in k)  # trained (B starts at zero)


def test_finetune_reproduces_and_resume_refuses_changed_lora(tiny_dir, text_file, tmp_path, capsys):
    from safetensors.torch import load_file

    s1 = tmp_path / "s1"
    assert calibrate_tiny(tiny_dir, text_file, s1) == 0

    def finetune(out, *extra):
        args = ("--data", text_file, "--steps", 2, "--seq-len", 32, "--batch-size", 2, "--save-every", 1)
        return cli("finetune", "--model", tiny_dir, "--routers", s1, "--lora-r", 4, *args, "--out", out, *extra)

    assert finetune(tmp_path / "a") == 0 and finetune(tmp_path / "b") == 0
    for name in ("routers.safetensors", "adapter_model.safetensors"):
        a, b = load_file(str(tmp_path / "a" / name)), load_file(str(tmp_path / "b" / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name  # LoRA's initialisation is seeded too
    capsys.readouterr()
    assert finetune(tmp_path / "a", "--resume", "--lora-r", 8) == 2
    assert "--resume: --lora-r 8 differs from 4" in capsys.readouterr().err


def test_finetune_distill_sets_stage_two_objective(tiny_dir, text_file, tmp_path):
    """`wide finetune --distill kl+lm`: stage 2 adds the KL to the dense base (adapter and routing off) to
    the LM loss, from the same first forward as plain LoRA, and its checkpoint records the objective."""
    s1 = tmp_path / "s1"
    assert calibrate_tiny(tiny_dir, text_file, s1) == 0

    def finetune(out, *extra):
        args = ("--data", text_file, "--steps", 1, "--seq-len", 32, "--batch-size", 2, "--log-every", 1)
        assert cli("finetune", "--model", tiny_dir, "--routers", s1, "--lora-r", 4, *args, "--out", out, *extra) == 0
        log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
        return log[0], json.loads((out / "wide_config.json").read_text())["config"]["distill"]

    (plain, plain_mode), (kd, kd_mode) = finetune(tmp_path / "plain"), finetune(tmp_path / "kd", "--distill", "kl+lm")
    assert (plain_mode, kd_mode) == ("none", "kl+lm")
    assert kd["lm_loss"] == pytest.approx(plain["lm_loss"], rel=1e-5)  # the same student forward
    assert kd["loss"] - plain["loss"] > 1e-4  # + KL(dense || routed) > 0: the routers skip work


def test_stage_two_checkpoints_load_with_their_adapter(tiny_dir, text_file, tmp_path, capsys):
    """Every loader of a stage-2 checkpoint merges its LoRA adapter into the weights, once, as `wide eval`
    scores it: `load_routers` (generate, demo, the runtime) and `wide.baselines.load` (refit, viz, eval);
    `wide refit --out` carries the adapter along; `wide finetune` refuses to start from one."""
    from peft import PeftModel

    from wide.baselines import load
    from wide.model import load_model, load_routers
    from wide.model.checkpoint import ADAPTER_FILES

    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    assert calibrate_tiny(tiny_dir, text_file, s1) == 0
    train = ("--data", text_file, "--steps", 2, "--seq-len", 32, "--batch-size", 2, "--lora-r", 4)
    assert cli("finetune", "--model", tiny_dir, *train, "--routers", s1, "--out", s2) == 0
    want, _ = load_model(str(tiny_dir))
    base = {k: v.clone() for k, v in want.state_dict().items()}
    want = PeftModel.from_pretrained(want, str(s2)).merge_and_unload().state_dict()
    assert any(not torch.equal(base[k], want[k]) for k in want)  # the adapter moves some weights
    for loader in (load_routers, load):
        model, _ = load_model(str(tiny_dir))
        for _ in range(2):  # a second load onto the same model merges nothing more
            wm = loader(model, s2)
            got = model.state_dict()
            assert all(torch.equal(got[k], want[k]) for k in want), loader.__name__
            wm.detach()
    refit = ("--data", text_file, "--batches", 1, "--batch-size", 2, "--seq-len", 32)
    assert cli("refit", "--model", tiny_dir, "--routers", s2, *refit, "--out", tmp_path / "r") == 0
    assert all((tmp_path / "r" / n).read_bytes() == (s2 / n).read_bytes() for n in ADAPTER_FILES)
    capsys.readouterr()
    assert cli("finetune", "--model", tiny_dir, *train, "--routers", s2, "--out", tmp_path / "s3") == 2
    assert "a stage-2 checkpoint" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("what", ["kernels", "e2e"])
def test_bench_without_cuda_refuses_in_one_line(what, tmp_path, capsys):
    assert main(["bench", what, "--quick", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: wide bench {what}") and "CUDA" in err
    assert not (tmp_path / "b").exists()
