"""Rebuild the WikiText-2 test slice packaged with `wide` (src/wide/data/wikitext/wiki.test.demo.raw.gz).

The slice is the raw text of the first pages of wiki.test.raw (lm-eval's page split, `wide.eval.tasks.
wikitext_pages`) up to and including the page that ends `wide demo`'s token budget for SmolLM2-135M's
tokenizer, so the demo scores exactly the tokens it scores on the full file.

    python scripts/make_wikitext_slice.py ../shared/data/wikitext/wiki.test.raw [--max-tokens 8192]
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

from wide.eval.perplexity import encode_like_hflm
from wide.eval.tasks import wikitext_pages
from wide.model import SMOLLM2, load_model
from wide.paths import PACKAGE_DIR, WIKITEXT_SLICE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", type=Path, help="wiki.test.raw of wikitext-2-raw-v1")
    ap.add_argument("--max-tokens", type=int, default=8192, help="the demo's token budget")
    a = ap.parse_args()
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    text = a.raw.read_text(encoding="utf-8")
    pages = wikitext_pages(text)
    _, tok = load_model(SMOLLM2, device="cpu")
    n, keep = 0, len(pages)
    for i, page in enumerate(pages):
        n += len(encode_like_hflm(tok, wikitext_detokenizer({"page": page})))
        if n > a.max_tokens:
            keep = i + 1  # this page ends the budget: shipping it lets the scorer see where to stop
            break
    # The raw prefix whose page split is exactly pages[:keep]: the lines before page `keep`'s header.
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if _is_header(line)]
    assert "\n".join(lines[: starts[0]]).strip() == "", "expected no text before the first page header"
    end = starts[keep] if keep < len(starts) else len(lines)
    prefix = "\n".join(lines[:end])
    assert wikitext_pages(prefix) == pages[:keep]
    out = PACKAGE_DIR / WIKITEXT_SLICE
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(out, "wb", mtime=0) as f:  # mtime 0: the same bytes on every rebuild
        f.write(prefix.encode("utf-8"))
    print(f"{keep} pages, {len(prefix.encode('utf-8'))} bytes raw -> {out} ({out.stat().st_size} bytes)")


def _is_header(line: str) -> bool:
    rline = line.replace("= = =", "===").replace("= =", "==").strip()
    return rline.startswith("= ") and rline.endswith(" =")


if __name__ == "__main__":
    main()
