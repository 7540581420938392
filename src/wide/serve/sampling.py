"""Next-token sampling for the serving engine: greedy, temperature, top-k, top-p.

Invariants:
  * temperature 0 is greedy (argmax; ties go to the lowest token id, as ``torch.argmax``).
  * A sampled row draws from its request's own ``torch.Generator`` (seeded from the request's seed), one draw per
    token, so the same seed and the same logits give the same tokens whatever other rows share the batch.
  * ``sample`` syncs once (the chosen ids come back as a list); ``sample_tokens`` leaves them on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def request_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from ``seed`` (None: a fresh random seed)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] fp32 -> probabilities [V] after temperature, top-k (0: off) and top-p (1: off) filtering; the
    most likely token always stays."""
    x = logits / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the tokens ranked above each one
        drop = before >= top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs


def sample_tokens(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """logits: [N, V] fp32, one row per request (its settings at the same index) -> the N chosen token ids [N]
    (int64, on the logits' device; no host sync)."""
    out = logits.argmax(-1)  # [N]: greedy rows keep it
    for i, t in enumerate(temperature):
        if t > 0:
            probs = filter_logits(logits[i], t, top_k[i], top_p[i])
            out[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return out


def sample(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """``sample_tokens`` read back: the N chosen token ids as a list (one host sync)."""
    return sample_tokens(logits, temperature, top_k, top_p, generators).tolist()
