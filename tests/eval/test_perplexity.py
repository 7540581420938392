"""Native WikiText-2 perplexity equals lm-eval's own `wikitext` task on the same documents."""

from __future__ import annotations

import json
import math

import pytest

from wide.eval.perplexity import rolling_windows, wikitext_perplexity
from wide.eval.tasks import build_docs, builtin_yaml, swapped_config


def test_rolling_windows_cover_every_token():
    toks = list(range(10, 30))
    w = rolling_windows(toks, 1, 8)
    assert sum(len(c) for _, c in w) == len(toks)
    assert w[0][0] == [1] and [t for _, c in w for t in c] == toks


def test_equals_lm_eval_wikitext(data_root, tiny, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    from wide.eval.lm_eval_model import WideLM

    model, tok = tiny
    ours = wikitext_perplexity(model, tok, max_length=256, batch_size=8, limit_docs=2)
    f = tmp_path / "wikitext.jsonl"
    f.write_text("".join(json.dumps(d) + "\n" for d in build_docs("wikitext")))
    cfg = load_yaml(builtin_yaml("wikitext"))  # lm-eval's own task, dataset swapped
    cfg.update(swapped_config("wikitext", f, "ref_wikitext"))
    cfg.pop("tag", None)
    lm = WideLM("tiny", model=model, tokenizer=tok, batch_size=8, max_length=256)
    res = simple_evaluate(
        model=lm, tasks=[cfg], limit=2, bootstrap_iters=0, task_manager=TaskManager(include_defaults=False)
    )["results"]["ref_wikitext"]
    for k in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert math.isclose(ours[k], res[f"{k},none"], rel_tol=1e-4), k
    assert ours["docs"] == 2 and ours["windows"] > 2


def test_max_tokens(data_root, tiny):
    model, tok = tiny
    r = wikitext_perplexity(model, tok, max_length=128, max_tokens=300)
    assert r["truncated"] and r["tokens"] == 300 and r["word_perplexity"] is None
    assert r["token_perplexity"] > 1


def test_missing_wikitext(tmp_path, tiny):
    model, tok = tiny
    with pytest.raises(FileNotFoundError, match="wiki.test.raw"):
        wikitext_perplexity(model, tok, data_dir=tmp_path)
