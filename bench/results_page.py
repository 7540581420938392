"""docs/results.md, rendered from the committed records: one table per source, each headed by its card, the
commit its record measured and the command that wrote it, with a link to the record.

The page is generated; edit ``SOURCES`` (what is shown, and the one-line narrative of each table) or the records,
never the page. tests/bench/test_results_page.py renders it and diffs it against the committed file.
The lab notes behind every figure (superseded runs, the reasoning): docs/history.md.

The README's results table (between its ``results`` markers) is rendered here too, from the same records.

Usage: python -m bench.results_page [--out docs/results.md]   (--check: exit 1 when a page is stale)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.decode import summarize_long_context as SL
from bench.kernels import summarize_kernels as SK

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "results.md"


@dataclass(frozen=True)
class Source:
    """One table of the page: ``record`` (a path under bench/results/) rendered by ``render``."""

    area: str  # bench/<area>/ wrote it
    title: str
    record: str
    commit: str  # the tree the record measured, as the record's page or docs/history.md states it
    note: str  # what the table shows, in one or two sentences (no figures: the table has them)
    render: Callable[[Path], tuple[str, str, list[str]]]  # record path -> (card, command, table lines)


def _level(s: float | str) -> str:
    """A sparsity level: a fraction as a percentage, or the record's own label (per-kind rates)."""
    return f"{s:.0%}" if isinstance(s, (int, float)) else str(s)


def _decode(path: Path) -> tuple[str, str, list[str]]:
    """A ``bench.decode.bench_decode`` record: TPOT per (variant, fused, B, sparsity)."""
    rec = json.loads(path.read_text())
    lines = [
        "| variant | fused | B | sparsity | TPOT ms | vs dense | vs dense fused |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rec["records"]:
        if r["kind"] != "tpot" or r.get("tpot_ms") is None or r.get("fused") is None:
            continue  # Hugging Face's row and the correctness checks: in the record's own page
        ffn_src = " (FFN router on the layer input)" if r.get("ffn_router_source") == "layer" else ""
        lines.append(
            f"| {r['variant']}{ffn_src} | {'yes' if r['fused'] else 'no'} | {r['B']} | {_level(r['sparsity'])} | "
            f"{r['tpot_ms']:.3f} | {r['tpot_speedup']:.2f}× | {r['tpot_speedup_vs_dense_fused']:.2f}× |"
        )
    return rec["meta"]["device"], rec["meta"]["command"], lines


def _kernels(path: Path) -> tuple[str, str, list[str]]:
    """The kernel benchmark (``wide bench kernels``): the routed GEMMs' speed-up over cuBLAS."""
    rows = json.loads(path.read_text())
    meta = json.loads(path.with_name(path.name.replace(".json", ".meta.json")).read_text())
    table = [ln for ln in SK.gemm_tables(SK._auto(rows)) if ln.startswith("|") or ln.startswith("GEMMs")]
    return meta["gpu"], meta["command"], [ln if ln.startswith("|") else f"\n{ln}\n" for ln in table]


def _e2e(path: Path) -> tuple[str, str, list[str]]:
    """``wide bench e2e``: TTFT and TPOT of the runtime, dense and WIDE."""
    meta = json.loads(path.with_name(path.name.replace(".json", ".meta.json")).read_text())
    table = [ln for ln in SK.e2e_table(path.name) if ln.startswith("|")]
    cmd = "VARIANTS_S=0 BENCH_S=0 TEST_S=0 E2E_S=480 PROFILE_S=0 E2E_ARGS=--compile bash scripts/device/kernels.sh $OUT"
    return meta["device"], cmd, table


def _zero_shot(path: Path) -> tuple[str, str, list[str]]:
    """An ``wide eval`` record with its rows' table: WikiText-2 word perplexity and zero-shot accuracy."""
    rec = json.loads(path.read_text())
    table = [ln for ln in rec["markdown"].splitlines() if ln.startswith("|")]
    card = rec["env"].get("gpu", rec["settings"].get("device", "?"))
    return card, "ROUTERS=DIR bash scripts/device/eval_routed.sh $OUT", table


def _long_context(path: Path) -> tuple[str, str, list[str]]:
    """A ``bench.decode.long_context`` record: the decode grid under the library's split rule, then TTFT."""

    rows = json.loads(path.read_text())
    default = [r for r in rows if r.get("kind") != "tpot" or SL.is_default(r)]
    cmds = " ; ".join(dict.fromkeys(r["command"] for r in rows if r.get("command")))
    lines = SL.tpot_table(default) + ["", "TTFT, B 1:", ""] + SL.ttft_table(rows)
    return rows[0]["gpu"], cmds, lines


def _long_context_quality_pooled(path: Path) -> tuple[str, str, list[str]]:
    """``bench.quality.long_context_quality --pool``: the slices' rows pooled (token-weighted)."""
    rec = json.loads(path.read_text())
    table = [ln for ln in (path.with_suffix(".md")).read_text().splitlines() if ln.startswith("|")]
    return "CPU, float32", rec["command"], table


def _serve(path: Path) -> tuple[str, str, list[str]]:
    """A ``wide bench serve`` record: the engine rows, then the bare step and Hugging Face rows it holds."""
    rec = json.loads(path.read_text())
    f = lambda v, fmt: "–" if v is None else format(v, fmt)  # noqa: E731
    lines = [
        "| workload | concurrency | variant | output tok/s | × dense | byte limit | TTFT p50 ms | TPOT p50 ms "
        "| attn / FFN skipped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rec["records"] if r["kind"] == "engine"):
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {r['variant']} | {r['output_tokens_per_s']:.1f} "
            f"| {f(r.get('speedup_vs_dense'), '.3f')} | {f(r.get('byte_limit'), '.3f')} | {r['ttft_p50_ms']:.0f} "
            f"| {f(r['tpot_p50_ms'], '.2f')} | {f(r['attn_sparsity'], '.1%')} / {f(r['ffn_sparsity'], '.1%')} |"
        )
    for r in (r for r in rec["records"] if r["kind"] == "bare_step"):
        lines.append(f"\nBare B 1 step, {r['variant']}, context {r['ctx']}: {r['tpot_ms']:.3f} ms; the engine's "
                     f"concurrency-1 TPOT p50 is {r['engine_tpot_p50_over_bare']:.3f}× of it.")  # fmt: skip
    for r in (r for r in rec["records"] if r["kind"] == "hf"):
        lines.append(f"\nHugging Face `generate`, compiled static cache, concurrency 1: {r['output_tokens_per_s']:.1f} "
                     f"output tok/s; the engine's dense row is {r['engine_dense_over_hf']:.3f}× of it.")  # fmt: skip
    for r in (r for r in rec["records"] if r["kind"] == "batch_dependence"):
        mode = "batch-invariant mode" if r["batch_invariant"] else "default mode"
        alone, together = r["alone_output_tokens_per_s"], r["together_output_tokens_per_s"]
        lines.append(f"\nGreedy batch dependence, {r['variant']}, {mode}: {r['changed']} of {r['requests']} requests' "
                     f"tokens change run together instead of alone; output tok/s alone {alone:.1f}, together "
                     f"{together:.1f}.")  # fmt: skip
    return rec["meta"]["device"], rec["meta"]["command"], lines


def _long_context_quality(path: Path) -> tuple[str, str, list[str]]:
    """A ``bench.quality.long_context_quality`` record: token perplexity per window length, against dense on the
    same tokens and window, with the real skip rates."""
    rec = json.loads(path.read_text())
    dense = {r["window"]: r["token_perplexity"] for r in rec["rows"] if r["row"] == "dense"}
    table = [
        "| model | path | window | token ppl | × dense | attn skip | FFN skip |",
        "|---|---|---|---|---|---|---|",
    ]
    pct = lambda v: "–" if v is None else f"{v:.1%}"  # noqa: E731
    for r in sorted(rec["rows"], key=lambda r: (r["window"], r["row"] != "dense", r["row"], r["path"])):
        ratio = r["token_perplexity"] / dense[r["window"]]
        table.append(
            f"| {r['row']} | {r['path']} | {r['window']:,} | {r['token_perplexity']:.3f} | {ratio:.3f} | "
            f"{pct(r.get('attn_sparsity'))} | {pct(r.get('ffn_sparsity'))} |"
        )
    return f"CPU, {rec['dtype']} ({rec['source']})", rec["command"], table


SOURCES: tuple[Source, ...] = (
    Source(
        "decode",
        "Decode: time per output token, fused decode layer (H200)",
        "decode/decode-h200.json",
        "6f41731",
        "Llama-3.1-8B shapes, random weights, 4,096 cached tokens, bf16, CUDA-graph decode; every ratio is against "
        "the same call's dense run (unfused: today's decode; fused: the fused dense layer).",
        _decode,
    ),
    Source(
        "decode",
        "Decode: time per output token, fused decode layer (H100)",
        "decode/decode-h100.json",
        "b20e4ce",
        "The same benchmark on an H100, with the routers beside QKV (the rule since the H200 table).",
        _decode,
    ),
    Source(
        "kernels",
        "Kernels: routed GEMMs against cuBLAS (H200)",
        "kernels/kernels-h200.json",
        "55338bb",
        "Llama-3.1-8B shapes, bf16, i.i.d. random masks; each op at the path ``wide.kernels.plan`` picks.",
        _kernels,
    ),
    Source(
        "decode",
        "End to end: prefill and decode (H200)",
        "decode/e2e-h200.json",
        "b69a101",
        "The runtime with a compiled layer step: 4,096-token prompt, decode at 4,096 cached tokens.",
        _e2e,
    ),
    Source(
        "quality",
        "Quality: the shipped routers + LoRA, full task sets (H200)",
        "quality/smollm2/routed-lora.json",
        "8f92636",
        "SmolLM2-135M through the served runtime, bf16; WikiText-2 word perplexity and lm-eval's zero-shot tasks.",
        _zero_shot,
    ),
    Source(
        "quality",
        "Quality: dense and the shipped routers, full task sets (H200)",
        "quality/smollm2/zero_shot.json",
        "af8bad8",
        "Dense and the routed rows merged, retention against dense (``python -m bench.quality.summarize_zero_shot``).",
        _zero_shot,
    ),
    Source(
        "decode",
        "Long context and batches: decode grid and TTFT (H100)",
        "decode/long-context-h100.json",
        "b1c38fc",
        "Llama-3.1-8B shapes, random weights, bf16, fused decode layer at B x cached keys, each ratio beside its "
        "byte limit (dense bytes / the bytes the row must read); rows timed under the other split rule and the "
        "rows an H100 cannot hold are in the record's page (docs/long-context.md).",
        _long_context,
    ),
    Source(
        "serve",
        "Serving: the engine under the long workload (H100)",
        "serve/serve-long-h100.json",
        "a8c64ef",
        "Llama-3.1-8B shapes, random weights, bf16, closed loop; prompts 8k-16k, outputs 128-512; every request runs "
        "to its drawn length. Byte limit: the decode bytes only. The concurrency-1 wide50 row ran before the engine "
        "had its warm-up and carries the routed kernels' first tuning (docs/serving.md#measured).",
        _serve,
    ),
    Source(
        "serve",
        "Serving: the engine under the chat workload (H100)",
        "serve/serve-chat-h100.json",
        "7650aff",
        "Prompts 128-4k, outputs 32-512; each engine warmed up before timing (Engine.warmup) and overlapping its host "
        "work with the next step; the bare step is the engine's own graphed B 1 step at the requests' median context "
        "(docs/serving.md#measured).",
        _serve,
    ),
    Source(
        "quality",
        "Quality at long context: the shipped routers on 2k, 4k and 8k windows (CPU)",
        "quality/long-context-cpu.json",
        "21ac089",
        "SmolLM2-135M (context 8,192), routers calibrated on 2,048-token sequences; a slice of WikiText-2's test set "
        "cut into windows of each length, so every length scores the same tokens (docs/long-context.md).",
        _long_context_quality,
    ),
    Source(
        "quality",
        "Quality at long context, four slices pooled (CPU)",
        "quality/long-context-cpu-pooled.json",
        "21ac089, e0befd1, b49ee54",
        "The same measurement on the first 32,768 tokens of the test set, as four slices of 8,192 (each its own "
        "record, masked path), pooled token-weighted by ``--pool``.",
        _long_context_quality_pooled,
    ),
)


def _load(record: str):
    return json.loads((RESULTS / record).read_text())


def _tpot(record: str, variant: str, b: int, sparsity: float) -> dict:
    """The fused-layer TPOT row of a decode record (the FFN router on the block's own norm, the default)."""
    return next(
        r
        for r in _load(record)["records"]
        if r["kind"] == "tpot" and r.get("fused") and r["variant"] == variant and r["B"] == b
        and r["sparsity"] == sparsity and r.get("ffn_router_source") in (None, "block")
    )  # fmt: skip


def _link(*records: str) -> str:
    return ", ".join(f"[`{r.rsplit('/', 1)[-1]}`](bench/results/{r})" for r in records)


def headline_rows() -> list[str]:
    """The README's results: one row per headline figure, the card it ran on and the record(s) it comes from."""
    rows = ["| Result | Hardware | Dense | WIDE | Record |", "|---|---|---|---|---|"]
    for rec in ("decode/decode-h200.json", "decode/decode-h100.json"):
        card = _load(rec)["meta"]["device"]
        for b in (1, 16):
            d, w = _tpot(rec, "dense", b, 0.0), _tpot(rec, "wide", b, 0.5)
            rows.append(
                f"| Decode TPOT, Llama-3.1-8B shapes, B {b}, 50%, fused layer | {card} | {d['tpot_ms']:.2f} ms | "
                f"{w['tpot_ms']:.2f} ms ({w['tpot_speedup_vs_dense_fused']:.2f}×) | {_link(rec)} |"
            )
    e2e = "decode/e2e-h200.json"
    card = json.loads((RESULTS / e2e.replace(".json", ".meta.json")).read_text())["device"]
    for b in (1, 16):
        d, w = (next(r for r in _load(e2e) if r["B"] == b and r["sparsity"] == sp and r["variant"] == v)
                for v, sp in (("dense", 0.0), ("wide", 0.5)))  # fmt: skip
        rows.append(
            f"| TTFT, 4,096-token prompt, B {b}, 50% | {card} | {d['ttft_ms']:.1f} ms | {w['ttft_ms']:.1f} ms "
            f"({w['ttft_speedup']:.2f}×) | {_link(e2e)} |"
        )
    lc = "decode/long-context-h100.json"
    lrows = _load(lc)
    for lv, ctx in (("wide 50%", 16384), ("shipped smollm2-135m-s50", 16384), ("wide 50%", 32768)):
        b = 16 if ctx == 16384 else 4
        d, w = (next(r for r in lrows if r.get("kind") == "tpot" and r["B"] == b and r["ctx"] == ctx
                     and r["level"] == name and SL.is_default(r) and "error" not in r)
                for name in ("dense", lv))  # fmt: skip
        rows.append(
            f"| Decode TPOT, B {b}, context {ctx // 1024}k, {lv}, fused layer | {w['gpu']} | {d['tpot_ms']:.2f} ms | "
            f"{w['tpot_ms']:.2f} ms ({w['tpot_speedup']:.2f}×, byte limit {w['byte_limit']:.2f}×) | {_link(lc)} |"
        )
    d, w = (next(r for r in lrows if r.get("kind") == "ttft" and r["prompt"] == 32768 and r["level"] == name
                 and r.get("default_layout", True))
            for name in ("dense", "wide 50%"))  # fmt: skip
    rows.append(
        f"| TTFT, 32,768-token prompt, B 1, 50% | {w['gpu']} | {d['ttft_ms']:.0f} ms | {w['ttft_ms']:.0f} ms "
        f"({w['ttft_speedup']:.2f}×) | {_link(lc)} |"
    )
    sl, sc = "serve/serve-long-h100.json", "serve/serve-chat-h100.json"
    srows = _load(sl)["records"]
    d, w = (next(r for r in srows if r["kind"] == "engine" and r["concurrency"] == 16 and r["variant"] == v)
            for v in ("dense", "wide50"))  # fmt: skip
    rows.append(
        f"| Serving, long workload (prompts 8k-16k), concurrency 16, 50%: output tok/s | {_load(sl)['meta']['device']} "
        f"| {d['output_tokens_per_s']:.0f} | {w['output_tokens_per_s']:.0f} ({w['speedup_vs_dense']:.2f}×) "
        f"| {_link(sl)} |"
    )
    d, w = (next(r for r in _load(sc)["records"] if r["kind"] == "engine" and r["concurrency"] == 16
                 and r["variant"] == v) for v in ("dense", "shipped_rates"))  # fmt: skip
    rows.append(
        f"| Serving, chat (prompts 128-4k), concurrency 16, shipped routers' rates: output tok/s "
        f"| {_load(sc)['meta']['device']} | {d['output_tokens_per_s']:.0f} | {w['output_tokens_per_s']:.0f} "
        f"({w['speedup_vs_dense']:.2f}×) | {_link(sc)} |"
    )
    hf = next(r for r in _load(sc)["records"] if r["kind"] == "hf")
    eng = next(r for r in _load(sc)["records"] if r["kind"] == "engine" and r["concurrency"] == 1
               and r["variant"] == "dense")  # fmt: skip
    rows.append(
        f"| Serving, chat, concurrency 1: the engine (dense) vs HF `generate` (compiled static cache), output tok/s "
        f"| {_load(sc)['meta']['device']} | {hf['output_tokens_per_s']:.0f} (HF) | {eng['output_tokens_per_s']:.0f} "
        f"(engine, {hf['engine_dense_over_hf']:.2f}×) | {_link(sc)} |"
    )
    kern = "kernels/kernels-h200.json"
    for op, g in (("q", 512), ("gate_up", 128), ("o", 512), ("down", 128)):
        r = next(r for r in SK._auto(_load(kern)) if r["op"] == op and r["group_size"] == g and r["M"] == 1
                 and r["sparsity"] == 0.5)  # fmt: skip
        rows.append(
            f"| Routed GEMM {op} (G {g}), M 1, 50% | {r['gpu']} | {r['dense_ms'] * 1e3:.1f} µs | "
            f"{r['wide_ms'] * 1e3:.1f} µs ({r['speedup']:.2f}×) | {_link(kern)} |"
        )
    dense_rec, lora_rec = "quality/smollm2/zero_shot.json", "quality/smollm2/routed-lora.json"
    dense, lora = _load(dense_rec), _load(lora_rec)
    dn = dense["rows"]["dense"]
    for name in ("smollm2-135m-s25-lora", "smollm2-135m-s50-lora"):
        r = lora["rows"][name]
        card = lora["env"]["gpu"]
        rows.append(
            f"| SmolLM2-135M `{name}`: WikiText-2 word ppl | {card} | {dn['wikitext']['word_perplexity']:.2f} | "
            f"{r['wikitext']['word_perplexity']:.2f} | {_link(dense_rec, lora_rec)} |"
        )
        rows.append(
            f"| SmolLM2-135M `{name}`: zero-shot accuracy, 7 tasks | {card} | {dn['avg']:.1%} | {r['avg']:.1%} "
            f"({r['avg'] / dn['avg']:.1%} of dense) | {_link(dense_rec, lora_rec)} |"
        )
    return rows


README = ROOT / "README.md"
BEGIN, END = "<!-- results: generated by python -m bench.results_page -->", "<!-- results: end -->"


def render_readme(text: str) -> str:
    """``text`` (the README) with its block between BEGIN and END replaced by ``headline_rows``."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + BEGIN + "\n" + "\n".join(headline_rows()) + "\n" + END + tail


def render() -> str:
    out = [
        "# Results",
        "",
        "<!-- generated by `python -m bench.results_page` from bench/results/: edit SOURCES or the records, "
        "not this page -->",
        "",
        "Every table below is rendered from one committed record; its header names the card, the commit the "
        "record measured and the command that wrote it. The lab notes (superseded runs, the reasoning, the "
        "figures quoted in prose): [history.md](history.md); what was tried and did not stay: "
        "[negative-results.md](negative-results.md). Commands are as the records wrote them (``scripts/<name>.py`` "
        "of older records is ``python -m bench.<area>.<name>`` now).",
        "",
        "Not on this page yet, because no GPU has run them: the decode grid at B 16 × 32k (an H200's memory; "
        "[long-context.md](long-context.md)), the long-context step kernel by kernel and the routed prefill "
        "attention's launch sweep (`STEP=profile bash scripts/device/serve_long.sh`).",
        "",
    ]
    for s in SOURCES:
        card, command, table = s.render(RESULTS / s.record)
        out += [
            f"## {s.title}",
            "",
            f"{s.note}",
            "",
            f"Card: {card} · commit: {s.commit} · record: [`{s.record}`](../bench/results/{s.record}) · "
            f"command: `{command}`",
            "",
            *table,
            "",
        ]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=PAGE)
    ap.add_argument("--check", action="store_true", help="exit 1 when --out differs from the rendering")
    a = ap.parse_args(argv)
    pages = {a.out: render(), README: render_readme(README.read_text())}
    if a.check:
        stale = [str(p) for p, text in pages.items() if not p.is_file() or p.read_text() != text]
        if stale:
            print(f"stale: {', '.join(stale)}: run python -m bench.results_page", file=sys.stderr)
            return 1
        return 0
    for p, text in pages.items():
        p.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
