"""Shared fixtures: tiny random decoders of every supported family; GPU tests skipped without CUDA."""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from pathlib import Path

# The CPU interpreter runs tl.dot as a numpy (OpenBLAS) matmul. OpenBLAS's FMA kernels (Haswell and later) sum a
# column's products in an order that depends on the column's place in the block, which a GPU's MMA does not, so the
# kernels' bit-for-bit tests across block layouts would hold or fail by the CI machine's CPU. The AVX kernels sum
# every column alike; OpenBLAS reads the setting once, when numpy loads it (docs/kernels.md#measuring).
if platform.machine().lower() in ("x86_64", "amd64") and "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

import pytest  # noqa: E402
import torch  # noqa: E402

# pytest-xdist workers compiling the same graph race on one Inductor cache ("file too short" when a
# worker loads a .so another is still writing): give each worker its own cache directory.
if "PYTEST_XDIST_WORKER" in os.environ and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.environ['PYTEST_XDIST_WORKER']}"
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: `-m data` sees the markers added here
def pytest_collection_modifyitems(config, items):
    for item in items:  # a test that takes a data root reads the offline data: marked `data` (.ci/run)
        if "data_root" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.data)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The offline data root (WIDE_DATA, else a shared/data next to the repository) with WikiText-2's test
    file, else the test is skipped. A test taking it is marked `data`."""
    from wide.paths import find_data_dir

    root = find_data_dir()
    if root is None:
        pytest.skip("no offline data root: set WIDE_DATA")
    if not (root / "wikitext" / "wiki.test.raw").is_file():
        pytest.skip(f"the data root {root} lacks wikitext/wiki.test.raw")
    return root


def tiny_model(
    family: str = "llama",
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv: int = 2,
    inter: int = 128,
    vocab: int = 101,
    seed: int = 0,
    **config,
):
    """A randomly initialised causal LM of the given family, fp32, eval mode (``config``: more fields of the
    family's config, e.g. ``sliding_window``)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=256,
    )
    cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[family]
    extra = {"head_dim": hidden // heads} if family == "qwen3" else {}
    model = cls[1](cls[0](**common, **extra, **config)).eval()
    model.config.wide_model_id = f"tiny-{family}"
    return model


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")
