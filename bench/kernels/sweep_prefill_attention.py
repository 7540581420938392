"""Routed prefill attention's launch configurations at long prompts, against the fastest SDPA backend
(docs/long-context.md#ttft).

The TTFT rows of the long-context grid time the routed prefill attention with the kernel's default launch
configuration, which was chosen at prompts of ≤ 8k; this times each candidate configuration (BLOCK_M stacked rows,
BLOCK_N keys, num_warps, num_stages) at B 1 and each prompt length, dense mask and i.i.d. masks at each sparsity,
after checking each configuration against the fp32 reference under the bf16 rule on an odd shape.

    PYTHONPATH=src:. python -m bench.kernels.sweep_prefill_attention --out $OUT
        -> OUT/prefill-sweep-CARD.{json,md}
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from wide.bench.checks import within_bf16_rule
from wide.bench.timing import card_tag, tree_commit

CONFIGS = "128,128,8,3/128,64,8,3/128,128,8,2/128,128,8,4/128,64,4,3/64,128,4,3/64,64,4,3/128,128,4,3"


def check_config(config: tuple[int, int, int, int] | None, device: str, interpret: bool) -> dict:
    """The configuration's routed prefill against the fp32 reference (bf16 rule) on B 2, T 333 (odd, not a tile
    multiple), GQA 4, head_dim 128, a random mask with one (b, g) column fully skipped."""
    from wide.kernels.attention import routed_attention_prefill
    from wide.kernels.attention.reference import attention_prefill_ref

    b, t, hq, hk, d = (2, 45, 8, 2, 64) if interpret else (2, 333, 8, 2, 128)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, t, hq, d, generator=g)  # [B, T, Hq, d]
    k = torch.randn(b, t, hk, d, generator=g)  # [B, T, Hk, d]
    v = torch.randn(b, t, hk, d, generator=g)
    mask = torch.rand(b, t, hk, generator=g) < 0.5  # [B, T, Hk] True = run
    mask[1, :, 0] = False
    if interpret:  # fp32 through the interpreter: the fp32 reference's tolerance
        ref32 = attention_prefill_ref(q, k, v, mask)
        out = routed_attention_prefill(q, k, v, mask, config=config)
        err = (out.float().cpu() - ref32).abs().max().item()
        return {"ok": err < 1e-3, "err": err, "torch_bf16_err": None}
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    ref32 = attention_prefill_ref(q, k, v, mask)  # upcast: fp32 math on the bf16 inputs
    ref16 = attention_prefill_ref(q, k, v, mask, upcast=False)  # plain PyTorch in bf16
    out = routed_attention_prefill(*(x.to(device) for x in (q, k, v)), mask.to(device), config=config)
    ok, err, base = within_bf16_rule(out.float().cpu(), ref32, ref16)
    return {"ok": ok, "err": err, "torch_bf16_err": base}


def parse_configs(text: str) -> list[tuple[int, int, int, int]]:
    """'BM,BN,W,S/BM,BN,W,S/…' -> configurations; one that is not four integers is a one-line error."""
    out = []
    for part in (p for p in text.split("/") if p.strip()):
        vals = [int(x) for x in part.split(",")]
        if len(vals) != 4:
            raise SystemExit(f"--configs: '{part}' is not BLOCK_M,BLOCK_N,num_warps,num_stages")
        out.append(tuple(vals))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--prompts", default="4096,16384,32768")
    ap.add_argument("--sparsities", default="0,0.5")
    ap.add_argument("--configs", default=CONFIGS, help="'/'-separated BLOCK_M,BLOCK_N,num_warps,num_stages")
    ap.add_argument("--budget-s", type=float, default=240.0, help="no configuration starts past this many seconds")
    ap.add_argument("--kv-layouts", default="nhd,hnd", help="K / V memory layouts each configuration is timed in")
    ap.add_argument("--smoke", action="store_true", help="CPU: the correctness checks only, through the interpreter")
    a = ap.parse_args(argv)
    t0 = time.time()
    configs = parse_configs(a.configs)
    interpret = a.smoke or not torch.cuda.is_available()
    device = "cpu" if interpret else "cuda"
    prompts = [int(x) for x in a.prompts.split(",") if x]
    levels = [float(x) for x in a.sparsities.split(",") if x]
    layouts = [x for x in a.kv_layouts.split(",") if x]
    if not layouts or any(x not in ("nhd", "hnd") for x in layouts):
        raise SystemExit(f"--kv-layouts: {a.kv_layouts!r}; known: nhd, hnd")
    command = "python -m bench.kernels.sweep_prefill_attention " + shlex.join(sys.argv[1:] if argv is None else argv)
    meta = {"command": command, "commit": tree_commit(), "card": card_tag(device),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__}  # fmt: skip
    rows: list[dict] = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"prefill-sweep-{meta['card']}"
    for cfg in [None, *configs]:
        if time.time() - t0 > a.budget_s:
            rows.append({"config": cfg, "skipped": "budget"})
            continue
        check = check_config(cfg, device, interpret)
        base = {"config": list(cfg) if cfg else "default", **{f"check_{k}": v for k, v in check.items()}}
        if interpret or not check["ok"]:
            rows.append(base)
        else:
            from wide.bench.attention_bench import bench_prefill

            for t, layout in ((t, lay) for t in prompts for lay in layouts):
                for r in bench_prefill(1, t, levels, config=cfg, layout=layout):
                    rows.append({**base, "T": t, "kv_layout": layout, "sparsity": r["sparsity"],
                                 "wide_ms": r["wide_ms"], "sdpa_ms": r["dense_ms"], "sdpa_backend": r["baseline"],
                                 "speedup": r["speedup"], "real_sparsity": r.get("real_sparsity")})  # fmt: skip
                torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
        meta["wall_s"] = round(time.time() - t0, 1)
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "records": rows}, indent=1))
        stem.with_suffix(".md").write_text(render(meta, rows))


def render(meta: dict, rows: list[dict]) -> str:
    """The sweep as a table: one row per (configuration, prompt, sparsity)."""
    lines = [f"# Routed prefill attention: launch configurations ({meta['device']}, {meta['commit']})", "",
             f"Command: `{meta['command']}`", "",
             "| config (BM, BN, warps, stages) | bf16 rule | T | K/V layout | sparsity | WIDE ms | SDPA ms | vs SDPA |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        cfg = r["config"] if isinstance(r["config"], str) else ",".join(map(str, r["config"] or []))
        if "skipped" in r:
            lines.append(f"| {cfg} | skipped ({r['skipped']}) | | | | | | |")
        elif "T" not in r:
            lines.append(f"| {cfg} | {'ok' if r['check_ok'] else 'FAIL'} ({r['check_err']:.2e}) | | | | | | |")
        else:
            lines.append(f"| {cfg} | ok | {r['T']} | {r['kv_layout']} | {r['sparsity']:.2f} | {r['wide_ms']:.3f} "
                         f"| {r['sdpa_ms']:.3f} "
                         f"| {r['speedup']:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
