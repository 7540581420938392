"""How much of a K-routed projection (O, down) a token-tile schedule can skip on real routing masks.

A GEMM-K run by tiles of R consecutive token rows can leave out a group's K tiles only where none of
the tile's rows runs that group. ``tile_occupancy`` is the fraction of (tile, group) pairs that must
run: for rows in their natural order, and in the shared pattern order of the 'ordered' GEMM-K
(``wide.kernels.route.reorder.pattern_order``). ``occupancy_report`` sets them against the active fraction
(what skipping per token would leave) and against i.i.d. masks with the same per-group rates (what
the kernel benchmark's random masks give).
"""

from __future__ import annotations

import torch

from wide.kernels.route.reorder import pattern_order_reference


def tile_occupancy(mask: torch.Tensor, rows: int = 128, order: torch.Tensor | None = None) -> float:
    """Fraction of (tile of ``rows`` consecutive rows, group) pairs with an active row.

    mask: [M, N_G] bool (True = the row runs the group); ``order``: [M] row permutation (None: natural).
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be [M, N_G], got {tuple(mask.shape)}")
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    m = mask.bool() if order is None else mask.bool()[order.long()]
    pad = (-m.shape[0]) % rows
    if pad:  # the last tile's missing rows run nothing
        m = torch.cat([m, m.new_zeros(pad, m.shape[1])])
    return m.view(-1, rows, m.shape[1]).any(1).float().mean().item()


def shuffled_like(mask: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Each group's column permuted on its own: the same per-group rates, no correlation between rows
    or groups (the i.i.d. masks of the kernel benchmark, at this mask's rates)."""
    cols = [c[torch.randperm(c.numel(), generator=generator)] for c in mask.bool().t()]
    return torch.stack(cols, dim=1)


def occupancy_report(mask: torch.Tensor, rows: int = 128, generator: torch.Generator | None = None) -> dict:
    """Active fraction and tile occupancy (natural / pattern order) of a mask and of its i.i.d. twin."""
    iid = shuffled_like(mask, generator)
    return {
        "tokens": mask.shape[0],
        "groups": mask.shape[1],
        "active": mask.float().mean().item(),
        "natural": tile_occupancy(mask, rows),
        "ordered": tile_occupancy(mask, rows, pattern_order_reference(mask)),
        "iid_natural": tile_occupancy(iid, rows),
        "iid_ordered": tile_occupancy(iid, rows, pattern_order_reference(iid)),
    }
