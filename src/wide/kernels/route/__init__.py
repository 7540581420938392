"""The route contract: one routing decision's plan (which kernel path each operator takes) and the route that
carries it (the mask, and the reorder index only where the sorted GEMM-MN needs it).

``plan.py`` is the one launch policy for the routed GEMMs (docs/kernels.md#path-policy); ``reorder.py`` builds the
route (``plan_route``) and the row orders it may carry; ``contract.py`` is what every op checks of the route it is
handed and where it takes its path from. Every op of a decision reads the same route.
"""

from wide.kernels.route.contract import route_plan, validate_route
from wide.kernels.route.plan import (
    K_PATHS,
    MN_PATHS,
    Plan,
    check_plan,
    mn_dense_below,
    mn_dense_thresholds,
    plan,
    sparsity_bucket,
)
from wide.kernels.route.reorder import (
    RouteIndex,
    has_index,
    pattern_order,
    pattern_order_reference,
    plan_route,
    reorder,
    reorder_reference,
    route_mask,
)

__all__ = [
    "K_PATHS",
    "MN_PATHS",
    "Plan",
    "RouteIndex",
    "check_plan",
    "has_index",
    "mn_dense_below",
    "mn_dense_thresholds",
    "pattern_order",
    "pattern_order_reference",
    "plan",
    "plan_route",
    "reorder",
    "reorder_reference",
    "route_mask",
    "route_plan",
    "sparsity_bucket",
    "validate_route",
]
