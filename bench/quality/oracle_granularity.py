"""Router or granularity? WIDE's groups against a magnitude oracle and TEAL-style thresholds (CPU).

At the FFN skip rates of a WIDE checkpoint (attention dense), WikiText-2 word perplexity of SmolLM2-135M
on the first test documents for:

  learned    the FFN routers of the checkpoint (its attention routers forced to run); they skip s_l of layer
             l's FFN channels on these documents, and every other row skips s_l in layer l too
  oracle G   a magnitude oracle of WIDE's structure: in layer l, a group of G intermediate channels is
             skipped where its contribution ||W_down[:, g] a_g|| (a = SwiGLU output) is below the
             s_l-quantile of all (token, group) contributions of the batch; G = 1 is per channel
  teal       TEAL-style input sparsity: in layer l, the entries of the FFN input (gate / up) and of the
             SwiGLU output (down) below the s_l-quantile of their batch's magnitudes are zeroed

Each of oracle and teal runs twice: at the learned per-layer rates s_l, and at their mean s in every layer
(uniform). Every row removes the same share of the FFN's FLOPs (a skipped channel drops its gate / up rows
and its down column; a zeroed input entry drops one column of the projection it feeds). The oracle sees the
activations it skips, which no router can; it is greedy per layer, not a bound on what training can reach.

--kind attn: the same for attention (the FFN forced to run): the oracle decides per KV group (WIDE's
decision: all query heads of a group) or per query head, on each decision's contribution through O;
TEAL-style zeroes the entries of the q / k / v and o inputs (it skips no attention-score work).

    python -m bench.quality.oracle_granularity --out bench/results/quality/smollm2/granularity-cpu.json
    python -m bench.quality.oracle_granularity --kind attn --out bench/results/quality/smollm2/granularity-attn-cpu.json
    python -m bench.quality.oracle_granularity --learned-only --routers DIR --out F   # a checkpoint's FFN alone
    python -m bench.quality.oracle_granularity --plot bench/results/quality/smollm2/granularity-cpu.json \
        --out docs/plots/granularity-cpu.png
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from wide.eval.perplexity import wikitext_perplexity
from wide.model import load_model, load_routers

GROUPS = (128, 64, 32, 16, 8, 1)


def _quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """The threshold below which (inclusive) round(q * n) of x's n entries lie: ``x > t`` keeps the rest
    (ties aside; kthvalue is exact and has no size limit, unlike torch.quantile). -inf when none is skipped."""
    flat = x.reshape(-1).float()
    k = min(round(q * flat.numel()), flat.numel())
    return flat.kthvalue(k).values if k > 0 else flat.new_tensor(float("-inf"))


def oracle_mlp(mlp, rate: float, group: int):  # rate: this layer's s_l
    """mlp.forward with a magnitude-oracle group router: skip the (token, group) pairs below the
    rate-quantile of their contribution to the down projection. x: [B, T, D] -> [B, T, D]."""
    w_down = mlp.down_proj.weight  # [D, D']
    d_model, d_ff = w_down.shape
    ng = d_ff // group
    col_norm = w_down.norm(dim=0)  # [D']

    def forward(x: torch.Tensor) -> torch.Tensor:
        a = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)  # [B, T, D']
        if group == 1:
            score = a.abs() * col_norm  # ||W_down[:, c] a_c||
        else:
            ag = a.reshape(-1, ng, group)  # [N, G_n, G]
            score = torch.einsum("ngc,dgc->ngd", ag, w_down.view(d_model, ng, group)).norm(dim=-1)  # [N, G_n]
        keep = score > _quantile(score, rate)
        if group > 1:
            keep = keep.repeat_interleave(group, dim=-1)
        return mlp.down_proj(a * keep.view_as(a))

    return forward


def teal_mlp(mlp, rate: float):
    """mlp.forward with TEAL-style input sparsity at ``rate`` per projection input (batch quantiles)."""

    def sparsify(t: torch.Tensor) -> torch.Tensor:
        return t * (t.abs() > _quantile(t.abs(), rate))

    def forward(x: torch.Tensor) -> torch.Tensor:
        xs = sparsify(x)
        a = mlp.act_fn(F.linear(xs, mlp.gate_proj.weight)) * F.linear(xs, mlp.up_proj.weight)
        return mlp.down_proj(sparsify(a))

    return forward


def oracle_o_hook(attn, rate: float, heads: int):
    """A forward pre-hook for attn.o_proj: zero the (token, decision) pairs of ``heads`` query heads whose
    contribution ||W_o[:, heads] o_heads|| is below the rate-quantile of the batch. o: [B, T, Hq * d]."""
    w_o = attn.o_proj.weight  # [D, Hq * d]
    d = attn.head_dim
    hq = w_o.shape[1] // d

    def hook(module, args):
        o = args[0]
        y = torch.einsum("bthc,Dhc->bthD", o.view(*o.shape[:-1], hq, d), w_o.view(-1, hq, d))  # [B, T, Hq, D]
        y = y.view(*y.shape[:2], hq // heads, heads, -1).sum(3)  # [B, T, decisions, D]
        keep = y.norm(dim=-1) > _quantile(y.norm(dim=-1), rate)  # [B, T, decisions]
        return (o * keep.repeat_interleave(heads * d, dim=-1),)

    return hook


def teal_hook(rate: float):
    """A forward pre-hook zeroing the entries of a projection's input below its batch's rate-quantile."""

    def hook(module, args):
        x = args[0]
        return (x * (x.abs() > _quantile(x.abs(), rate)),)

    return hook


def learned_rows(model, routers: str, kind: str, ppl) -> tuple[float, float, list[float], int]:
    """The checkpoint's ``kind`` routers alone (the other kind's forced to run), on the masked path (on the
    CPU the served runtime's decisions and logits are the same, docs/routing.md): (word perplexity, skip
    rate, per-layer skip rates, FFN group size). The model is left without routers."""
    wm = load_routers(model, routers)
    other = "ffn" if kind == "attn" else "attn"
    for r in wm.routers:
        getattr(r, other).skip_bias.fill_(-1e4)
    wm.start_meter()
    word_ppl = ppl(f"learned {kind} routers")
    meter = wm.stop_meter()
    wm.detach()
    return word_ppl, meter[f"{kind}_sparsity"], meter["per_layer"][kind], wm.config.ffn_group_size


def run_attention(args: argparse.Namespace, model, ppl) -> list[dict]:
    """The attention rows: learned routers (FFN forced to run), then per layer the oracle per KV group and
    per query head and TEAL-style on q / k / v / o inputs, at the learned per-layer and uniform rates."""
    rows = [{"method": "dense", "attn_skip": 0.0, "word_ppl": ppl("dense")}]
    learned, rate, per_layer, _ = learned_rows(model, args.routers, "attn", ppl)
    attns = [layer.self_attn for layer in model.model.layers]
    per_group = attns[0].num_key_value_groups  # query heads per KV group: one WIDE decision
    rows.append({"method": "learned", "routers": args.routers, "heads": per_group, "attn_skip": rate,
                 "per_layer": per_layer, "word_ppl": learned})  # fmt: skip
    for alloc, rates in (("learned", per_layer), ("uniform", [rate] * len(attns))):
        for heads in (per_group, 1):
            hooks = [
                a.o_proj.register_forward_pre_hook(oracle_o_hook(a, s_l, heads))
                for a, s_l in zip(attns, rates, strict=True)
            ]
            try:
                rows.append({"method": "oracle", "allocation": alloc, "heads": heads, "attn_skip": rate,
                             "word_ppl": ppl(f"oracle per {heads} heads, {alloc} rates")})  # fmt: skip
            finally:
                for h in hooks:
                    h.remove()
        projs = ("q_proj", "k_proj", "v_proj", "o_proj")
        hooks = [getattr(a, p).register_forward_pre_hook(teal_hook(s_l))
                 for a, s_l in zip(attns, rates, strict=True) for p in projs]  # fmt: skip
        try:
            rows.append({"method": "teal", "allocation": alloc, "attn_skip": rate,
                         "word_ppl": ppl(f"teal, {alloc} rates")})  # fmt: skip
        finally:
            for h in hooks:
                h.remove()
    return rows


def run(args: argparse.Namespace) -> dict:
    model, tok = load_model(args.model)
    for mlp in (layer.mlp for layer in model.model.layers):
        if mlp.gate_proj.bias is not None or mlp.down_proj.bias is not None:
            raise SystemExit("this study assumes bias-free FFN projections (Llama / Qwen / Mistral)")

    def ppl(desc: str) -> float:
        res = wikitext_perplexity(
            model, tok, max_length=args.max_length, batch_size=args.batch_size, limit_docs=args.docs,
            device="cpu", desc=desc,
        )  # fmt: skip
        return res["word_perplexity"]

    t0 = time.time()
    command = "python -m bench.quality.oracle_granularity " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in vars(args).items()
        if v is not None and v is not False
    )
    meta = {"command": command, "kind": args.kind, "model": args.model, "docs": args.docs,
            "max_length": args.max_length}  # fmt: skip
    if args.kind == "attn":
        rows = run_attention(args, model, ppl)
        return meta | {"wall_s": time.time() - t0, "rows": rows}
    rows = [{"method": "dense", "ffn_skip": 0.0, "word_ppl": ppl("dense")}]
    learned, rate, per_layer, group = learned_rows(model, args.routers, "ffn", ppl)
    rows.append({"method": "learned", "routers": args.routers, "group": group,
                 "ffn_skip": rate, "per_layer": per_layer, "word_ppl": learned})  # fmt: skip
    if args.learned_only:
        return meta | {"wall_s": time.time() - t0, "rows": rows}
    layers = model.model.layers
    originals = [layer.mlp.forward for layer in layers]
    try:
        for alloc, rates in (("learned", per_layer), ("uniform", [rate] * len(layers))):
            for g in GROUPS:
                for layer, s_l in zip(layers, rates, strict=True):
                    layer.mlp.forward = oracle_mlp(layer.mlp, s_l, g)
                rows.append({"method": "oracle", "allocation": alloc, "group": g, "ffn_skip": rate,
                             "word_ppl": ppl(f"oracle G {g}, {alloc} rates")})  # fmt: skip
            for layer, s_l in zip(layers, rates, strict=True):
                layer.mlp.forward = teal_mlp(layer.mlp, s_l)
            rows.append({"method": "teal", "allocation": alloc, "ffn_skip": rate,
                         "word_ppl": ppl(f"teal, {alloc} rates")})  # fmt: skip
    finally:
        for layer, fwd in zip(model.model.layers, originals, strict=True):
            layer.mlp.forward = fwd
    return meta | {"wall_s": time.time() - t0, "rows": rows}


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    rows = result["rows"]
    dense = rows[0]["word_ppl"]
    attn = result.get("kind") == "attn"
    what, other, skip = ("attention", "FFN", "attn_skip") if attn else ("FFN", "attention", "ffn_skip")
    unit = "KV groups' heads" if attn else "intermediate channels"
    lines = [
        f"# Router or granularity: SmolLM2-135M's {what} at the routers' skip rates (CPU, {other} dense)",
        "",
        f"Command: `{result['command']}` ({result['wall_s']:.0f} s). WikiText-2 word perplexity over the first "
        f"{result['docs']} test documents in {result['max_length']}-token windows. Every row skips the share "
        f"of the {what}'s {unit} that the learned routers skipped on these documents: per layer as they did "
        "('learned'), or their mean in every layer ('uniform').",
        "",
        f"| row | per-layer rates | {what} skipped | word ppl | × dense |",
        "|---|---|---|---|---|",
    ]
    teal = "TEAL-style input thresholds (per channel of each projection's input)"
    for r in rows:
        name = {"dense": "dense", "teal": teal}.get(r["method"], "")
        if r["method"] == "learned":
            size = f"{r['heads']} heads" if attn else f"G {r['group']}"
            name = f"learned WIDE routers (`{Path(r['routers']).name}`, {size})"
        elif r["method"] == "oracle" and attn:
            name = f"magnitude oracle, per {r['heads']} query head" + ("s (a KV group)" if r["heads"] > 1 else "")
        elif r["method"] == "oracle":
            name = f"magnitude oracle, G {r['group']}" + (" (per channel)" if r["group"] == 1 else "")
        alloc = {"dense": "-", "learned": "learned"}.get(r["method"], r.get("allocation", ""))
        lines.append(f"| {name} | {alloc} | {r[skip]:.3f} | {r['word_ppl']:.2f} | {r['word_ppl'] / dense:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def plot(result: dict, out: Path) -> None:
    """Perplexity (x dense) against the group size of the oracle, TEAL and the learned routers as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    dense = rows[0]["word_ppl"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    styles = {"learned": ("tab:blue", "o", "-"), "uniform": ("tab:orange", "s", "--")}
    for alloc, (color, marker, ls) in styles.items():
        pts = sorted((r["group"], r["word_ppl"] / dense) for r in rows if r.get("allocation") == alloc and "group" in r)
        ax.plot(*zip(*pts, strict=True), color=color, marker=marker, ls=ls, label=f"magnitude oracle, {alloc} rates")
        teal = next(r for r in rows if r["method"] == "teal" and r["allocation"] == alloc)
        ax.axhline(teal["word_ppl"] / dense, color=color, ls=":", label=f"TEAL-style, {alloc} rates")
    learned = next(r for r in rows if r["method"] == "learned")
    ax.plot([learned["group"]], [learned["word_ppl"] / dense], "k*", ms=12, label="learned WIDE routers")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([1, 2, 4, 8, 16, 32, 64, 128], ["1", "2", "4", "8", "16", "32", "64", "128"])
    ticks = [1, 1.5, 2, 3, 4, 6, 8]
    ax.set_yticks(ticks, [f"{t:g}×" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("FFN channels per skip decision (G)")
    ax.set_ylabel("WikiText-2 word perplexity / dense")
    ax.set_title(f"FFN skip rate {learned['ffn_skip']:.0%} in every row, attention dense")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plot", type=Path, help="plot this FFN result file to --out (a .png) instead of running")
    ap.add_argument("--kind", choices=["ffn", "attn"], default="ffn", help="which half of the layer is studied")
    ap.add_argument("--out", type=Path, default=Path("bench/results/quality/smollm2/granularity-cpu.json"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--routers", default="src/wide/checkpoints/smollm2-135m-s50")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--learned-only", action="store_true", help="FFN: only the dense and learned rows")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.out)
        return
    torch.manual_seed(0)
    with torch.no_grad():
        write(run(args), args.out)


if __name__ == "__main__":
    main()
