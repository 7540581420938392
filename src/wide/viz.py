"""Routing analyses (paper §4.4): per-layer sparsity profiles, token routing maps, training curves."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_layer_profile(per_layer: dict[str, list[float]], out: str | Path, title: str = "") -> Path:
    """Bar chart of the attention and FFN skip rate of every layer (a meter summary's `per_layer`)."""
    plt = _plt()
    attn, ffn = per_layer["attn"], per_layer["ffn"]
    x = range(len(attn))
    fig, ax = plt.subplots(figsize=(max(6, len(attn) * 0.28), 3.2))
    w = 0.42
    ax.bar([i - w / 2 for i in x], attn, w, label="attention", color="#4c72b0")
    ax.bar([i + w / 2 for i in x], ffn, w, label="FFN", color="#dd8452")
    ax.set_xlabel("layer")
    ax.set_ylabel("skip rate")
    ax.set_ylim(0, 1)
    ax.set_xticks(list(x))
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(frameon=False, ncol=2)
    ax.set_title(title or "skip rate per layer")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return Path(out)


def plot_token_map(
    tokens: list[str], ffn_exec: torch.Tensor, attn_exec: torch.Tensor, out: str | Path, title: str = ""
) -> Path:
    """Heatmaps of the fraction of groups each token executes, per layer.
    ffn_exec / attn_exec: [L, T] fractions in [0, 1]."""
    plt = _plt()
    n_layers, n_tok = ffn_exec.shape
    fig, axes = plt.subplots(
        2, 1, figsize=(max(6, 0.42 * n_tok), 1.2 + 0.16 * n_layers * 2), sharex=True, layout="constrained"
    )
    for ax, data, name in ((axes[0], attn_exec, "attention"), (axes[1], ffn_exec, "FFN")):
        im = ax.imshow(data.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set_ylabel(f"{name}\nlayer")
    axes[1].set_xticks(range(n_tok))
    axes[1].set_xticklabels(tokens, rotation=70, fontsize=8)
    fig.colorbar(im, ax=axes, fraction=0.02, label="groups executed")
    fig.suptitle(title or "fraction of groups executed per token and layer")
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return Path(out)


def plot_training(log_jsonl: str | Path, out: str | Path, target: float | None = None) -> Path:
    """LM loss and the Gumbel-time vs argmax-time skip rates over a calibration run."""
    plt = _plt()
    rows = [json.loads(line) for line in Path(log_jsonl).read_text().splitlines() if line.strip()]
    step = [r["step"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
    a1.plot(step, [r["lm_loss"] for r in rows], color="#333")
    a1.set_xlabel("step")
    a1.set_ylabel("LM loss")
    for key, color, label in (("attn_skip", "#4c72b0", "attention"), ("ffn_skip", "#dd8452", "FFN")):
        a2.plot(step, [r[key] for r in rows], color=color, label=f"{label} (Gumbel)")
        a2.plot(step, [r[key + "_argmax"] for r in rows], color=color, ls="--", label=f"{label} (argmax)")
    if target is not None:
        a2.axhline(target, color="grey", lw=0.8, ls=":", label="target")
    a2.set_xlabel("step")
    a2.set_ylabel("skip rate")
    a2.set_ylim(0, 1)
    a2.legend(frameon=False, fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return Path(out)


@torch.no_grad()
def token_routing(wm, tokenizer, text: str) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Route one text; return its tokens and the executed fraction per layer and token ([L, T] each)."""
    device = next(wm.model.parameters()).device
    ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
    with wm.routing("argmax"):
        wm(ids)
    attn = torch.stack([m["attn"][0].float().mean(-1) for m in wm.last_masks]).cpu()  # [L, T]
    ffn = torch.stack([m["ffn"][0].float().mean(-1) for m in wm.last_masks]).cpu()
    toks = [tokenizer.decode([int(t)]) for t in ids[0]]
    return toks, ffn, attn
