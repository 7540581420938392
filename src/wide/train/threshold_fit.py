"""Fit argmax thresholds after training so that inference skips at the rate training ran under.

Under hard Gumbel-Softmax a router skips group g with probability softmax(logits)[skip]; argmax skips
only where the margin logit(skip) − logit(execute) > 0, which can be far rarer (a router whose skip
probability hovers around 0.3 never skips under argmax). A per-router offset δ added to the skip logit
(`Router.skip_bias`) moves the argmax rate onto a target:

  mode "router": every router matches its own expected Gumbel-time rate;
  mode "kind":   one δ for all attention routers and one for all FFN routers, each matching that
                 kind's mean expected rate (keeps argmax's per-layer allocation);
  mode "global": one δ for every router, matching the loss's overall rate
                 mean_l ½(rate_attn_l + rate_ffn_l) (keeps argmax's attention / FFN split too).
The expected rate is the one training sampled under, i.e. with the offsets the routers carried while it
ran (``train_bias``): zero in stage 1, the stage-1 fit's δ in stage 2 (LoRA recovery starts from fitted
routers and its sparsity loss holds the rate with that δ in the margin). Fitting stage 2 to its δ = 0 rates
instead lets its real sparsity fall (docs/design.md#threshold-fit).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from wide.routing import fit_skip_bias

FIT_MODES = ("router", "kind", "global", "none")
Key = tuple[int, str]  # (layer, "attn" | "ffn")


def _name(key: Key) -> str:
    """A router's name in a fit record: (3, "attn") -> "attn3"."""
    return f"{key[1]}{key[0]}"


def _key(name: str) -> Key:
    """The inverse of ``_name``: "ffn12" -> (12, "ffn")."""
    kind = "attn" if name.startswith("attn") else "ffn"
    return int(name[len(kind) :]), kind


def skip_biases(wm) -> dict[Key, float]:
    """Every router's current skip-logit offset δ (the offsets a training run starting now samples under)."""
    return {(i, k): float(getattr(r, k).skip_bias) for i, r in enumerate(wm.routers) for k in ("attn", "ffn")}


@torch.no_grad()
def collect_margins(
    wm, batches: Iterable[dict], device: torch.device, train_bias: dict[Key, float] | None = None
) -> tuple[dict, dict]:
    """Skip margins (argmax decisions, offsets at 0) and expected Gumbel-time skip rates per router, the
    latter under the offsets ``train_bias`` (default 0) that training sampled with."""
    train_bias = train_bias or {}
    margins: dict[Key, list] = {(i, k): [] for i in range(len(wm.routers)) for k in ("attn", "ffn")}
    probs: dict[Key, list] = {key: [] for key in margins}
    for r in wm.routers:
        r.attn.skip_bias.zero_()
        r.ffn.skip_bias.zero_()
    amp = torch.bfloat16 if device.type == "cuda" else None
    with wm.routing("gumbel"):
        for batch in batches:
            ids, am = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                wm(ids, attention_mask=am)
            keep = am.bool()
            for (i, k), lst in margins.items():
                mg = wm.last_masks[i][k + "_margin"][keep]  # [N_tok, N_G] skip margins
                lst.append(mg.flatten())
                # the two-class softmax's P(skip), with the offset training sampled under
                probs[(i, k)].append(torch.sigmoid(mg + train_bias.get((i, k), 0.0)).flatten())
    m = {key: torch.cat(v) for key, v in margins.items()}
    p = {key: float(torch.cat(v).mean()) for key, v in probs.items()}
    return m, p


def _overall(rates: dict[Key, float]) -> float:
    """The loss's overall rate: mean over layers of ½(attention rate + FFN rate)."""
    layers = sorted({i for i, _ in rates})
    return sum(0.5 * (rates[(i, "attn")] + rates[(i, "ffn")]) for i in layers) / len(layers)


def _rates(margins: dict[Key, torch.Tensor], deltas: dict[Key, float]) -> dict[Key, float]:
    return {key: float(((m + deltas[key]) > 0).float().mean()) for key, m in margins.items()}


def _bisect(f, target: float, lo: float = -50.0, hi: float = 50.0, iters: int = 50) -> float:
    """δ with f(δ) ≈ target for a non-decreasing f."""
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return 0.5 * (lo + hi)


def fit_offsets(margins: dict[Key, torch.Tensor], expected: dict[Key, float], mode: str) -> dict[Key, float]:
    """The skip-logit offset of every router under `mode` (see the module docstring)."""
    if mode not in FIT_MODES:
        raise ValueError(f"fit mode must be one of {FIT_MODES}, got {mode!r}")
    if mode == "none":
        return dict.fromkeys(margins, 0.0)
    if mode == "router":
        return {key: fit_skip_bias(m, expected[key]) for key, m in margins.items()}
    if mode == "kind":
        out = {}
        for kind in ("attn", "ffn"):
            keys = [key for key in margins if key[1] == kind]
            target = sum(expected[k] for k in keys) / len(keys)

            def mean_rate(x: float, keys: list[Key] = keys) -> float:
                return sum(((margins[k] + x) > 0).float().mean().item() for k in keys) / len(keys)

            d = _bisect(mean_rate, target)
            out.update(dict.fromkeys(keys, d))
        return out
    target = _overall(expected)
    d = _bisect(lambda x: _overall(_rates(margins, dict.fromkeys(margins, x))), target)
    return dict.fromkeys(margins, d)


@torch.no_grad()
def fit_thresholds(
    wm, batches: Iterable[dict], device: torch.device, mode: str = "router", train_bias: dict[Key, float] | None = None
) -> dict:
    """Fit and set every router's skip_bias to the rates training ran at (under ``train_bias``, default 0);
    return the argmax skip rates before and after, the expected rates and the offsets trained under."""
    margins, expected = collect_margins(wm, batches, device, train_bias)
    deltas = fit_offsets(margins, expected, mode)
    for (i, k), d in deltas.items():
        getattr(wm.routers[i], k).skip_bias.fill_(d)
    before = {_name(k): v for k, v in _rates(margins, dict.fromkeys(margins, 0.0)).items()}
    after = {_name(k): v for k, v in _rates(margins, deltas).items()}
    return {
        "mode": mode,
        "argmax_skip_before": before,
        "argmax_skip_after": after,
        "expected_gumbel_skip": {_name(k): v for k, v in expected.items()},
        "trained_skip_bias": {_name(k): (train_bias or {}).get(k, 0.0) for k in margins},
    }


def trained_bias_of(fit: dict | None) -> dict[Key, float] | None:
    """The offsets a checkpoint's routers were trained under, from its recorded fit (``trained_skip_bias``,
    names like "attn3"); None where the record predates it (then 0 is assumed, as stage 1 trains)."""
    named = (fit or {}).get("trained_skip_bias")
    if not named:
        return None
    return {_key(n): float(v) for n, v in named.items()}
