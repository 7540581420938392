"""Serving tests run the runtime on the torch references (no Triton interpreter: real models on the CPU)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "0")
