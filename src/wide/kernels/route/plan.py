"""The routing-path policy: which kernel path each operator of one routing decision takes.

One decision (a routing mask [M, N_G] over groups of ``group_size`` columns) serves several operators:
  attention: Q (GEMM-MN) -> routed attention -> O (GEMM-K)
  FFN:       gate+up (fused GEMM-MN) -> down (GEMM-K)
``plan`` decides their paths once, on the host, from shapes and the expected sparsity (never from the
mask, so no host sync); ``reorder.plan_route(mask, plan)`` builds the route that carries the plan, and
the operators read ``route.plan``. Every threshold of the policy lives in this module; the measurements
behind them are in docs/kernels.md#path-policy.

GEMM-MN (Q, gate/up) paths:
  small  (M <= SMALL_M): the decode kernels read the mask and skip the weight tiles no token runs.
  dense  (SMALL_M < M <= DENSE_M, or past it when little is skipped): cuBLAS + a masked epilogue.
  sorted (M > DENSE_M): rows gathered per group through the reorder index; inactive tiles exit.
GEMM-K (O, down) paths:
  small   (M <= SMALL_M_K, groups of >= 64 columns, or M 1): the decode kernel skips unused groups.
  dense   (otherwise): cuBLAS over the producer's zeros (or over x with its inactive groups zeroed).
  ordered (few groups, large M, enough expected sparsity): rows in one shared pattern order, each
          tile streams only the K tiles of the groups some of its rows run.

Forcing a path uses the same vocabulary: ``plan(..., force_mn="sorted", force_k="dense")`` or a ``Plan``
built by hand (``plan_route`` checks it). ``wide.kernels.route.plan`` is the function; import the thresholds
from this module (``from wide.kernels.route.plan import SMALL_M``).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

MNPath = Literal["small", "dense", "sorted"]
KPath = Literal["small", "dense", "ordered"]
MN_PATHS: tuple[str, ...] = ("small", "dense", "sorted")
K_PATHS: tuple[str, ...] = ("small", "dense", "ordered")

# Token-count regimes (docs/kernels.md#path-policy).
SMALL_M = 16  # M <= SMALL_M (decode): mask-reading kernels skip the weight tiles no token runs
# GEMM-K's small path stops earlier: past a few tokens, i.i.d. decisions leave almost no group unused by
# the whole batch (1 - p^M), and cuBLAS over the producer's zeros costs nothing extra.
SMALL_M_K = 4
SMALL_K_MIN_GROUP = 64  # narrower groups (32-column weight tiles) take GEMM-K's small path at M 1 only
DENSE_M = 256  # SMALL_M < M <= DENSE_M: every group has an active token, so cuBLAS + masked epilogue

# M > DENSE_M: the sorted GEMM-MN beats cuBLAS + the masked epilogue only once enough is skipped. Per
# minimum group size, (M below which, threshold) bands: the expected sparsity below which 'dense' serves
# M > DENSE_M (narrow groups run narrow tiles; few large groups at moderate M lose whole waves).
MN_DENSE_BELOW = (
    (256, ((2048, 0.55), (8192, 0.22), (None, 0.12))),
    (128, ((None, 0.13),)),
    (0, ((2048, 0.55), (None, 0.45))),
)

# 'ordered' GEMM-K: a tile of 128 rows in the shared order shares the first ~log2(M / 128) + 1 groups'
# bits, so it pays for few groups at large M; (min M, min expected sparsity) pairs where it is chosen.
ORDERED_MAX_GROUPS = 16
ORDERED_WHEN = ((16384, 0.4), (8192, 0.6))


class Plan(NamedTuple):
    """The paths of the operators of one routing decision (decided once, by ``plan``)."""

    mn: str  # GEMM-MN (Q, gate/up): "small" | "dense" | "sorted"
    k: str  # GEMM-K (O, down): "small" | "dense" | "ordered"
    reorder: bool  # the route carries the reorder index (required by mn "sorted")


def mn_dense_below(group_size: int, m: int) -> float:
    """The expected sparsity below which a GEMM-MN of this group size runs dense at M > DENSE_M."""
    bands = next(b for g_min, b in MN_DENSE_BELOW if group_size >= g_min)
    return next(s for m_max, s in bands if m_max is None or m < m_max)


def mn_dense_thresholds(group_size: int) -> tuple[float, ...]:
    """Every ``mn_dense_below`` value of this group size (any M): what a sparsity bucket must preserve."""
    bands = next(b for g_min, b in MN_DENSE_BELOW if group_size >= g_min)
    return tuple(s for _, s in bands)


def sparsity_bucket(sparsity: float | None, group_size: int | None = None) -> float:
    """``sparsity`` reduced to what ``plan`` reads of it: the largest threshold it reaches among
    ORDERED_WHEN's sparsities and, given the group size, the GEMM-MN dense/sorted thresholds (any M),
    else 0. ``plan`` decides the same for a sparsity and its bucket, so callers that specialise code on
    it (the runtime's compiled layer step) share one variant across layers that choose alike."""
    if sparsity is None:
        return 0.0
    thresholds = [s for _, s in ORDERED_WHEN] + (list(mn_dense_thresholds(group_size)) if group_size else [])
    return max((s for s in thresholds if sparsity >= s), default=0.0)


def _mn_path(m: int, group_size: int, sparsity: float | None) -> str:
    if m <= SMALL_M:
        return "small"
    if m <= DENSE_M:
        return "dense"
    if sparsity is not None and sparsity < mn_dense_below(group_size, m):
        return "dense"
    return "sorted"


def _k_path(m: int, group_size: int, n_groups: int, sparsity: float | None) -> str:
    if m <= SMALL_M_K and (group_size >= SMALL_K_MIN_GROUP or m == 1):
        return "small"
    s = sparsity or 0.0
    if n_groups <= ORDERED_MAX_GROUPS and any(m >= m_min and s >= s_min for m_min, s_min in ORDERED_WHEN):
        return "ordered"
    return "dense"


def plan(
    m: int,
    group_size: int,
    n_groups: int,
    sparsity: float | None = None,
    *,
    force_mn: str | None = None,
    force_k: str | None = None,
) -> Plan:
    """The paths of one routing decision over ``m`` tokens and ``n_groups`` groups of ``group_size``
    columns, given the fraction of groups the caller expects skipped (``sparsity``: the routers' fitted
    or target rate; None: unknown, which keeps the sorted GEMM-MN past DENSE_M and never picks 'ordered').

    ``force_mn`` / ``force_k`` replace the automatic choice of one operator (benchmarks, tests). The
    route is reordered exactly when the GEMM-MN takes the sorted path.
    """
    if sparsity is not None and not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must lie in [0, 1], got {sparsity}")
    if group_size <= 0 or n_groups <= 0:
        raise ValueError(f"group_size and n_groups must be positive, got {group_size} and {n_groups}")
    if force_mn is not None and force_mn not in MN_PATHS:
        raise ValueError(f"unknown force_mn {force_mn!r}; choose from {MN_PATHS}")
    if force_k is not None and force_k not in K_PATHS:
        raise ValueError(f"unknown force_k {force_k!r}; choose from {K_PATHS}")
    for name, forced in (("force_mn", force_mn), ("force_k", force_k)):
        if forced == "small" and m > SMALL_M:
            raise ValueError(f"{name}='small' serves M <= {SMALL_M}, got M={m}")
    mn = force_mn or _mn_path(m, group_size, sparsity)
    k = force_k or _k_path(m, group_size, n_groups, sparsity)
    return Plan(mn, k, mn == "sorted")


def check_plan(p: Plan) -> None:
    """A plan built by hand names known paths, and reorders where its GEMM-MN takes the sorted path."""
    if not isinstance(p, Plan):
        raise ValueError(f"expected a wide.kernels.Plan, got {type(p).__name__}")
    if p.mn not in MN_PATHS or p.k not in K_PATHS:
        raise ValueError(f"unknown path in {p}; GEMM-MN: {MN_PATHS}, GEMM-K: {K_PATHS}")
    if p.mn == "sorted" and not p.reorder:
        raise ValueError(f"{p}: the sorted GEMM-MN needs the reorder index (reorder=True)")
