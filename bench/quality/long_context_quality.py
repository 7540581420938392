"""Long-context quality on the CPU: SmolLM2-135M (context 8,192) WikiText-2 perplexity on windows of 2k,
4k and 8k tokens, dense vs the shipped routers, through the masked path (WideModel hooks on the Hugging
Face model) and the served path (WideRuntime.score on the CPU references), with the real attention / FFN
skip rates per window length.

    nice python -m bench.quality.long_context_quality --out bench/results/quality --tokens 8192

Text: the first ``--tokens`` tokens of WikiText-2's test split (pages detokenised as lm-eval's wikitext
task does, joined into one stream), cut into disjoint windows of exactly L tokens; every window starts
with the tokenizer's prefix token (BOS, else EOS) and all its L tokens are scored. Token perplexity per
window length and per position bucket ([0, 2k), [2k, 4k), [4k, 8k) of the window): the routers were
calibrated on 2,048-token sequences, so the later buckets show whether they keep their quality where
they were never trained. Records: OUT/long-context-cpu.json (written after every row) and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from wide.bench.timing import tree_commit

ROUTERS = ("smollm2-135m-s25", "smollm2-135m-s50")
BUCKETS = ((0, 2048), (2048, 4096), (4096, 8192))  # positions inside a window


@dataclass
class QualityRow:
    row: str  # "dense" or the router checkpoint's name
    path: str  # "hf" (dense), "masked" or "served"
    window: int  # tokens per window
    windows: int
    tokens: int  # scored tokens
    token_perplexity: float
    bucket_perplexity: dict  # "lo-hi" -> token perplexity over those window positions
    attn_sparsity: float | None  # real skip rates over the scored windows (None: dense)
    ffn_sparsity: float | None
    seconds: float


def token_stream(tokenizer, n_tokens: int, data_dir: str | None, offset: int = 0) -> tuple[list[int], str]:
    """n_tokens of WikiText-2 test from token ``offset`` on (lm-eval's detokeniser per page, pages joined)."""
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    from wide.eval.perplexity import encode_like_hflm
    from wide.eval.tasks import wikitext_test_pages

    pages, source = wikitext_test_pages(data_dir)
    toks: list[int] = []
    for page in pages:
        toks += encode_like_hflm(tokenizer, wikitext_detokenizer({"page": page}))
        if len(toks) >= offset + n_tokens:
            return toks[offset : offset + n_tokens], source
    raise ValueError(f"WikiText-2 test holds {len(toks)} tokens, fewer than --offset + --tokens {offset + n_tokens}")


@torch.no_grad()
def window_nll(model, stream: list[int], window: int, prefix: int) -> torch.Tensor:
    """Per-token negative log-likelihood [n_windows, window] of disjoint windows of the stream; the input
    of window w is [prefix] + its first window - 1 tokens, its targets all its window tokens."""
    n = len(stream) // window
    out = torch.empty(n, window, dtype=torch.float64)
    for w in range(n):
        tgt = torch.tensor(stream[w * window : (w + 1) * window])  # [L]
        ids = torch.cat([torch.tensor([prefix]), tgt[:-1]])[None]  # [1, L]
        logits = model(ids).logits[0]  # [L, V]
        for lo in range(0, window, 1024):  # log-softmax in chunks: [1024, V] fp32 at a time
            lp = F.log_softmax(logits[lo : lo + 1024].float(), dim=-1)
            out[w, lo : lo + 1024] = -lp.gather(-1, tgt[lo : lo + 1024, None])[:, 0].double()
        del logits
    return out


def measure(model, wm, row: str, path: str, stream: list[int], window: int, prefix: int) -> QualityRow:
    t0 = time.time()
    if wm is not None:
        wm.start_meter()
    nll = window_nll(model, stream, window, prefix)
    sp = wm.stop_meter() if wm is not None else None
    buckets = {f"{lo}-{hi}": math.exp(float(nll[:, lo:hi].mean())) for lo, hi in BUCKETS if hi <= window}
    return QualityRow(
        row=row,
        path=path,
        window=window,
        windows=nll.shape[0],
        tokens=nll.numel(),
        token_perplexity=math.exp(float(nll.mean())),
        bucket_perplexity=buckets,
        attn_sparsity=None if sp is None else sp["attn_sparsity"],
        ffn_sparsity=None if sp is None else sp["ffn_sparsity"],
        seconds=time.time() - t0,
    )


def to_markdown(record: dict) -> str:
    """The record's table; "× dense": the row's perplexity over the dense model's on the same tokens and window
    (the ratio is what a router costs; the buckets hold different text, so their absolute values differ)."""
    lines = [
        "# Long-context quality (CPU): SmolLM2-135M on WikiText-2 windows",
        "",
        f"Command: `{record['command']}` (commit {record['commit']})",
        "",
        f"Text: {record['source']} (pages detokenised as lm-eval's wikitext task does, joined), cut into disjoint "
        "windows of exactly L tokens, each scored in full (token perplexity; the prefix token opens every "
        "window): every window length scores the same tokens, with less context the shorter it is. Buckets: "
        "perplexity over those positions of the window. Skip: the real attention / FFN skip rates on these "
        "windows. The routers were calibrated on 2,048-token sequences.",
        "",
        "| row | path | window | token ppl | × dense | ppl [0,2k) | × dense | ppl [2k,4k) | × dense | ppl [4k,8k) "
        "| × dense | attn skip | FFN skip |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x, fmt):
        return "–" if x is None else format(x, fmt)

    dense = {r["window"]: r for r in record["rows"] if r["row"] == "dense"}
    for r in record["rows"]:
        d = dense.get(r["window"])
        cells = [f"{r['token_perplexity']:.3f}", f(d and r["token_perplexity"] / d["token_perplexity"], ".3f")]
        for key in ("0-2048", "2048-4096", "4096-8192"):
            v = r["bucket_perplexity"].get(key)
            ref = d["bucket_perplexity"].get(key) if d else None
            cells += [f(v, ".3f"), f(v / ref if v is not None and ref else None, ".3f")]
        lines.append(
            f"| {r['row']} | {r['path']} | {r['window']} | "
            + " | ".join(cells)
            + f" | {f(r['attn_sparsity'], '.1%')} | {f(r['ffn_sparsity'], '.1%')} |"
        )
    return "\n".join(lines) + "\n"


def pool(records: list[dict]) -> list[dict]:
    """Slices of the test set scored alike (records of this script) -> one row per (row, path, window) over all of
    them: token perplexity exp(sum of NLL / tokens), skip rates weighted by tokens, × dense on the same pooled
    tokens. Only (row, path, window) present in every record."""
    keys = set.intersection(*({(r["row"], r["path"], r["window"]) for r in rec["rows"]} for rec in records))
    out = []
    for key in sorted(keys, key=lambda k: (k[2], k[0] != "dense", k[0], k[1])):
        rs = [r for rec in records for r in rec["rows"] if (r["row"], r["path"], r["window"]) == key]
        n = sum(r["tokens"] for r in rs)
        nll = sum(math.log(r["token_perplexity"]) * r["tokens"] for r in rs)

        def wmean(field: str, rs=rs, n=n) -> float | None:
            v = [r[field] for r in rs]
            return None if any(x is None for x in v) else sum(x * r["tokens"] for x, r in zip(v, rs, strict=True)) / n

        out.append({"row": key[0], "path": key[1], "window": key[2], "tokens": n, "slices": len(rs),
                    "token_perplexity": math.exp(nll / n), "attn_sparsity": wmean("attn_sparsity"),
                    "ffn_sparsity": wmean("ffn_sparsity")})  # fmt: skip
    dense = {r["window"]: r["token_perplexity"] for r in out if r["row"] == "dense"}
    for r in out:
        r["x_dense"] = r["token_perplexity"] / dense[r["window"]] if r["window"] in dense else None
    return out


def pooled_markdown(rows: list[dict], sources: list[str], command: str) -> str:
    f = lambda x, fmt: "–" if x is None else format(x, fmt)  # noqa: E731
    lines = [
        "# Long-context quality (CPU), pooled over slices: SmolLM2-135M on WikiText-2 windows",
        "",
        f"Command: `{command}`",
        "",
        "Slices (each its own record): " + "; ".join(sources) + ". Token perplexity over every slice's tokens "
        "(exp of the summed NLL over the summed tokens); × dense on the same tokens and window; skip rates "
        "weighted by tokens.",
        "",
        "| row | path | window | tokens | token ppl | × dense | attn skip | FFN skip |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['path']} | {r['window']} | {r['tokens']:,} | {r['token_perplexity']:.3f} | "
            f"{f(r['x_dense'], '.3f')} | {f(r['attn_sparsity'], '.1%')} | {f(r['ffn_sparsity'], '.1%')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/quality")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--routers", nargs="*", default=list(ROUTERS), help="shipped checkpoint names or dirs")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--offset", type=int, default=0, help="skip this many tokens of the stream first (another slice)")
    ap.add_argument("--windows", type=int, nargs="+", default=[8192, 2048, 4096])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--served-windows", type=int, nargs="*", default=[8192], help="windows also scored served")
    ap.add_argument("--render", type=Path, help="only rewrite the .md of this record (.json)")
    ap.add_argument("--pool", type=Path, nargs="+", help="only pool these records (slices) into OUT/long-context-"
                    "cpu-pooled.{json,md}")  # fmt: skip
    a = ap.parse_args(argv)
    if a.render is not None:
        a.render.with_suffix(".md").write_text(to_markdown(json.loads(a.render.read_text())))
        return
    if a.pool:
        recs = [json.loads(p.read_text()) for p in a.pool]
        cmd = "python -m bench.quality.long_context_quality " + shlex.join(argv or sys.argv[1:])
        rows = pool(recs)
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        srcs = [f"`{p.name}` ({r['source']}, commit {r['commit']})" for p, r in zip(a.pool, recs, strict=True)]
        (out / "long-context-cpu-pooled.json").write_text(json.dumps({"command": cmd, "sources": [str(p) for p in
                                                                     a.pool], "rows": rows}, indent=1))  # fmt: skip
        (out / "long-context-cpu-pooled.md").write_text(pooled_markdown(rows, srcs, cmd))
        return
    torch.manual_seed(0)
    from wide.baselines import load as load_method
    from wide.eval.lm_eval_model import RuntimeScorer
    from wide.eval.perplexity import prefix_token_id
    from wide.model import load_model
    from wide.runtime import WideRuntime

    def router_dir(name: str) -> str:
        p = Path(name)
        return str(p if p.is_dir() else Path(__file__).resolve().parents[2] / "src/wide/checkpoints" / name)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(a.model, dtype=torch.float32, device="cpu")
    stream, source = token_stream(tok, a.tokens, a.data_dir, a.offset)
    prefix = prefix_token_id(tok)
    record = {
        "model": a.model,
        "tokens": a.tokens,
        "source": f"WikiText-2 test, {source}, "
        + (f"first {a.tokens} tokens" if not a.offset else f"tokens {a.offset}-{a.offset + a.tokens - 1}"),
        "offset": a.offset,
        "dtype": "float32",
        "device": "cpu",
        "command": "nice python -m bench.quality.long_context_quality " + shlex.join(argv or sys.argv[1:]),
        "commit": tree_commit(),
        "env": {"torch": torch.__version__, "python": platform.python_version()},
        "rows": [],
    }

    stem = "long-context-cpu" + (f"-offset{a.offset}" if a.offset else "")

    def emit(r: QualityRow) -> None:
        record["rows"].append(asdict(r))
        print(json.dumps(asdict(r)), flush=True)
        (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
        (out / f"{stem}.md").write_text(to_markdown(record))

    routed = []  # (label, its own model copy with the routers attached, WideModel)
    for name in a.routers:
        m, _ = load_model(a.model, dtype=torch.float32, device="cpu")
        wm = load_method(m, router_dir(name))
        wm.eval()
        routed.append((Path(name).name, m, wm))
    for w in a.windows:  # window-major: a run cut short keeps complete windows
        emit(measure(model, None, "dense", "hf", stream, w, prefix))
        for label, m, wm in routed:
            emit(measure(m, wm, label, "masked", stream, w, prefix))
    for label, _, wm in routed:
        if a.served_windows:
            rt = WideRuntime(wm, max_batch=1, max_seq=max(a.served_windows), fused_decode=False)
            for w in a.served_windows:
                emit(measure(RuntimeScorer(rt), wm, label, "served", stream, w, prefix))


if __name__ == "__main__":
    main()
