"""Shared Triton helpers: device / interpreter detection, allocator, autotune helpers.

Shared with the attention kernels (import only). Triton reads ``TRITON_INTERPRET`` when a kernel is
decorated, so the variable must be set before any ``wide.kernels`` module is imported.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

try:  # Triton is optional on CPU-only installs
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    HAS_TRITON = False

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpret_mode() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Dispatch rule: Triton on CUDA tensors; on CPU only under the interpreter; else torch."""
    if not HAS_TRITON:
        return False
    if t.is_cuda:
        return not interpret_mode()
    return t.device.type == "cpu" and interpret_mode()


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def m_bucket(m: int) -> int:
    """Autotune key bucket for the token count M (powers of two, 16 ... 8192)."""
    return min(max(next_pow2(m), 16), 8192)


def check_dtype(*tensors: torch.Tensor) -> None:
    d = tensors[0].dtype
    if d not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {d} not supported (fp16, bf16, fp32)")
    for t in tensors[1:]:
        if t.dtype != d:
            raise ValueError(f"dtype mismatch: {t.dtype} vs {d}")


def autotune_limit() -> int:
    """``WIDE_AUTOTUNE_MAX``: 0 (unset, the default) lets every autotuner try all its configs; N > 0 only the
    first N of each list (fast GPU test runs; timings taken so are not what a deployment gets)."""
    return max(int(os.environ.get("WIDE_AUTOTUNE_MAX", "0")), 0)


def autotune_subset(configs: list) -> list:
    """The configs an autotuner tries: all, or the first ``autotune_limit()``."""
    limit = autotune_limit()
    return configs[:limit] if limit > 0 else configs


def warn_if_autotune_limited(what: str) -> None:
    """One warning when a benchmark runs with ``WIDE_AUTOTUNE_MAX`` set."""
    n = autotune_limit()
    if n:
        warnings.warn(
            f"{what}: WIDE_AUTOTUNE_MAX={n} lets each autotuned kernel try only its first {n} config(s); "
            "these timings are not what a deployment gets (unset it to tune fully)",
            stacklevel=3,
        )


def largest_pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


@functools.cache
def _pdl_device(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch arguments for programmatic dependent launch (PDL, Hopper+) of a kernel reading ``t``.

    A kernel launched with PDL may be scheduled as soon as its predecessor's programs have exited,
    before that kernel's completion is processed; it then waits (``pdl_begin``, its first statement)
    until the predecessor's writes are visible, which shortens back-to-back decode kernels in a CUDA
    graph (docs/kernels.md#pdl). Off in the interpreter, below sm_90 and with ``WIDE_PDL=0``. Returns
    ``{"PDL": bool}`` plus ``launch_pdl=True`` when on.
    """
    on = (
        HAS_GDC
        and t.is_cuda
        and not interpret_mode()
        and os.environ.get("WIDE_PDL", "1") != "0"
        and _pdl_device(t.device.index if t.device.index is not None else torch.cuda.current_device())
    )
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def _alloc(size: int, alignment: int, stream) -> torch.Tensor:  # noqa: ARG001
    return torch.empty(size, device="cuda", dtype=torch.int8)


@functools.lru_cache(maxsize=1)
def ensure_allocator() -> None:
    """Install the global-scratch allocator that device-side tensor descriptors need."""
    if HAS_TRITON and hasattr(triton, "set_allocator"):
        triton.set_allocator(_alloc)


@functools.cache
def tma_supported(device_index: int = 0) -> bool:
    """Hopper+ GPU, compiled Triton with ``tl.make_tensor_descriptor``, and a probe kernel that runs.

    True also means the descriptors' scratch allocator is installed (``ensure_allocator``)."""
    if not HAS_TRITON or interpret_mode() or not torch.cuda.is_available():
        return False
    if os.environ.get("WIDE_NO_TMA", "0") == "1":
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9 or not hasattr(tl, "make_tensor_descriptor"):
        return False
    try:
        ensure_allocator()
        x = torch.randn(64, 64, device=f"cuda:{device_index}", dtype=torch.float16)
        y = torch.empty_like(x)
        _tma_probe[(1,)](x, y, 64, 64, B=64)
        torch.cuda.synchronize(device_index)
        return bool(torch.equal(x, y))
    except Exception:  # noqa: BLE001 - any compile/launch failure means "no TMA"
        return False


HAS_GDC = False
if HAS_TRITON:
    try:  # grid dependency control (PDL): Triton >= 3.3
        from triton.language.extra.cuda import gdc_wait

        HAS_GDC = True
    except ImportError:  # pragma: no cover - older Triton
        pass

    @triton.jit
    def pdl_begin(PDL: tl.constexpr):
        """A PDL-launched kernel's first statement: wait until the previous kernel has completed and its
        writes are visible. (No early trigger of the next kernel: it measured slower, docs/kernels.md#pdl.)"""
        if PDL:
            gdc_wait()

    @triton.jit
    def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of program ``pid``: GROUP_M m-tiles walk the n-tiles together, so the weight
        tiles they share stay in L2 (the usual grouped ordering of a tiled GEMM)."""
        per_group = GROUP_M * num_pid_n
        first_m = (pid // per_group) * GROUP_M
        gm = min(num_pid_m - first_m, GROUP_M)
        return first_m + (pid % per_group) % gm, (pid % per_group) // gm

    @triton.jit
    def _tma_probe(x_ptr, y_ptr, R, C, B: tl.constexpr):
        d = tl.make_tensor_descriptor(x_ptr, shape=[R, C], strides=[C, 1], block_shape=[B, B])
        v = d.load([0, 0])
        o = tl.arange(0, B)
        tl.store(y_ptr + o[:, None] * C + o[None, :], v)
