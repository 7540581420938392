"""Launch rules of the fused decode layer: batch limit, grids, K splits, stages, the down step, the attention
splits, and ``launch_overrides`` (GPU sweeps replace a rule's value within a block). One place decides each
launch shape (docs/kernels.md#fused-decode-layer)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields

import torch

from .._triton_utils import largest_pow2_divisor, next_pow2

MAX_BATCH = 16  # decode only: one 16-row tensor-core tile holds the batch


_SWITCHES = ("compact_k", "router_overlap", "long_context")  # LaunchOverrides fields that are 0 / 1


@dataclass(frozen=True)
class LaunchOverrides:
    """Launch shapes that replace this module's shape rules (None: the rule), for GPU sweeps
    (``launch_overrides``). block_k / num_warps / num_stages: the weight-streaming loops; qkv_slices: row
    slices per head; *_splits: K splits (powers of two); o_block_n / ffn_block_n: output columns per tile;
    ffn_chunk: channels per FFN producer; down_block_k / down_stages: K step and pipeline depth of the FFN's
    down-projection loop alone (block_k and down_block_k >= 16, a tensor-core dot's K); down_span: columns a
    down step gathers from whole groups narrower than it (``down_step``; the rule: NARROW_DOWN_SPAN;
    down_span=G gives one group a step);
    compact_k: 1 (the rule) the routed O and down loops visit only the K steps of groups some token runs (a
    list per program), 0 they predicate the others off; norm_tile: elements per step of the norm tails;
    attn_splits: KV splits of every running pair of decode attention (any count; the rule: ``attn_num_splits``
    on the running pairs), attn_programs: the programs that rule aims for (the rule: the SM count), attn_block_n:
    keys per step (a power of two >= 16), attn_warps; router_overlap: 1 the layer's routers run on a side stream
    beside a QKV launch that computes every Q head, 0 (the rule) they run before it and QKV skips the Q heads of
    groups no token runs (``router_overlap``); long_context: 1 decode attention over a cache of at least
    ``LONG_CONTEXT`` keys takes the long-context split rule (``attn_num_splits``), 0 (the rule until a GPU run
    keeps it: docs/long-context.md#the-split-rule) the short one at any length."""

    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    qkv_slices: int | None = None
    qkv_splits: int | None = None
    o_block_n: int | None = None
    o_splits: int | None = None
    ffn_block_n: int | None = None
    ffn_chunk: int | None = None
    ffn_splits: int | None = None
    down_block_k: int | None = None
    down_span: int | None = None
    down_stages: int | None = None
    compact_k: int | None = None
    norm_tile: int | None = None
    attn_splits: int | None = None
    attn_programs: int | None = None
    attn_block_n: int | None = None
    attn_warps: int | None = None
    router_overlap: int | None = None
    long_context: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _SWITCHES and v not in (None, 0, 1):
                raise ValueError(f"launch override {f.name} must be 0 or 1, got {v!r}")
            if f.name not in _SWITCHES and v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"launch override {f.name} must be a positive int, got {v!r}")
            pow2 = f.name.endswith("_splits") and f.name != "attn_splits" or f.name in ("attn_block_n", "down_span")
            if v is not None and pow2 and v & (v - 1):
                raise ValueError(f"launch override {f.name} must be a power of two, got {v}")
            if v is not None and f.name in ("block_k", "down_block_k") and v < 16:  # a tensor-core dot's K
                raise ValueError(f"launch override {f.name} must be at least 16, got {v}")


_OVERRIDES: ContextVar[LaunchOverrides | None] = ContextVar("wide_fused_launch", default=None)  # None: no overrides


@contextmanager
def launch_overrides(**shapes: int) -> Iterator[LaunchOverrides]:
    """Within the block (and CUDA graphs captured in it) the fused kernels launch with these shapes
    instead of the shape rules; keys are ``LaunchOverrides``' fields (an unknown key: TypeError)."""
    ov = LaunchOverrides(**shapes)
    token = _OVERRIDES.set(ov)
    try:
        yield ov
    finally:
        _OVERRIDES.reset(token)


def _ov(name: str, rule):
    """The override of ``name`` if one is set, else ``rule`` (a value)."""
    ov = _OVERRIDES.get()
    v = None if ov is None else getattr(ov, name)
    return rule if v is None else v


BLOCK_M = 16


def router_overlap(cuda: bool) -> bool:
    """Whether a routed decode layer runs its routers beside the QKV launch (on a side stream;
    QKV then computes every Q head, which the routed attention and O ignore for groups no token runs) instead
    of before it. A Q head is the same GEMV whether or not its neighbours run, so both give the same logits bit
    for bit. The rule: beside QKV wherever a side stream exists (cuda), before it on the CPU, where the launches
    run in order anyway (docs/kernels.md#fused-decode-layer); ``launch_overrides(router_overlap=0 / 1)`` forces
    either, also on the CPU (no side stream there: the same launches in order, for the tests)."""
    return bool(_ov("router_overlap", int(cuda)))


def _prec(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _sms(t: torch.Tensor) -> int:
    if t.is_cuda:
        return torch.cuda.get_device_properties(t.device).multi_processor_count
    return 132


def _gemv_blocks(t: torch.Tensor) -> tuple[int, int]:
    """(BLOCK_K, num_warps) of the weight-streaming loops: wide K tiles on the GPU, small in the interpreter."""
    if not t.is_cuda:
        return 64, 1
    return _ov("block_k", 256), _ov("num_warps", 4)


def _stages(t: torch.Tensor, rule: int | None = None) -> dict:
    """The kernel's num_stages: the override, else ``rule``, else Triton's default."""
    stages = _ov("num_stages", rule)
    return {"num_stages": stages} if t.is_cuda and stages is not None else {}


# A list-driven K loop keeps about (stages - 1) / 2 weight tiles in flight where the predicated loop keeps
# stages - 1, so it runs deeper than Triton's default (docs/kernels.md#fused-decode-layer).
COMPACT_STAGES = 5
# The down loop gathers whole groups narrower than this into steps of up to this many columns (``down_step``;
# wider groups step one at a time), so that narrow groups take no more loop trips than 128-column ones
# (docs/kernels.md#fused-decode-layer).
NARROW_DOWN_SPAN = 128


def _norm_blocks(b: int, d: int, t: torch.Tensor) -> dict:
    """Row and column tile of the single-program RMSNorm passes: [RB, NB] with RB * NB = 16384 elements on the
    GPU, 256 in the interpreter. The pass runs in one program after every tile is done, so its dependent steps
    are on the critical path; wider steps win over the registers they take from the kernel (a sweep of
    ``norm_tile``, docs/kernels.md#fused-decode-layer)."""
    rb = max(2, next_pow2(b))
    total = _ov("norm_tile", 16384) if t.is_cuda else 256
    return {"RB": rb, "NB": max(16, min(next_pow2(d), total // rb))}


def qkv_row_slices(head_dim: int, qk_norm: bool, n_heads: int, sms: int) -> int:
    """Row slices per head for the QKV kernel: each slice >= 32 rows of each RoPE half (then the K split,
    ``k_splits``, fills the SMs: wider tiles read faster than more of them)."""
    if qk_norm:
        return 1
    rs = 1
    while rs * 2 * 64 <= head_dim and n_heads * rs < 2 * sms:
        rs *= 2
    return rs


# Caches of at least this many keys take the long-context split rule; LONG_WAVES: the programs per SM it aims
# for (docs/kernels.md#split-count-at-long-context).
LONG_CONTEXT = 8192
LONG_WAVES = 4


def long_context(max_len: int) -> bool:
    """Whether decode attention over a cache of ``max_len`` keys takes the long-context split rule: from
    ``LONG_CONTEXT`` keys, when the ``long_context`` override turns it on. Off by default: it is correct (its
    tests) but not yet timed on a GPU (docs/long-context.md#the-split-rule)."""
    return max_len >= LONG_CONTEXT and bool(_ov("long_context", 0))


def attn_split_cap(max_len: int) -> int:
    """The most KV splits a decode attention call takes: at most 16, each of at least 256 keys; at long
    context (``long_context``) at most 32, each of at least 512 keys."""
    if long_context(max_len):
        return max(1, min(32, max_len // 512))
    return max(1, min(16, max_len // 256))


def attn_programs(max_len: int, sms: int) -> int:
    """The programs the split rule aims for: one per SM; at long context ``LONG_WAVES`` per SM, so that the
    running pairs' count rounds the last wave off by a small part (``attn_num_splits``)."""
    return sms * (LONG_WAVES if long_context(max_len) else 1)


def attn_num_splits(running: int, max_len: int, programs: int) -> int:
    """KV splits of each running (token, group) pair, from how many of the batch's pairs run: ``programs //
    running`` (``attn_programs``: about one program per SM, at long context several) within ``attn_split_cap``.
    At short context more programs lose (the merging program reads every split's partials in turn), fewer
    leave SMs idle, with every pair running and with half of them skipped alike
    (docs/kernels.md#fused-decode-layer); at long context a split's keys outweigh its merge, and one program
    per SM leaves up to half of them idle when the running count passes a divisor of the SM count
    (docs/kernels.md#split-count-at-long-context). The kernel applies it to the count it reads from the mask,
    so the count, and with it a token's rounding, depends on the batch's masks (a repeat is bit-identical)."""
    return max(1, min(attn_split_cap(max_len), programs // max(1, running)))


def k_splits(n_tiles: int, max_splits: int, sms: int) -> int:
    """K splits of an output-tiled GEMV (O, down): the largest power of two <= max_splits that keeps the
    programs at most ~2 per SM, so that every SM streams weights with several programs (docs/kernels.md,
    "Fused decode layer")."""
    ks = 1
    while ks * 2 <= max_splits and n_tiles * ks * 2 <= 2 * sms:
        ks *= 2
    return ks


def ffn_chunk(group: int, n_groups: int, sms: int) -> int:
    """Channels per FFN producer: the group's largest power-of-two divisor (<= 128), halved down to 16
    while there are fewer than ~2 producers per SM."""
    ch = largest_pow2_divisor(group, 128)
    if ch < 16:
        raise ValueError(f"FFN group size {group} is not a multiple of 16 channels")
    while ch > 16 and n_groups * (group // ch) < 2 * sms:
        ch //= 2
    return ch


def down_step(group: int, n_groups: int, splits: int, step: int, span: int) -> tuple[int, int]:
    """(BLOCK_KD, SUB) of the FFN's down-projection loop: sub-steps of the group's largest power-of-two divisor
    <= step, and SUB > 1 whole groups a step, up to ``span`` columns (0: one group), where every K split starts
    on a step (split s starts at group s * n_groups // splits) and the step's SUB run bits fit below its first
    column (2**SUB <= the step's columns: at most 8 groups of 32 a step). Narrow groups then take as few loop trips as
    ``span``-wide ones and read the same bytes (docs/kernels.md#fused-decode-layer)."""
    bkd = largest_pow2_divisor(group, step)
    sub = 1
    if bkd == group:
        # a list entry is the step's first column (a multiple of bkd * sub) plus SUB run bits: 2**SUB <= bkd * sub
        while (
            bkd * sub * 2 <= span
            and 2 ** (sub * 2) <= bkd * sub * 2
            and all(s * n_groups // splits % (sub * 2) == 0 for s in range(splits))
        ):
            sub *= 2
    return bkd, sub


def _compact(mask: torch.Tensor | None, steps: int) -> tuple[bool, int]:
    """(COMPACT, NS_P) of a routed K loop of at most ``steps`` steps a program: the list-driven loop (the rule;
    ``compact_k=0`` predicates instead), its list length a power of two >= steps; 1 without a list, so that the
    predicated loop's compiled kernel does not depend on the step count."""
    compact = mask is not None and bool(_ov("compact_k", 1))
    return compact, next_pow2(max(steps, 1)) if compact else 1


def _k_lists(t: torch.Tensor, programs: int, ns_p: int, compact: bool) -> torch.Tensor:
    """int32 scratch [programs, NS_P]: each program's list of the K steps it visits (COMPACT), else a dummy."""
    return torch.empty(programs * ns_p if compact else 1, dtype=torch.int32, device=t.device)
