"""Serving tests run the runtime on the torch references (no Triton interpreter: real models on the CPU).

Other folders' conftests set TRITON_INTERPRET=1 when a pytest-xdist worker collects them, and the kernels read it
at each call (``wide.kernels._triton_utils.interpret_mode``): so each test here sets it back, and the server
processes the tests start inherit it."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "0")


@pytest.fixture(autouse=True)
def _torch_references(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
