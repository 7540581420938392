"""The static-width runtime test runs the real Triton kernels: on a CPU-only machine through the
interpreter (set before `wide.kernels` is imported, as in tests/runtime)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
