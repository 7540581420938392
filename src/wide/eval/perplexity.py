"""WikiText-2 perplexity computed exactly as lm-evaluation-harness's `wikitext` task does.

Per document (62 pages of wiki.test.raw, see `tasks.wikitext_pages`): lm-eval's
`wikitext_detokenizer`, tokenised like HFLM.tok_encode, split into rolling windows by lm-eval's
`get_rolling_token_windows` (context_len=1, the first window prefixed with HFLM's prefix token: BOS
when the tokenizer has one, else EOS) + `make_disjoint_window`; each window's loglikelihood is
summed. word_perplexity = exp(-sum ll / sum words), words counted as `re.split(r"\\s+", page)` of the
raw page; byte_perplexity and bits_per_byte over the raw page's UTF-8 bytes; token perplexity over
the scored tokens. Log-softmax runs in fp32 (lm-eval's HFLM uses the model dtype unless
`softmax_dtype` is set: identical in fp32, slightly different in bf16).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from wide.eval.tasks import wikitext_test_pages


def prefix_token_id(tokenizer) -> int:
    """HFLM.prefix_token_id (lm-eval 0.4.13): BOS when defined, else EOS."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def encode_like_hflm(tokenizer, text: str) -> list[int]:
    """HFLM.tok_encode with default arguments."""
    kwargs = {}
    bos = tokenizer.decode(prefix_token_id(tokenizer))
    if bos and text.startswith(bos):
        kwargs["add_special_tokens"] = False
    return tokenizer.encode(text, **kwargs)


def rolling_windows(tokens: list[int], prefix: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs exactly as HFLM.loglikelihood_rolling builds them."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    return [
        make_disjoint_window(w)
        for w in get_rolling_token_windows(
            token_list=tokens, prefix_token=prefix, max_seq_len=max_length, context_len=1
        )
    ]


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def window_loglikelihoods(
    model,
    windows: list[tuple[list[int], list[int]]],
    *,
    max_length: int,
    batch_size: int = 8,
    device: torch.device | str | None = None,
    meter=None,
    desc: str = "perplexity",
) -> list[float]:
    """Sum of log p(continuation | context) per window, batched (right padding, sorted by length).
    `meter` (a wide SparsityMeter) gets the [B, T] real-token mask before each forward."""
    device = torch.device(device) if device is not None else _model_device(model)
    inputs = []
    for ctx, cont in windows:
        inp = (ctx + cont)[-(max_length + 1) :][:-1]  # as HFLM._loglikelihood_tokens
        inputs.append((inp, cont))
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
    out = [0.0] * len(inputs)
    for s in tqdm(range(0, len(order), batch_size), desc=desc, leave=False):
        idx = order[s : s + batch_size]
        lens = [len(inputs[i][0]) for i in idx]
        t = max(lens)
        ids = torch.zeros(len(idx), t, dtype=torch.long)  # [B, T] right-padded
        for r, i in enumerate(idx):
            ids[r, : lens[r]] = torch.tensor(inputs[i][0])
        mask = torch.arange(t)[None, :] < torch.tensor(lens)[:, None]  # [B, T] real tokens
        if meter is not None:
            meter.set_token_mask(mask.to(device))
        logits = model(ids.to(device)).logits  # [B, T, V]
        for r, i in enumerate(idx):
            cont = inputs[i][1]
            n = len(cont)
            lp = F.log_softmax(logits[r, lens[r] - n : lens[r]].float(), dim=-1)  # [n, V]
            tgt = torch.tensor(cont, device=lp.device)
            out[i] = float(lp.gather(-1, tgt[:, None]).sum())
    if meter is not None:
        meter.set_token_mask(None)
    return out


def wikitext_perplexity(
    model,
    tokenizer,
    *,
    data_dir: str | Path | None = None,
    max_length: int = 2048,
    batch_size: int = 8,
    limit_docs: int | None = None,
    max_tokens: int | None = None,
    device: torch.device | str | None = None,
    meter=None,
    desc: str = "wikitext",
    fallback_slice: bool = False,
) -> dict:
    """WikiText-2 test perplexity as lm-eval's `wikitext` task computes it.

    limit_docs: only the first N of the 62 documents (CPU slices). max_tokens: stop adding documents
    once this many tokens are scored (at least one document; a lone longer document is cut, and then
    only token perplexity is reported). Returns word_perplexity, byte_perplexity, bits_per_byte,
    token_perplexity, the counts they come from, and `source` (data root, packaged slice or hub; see
    `tasks.wikitext_test_pages`). desc: the progress bar's label (what is being scored). fallback_slice: with
    neither a data root nor the hub, score the packaged slice (its `source` says so)."""
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    prefix = prefix_token_id(tokenizer)

    def windows_of(pages: list[str]) -> tuple[list, list, int, int, int, bool, bool]:
        """(windows, owner, words, bytes, tokens, truncated, complete): complete is False when the
        pages ran out before `limit_docs` / `max_tokens` said where to stop."""
        windows, owner, words, nbytes, ntok, truncated = [], [], 0, 0, 0, False
        for d, page in enumerate(pages[:limit_docs] if limit_docs is not None else pages):
            toks = encode_like_hflm(tokenizer, wikitext_detokenizer({"page": page}))
            if max_tokens is not None and ntok + len(toks) > max_tokens:
                if d > 0:
                    return windows, owner, words, nbytes, ntok, truncated, True
                toks, truncated = toks[:max_tokens], True
            ntok += len(toks)
            words += len(re.split(r"\s+", page))
            nbytes += len(page.encode("utf-8"))
            for w in rolling_windows(toks, prefix, max_length):
                windows.append(w)
                owner.append(d)
        return windows, owner, words, nbytes, ntok, truncated, limit_docs is not None and limit_docs <= len(pages)

    # A slice of the test set may come from the pages packaged with `wide` when no data root holds the
    # full file; if the slice ends before the requested budget does, the full set is read instead.
    limited = max_tokens is not None or limit_docs is not None
    pages, source = wikitext_test_pages(data_dir, allow_slice=limited, fallback_slice=fallback_slice)
    windows, owner, words, nbytes, ntok, truncated, complete = windows_of(pages)
    if source == "packaged slice" and not complete and limited:
        pages, source = wikitext_test_pages(data_dir, fallback_slice=fallback_slice)
        windows, owner, words, nbytes, ntok, truncated, _ = windows_of(pages)
    n_docs = max(owner) + 1 if owner else 0
    lls = window_loglikelihoods(
        model,
        windows,
        max_length=max_length,
        batch_size=batch_size,
        device=device,
        meter=meter,
        desc=desc,
    )
    ll = sum(lls)
    res = {
        "docs": n_docs,
        "tokens": ntok,
        "windows": len(windows),
        "loglikelihood": ll,
        "token_perplexity": math.exp(-ll / ntok) if ntok else float("nan"),
        "max_length": max_length,
        "truncated": truncated,
        "source": source,
    }
    if truncated:
        res.update(words=None, bytes=None, word_perplexity=None, byte_perplexity=None, bits_per_byte=None)
    else:
        res.update(
            words=words,
            bytes=nbytes,
            word_perplexity=math.exp(-ll / words),
            byte_perplexity=math.exp(-ll / nbytes),
            bits_per_byte=-ll / nbytes / math.log(2),
        )
    return res
