"""Calibration data: load texts, tokenise (packed or padded) with an on-disk cache, order batches.

Sources (``--data``): a ``.txt`` file (one document per file), a ``.jsonl`` / ``.json`` file (a text
field per record), a ``.parquet`` file (a text column), a directory of such files (recursive,
sorted), or a Hugging Face dataset ``name`` / ``name:config`` / ``name:config:split``. Several
sources may be joined with commas. Relative paths are looked up in the working directory, then
under the data root (``WIDE_DATA`` / ``--data-dir``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

TEXT_EXTENSIONS = (".txt", ".jsonl", ".json", ".parquet")
CACHE_FORMAT = 1  # bump when the cached tensors' layout changes
ENCODE_BATCH = 512  # documents per tokenizer call
BINARY_SAMPLE = 1 << 20  # characters of a .txt inspected for binary content
BINARY_FRACTION = 0.01  # more control characters than this (whitespace aside) mean binary data
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f]")  # C0 / C1 controls except \t \n \v \f \r

Mode = Literal["packed", "padded"]
Texts = Sequence[str] | Callable[[], Sequence[str]]


class DataError(ValueError):
    """Calibration data that cannot be found, read or used."""


# ----------------------------------------------------------------------------- sources


def default_data_root() -> Path | None:
    """The data root (``WIDE_DATA``, else a shared/data found by ``wide.paths``), or None."""
    try:
        from wide.paths import data_dir
    except ImportError:
        root = os.environ.get("WIDE_DATA")
        return Path(root).expanduser() if root else None
    try:
        return data_dir()
    except FileNotFoundError:
        return None


def default_cache_dir() -> Path:
    """``$WIDE_CACHE/tokens`` if ``WIDE_CACHE`` is set, else ``~/.cache/wide/tokens``."""
    root = os.environ.get("WIDE_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "wide") / "tokens"


def split_sources(source: str | Path | Sequence[str | Path]) -> list[str]:
    """Split a comma-separated source string (or a list of them) into single sources."""
    if isinstance(source, (str, Path)):
        text = str(source)
        if Path(text).expanduser().exists():  # a path that happens to contain a comma
            return [text]
        return [s.strip() for s in text.split(",") if s.strip()]
    return [s for item in source for s in split_sources(item)]


def _resolve_path(source: str, data_root: Path | None) -> Path | None:
    """The existing path a source names (as given, then under the data root), or None."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    if data_root is not None and not path.is_absolute() and (data_root / path).exists():
        return data_root / path
    return None


def _looks_like_path(source: str) -> bool:
    """True for sources that can only be meant as a path, never a hub dataset name."""
    return (
        source.startswith(("/", ".", "~"))
        or source.lower().endswith(TEXT_EXTENSIONS)
        or source.count("/") > 1
        or "\\" in source
    )


def _missing_path_error(source: str, data_root: Path | None) -> DataError:
    where = f"{Path.cwd()}" + (f" or under the data root {data_root}" if data_root else ", no data root set")
    return DataError(
        f"data path {source!r} does not exist (looked in {where}); "
        "set the data root with WIDE_DATA=<dir> or --data-dir <dir>"
    )


def list_files(directory: Path) -> list[Path]:
    """Data files under a directory, recursively, sorted by relative path; hidden files skipped."""
    files = [
        p
        for p in directory.rglob("*")
        if p.is_file()
        and p.suffix.lower() in TEXT_EXTENSIONS
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    ]
    if not files:
        raise DataError(
            f"no usable data files under directory {str(directory)!r}; "
            f"accepted extensions: {', '.join(TEXT_EXTENSIONS)}"
        )
    return sorted(files, key=lambda p: p.relative_to(directory).as_posix())


def _expand(source: str, data_root: Path | None) -> list[Path] | tuple[str, str | None, str]:
    """Files a path source names, or (name, config, split) for a hub dataset."""
    path = _resolve_path(source, data_root)
    if path is not None:
        if path.is_dir():
            return list_files(path)
        if path.suffix.lower() not in TEXT_EXTENSIONS:
            raise DataError(f"unsupported data file {str(path)!r}; accepted extensions: {', '.join(TEXT_EXTENSIONS)}")
        return [path]
    if _looks_like_path(source):
        raise _missing_path_error(source, data_root)
    return _parse_hub_name(source)


def _parse_hub_name(source: str) -> tuple[str, str | None, str]:
    """``name[:config[:split]]`` -> (name, config or None, split; default "train")."""
    parts = source.split(":")
    if len(parts) > 3:
        raise DataError(f"bad dataset name {source!r}: expected name, name:config or name:config:split")
    name, config, split = (parts + [None, None])[:3]
    return name, config or None, split or "train"


# ----------------------------------------------------------------------------- readers


def _record_text(record: Any, text_field: str, where: str) -> str | None:
    """The text of one record (None when empty); errors name the place and the record's keys."""
    if isinstance(record, str) and text_field == "text":
        value = record  # a bare list of strings
    elif not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with a {text_field!r} field, got {type(record).__name__}")
    elif text_field not in record:
        raise DataError(f"{where}: record has no {text_field!r} field; its keys are {sorted(record)}")
    else:
        value = record[text_field]
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: field {text_field!r} is {type(value).__name__}, expected a string")
    return value if value and value.strip() else None


def _decode(data: bytes, where: str) -> str:
    """Strict UTF-8 (a leading BOM is dropped); a DataError naming the place and the byte offset."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start} is invalid); "
            "convert the file to UTF-8"
        ) from None


def _check_text(text: str, where: str) -> None:
    """Reject binary data that happens to decode: more than BINARY_FRACTION of the characters (in the
    first BINARY_SAMPLE) are control characters other than whitespace, or any is NUL."""
    sample = text[:BINARY_SAMPLE]
    n_ctrl = len(_CONTROL.findall(sample))
    if "\x00" in sample or n_ctrl > BINARY_FRACTION * len(sample):
        raise DataError(
            f"{where}: looks like binary data, not text ({n_ctrl} control characters in the first "
            f"{len(sample)}); pass text files"
        )


def _read_txt(path: Path, text_field: str) -> Iterator[str]:
    text = _decode(path.read_bytes(), str(path)).replace("\r\n", "\n").replace("\r", "\n")  # as read_text()
    _check_text(text, str(path))
    if text.strip():
        yield text


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            line = _decode(raw, where)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg})") from None
            text = _record_text(record, text_field, where)
            if text is not None:
                yield text


def _json_records(obj: Any, path: Path) -> list[Any]:
    """The record list of a JSON document: a list, or the list under ``data`` (or the only list)."""
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict):
        if isinstance(obj.get("data"), list):
            return obj["data"]
        lists = [v for v in obj.values() if isinstance(v, list)]
        if len(lists) == 1:
            return lists[0]
        if all(not isinstance(v, (list, dict)) for v in obj.values()):
            return [obj]  # a single record
        raise DataError(f"{path}: JSON object has no 'data' list of records; its keys are {sorted(obj)}")
    raise DataError(f"{path}: expected a JSON list of records or {{'data': [...]}}")


def _read_json(path: Path, text_field: str) -> Iterator[str]:
    try:
        obj = json.loads(_decode(path.read_bytes(), str(path)))
    except json.JSONDecodeError as e:
        if e.msg != "Extra data":
            raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
        yield from _read_jsonl(path, text_field)  # JSON lines under a .json name
        return
    for i, record in enumerate(_json_records(obj, path)):
        text = _record_text(record, text_field, f"{path}: record {i}")
        if text is not None:
            yield text


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    columns = pf.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{path}: parquet file has no {text_field!r} column; its columns are {columns}")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str) and text.strip():
                yield text


READERS: dict[str, Callable[[Path, str], Iterator[str]]] = {
    ".txt": _read_txt,
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
}


def _read_hub(spec: tuple[str, str | None, str], text_field: str, source: str) -> Iterator[str]:
    name, config, split = spec
    try:
        import datasets

        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline, unknown name, bad config: all surface the same way
        raise DataError(
            f"data source {source!r} does not exist as a path (set the data root with WIDE_DATA or "
            f"--data-dir) and loading it as a Hugging Face dataset failed (is the hub unreachable / "
            f"offline?): {type(e).__name__}: {e}"
        ) from e
    if text_field not in ds.column_names:
        raise DataError(f"dataset {source!r} has no {text_field!r} column; its columns are {ds.column_names}")
    for text in ds[text_field]:
        if isinstance(text, str) and text.strip():
            yield text


def iter_texts(
    source: str | Path | Sequence[str | Path], *, text_field: str = "text", data_root: Path | None = None
) -> Iterator[str]:
    """Yield the non-empty documents of every source, in order."""
    root = data_root if data_root is not None else default_data_root()
    for src in split_sources(source):
        target = _expand(src, root)
        if isinstance(target, tuple):
            yield from _read_hub(target, text_field, src)
            continue
        for path in target:
            yield from READERS[path.suffix.lower()](path, text_field)


def load_texts(
    source: str | Path | list,
    *,
    text_field: str = "text",
    max_docs: int | None = None,
    data_root: str | Path | None = None,
) -> list[str]:
    """Load up to ``max_docs`` non-empty documents from one or more sources (see module doc)."""
    root = Path(data_root).expanduser() if data_root is not None else None
    texts: list[str] = []
    for text in iter_texts(source, text_field=text_field, data_root=root):
        if max_docs is not None and len(texts) >= max_docs:
            break
        texts.append(text)
    if not texts:
        raise DataError(f"no non-empty {text_field!r} documents found in data source {str(source)!r}")
    return texts


def source_fingerprint(
    source: str | Path | Sequence[str | Path],
    *,
    text_field: str = "text",
    max_docs: int | None = None,
    data_root: str | Path | None = None,
) -> str:
    """A cheap identity of a source: file paths, sizes and mtimes (hub: the dataset name)."""
    root = Path(data_root).expanduser() if data_root is not None else default_data_root()
    parts: list[str] = [f"field={text_field}", f"max_docs={max_docs}"]
    for src in split_sources(source):
        target = _expand(src, root)
        if isinstance(target, tuple):
            parts.append("hub:" + ":".join(str(x) for x in target))
            continue
        for path in target:
            st = path.stat()
            parts.append(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    return _hash("\n".join(parts))


# ----------------------------------------------------------------------------- dataset


@dataclass
class TokenDataset:
    """Fixed-length token rows. input_ids: [N, L] int64; attention_mask: [N, L] bool."""

    input_ids: torch.Tensor  # [N, L] int64
    attention_mask: torch.Tensor  # [N, L] bool
    meta: dict[str, Any] = field(default_factory=dict)
    _content_sha256: str | None = field(default=None, init=False, repr=False, compare=False)  # content_hash()

    def __post_init__(self) -> None:
        if self.input_ids.shape != self.attention_mask.shape or self.input_ids.dim() != 2:
            raise ValueError(
                f"input_ids {tuple(self.input_ids.shape)} and attention_mask "
                f"{tuple(self.attention_mask.shape)} must both be [N, L]"
            )
        self.input_ids = self.input_ids.long()
        self.attention_mask = self.attention_mask.bool()

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def n_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int(self.attention_mask.sum())

    @property
    def labels(self) -> torch.Tensor:
        """input_ids with -100 where attention_mask is 0. [N, L]"""
        return self.input_ids.masked_fill(~self.attention_mask, -100)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.batch([i]).items()}

    def batch(self, indices: Sequence[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows ``indices`` as {input_ids, attention_mask, labels}, each [B, L]."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        ids, mask = self.input_ids[idx], self.attention_mask[idx]
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(~mask, -100)}

    def content_hash(self) -> str:
        """SHA-256 of the rows' tokens and masks (their shapes included): equal exactly when the training
        text is, whatever path or cache it came from. Computed once per dataset."""
        if self._content_sha256 is None:
            h = hashlib.sha256(f"{tuple(self.input_ids.shape)}".encode())
            h.update(self.input_ids.contiguous().numpy().tobytes())
            h.update(self.attention_mask.contiguous().numpy().tobytes())
            self._content_sha256 = h.hexdigest()
        return self._content_sha256

    def subset(self, indices: Sequence[int] | torch.Tensor) -> TokenDataset:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return TokenDataset(self.input_ids[idx], self.attention_mask[idx], dict(self.meta))


def _hash(text: str | bytes) -> str:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _hash_texts(texts: Sequence[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in texts:
        h.update(t.encode("utf-8", errors="surrogatepass"))
        h.update(b"\x00\x1e")  # document separator, so ["ab"] != ["a", "b"]
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Identity of a tokenizer: class, name_or_path, vocab size, specials and its serialised state."""
    parts = [
        type(tokenizer).__name__,
        str(getattr(tokenizer, "name_or_path", "")),
        str(getattr(tokenizer, "vocab_size", "")),
        str(len(tokenizer)),
        f"eos={tokenizer.eos_token_id} pad={tokenizer.pad_token_id}",
    ]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # fast tokenizer: the full JSON state, a few MB at most
        parts.append(_hash(backend.to_str()))
    else:
        parts.append(_hash(json.dumps(sorted(tokenizer.get_vocab().items()))))
    return _hash("\n".join(parts))


def _special_ids(tokenizer: Any, add_eos: bool) -> tuple[int | None, int]:
    """(eos id or None, pad id): pad falls back to eos, then 0."""
    eos = tokenizer.eos_token_id
    if add_eos and eos is None:
        raise DataError("add_eos=True but the tokenizer has no eos_token; pass add_eos=False")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return eos, 0 if pad is None else pad


def _encode_batch(tokenizer: Any, texts: list[str], max_length: int | None = None) -> list[list[int]]:
    """Token ids of each text, without special tokens (truncated when max_length is given)."""
    kwargs: dict[str, Any] = {"truncation": True, "max_length": max_length} if max_length else {}
    out = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False, **kwargs)
    return out["input_ids"]


def _encode_all(tokenizer: Any, texts: Sequence[str], max_length: int | None, progress: bool) -> Iterator[list[int]]:
    """Token ids of every text, tokenised in batches under a progress bar."""
    with tqdm(total=len(texts), desc="tokenising", unit="doc", disable=not progress) as bar:
        for start in range(0, len(texts), ENCODE_BATCH):
            chunk = list(texts[start : start + ENCODE_BATCH])
            yield from _encode_batch(tokenizer, chunk, max_length)
            bar.update(len(chunk))


def _pack(encoded: Iterator[list[int]], seq_len: int, eos: int | None) -> tuple[torch.Tensor, dict]:
    """Concatenate docs (each followed by eos) and cut full seq_len rows. Returns [N, L] ids."""
    pieces: list[np.ndarray] = []
    n_docs = 0
    for ids in encoded:
        pieces.append(np.asarray(ids + ([eos] if eos is not None else []), dtype=np.int64))
        n_docs += 1
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)  # [T]
    n_rows = stream.size // seq_len
    if n_rows == 0:
        raise DataError(
            f"only {stream.size} tokens in {n_docs} documents, fewer than seq_len={seq_len}: "
            "use a smaller seq_len or more data"
        )
    ids = torch.from_numpy(stream[: n_rows * seq_len].reshape(n_rows, seq_len).copy())  # [N, L]
    stats = {"n_docs": n_docs, "total_tokens": int(stream.size), "dropped_tokens": int(stream.size % seq_len)}
    return ids, stats


def _pad(
    encoded: Iterator[list[int]], seq_len: int, eos: int | None, pad: int
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One row per doc: truncated to seq_len, eos appended if it fits, right-padded. [N, L] x2."""
    rows: list[list[int]] = []
    for ids in encoded:
        if eos is not None and len(ids) < seq_len:
            ids = ids + [eos]
        if ids:
            rows.append(ids[:seq_len])
    if not rows:
        raise DataError("every document tokenised to nothing: no rows to build")
    input_ids = torch.full((len(rows), seq_len), pad, dtype=torch.long)  # [N, L]
    lengths = torch.tensor([len(r) for r in rows])  # [N]
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    mask = torch.arange(seq_len)[None, :] < lengths[:, None]  # [N, L]
    return input_ids, mask, {"n_docs": len(rows), "total_tokens": int(lengths.sum())}


def tokenize_texts(
    texts: Sequence[str],
    tokenizer: Any,
    *,
    seq_len: int,
    mode: Mode = "packed",
    add_eos: bool = True,
    progress: bool | None = None,
) -> TokenDataset:
    """Tokenise texts into a TokenDataset (no caching): see ``build_dataset``."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if mode not in ("packed", "padded"):
        raise ValueError(f"mode must be 'packed' or 'padded', got {mode!r}")
    show = sys.stderr.isatty() if progress is None else progress
    eos, pad = _special_ids(tokenizer, add_eos)
    eos = eos if add_eos else None
    if mode == "packed":
        ids, stats = _pack(_encode_all(tokenizer, texts, None, show), seq_len, eos)
        mask = torch.ones_like(ids, dtype=torch.bool)  # [N, L]
    else:
        ids, mask, stats = _pad(_encode_all(tokenizer, texts, seq_len, show), seq_len, eos, pad)
    meta = {"mode": mode, "seq_len": seq_len, "add_eos": add_eos, **stats}
    return TokenDataset(ids, mask, meta)


def cache_key(
    tokenizer: Any,
    *,
    source_id: str,
    seq_len: int,
    mode: str,
    add_eos: bool,
    text_field: str = "text",
    max_docs: int | None = None,
) -> str:
    """Hash of everything the tokenised rows depend on."""
    fields = [
        f"format={CACHE_FORMAT}",
        f"tokenizer={tokenizer_fingerprint(tokenizer)}",
        f"source={source_id}",
        f"seq_len={seq_len}",
        f"mode={mode}",
        f"add_eos={add_eos}",
        f"text_field={text_field}",
        f"max_docs={max_docs}",
    ]
    return _hash("\n".join(fields))


def _save_atomic(ds: TokenDataset, path: Path) -> None:
    """Write to a temp file in the same directory, then os.replace it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "input_ids": ds.input_ids.to(torch.int32),  # [N, L]; vocab ids fit in int32
        "attention_mask": ds.attention_mask,  # [N, L] bool
        "meta": ds.meta,
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_cached(path: Path) -> TokenDataset | None:
    """The cached dataset at path, or None if missing or unreadable."""
    if not path.is_file():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        return TokenDataset(payload["input_ids"], payload["attention_mask"], dict(payload["meta"]))
    except Exception as e:  # a truncated or foreign file: rebuild it
        log.warning("ignoring unreadable token cache %s (%s)", path, e)
        return None


def build_dataset(
    texts: Texts,
    tokenizer: Any,
    *,
    seq_len: int,
    mode: Mode = "packed",
    cache_dir: str | Path | None = None,
    source_id: str = "",
    add_eos: bool = True,
    text_field: str = "text",
    max_docs: int | None = None,
    use_cache: bool = True,
    progress: bool | None = None,
) -> TokenDataset:
    """Tokenise texts into fixed-length rows, reusing an on-disk cache when the key matches.

    packed: docs tokenised without special tokens, each followed by EOS, concatenated and cut into
        full seq_len rows (remainder dropped); attention_mask all ones.
    padded: one row per doc, truncated to seq_len, EOS appended if it fits, right-padded with
        pad_token_id (else eos); attention_mask 0 and labels -100 on padding.
    texts: the documents, or a zero-argument callable returning them (called only on a cache miss;
        then ``source_id`` must identify them, e.g. ``source_fingerprint(source)``).
    The key covers the tokenizer, source_id, a hash of the texts (when given as a sequence),
    seq_len, mode, add_eos, text_field and max_docs. cache_dir defaults to ``default_cache_dir()``.
    """
    if callable(texts) and not source_id:
        raise ValueError("texts given as a callable need a source_id to key the cache")
    text_id = source_id if callable(texts) else f"{source_id}|texts={_hash_texts(texts)}"
    key = cache_key(
        tokenizer,
        source_id=text_id,
        seq_len=seq_len,
        mode=mode,
        add_eos=add_eos,
        text_field=text_field,
        max_docs=max_docs,
    )
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = path / f"{key}.pt"
    if use_cache and (cached := _load_cached(path)) is not None:
        log.info("token cache hit: %s (%d rows)", path, len(cached))
        return cached
    docs = texts() if callable(texts) else texts
    ds = tokenize_texts(docs, tokenizer, seq_len=seq_len, mode=mode, add_eos=add_eos, progress=progress)
    ds.meta.update({"cache_key": key, "source_id": source_id})
    if use_cache:
        _save_atomic(ds, path)
        log.info("token cache written: %s (%d rows)", path, len(ds))
    return ds


def load_calibration_data(
    source: str | Path | list,
    tokenizer: Any,
    *,
    seq_len: int,
    mode: Mode = "packed",
    text_field: str = "text",
    max_docs: int | None = None,
    data_root: str | Path | None = None,
    cache_dir: str | Path | None = None,
    add_eos: bool = True,
    use_cache: bool = True,
    progress: bool | None = None,
) -> TokenDataset:
    """``--data`` end to end: on a cache hit (same files, sizes, mtimes, ...) nothing is read or tokenised."""
    fp = source_fingerprint(source, text_field=text_field, max_docs=max_docs, data_root=data_root)
    return build_dataset(
        lambda: load_texts(source, text_field=text_field, max_docs=max_docs, data_root=data_root),
        tokenizer,
        seq_len=seq_len,
        mode=mode,
        cache_dir=cache_dir,
        source_id=fp,
        add_eos=add_eos,
        text_field=text_field,
        max_docs=max_docs,
        use_cache=use_cache,
        progress=progress,
    )


def train_eval_split(
    ds: TokenDataset, eval_fraction: float | int = 0.01, seed: int = 0
) -> tuple[TokenDataset, TokenDataset]:
    """Seeded split into (train, eval); a float is a fraction (at least 1 row), an int a row count."""
    n = len(ds)
    n_eval = eval_fraction if isinstance(eval_fraction, int) else max(1, round(n * eval_fraction))
    if not 0 < n_eval < n:
        raise DataError(f"cannot hold out {n_eval} of {n} rows for eval: need 0 < eval rows < {n}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return ds.subset(perm[n_eval:].sort().values), ds.subset(perm[:n_eval].sort().values)


# ----------------------------------------------------------------------------- batch order


class DataOrder:
    """Deterministic, resumable batch order: a permutation seeded with seed + epoch per epoch.

    Each epoch yields ``n_examples // batch_size`` full batches (the remainder is left out of
    that epoch; a fresh permutation next epoch gives it a chance). Iterating never ends.
    """

    def __init__(self, n_examples: int, batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if n_examples < batch_size:
            raise DataError(
                f"only {n_examples} training sequences for batch_size={batch_size}: use a smaller "
                "seq_len, a smaller batch size or more calibration data"
            )
        self.n_examples, self.batch_size, self.seed = n_examples, batch_size, seed
        self.epoch, self.position = 0, 0  # position: batches already taken in this epoch
        self._perm: tuple[int, torch.Tensor] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.n_examples // self.batch_size

    def __len__(self) -> int:
        return self.batches_per_epoch

    def _permutation(self) -> torch.Tensor:
        """This epoch's order. [n_examples]"""
        if self._perm is None or self._perm[0] != self.epoch:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = (self.epoch, torch.randperm(self.n_examples, generator=gen))
        return self._perm[1]

    def next_batch(self) -> list[int]:
        """The next batch of indices; advances (epoch, position)."""
        start = self.position * self.batch_size
        batch = self._permutation()[start : start + self.batch_size].tolist()
        self.position += 1
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "n_examples": self.n_examples,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at (epoch, position); the data size, batch size and seed must match."""
        for k in ("n_examples", "batch_size", "seed"):
            if k in state and state[k] != getattr(self, k):
                raise ValueError(f"DataOrder state has {k}={state[k]}, this order has {getattr(self, k)}")
        if not 0 <= state["position"] < self.batches_per_epoch:
            raise ValueError(f"position {state['position']} outside [0, {self.batches_per_epoch})")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
