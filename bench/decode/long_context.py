"""Long-context and batched decode: the B x context grid of TPOT with each ratio beside its byte limit, and
TTFT of long prompts, on one GPU (docs/long-context.md).

    PYTHONUNBUFFERED=1 PYTHONPATH=src:. python -m bench.decode.long_context --out $OUT --budget-s 480

Writes $OUT/long-context-CARD.json (a JSON list, one record per row, written after every row so a run cut
short keeps what finished) and $OUT/long-context-CARD.md (the command and the tables of
``bench.decode.summarize_long_context``); CARD names the GPU (``wide.bench.timing.card_tag``).

Llama-3.1-8B shapes, random weights, bf16, the fused decode layer (``WideRuntime(fused_decode=True)``), each
step replayed from a CUDA graph. The model is built once; per (context, B, variant) a runtime with a cache of
context + 16 keys is built, its K/V filled with random values and every sequence's length set to the context
(no prefill: a decode step reads the cache whatever wrote it), then freed. Variants: fused dense, WIDE at 0 /
50 / 70% (random routers whose thresholds are fitted so that argmax skips that fraction on a probe), and the
shipped SmolLM2 routers' per-kind rates (attention / FFN, read from their checkpoints' threshold-fit records).
A row that cannot fit the card's free memory is recorded as skipped with the reason. From ``LONG_CONTEXT``
keys each row is timed under the long-context split rule and the short one (``launch_overrides(long_context=
0)``) on the same runtime, each against the dense row of the same rule.

Per row: TPOT, the bytes the step reads (weights of the groups the batch's union runs, K/V of the (token, KV
group) pairs that run: ``wide.bench.e2e.decode_bytes``), TB/s, the measured fractions, the byte limit (dense
bytes / the row's bytes) and the speed-up's share of it. TTFT rows (B 1): the dense runtime (SDPA) against
the routed one at each prompt length, with attention's share of the prefill time (the attention op alone on
the prompt's shapes, times the layers).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from wide.bench.e2e import LLAMA_8B, build_model, decode_bytes, routers_at
from wide.bench.timing import card_tag, median_ms, tree_commit
from wide.config import WideConfig
from wide.kernels import fused_decode as FD
from wide.model import WideModel
from wide.runtime import GraphedDecode, WideRuntime
from wide.runtime.model import KV_LAYOUTS

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINTS = ROOT / "src" / "wide" / "checkpoints"
SHIPPED = ("smollm2-135m-s50", "smollm2-135m-s50-lora")
# the split rules a long-context row is timed under (fused_decode.launch_overrides)
RULES = {"long": {"long_context": 1}, "short": {"long_context": 0}}
DEFAULT_LAYOUT = "nhd"  # the cache layout WideRuntime allocates by default (its kv_layout)
MARGIN_BYTES = 3 << 30  # free memory kept beside a runtime's cache (graph pools, partials, activations)
SMOKE_SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                   vocab_size=101, num_hidden_layers=2, max_position_embeddings=1024)  # fmt: skip


@dataclass(frozen=True)
class Level:
    """A variant of the grid: dense (attn None) or WIDE at per-kind skip rates."""

    name: str  # "dense", "wide 50%", "shipped smollm2-135m-s50"
    attn: float | None = None
    ffn: float | None = None
    source: str | None = None  # where the rates were read

    @property
    def sparsity(self) -> float | str:
        if self.attn is None:
            return 0.0
        return self.attn if self.attn == self.ffn else f"attn {self.attn:.3f} / ffn {self.ffn:.3f}"


@dataclass
class GridConfig:
    batches: list[int]
    contexts: list[int]
    prompts: list[int]
    levels: list[Level]
    ttft_levels: list[str]  # level names that get TTFT rows (besides dense)
    reps: int
    ttft_reps: int
    budget_s: float
    smoke: bool
    rules: list[str] = field(default_factory=lambda: list(RULES))
    layouts: list[str] = field(default_factory=lambda: ["nhd"])  # cache layouts every cell is timed under


def shipped_rates(name: str) -> Level:
    """The per-kind skip rates a shipped checkpoint's threshold fit recorded (argmax, after the fit), averaged
    over its layers."""
    path = CHECKPOINTS / name / "wide_config.json"
    if not path.is_file():
        raise SystemExit(f"no shipped checkpoint {name!r} under {CHECKPOINTS}")
    fit = json.loads(path.read_text())["training"]["skip_bias_fit"]["argmax_skip_after"]
    rate = {k: [v for key, v in fit.items() if key.startswith(k)] for k in ("attn", "ffn")}
    a, f = (sum(v) / len(v) for v in (rate["attn"], rate["ffn"]))
    return Level(f"shipped {name}", round(a, 4), round(f, 4), f"{path.relative_to(ROOT)}: argmax_skip_after")


def cache_bytes(shape: dict, batch: int, seq: int, elem: int) -> int:
    """K and V of every layer: L * B * S * Hk * d * 2 * elem."""
    hd = shape["hidden_size"] // shape["num_attention_heads"]
    return shape["num_hidden_layers"] * batch * seq * shape["num_key_value_heads"] * hd * 2 * elem


def fits(nbytes: int) -> str | None:
    """Why ``nbytes`` more cannot be allocated on this GPU (one line), or None."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    if nbytes + MARGIN_BYTES > free:
        return (f"the cache needs {nbytes / 1e9:.1f} GB (+{MARGIN_BYTES / 1e9:.1f} GB margin), "
                f"{free / 1e9:.1f} GB of {total / 1e9:.1f} GB free on {card_tag()}")  # fmt: skip
    return None


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rules_for(ctx: int, wanted: list[str]) -> list[str]:
    """The rules a row is timed under: both from LONG_CONTEXT keys, else the one rule there is ("short")."""
    return [r for r in wanted if r in RULES] if ctx + 16 >= FD.LONG_CONTEXT else ["short"]


def filled_runtime(wm: WideModel, batch: int, ctx: int, routed: bool, dev: str, layout: str = "nhd") -> WideRuntime:
    """A fused-decode runtime whose cache (``layout``: ``KV_LAYOUTS``) holds ``ctx`` random keys per sequence (a
    decode step reads the cache whatever wrote it, so no long prefill is needed), room for 16 more."""
    rt = WideRuntime(wm, max_batch=batch, max_seq=ctx + 16, routed=routed, fused_decode=True, kv_layout=layout)
    gen = torch.Generator(device=dev).manual_seed(ctx * 31 + batch)
    for c in (rt.cache.k, rt.cache.v):  # [L, B, S, Hk, d]: any values serve a time; drawn in the logical order, one
        for row in c.flatten(0, 1):  # (layer, sequence) at a time, so that every layout holds the same values
            row.copy_(torch.randn(row.shape, generator=gen, device=dev, dtype=row.dtype))
    rt.cache.lens.fill_(ctx)
    return rt


def decode_rows(
    wm: WideModel, level: Level, batch: int, ctx: int, cfg: GridConfig, dev: str, layout: str = "nhd"
) -> list[dict]:
    """One record per rule: TPOT of a CUDA-graph decode step at ``ctx`` random cached keys in a ``layout`` cache,
    bytes, fractions."""
    routed = level.attn is not None
    rt = filled_runtime(wm, batch, ctx, routed, dev, layout)
    lens = rt.cache.lens.clone()
    # the same tokens for every variant of a (B, ctx): rows with the same routers take the same decisions
    ids = torch.randint(0, wm.dims.vocab, (batch, 1), generator=torch.Generator().manual_seed(batch)).to(dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 132
    out = []
    for rule in rules_for(ctx, cfg.rules):
        with FD.launch_overrides(**RULES[rule]):
            step = GraphedDecode(rt, batch) if dev == "cuda" else rt.decode

            def decode(step=step):
                rt.cache.lens.copy_(lens)
                step(ids)

            decode()
            tpot = median_ms(decode, cfg.reps, dev)
            launch = {"attn_split_cap": FD.attn_split_cap(ctx + 16), "attn_programs": FD.attn_programs(ctx + 16, sms)}
        default = rule == ("long" if FD.long_context(ctx + 16) else "short")  # the rule the library takes
        out.append({"rule": rule, "default_rule": default, "tpot_ms": tpot, **launch,
                    "kv_layout": layout, "default_layout": layout == DEFAULT_LAYOUT})  # fmt: skip
    rt.cache.lens.copy_(lens)
    rt.decode(ids)  # eager: the step's masks (the graph's are the same decisions)
    masks = [(a.clone(), f.clone()) for a, f in rt.fused_masks] if routed else None
    nbytes, frac = decode_bytes(rt, batch, ctx, masks)
    dense_bytes, _ = decode_bytes(rt, batch, ctx, None)
    d = wm.dims
    kv_pair = batch * (ctx + 1) * d.n_kv_heads * d.head_dim * 2 * rt.cache.k.element_size()  # per layer, all run
    kv = int(d.n_layers * kv_pair * frac["attn_token_run"])
    acct = {
        "bytes_read": nbytes,
        "bytes_kv": kv,
        "bytes_weights": nbytes - kv,
        "dense_bytes": dense_bytes,
        "byte_limit": dense_bytes / nbytes,
        "cache_bytes": rt.cache.k.numel() * rt.cache.k.element_size() * 2,
    }
    if routed:
        acct.update({f"measured_{k}": v for k, v in frac.items()})
    for r in out:
        r.update(acct, tb_per_s=nbytes / (r["tpot_ms"] * 1e-3) / 1e12)
    return out


def attention_ms(
    level: Level, shape: dict, prompt: int, dev: str, dtype: torch.dtype, reps: int, layout: str = "nhd"
) -> float:
    """One layer's prefill attention on the prompt's shapes: SDPA (dense, as the runtime calls it) or the
    routed kernel under an i.i.d. mask at the level's attention rate, K / V in the cache's ``layout``."""
    from wide.kernels import routed_attention_prefill

    hq, hk = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = shape["hidden_size"] // hq
    g = torch.Generator(device=dev).manual_seed(prompt)
    q = torch.randn(1, prompt, hq, hd, device=dev, dtype=dtype, generator=g)  # [B, T, Hq, d]
    k = torch.randn(1, prompt, hk, hd, device=dev, dtype=dtype, generator=g)  # [B, T, Hk, d]
    v = torch.randn_like(k)
    if layout == "hnd":  # the same [B, T, Hk, d] tensors over head-major storage, as the runtime's cache holds them
        k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    if level.attn is None:
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def fn():
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    else:
        mask = torch.rand(1, prompt, hk, device=dev, generator=g) >= level.attn  # [B, T, Hk] True = run

        def fn():
            routed_attention_prefill(q, k, v, mask)

    fn()
    return median_ms(fn, reps, dev)


def ttft_row(
    wm: WideModel, level: Level, prompt: int, cfg: GridConfig, probe: torch.Tensor, dev: str, layout: str = "nhd"
) -> dict:
    """TTFT of a B 1 prefill of ``prompt`` tokens (issued from Python, as ``wide bench e2e``), and attention's
    share of it."""
    routed = level.attn is not None
    hints = {}
    if routed:  # the per-layer rates the routers reach on the probe pick the prefill's kernel paths
        wm.start_meter()
        with torch.no_grad():
            wm(probe)
        per_layer = wm.stop_meter()["per_layer"]
        hints = dict(attn_sparsity_hint=per_layer["attn"], ffn_sparsity_hint=per_layer["ffn"])
    rt = WideRuntime(wm, max_batch=1, max_seq=prompt + 8, routed=routed, fused_decode=False, kv_layout=layout, **hints)
    ids = torch.randint(0, wm.dims.vocab, (1, prompt), generator=torch.Generator().manual_seed(prompt)).to(dev)

    def prefill():
        rt.cache.reset()
        rt.prefill(ids)

    prefill()  # warm-up (autotune, compile)
    prefill()
    ttft = median_ms(prefill, cfg.ttft_reps, dev)
    shape = wm.model.config.to_dict()
    attn = attention_ms(level, shape, prompt, dev, next(wm.model.parameters()).dtype, cfg.ttft_reps, layout)
    layers = wm.dims.n_layers
    return {"ttft_ms": ttft, "attention_ms_per_layer": attn, "attention_share": layers * attn / ttft,
            "kv_layout": layout, "default_layout": layout == DEFAULT_LAYOUT}  # fmt: skip


def _env() -> dict:
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"card": card_tag(), "gpu": dev, "commit": tree_commit(), "torch": torch.__version__, "triton": tv}


def run_grid(cfg: GridConfig, out: Path, command: str) -> list[dict]:
    """Every row of the grid, then the TTFT rows; records rewritten after each row."""
    from bench.decode.summarize_long_context import write_markdown

    t0 = time.time()
    dev, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    shape = dict(LLAMA_8B, **(SMOKE_SHAPE if cfg.smoke else {}))
    env = _env()
    card = env["card"]
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def emit(rec: dict) -> None:
        rec.update(env, command=command, elapsed_s=round(time.time() - t0, 1))
        rows.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k not in ("traceback", "command")}), flush=True)
        (out / f"long-context-{card}.json").write_text(json.dumps(rows, indent=1))
        write_markdown(rows, out / f"long-context-{card}.md")

    def attempt(rec: dict, fn) -> list[dict]:
        """fn() -> records to merge into rec; a failure or a spent budget is recorded, and the grid goes on."""
        if time.time() - t0 > cfg.budget_s:
            emit({**rec, "error": "skipped: time budget spent"})
            return []
        try:
            got = fn()  # its runtime is freed on return
            _free()
        except Exception as exc:  # noqa: BLE001 - record and keep going
            emit({**rec, "error": f"{type(exc).__name__}: {exc}"[:400], "traceback": traceback.format_exc()[-1500:]})
            _free()
            return []
        done = [{**rec, **g} for g in got]
        for r in done:
            emit(r)
        return done

    model = build_model(shape, dev, dtype)
    wm = WideModel(model, WideConfig(ffn_group_size=32 if cfg.smoke else 128))
    probe = torch.randint(0, shape["vocab_size"], (1, 32 if cfg.smoke else 512), device=dev)
    states = {}  # level name -> router weights fitted to its rates (one fit per level)
    for lv in list(cfg.levels):
        if lv.attn is not None:
            try:
                routers_at(wm, (lv.attn, lv.ffn), probe)
            except Exception as exc:  # noqa: BLE001 - the level is left out, the grid goes on
                emit({"kind": "tpot", "variant": "wide", "level": lv.name, "error": f"routers: {exc}"[:400]})
                cfg.levels.remove(lv)
                continue
            states[lv.name] = {k: v.clone() for k, v in wm.routers.state_dict().items()}
    elem = torch.tensor([], dtype=dtype).element_size()
    base: dict[tuple[int, int], float] = {}  # (ctx, B) -> the dense row's TPOT under the library's defaults
    for ctx, b, layout in ((c, b, lay) for c in cfg.contexts for b in cfg.batches for lay in cfg.layouts):
        dense: dict[str, float] = {}  # rule -> the dense row's TPOT in this layout
        for lv in cfg.levels:
            rec = {"kind": "tpot", "variant": "dense" if lv.attn is None else "wide", "level": lv.name,
                   "B": b, "ctx": ctx, "sparsity": lv.sparsity, "attn_rate": lv.attn, "ffn_rate": lv.ffn,
                   "rates_from": lv.source}  # fmt: skip
            why = fits(cache_bytes(shape, b, ctx + 16, elem))
            if why is not None:
                emit({**rec, "error": f"skipped: {why}"})
                continue
            if lv.attn is not None:
                wm.routers.load_state_dict(states[lv.name])
            cell = lambda lv=lv, b=b, ctx=ctx, lay=layout: decode_rows(wm, lv, b, ctx, cfg, dev, lay)  # noqa: E731
            for r in attempt(rec, cell):
                if lv.attn is None:
                    dense[r["rule"]] = r["tpot_ms"]
                    if r["default_rule"] and r["default_layout"]:
                        base[(ctx, b)] = r["tpot_ms"]
                ref, short = dense.get(r["rule"]), dense.get("short")
                if ref:
                    r["tpot_speedup"] = ref / r["tpot_ms"]
                    r["share_of_limit"] = r["tpot_speedup"] / r["byte_limit"]
                if short:
                    r["tpot_speedup_vs_short_dense"] = short / r["tpot_ms"]
                if (ctx, b) in base:  # what a change of rule or layout gains against today's dense step
                    r["tpot_speedup_vs_default_dense"] = base[(ctx, b)] / r["tpot_ms"]
            (out / f"long-context-{card}.json").write_text(json.dumps(rows, indent=1))
    by_name = {lv.name: lv for lv in cfg.levels}
    ttft_levels = [by_name["dense"]] + [by_name[n] for n in cfg.ttft_levels if n in by_name]
    for prompt, layout in ((p, lay) for p in cfg.prompts for lay in cfg.layouts):
        dense_ttft = None
        for lv in ttft_levels:
            rec = {"kind": "ttft", "variant": "dense" if lv.attn is None else "wide", "level": lv.name, "B": 1,
                   "ctx": prompt, "prompt": prompt, "sparsity": lv.sparsity, "attn_rate": lv.attn,
                   "ffn_rate": lv.ffn}  # fmt: skip
            why = fits(cache_bytes(shape, 1, prompt + 8, elem) + 24 * prompt * shape["intermediate_size"])
            if why is not None:
                emit({**rec, "error": f"skipped: {why}"})
                continue
            if lv.attn is not None:
                wm.routers.load_state_dict(states[lv.name])
            for r in attempt(rec, lambda lv=lv, p=prompt, lay=layout: [ttft_row(wm, lv, p, cfg, probe, dev, lay)]):
                if lv.attn is None:
                    dense_ttft = r["ttft_ms"]
                elif dense_ttft:
                    r["ttft_speedup"] = dense_ttft / r["ttft_ms"]
        (out / f"long-context-{card}.json").write_text(json.dumps(rows, indent=1))
        write_markdown(rows, out / f"long-context-{card}.md")
    return rows


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_config(argv: list[str] | None = None) -> tuple[GridConfig, Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--prompts", default="4096,16384,32768", help="TTFT prompt lengths (B 1); empty: none")
    ap.add_argument("--sparsities", default="0,0.5,0.7", help="WIDE levels at one rate for both kinds")
    ap.add_argument("--shipped", default=",".join(SHIPPED), help="checkpoints whose per-kind rates are levels")
    ap.add_argument("--ttft-levels", default="wide 50%", help="levels with TTFT rows besides dense ('/'-separated)")
    ap.add_argument("--rules", default="long,short", help="split rules timed from LONG_CONTEXT keys")
    ap.add_argument("--kv-layouts", default=DEFAULT_LAYOUT, help=f"cache layouts each cell is timed in {KV_LAYOUTS}")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=480.0, help="no row starts past this many seconds")
    ap.add_argument("--smoke", action="store_true", help="tiny model and lengths (CPU check of the code path)")
    a = ap.parse_args(argv)
    levels = [Level("dense")]
    levels += [Level(f"wide {float(s):.0%}", float(s), float(s)) for s in a.sparsities.split(",") if s]
    levels += [shipped_rates(n) for n in a.shipped.split(",") if n]
    smoke = a.smoke
    cfg = GridConfig(
        batches=_ints(a.batches if not smoke or a.batches != "1,4,16" else "1,3"),
        contexts=_ints(a.contexts if not smoke or a.contexts != "4096,16384,32768" else "48,200"),
        prompts=_ints(a.prompts if not smoke or a.prompts != "4096,16384,32768" else "32,64"),
        levels=levels,
        ttft_levels=[n for n in a.ttft_levels.split("/") if n],
        reps=a.reps if not smoke else 1,
        ttft_reps=a.ttft_reps if not smoke else 1,
        budget_s=a.budget_s,
        smoke=smoke,
        rules=[r for r in a.rules.split(",") if r],
        layouts=[x for x in a.kv_layouts.split(",") if x],
    )
    bad = [x for x in cfg.layouts if x not in KV_LAYOUTS]
    if bad or not cfg.layouts:
        raise SystemExit(f"--kv-layouts: {bad or 'none'}; known: {list(KV_LAYOUTS)}")
    unknown = [r for r in cfg.rules if r not in RULES]
    if unknown:
        raise SystemExit(f"unknown split rule(s) {unknown}; known: {list(RULES)}")
    return cfg, Path(a.out)


def main(argv: list[str] | None = None) -> None:
    cfg, out = parse_config(argv)
    command = "python -m bench.decode.long_context " + shlex.join(sys.argv[1:] if argv is None else argv)
    rows = run_grid(cfg, out, command)
    ok = sum(1 for r in rows if "error" not in r)
    print(f"{ok} of {len(rows)} rows measured -> {out}", flush=True)


if __name__ == "__main__":
    main()
