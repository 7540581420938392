"""The decision rule's ops: a router's margin and its group decisions in one Triton launch (``ops.py``: the
kernel, its launch rules ``default_config`` / ``head_schedule``, op registration and the fp64 references).
The rule itself: docs/routing.md.
"""

from wide.kernels.router.ops import (
    compute_dtype,
    router_decisions,
    router_decisions_pair,
    router_decisions_ref,
    router_margin,
    router_margin_ref,
)

__all__ = [
    "compute_dtype",
    "router_decisions",
    "router_decisions_pair",
    "router_decisions_ref",
    "router_margin",
    "router_margin_ref",
]
