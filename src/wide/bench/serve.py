"""`wide bench serve`: the continuous-batching engine under two seeded synthetic workloads, Llama-3.1-8B shapes with
random weights, dense vs WIDE 50% vs the shipped routers' per-kind rates (docs/serving.md#benchmark).

Rows (written after each one, so a run stopped by its time budget keeps what finished):
  * ``engine``: a workload ("chat": prompts 128-4k, outputs 32-512; "long": prompts 8k-16k, outputs 128-512;
    lengths from a seeded log-normal) at a concurrency (closed loop: a new request as soon as one finishes),
    per variant: requests/s, output tokens/s, TTFT and TPOT p50 / p99, and for WIDE its byte limit: the bytes
    the dense engine's decode steps read over the bytes its own read (weights the batch's union runs + the KV
    pairs its tokens run), sampled every 32 steps;
  * ``hf``: Hugging Face ``generate`` with a static cache (its forward compiled) at concurrency 1, the same chat
    requests: the baseline users have today;
  * ``bare_step``: the engine's own B 1 decode step alone (``GraphedDecode`` replay) at the chat requests' median
    context: the engine's overhead is its concurrency-1 TPOT over this;
  * ``batch_dependence``: how many requests' greedy tokens change when they run 16 together instead of alone,
    with and without batch-invariant mode, and what that mode costs in time.
Every request runs to its drawn output length (``ignore_eos``): dense and WIDE serve the same token counts.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from dataclasses import dataclass

import torch

from wide.bench.e2e import LLAMA_8B, TINY_LLAMA, build_model, routers_at
from wide.bench.timing import card_tag, median_ms, tree_commit
from wide.config import WideConfig
from wide.kernels.fused_decode import router_overlap
from wide.model import WideModel
from wide.runtime import GraphedDecode, WideRuntime
from wide.serve import Engine, SamplingParams


@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths: log-normal (median, sigma), clipped to [lo, hi]."""

    name: str
    prompt: tuple[float, float, int, int]
    output: tuple[float, float, int, int]

    def draw(self, n: int, seed: int, scale: tuple[float, float] = (1.0, 1.0)) -> list[tuple[int, int]]:
        """n (prompt, output) length pairs; ``scale`` shrinks the prompt / output lengths (smoke runs)."""
        g = torch.Generator().manual_seed(seed)

        def one(spec, k: float) -> int:
            med, sigma, lo, hi = spec
            v = math.exp(math.log(med) + sigma * float(torch.randn((), generator=g)))
            return max(2, int(min(hi, max(lo, v)) * k))

        return [(one(self.prompt, scale[0]), one(self.output, scale[1])) for _ in range(n)]


PARTS = ("engine", "bare", "hf", "batch")
WORKLOADS = {
    "chat": Workload("chat", prompt=(700.0, 1.0, 128, 4096), output=(128.0, 0.8, 32, 512)),
    "long": Workload("long", prompt=(11000.0, 0.2, 8192, 16384), output=(256.0, 0.5, 128, 512)),
}


def shipped_rates(name: str = "smollm2-135m-s50") -> tuple[float, float]:
    """The mean per-kind skip rates (attention, FFN) a shipped checkpoint's threshold fit recorded."""
    from wide.paths import resolve_routers

    cfg = json.loads((resolve_routers(name) / "wide_config.json").read_text())
    fit = cfg["training"]["skip_bias_fit"]["argmax_skip_after"]
    per = {k: [v for key, v in fit.items() if key.startswith(k)] for k in ("attn", "ffn")}
    return sum(per["attn"]) / len(per["attn"]), sum(per["ffn"]) / len(per["ffn"])


class ByteMeter:
    """Bytes a decode step reads, dense and as run, summed over every ``every``-th step (``Engine.step_hook``).

    Per layer: Q / O rows of the groups the batch's union runs (Q whole when the fused step computes every Q head),
    K / V projections whole, FFN channels of the union, the KV cache pairs (token, group) each busy row runs over
    its context; lm_head once. Dense: every group of every busy row."""

    def __init__(self, rt: WideRuntime, every: int = 32):
        d = rt.wm.dims
        self.el = rt.hf.lm_head.weight.element_size()
        self.dm, self.hq, self.hk, self.hd, self.nl = d.hidden, d.n_q_heads, d.n_kv_heads, d.head_dim, d.n_layers
        self.df = rt.layers[0].mlp.down_proj.weight.shape[1]
        self.lm = rt.hf.lm_head.weight.numel() * self.el
        self.router = 2 * rt.heads[0][0][0].numel() * self.el if rt.routed else 0
        self.q_whole = router_overlap(rt.hf.lm_head.weight.is_cuda)
        self.every, self.n = every, 0
        self.dense = self.wide = 0.0

    def __call__(self, busy: list[int], ctx: list[int], masks: list) -> None:
        self.n += 1
        if (self.n - 1) % self.every:
            return
        el, dm, hq, hk, hd, nl, df = self.el, self.dm, self.hq, self.hk, self.hd, self.nl, self.df
        kv_pair = hd * 2 * el  # one token's K and V of one group
        tokens = sum(c + 1 for c in ctx)
        dense = nl * (2 * hq * hd * dm * el + 2 * hk * hd * dm * el + 3 * df * dm * el + tokens * hk * kv_pair)
        self.dense += dense + self.lm
        if not masks:
            self.wide += dense + self.lm
            return
        rows = torch.tensor(busy, device=masks[0][0].device)
        a = torch.stack([m.reshape(m.shape[0], -1)[rows] for m, _ in masks])  # [L, n, Hk]
        f = torch.stack([m.reshape(m.shape[0], -1)[rows] for _, m in masks])  # [L, n, G]
        ua = a.any(1).float().mean(-1)  # [L]: union run fraction
        uf = f.any(1).float().mean(-1)
        pairs = (a.sum(-1).double() * torch.tensor([c + 1 for c in ctx], device=a.device).double()).sum()
        qo = hq * hd * dm * el * ((1.0 if self.q_whole else ua) + ua)
        wide = (qo + 2 * hk * hd * dm * el + 3 * df * dm * el * uf + self.router).sum() + pairs * kv_pair
        self.wide = wide + self.lm + self.wide  # a device scalar: nothing read back to the host until limit()

    def limit(self) -> float | None:
        wide = float(self.wide)
        return self.dense / wide if wide else None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def drive(engine: Engine, requests: list[tuple[list[int], SamplingParams]], concurrency: int) -> dict:
    """Closed loop on this thread: ``concurrency`` requests in flight, the next submitted as one finishes."""
    results, pending = [], list(reversed(requests))

    def sink(o) -> None:
        if o.result is not None:
            results.append(o.result)
            if pending:
                engine.submit(*pending.pop(), sink)

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        engine.submit(*pending.pop(), sink)
    while len(results) < len(requests):
        engine.step()
    _sync(engine.device)
    wall = time.perf_counter() - t0
    out_tokens = sum(len(r.token_ids) for r in results)
    tpot = [(r.latency_s - r.ttft_s) / (len(r.token_ids) - 1) for r in results if len(r.token_ids) > 1]
    ttft = [r.ttft_s for r in results]
    return {
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "ttft_p50_ms": 1e3 * _pct(ttft, 0.5),
        "ttft_p99_ms": 1e3 * _pct(ttft, 0.99),
        "tpot_p50_ms": None if not tpot else 1e3 * _pct(tpot, 0.5),
        "tpot_p99_ms": None if not tpot else 1e3 * _pct(tpot, 0.99),
        "attn_sparsity": _mean([r.attn_sparsity for r in results]),
        "ffn_sparsity": _mean([r.ffn_sparsity for r in results]),
        "_results": results,
    }


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def make_requests(lengths: list[tuple[int, int]], vocab: int, seed: int, greedy: bool = True) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, vocab, (p,), generator=g).tolist(), SamplingParams(max_tokens=o, ignore_eos=True))
        for p, o in lengths
    ]


def hf_static_generate(model, requests: list, max_len: int) -> dict:
    """Hugging Face ``generate`` (greedy) over one static cache of ``max_len`` tokens, its forward compiled (the
    static cache's auto-compile), one request at a time; the first request warms up (not timed)."""
    from transformers import StaticCache

    dev = next(model.parameters()).device
    cache = StaticCache(config=model.config, max_cache_len=max_len)

    def one(prompt, sp) -> int:
        cache.reset()
        ids = torch.tensor([prompt], device=dev)
        kw = dict(max_new_tokens=sp.max_tokens, min_new_tokens=sp.max_tokens, do_sample=False)
        try:  # newer transformers name the cache argument `cache`, older ones `past_key_values`
            out = model.generate(ids, cache=cache, **kw)
        except (TypeError, ValueError):
            out = model.generate(ids, past_key_values=cache, **kw)
        return out.shape[1] - ids.shape[1]

    with torch.no_grad():
        t = time.perf_counter()
        one(*requests[0])
        _sync(dev)
        warm_s = time.perf_counter() - t
        t0 = time.perf_counter()
        n = sum(one(*r) for r in requests[1:])
        _sync(dev)
    wall = time.perf_counter() - t0
    return {"requests": len(requests) - 1, "wall_s": wall, "output_tokens_per_s": n / wall, "warmup_s": warm_s}


def run_serve_bench(
    out_dir: str | None = None,
    *,
    smoke: bool = False,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    concurrency: tuple[int, ...] = (1, 4, 16),
    workloads: tuple[str, ...] = ("chat", "long"),
    budget_s: float = 420.0,
    parts: tuple[str, ...] = PARTS,
    requests_per_slot: float = 1.5,
    min_requests: int = 4,
    seed: int = 0,
    command: str = "",
) -> list[dict]:
    """The rows of the benchmark named in ``parts`` (see the module docstring; "engine" rows for ``workloads`` and
    ``concurrency``) -> the records, also written to ``out_dir`` as ``serve-CARD.json`` and ``.md`` (``serve-
    WORKLOADS-CARD`` for a subset of the workloads). ``smoke``: a tiny model and tiny lengths (a CPU check of the
    harness). No new row starts past ``budget_s``."""
    t_start = time.time()
    shape = TINY_LLAMA if smoke else LLAMA_8B
    scale = (1 / 128, 1 / 16) if smoke else (1.0, 1.0)
    max_batch = max(concurrency)
    model = build_model(shape, device, dtype)
    vocab = shape["vocab_size"]
    probe = torch.randint(0, vocab, (1, 64 if smoke else 512), generator=torch.Generator().manual_seed(1)).to(device)
    attn_r, ffn_r = shipped_rates()
    variants = [("dense", None), ("wide50", (0.5, 0.5)), ("shipped_rates", (attn_r, ffn_r))]
    card = card_tag(device)
    if tuple(workloads) != tuple(WORKLOADS):
        card = "-".join(workloads) + "-" + card
    meta = {
        "device": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu",
        "card": card,
        "torch": torch.__version__,
        "commit": tree_commit(),
        "command": command,
        "shape": "tiny" if smoke else "llama-3.1-8b",
        "dtype": str(dtype),
        "shipped_rates": {"attn": attn_r, "ffn": ffn_r, "from": "smollm2-135m-s50"},
        "budget_s": budget_s,
        "parts": list(parts),
        "workloads": list(workloads),
        "concurrency": list(concurrency),
    }
    rows: list[dict] = []

    def over() -> bool:
        return time.time() - t_start > budget_s

    def record(row: dict) -> None:
        rows.append({k: v for k, v in row.items() if not k.startswith("_")})
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}), flush=True)
        _write(out_dir, rows, meta, card)

    wms: dict[str, WideModel] = {}

    def wide_model(variant: str, rates) -> WideModel:
        for w in wms.values():
            w.detach()
        wms.clear()
        wm = WideModel(model, WideConfig(ffn_group_size=32 if smoke else 128))
        if rates is not None:
            routers_at(wm, tuple(rates), probe)
        wms[variant] = wm
        return wm

    def engine_for(wm: WideModel, routed: bool, max_seq: int, invariant: bool = False, meter: bool = False):
        rt = WideRuntime(wm, max_batch=max_batch, max_seq=max_seq, routed=routed, batch_invariant=invariant)
        bytes_ = ByteMeter(rt, every=1 if smoke else 32) if meter else None
        return Engine(rt, max_context=max_seq, batch_invariant=invariant, step_hook=bytes_), bytes_

    # 1. the engine under each workload, concurrency and variant
    dense_tps: dict[tuple[str, int], float] = {}
    dense_bytes: dict[tuple[str, int], float] = {}
    for wl_name in workloads if "engine" in parts else ():
        wl = WORKLOADS[wl_name]
        for variant, rates in variants:
            if over():
                break
            wm = wide_model(variant, rates)
            for c in concurrency:
                if over():
                    break
                n = max(min_requests, int(round(requests_per_slot * c)))
                lengths = wl.draw(n, seed + c, scale)
                max_seq = max(p + o for p, o in lengths) + 1
                engine, meter = engine_for(wm, rates is not None, max_seq, meter=True)
                reqs = make_requests(lengths, vocab, seed + c)
                # warm-up, untimed: every prompt-length class the routed prefill kernels tune for, then one request
                engine.warmup(max(p for p, _ in lengths))
                drive(engine, reqs[:1], 1)
                meter.dense = meter.wide = 0.0
                meter.n = 0
                r = drive(engine, reqs, c)
                row = {"kind": "engine", "workload": wl_name, "concurrency": c, "variant": variant, **r}
                row["bytes_dense_over_own"] = meter.limit()
                if variant == "dense":
                    dense_tps[(wl_name, c)] = r["output_tokens_per_s"]
                    dense_bytes[(wl_name, c)] = meter.dense
                elif (wl_name, c) in dense_tps:
                    row["speedup_vs_dense"] = r["output_tokens_per_s"] / dense_tps[(wl_name, c)]
                    lim = row["bytes_dense_over_own"]
                    row["byte_limit"] = lim
                    row["of_byte_limit"] = None if not lim else row["speedup_vs_dense"] / lim
                record(row)
                del engine, meter
                _free(device)

    # 2. the engine's bare B 1 step (GraphedDecode replay) at the chat requests' median context
    if "bare" in parts and not over():
        lengths = WORKLOADS["chat"].draw(max(min_requests, int(round(requests_per_slot))), seed + 1, scale)
        ctx = sorted(p + o // 2 for p, o in lengths)[len(lengths) // 2]
        wm = wide_model("dense", None)
        for variant, rates in variants:
            wm = wide_model(variant, rates)
            rt = WideRuntime(wm, max_batch=1, max_seq=ctx + 2, routed=rates is not None)
            ids = torch.randint(0, vocab, (1, 1), device=device)
            step = GraphedDecode(rt, 1) if torch.device(device).type == "cuda" else rt.decode
            lens = torch.full_like(rt.cache.lens, ctx)

            def one(rt=rt, lens=lens, step=step, ids=ids) -> None:
                rt.cache.lens.copy_(lens)
                step(ids)

            ms = median_ms(one, 3 if smoke else 30, device)
            eng = next((x for x in rows if x.get("workload") == "chat" and x.get("concurrency") == 1
                        and x.get("variant") == variant), None)  # fmt: skip
            row = {"kind": "bare_step", "variant": variant, "ctx": ctx, "tpot_ms": ms}
            if eng is not None and eng.get("tpot_p50_ms"):
                row["engine_tpot_p50_over_bare"] = eng["tpot_p50_ms"] / ms
            record(row)
            del rt, step
            _free(device)

    # 3. Hugging Face generate, static cache, compiled, concurrency 1, the chat requests
    if "hf" in parts and not over():
        for w in wms.values():
            w.detach()
        wms.clear()
        # the engine's concurrency-1 chat requests, after one more that warms up (compiles)
        lengths = WORKLOADS["chat"].draw(max(min_requests, int(round(requests_per_slot))), seed + 1, scale)
        lengths = lengths[:1] + lengths
        reqs = make_requests(lengths, vocab, seed + 1)
        try:
            r = hf_static_generate(model, reqs, max(p + o for p, o in lengths) + 1)
            row = {"kind": "hf", "workload": "chat", "concurrency": 1, "variant": "hf_static_compiled", **r}
            eng = next((x for x in rows if x.get("workload") == "chat" and x.get("concurrency") == 1
                        and x.get("variant") == "dense"), None)  # fmt: skip
            if eng is not None:
                row["engine_dense_over_hf"] = eng["output_tokens_per_s"] / r["output_tokens_per_s"]
        except Exception as e:  # the baseline's failure is a record, not the end of the run
            row = {"kind": "hf", "variant": "hf_static_compiled", "error": f"{type(e).__name__}: {e}"}
        record(row)
        _free(device)

    # 4. greedy batch dependence, with and without batch-invariant mode (WIDE 50%)
    if "batch" in parts and not over():
        wm = wide_model("wide50", (0.5, 0.5))
        n = max_batch
        lengths = [(p, 8 if smoke else 32) for p, _ in WORKLOADS["chat"].draw(n, seed + 99, scale)]
        reqs = make_requests(lengths, vocab, seed + 99)
        max_seq = max(p + o for p, o in lengths) + 1
        for invariant in (False, True):
            engine, _ = engine_for(wm, True, max_seq, invariant=invariant)
            engine.warmup(max(p for p, _ in lengths))
            drive(engine, reqs[:1], 1)
            alone_r = [drive(engine, [q], 1) for q in reqs]
            alone = [a["_results"][0].token_ids for a in alone_r]
            together_r = drive(engine, reqs, n)
            got = {tuple(x.token_ids) for x in together_r["_results"]}
            changed = sum(tuple(a) not in got for a in alone)
            record({
                "kind": "batch_dependence", "variant": "wide50", "batch_invariant": invariant, "requests": n,
                "changed": changed, "changed_fraction": changed / n,
                "alone_output_tokens_per_s": sum(len(t) for t in alone) / sum(a["wall_s"] for a in alone_r),
                "together_output_tokens_per_s": together_r["output_tokens_per_s"],
            })  # fmt: skip
            del engine
            _free(device)
    meta["wall_s"] = time.time() - t_start
    meta["stopped_by_budget"] = over()
    _write(out_dir, rows, meta, card)
    return rows


def _free(device) -> None:
    gc.collect()  # an engine and its runtime form reference cycles (graphs, hooks): free the cache now
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _write(out_dir: str | None, rows: list[dict], meta: dict, card: str) -> None:
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"serve-{card}.json"), "w") as f:
        json.dump({"meta": meta, "records": rows}, f, indent=1)
    cols = ["workload", "concurrency", "variant", "requests_per_s", "output_tokens_per_s", "ttft_p50_ms",
            "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "speedup_vs_dense", "byte_limit", "of_byte_limit",
            "attn_sparsity", "ffn_sparsity"]  # fmt: skip
    lines = [f"# Serving engine ({meta['device']}, {meta['shape']} shapes, random weights, commit "
             f"{meta.get('commit', '?')})", "", f"Command: `{meta.get('command') or '?'}`", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]  # fmt: skip
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows if r["kind"] == "engine"]
    for kind in ("bare_step", "hf", "batch_dependence"):
        lines += ["", f"## {kind}", ""]
        lines += ["- " + ", ".join(f"{k}={_fmt(v)}" for k, v in r.items() if k != "kind") for r in rows
                  if r["kind"] == kind]  # fmt: skip
    with open(os.path.join(out_dir, f"serve-{card}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
